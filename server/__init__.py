"""Inference engine and HTTP API for the models in the model store."""

import os

# torch's CPU allocator puts allocations of 2 MB and more (the KV cache, the prepacked weights) on transparent huge
# pages when this is set before it starts: a decode step streams them from memory, and on 2 MB pages the same read
# ran 25-45 % faster on the Sapphire Rapids Xeon (server/execution/huge_pages.py moves the weights themselves).
# The server's entry points import this package before torch; a value set by the user wins.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
