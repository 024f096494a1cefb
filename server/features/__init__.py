"""What the product does with a served model, shared by the HTTP routes and the Cog predictor: completion
(completion.py), chat templates (chat.py), structured output (constraints.py), readouts: score, attention
and fill-mask (readouts.py), and inspect: logit lens, head ablation, activation patching (inspect.py)."""
