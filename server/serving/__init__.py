"""The models being served: the registry that loads them from the store, where and in what dtype they run
(placement.py), their model cards (model_card.py)."""
