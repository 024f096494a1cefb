"""The inference engine: continuous batching over any runner (core.py), what it keeps of each request and
running row (rows.py), drafts from a row's own n-grams (speculation.py), and the output side that makes
text from its ids (output.py, detokenizer.py)."""
