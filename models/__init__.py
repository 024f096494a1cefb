"""Model code that training and serving both import (and that imports neither): the from-scratch GPT
(`gpt.py`, with its positions, relational heads, softmax/softmax1 and KV caches), the sampler, and
EsperBERTo (`esperberto/`)."""
