"""Models and service responses."""

from __future__ import annotations

from pydantic import BaseModel, Field, create_model

from server.config import Settings


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
    weights: str = Field(
        default="",
        description="how the weights are held and computed: the dtype's floats, int8, or a GGUF file's "
        "quantized blocks in their own bits (which kernel), or widened to the dtype",
    )


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


# the settings /info shows, each with its type and description from server/config.py (one declaration)
INFO_SETTINGS = (
    "max_batch_size",
    "max_queue",
    "max_prefill_tokens",
    "steps_per_schedule",
    "draft_tokens",
    "max_new_tokens_cap",
    "max_prompt_chars",
    "max_prompt_tokens",
    "request_timeout_s",
    "default_eos_bias",
    "max_context",
    "kv_cache_mb",
    "prefix_caching",
)


class ServedState(BaseModel):
    models: list[str]
    devices: list[str]
    auth: bool = Field(description="whether requests need a bearer token (api_token is set)")
    kv_cache_bytes: dict[str, int] = Field(
        description="per model, the bytes its KV cache holds (our decoder: its pool of blocks, sized by kv_cache_mb; "
        "a transformers model: max_batch_size slots x its served context)"
    )
    kv_pool: dict[str, dict] = Field(
        description="per model served from a paged KV pool: its blocks and tokens, the blocks held, the free blocks "
        "still holding a cached prefix, the longest request it could admit now, and the prompt tokens served from "
        "cached blocks (prefix caching) with their share"
    )
    context: dict[str, int] = Field(description="per model, the positions a sequence may reach as served")
    weights: dict[str, str] = Field(
        description="per completion model, what holds its weights and computes them (a quantized GGUF file: in "
        "its own bits on our kernel, or widened to the dtype)"
    )
    compile_seconds: dict[str, dict[str, float]] = Field(
        description="per model, the seconds each compiled pass took to build so far (e.g. DecodeStep_8: 22.7)"
    )
    compile_states: dict[str, dict[str, str]] = Field(
        description="per model, each compiled pass in build order: built, building, waiting, or not built (and why: "
        "its build failed, or its outputs on a real request's inputs were not the eager pass's); a pass not built "
        "runs eagerly, or on a larger built bucket"
    )
    placement: dict = Field(
        description="device, dtype, weights' form and kernels in use, why (setting or CPU feature), the CPU's features"
    )


Info = create_model(
    "Info",
    __base__=ServedState,
    __doc__="Service limits and devices (TGI's /info, extended): the settings in force and what each model runs on.",
    **{
        name: (Settings.model_fields[name].annotation, Field(description=Settings.model_fields[name].description))
        for name in INFO_SETTINGS
    },
)
