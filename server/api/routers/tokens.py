"""POST /tokenize and POST /detokenize, in vLLM's shapes."""

from __future__ import annotations

from fastapi import APIRouter

from server.api.dependencies import AppSettings, Registry
from server.api.schemas.tokens import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from server.features.completion import check_token_ids, encode_prompt, find_model

router = APIRouter(tags=["tokens"])


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, registry: Registry, settings: AppSettings) -> TokenizeResponse:
    """A text's token ids as a prompt is encoded (the checkpoint's start-of-sequence tokens included)."""
    m = find_model(registry, body.model, "causal", "model")
    ids = encode_prompt(m, body.content, settings, body.content_field)
    return TokenizeResponse(tokens=ids, token_strs=[m.runner.tokenizer.decode([i]) for i in ids], count=len(ids))


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, registry: Registry, settings: AppSettings) -> DetokenizeResponse:
    """Token ids back to text."""
    m = find_model(registry, body.model, "causal", "model")
    return DetokenizeResponse(prompt=m.runner.tokenizer.decode(check_token_ids(m, body.tokens, settings, "tokens")))
