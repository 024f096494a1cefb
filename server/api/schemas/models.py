"""Models and service responses."""

from __future__ import annotations

from pydantic import BaseModel, Field


class ModelSummary(BaseModel):
    id: str
    kind: str = Field(description="causal (completion: any causal LM) or mlm (fill-mask)")
    tasks: list[str]
    attention: str = Field(description="attention normaliser: softmax/softmax0 or softmax1")
    attention_settings: dict[str, str | int] = Field(
        default_factory=dict,
        description="the attention variant: score (dot/additive), qkv_sharing, masking, softmax, positions "
        "(sinusoidal/learned/rope), self-attention and relational heads, relations and symbol type",
    )
    parameters: int
    layers: int | None = None
    heads: int | None = Field(default=None, description="attention heads per layer (relational heads included)")
    context_length: int | None = None


class ModelList(BaseModel):
    data: list[ModelSummary] = Field(description="the served models")
    failed: dict[str, str] = Field(description="checkpoints refused at start-up, with the reason (file and rule)")


class ModelCard(ModelSummary):
    config: dict
    card: str = Field(description="the model card, markdown")


class Health(BaseModel):
    status: str = Field(description="ok or loading")
    models: list[str]
    failed: dict[str, str] = Field(description="checkpoints refused at start-up, with the reason")
    loading: list[str] = Field([], description="models loading behind the default one (a request for one gets 503)")
    compiling: list[str] = Field(
        [], description="models whose compiled decode steps are still being built (eager serves)"
    )


class Info(BaseModel):
    models: list[str]
    devices: list[str]
    max_batch_size: int
    max_queue: int
    max_prefill_tokens: int
    steps_per_schedule: int
    draft_tokens: int
    max_new_tokens_cap: int
    max_prompt_chars: int
    max_prompt_tokens: int
    request_timeout_s: float
    default_eos_bias: float
    auth: bool
    max_context: int = Field(description="positions a sequence may reach (longer checkpoint contexts are capped)")
    kv_cache_mb: int = Field(description="the bound on each model's static KV cache (a slot's context is cut to fit)")
    kv_cache_bytes: dict[str, int] = Field(
        description="per model, the bytes its static KV cache holds (max_batch_size slots x its served context)"
    )
    context: dict[str, int] = Field(description="per model, the positions a sequence may reach as served")
    compile_seconds: dict[str, dict[str, float]] = Field(
        description="per model, the seconds each compiled pass took to build so far (e.g. DecodeStep_8: 22.7)"
    )
    placement: dict = Field(
        description="device, dtype, weights' form and kernels in use, why (setting or CPU feature), the CPU's features"
    )
