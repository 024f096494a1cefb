"""Command-line helpers: the no-Docker `cog predict`, the Cog schema, demo screenshots."""
