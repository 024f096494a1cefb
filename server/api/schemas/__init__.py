"""Pydantic request/response models, one module per wire format or resource."""
