"""Inference engine and HTTP API for the models in the model store."""
