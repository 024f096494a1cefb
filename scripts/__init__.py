"""Command-line helpers: the no-Docker `cog run`, the Cog schema, demo screenshots."""
