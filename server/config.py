"""Server configuration, from environment variables (prefix TINYSERVE_) or keyword arguments."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from model_store import STORE_ROOT


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TINYSERVE_", env_nested_delimiter="__")

    host: str = Field("127.0.0.1", description="interface to bind")
    port: int = Field(8000, ge=1, le=65535, description="TCP port to listen on")
    store: Path = Field(STORE_ROOT, description="model store folder")
    models: list[str] | None = Field(None, description="model ids to load (default: every valid checkpoint)")
    device: str = Field("auto", description="auto (CUDA when present), cpu, cuda, cuda:N")
    dtype: str = Field(
        "auto",
        description="auto (float16 on CUDA; bfloat16 on CPUs with native bf16, i.e. AVX512-BF16 or AMX; "
        "else float32), float32, float16, bfloat16 (without AVX-512: faster than float32 at one stream, slower at 32)",
    )
    weights: Literal["native", "int8", "int4"] = Field(
        "native",
        description="native (a float checkpoint in `dtype`; a quantized GGUF file in its own bits), int8 "
        "(weight-only int8 linear layers with per-channel scales, activations in `dtype`: half the bytes a decode "
        "step reads in bf16) or int4 (4-bit codes in groups of 32 with a scale and a zero each, as GGUF's Q4_1; "
        "docs/BENCHMARKS.md)",
    )
    ready_after: Literal["default", "all", "compiled"] = Field(
        "default",
        description="what /health waits for before its 200: the default completion model (the other models "
        "load behind it, and a request for one still loading gets 503 with Retry-After), every model, or every "
        "model and its compiled steps (a replica behind a load balancer then serves at full speed once ready; "
        "the server answers nothing before)",
    )
    max_batch_size: int = Field(32, ge=1, description="requests decoded together per model")
    max_queue: int = Field(64, ge=1, description="requests waiting per model before 429")
    max_context: int = Field(
        2048,
        ge=16,
        description="positions a sequence may reach: a transformers checkpoint with a longer context is served "
        "up to this, and `tinyserve store add` checks it against this "
        "(a request may reach it while the KV pool, kv_cache_mb, has blocks for it)",
    )
    kv_cache_mb: int = Field(
        1024,
        ge=1,
        description="memory of one model's KV cache: our decoder's pool of 16-position blocks, which every request "
        "draws on as it grows (a request waits for blocks; the longest request is the smaller of the context and "
        "the pool); a transformers model's static cache, max_batch_size slots of the served context, each slot's "
        "context cut to fit (start-up log and /info give the result)",
    )
    prefix_caching: bool = Field(
        True,
        description="prompts that start with the full blocks an earlier request computed read those blocks "
        "instead of computing them again (vLLM's automatic prefix caching; our decoder's KV pool); a freed block "
        "stays findable until the pool needs it",
    )
    max_prefill_tokens: int = Field(
        4096, ge=1, description="padded prompt tokens prefilled in one forward pass (waiting prompts are grouped)"
    )
    steps_per_schedule: int = Field(
        8,
        ge=1,
        description="decode steps run back to back between two schedules while every running request is greedy "
        "and unconstrained and none waits (vLLM's multi-step scheduling: the engine's Python between steps is paid "
        "once for them); an end of text, a new request or a cancellation ends them early; streams then get their "
        "tokens up to this many at a time; 1: a schedule every step",
    )
    draft_tokens: int = Field(
        3,
        ge=0,
        description="speculative decoding of a lone greedy request: up to this many draft tokens, what followed the "
        "last occurrence of its last few tokens (prompt lookup, vLLM's ngram method), checked by the model in one "
        "pass with its pending token (the decoder's compiled draft check on the CPU: at most 3); each one the model "
        "agrees with is a decode step saved; runs within a multi-step run (steps_per_schedule > 1); 0: none",
    )
    compile_models: bool = Field(
        True,
        description="compile the GPT decode step and the fill-mask encoder per shape bucket, in the background "
        "(eager serves until each is ready; a failure leaves it eager)",
    )
    compile_max_batch: int = Field(32, ge=1, description="compile the decode buckets of at most this many rows")
    compile_workers: int = Field(
        1,
        ge=0,
        description="processes beside the server that build a CPU model's compiled passes at the same time (each "
        "holds its own copy of the weights until it is done; stopped while requests run); 0: the server builds all",
    )
    compile_cache_dir: Path | None = Field(
        Path("~/.cache/tinyserve/compiled"), description="compiled steps cached here (per checkpoint, dtype, torch)"
    )
    max_new_tokens_cap: int = Field(256, ge=1, description="upper bound on max_new_tokens")
    max_prompt_chars: int = Field(20_000, ge=1, description="longer text prompts are refused (422)")
    max_prompt_tokens: int = Field(
        32_768, ge=1, description="longer prompts sent as token ids are refused (422), before any id is checked"
    )
    max_inspect_tokens: int = Field(
        65_536,
        ge=1,
        description="looking inside a model (/inspect/*): forward passes x tokens per request; above it a 422",
    )
    grammar_compile_timeout_s: float = Field(
        10.0, gt=0, description="structured output: a schema, regex or grammar that compiles longer is refused (4xx)"
    )
    responses_kept: int = Field(
        1_000, ge=0, description="/v1/responses: stored responses kept in memory for previous_response_id, at most"
    )
    responses_kept_mb: float = Field(64.0, ge=0, description="/v1/responses: and at most this many MB of them")
    steering_vectors_kept: int = Field(
        256, ge=0, description="/inspect/steering-vector: named vectors kept in memory (all models), the oldest dropped"
    )
    truncate_prompt: bool = Field(
        False, description="over-long prompts (in tokens): keep the last tokens instead of refusing"
    )
    request_timeout_s: float = Field(60.0, gt=0, description="per-request time limit")
    shutdown_grace_s: float = Field(
        60.0, ge=0, description="on SIGTERM: time in-flight requests (streams too) get to finish; new ones are refused"
    )
    default_eos_bias: float = Field(0.0, description="EOS logit bias used when a request gives none")
    api_token: SecretStr | None = Field(None, description="when set, requests need 'Authorization: Bearer <token>'")
    auth_exempt: list[str] = Field(["/health", "/metrics"], description="paths that never need the token")
    cors_origins: list[str] = Field([], description="allowed CORS origins (closed by default)")
    max_body_bytes: int = Field(1_000_000, ge=1, description="larger request bodies get 413")


def default(name: str):
    """A setting's declared default: what the engine, the runners and the Cog predictor use when nothing is
    configured (one source for every default)."""
    return Settings.model_fields[name].default
