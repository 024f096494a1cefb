"""Our decoder (models/gpt.py: the from-scratch GPT and every family model_store/families.py maps onto it)
served: the runner (runner.py), its fixed-shape decode step over the static KV cache that the background
compiler builds per row bucket (step.py), the prepacked copy that runs uncompiled (prepacked.py), and the
CUDA graphs of the compiled steps (cuda_graphs.py)."""
