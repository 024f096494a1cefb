"""The runner of a checkpoint: our decoder's or transformers', as its family's row says
(model_store/families.py, `Family.runner`)."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch

from models.kv_cache import BLOCK_TOKENS
from server.execution.huge_pages import HugePageBlock, huge_pages_offered, on_huge_pages

log = logging.getLogger("tinyserve")


def load_runner(
    runner: str,
    folder: Path,
    device: torch.device,
    dtype: torch.dtype,
    max_rows: int,
    weights: str = "native",
    max_context: int | None = None,
    kv_cache_mb: int | None = None,
):
    """The runner of a validated checkpoint folder, its weights on device in dtype (linear layers in
    int8 when weights == "int8"), its positions capped at max_context and by what max_rows slots of
    kv_cache_mb hold."""
    import json

    from model_store import CheckpointError, load_causal_lm, load_gpt
    from models.quantize import quantize_int4, quantize_int8

    quantize = {"int8": quantize_int8, "int4": quantize_int4}.get(weights, lambda model: model)
    budget = kv_cache_mb * 2**20 if kv_cache_mb is not None else None
    if runner == "decoder":  # ours, or a family model_store/families.py maps onto it
        from server.execution.decoder.runner import GPTRunner, pool_blocks

        # native weights are served as read: straight into the huge-page block (int8/int4 replace them)
        block = HugePageBlock() if weights == "native" and device.type == "cpu" and huge_pages_offered() else None
        model, tokenizer = load_gpt(folder, device, dtype, max_context, block)
        family = (json.loads((folder / "config.json").read_text()).get("architectures") or ["gpt"])[0]
        try:
            blocks = pool_blocks(model, max_rows, budget)
        except ValueError as e:
            raise CheckpointError(folder, str(e)) from None
        model = quantize(model)
        held = held_as(model, dtype, weights)
        on_huge_pages(model, block)  # the rest; before the runner's copies of it (prepacked layers) and its cache
        served = GPTRunner(model, tokenizer, max_rows, family, blocks)
        served.facts = replace(served.facts, weights=held)
        log.info("%s: weights %s", folder.name, held)
        return cut_context_logged(served, folder, model.config.context_length, kv_cache_mb)
    if runner == "transformers":
        from server.execution.hf_causal import HFCausalLMRunner, served_context

        log.warning("%s: served by transformers, the slow path (eager, no compiled steps)", folder.name)
        model, tokenizer = load_causal_lm(folder, device, dtype)
        model = quantize(model)
        log.info("%s: weights %s", folder.name, held_as(model, dtype, weights))
        on_huge_pages(model)
        try:
            served = HFCausalLMRunner(model, tokenizer, max_rows, max_context, budget)
        except ValueError as e:  # e.g. no end-of-text token: refused like any bad checkpoint
            raise CheckpointError(folder / "config.json", str(e)) from None
        return cut_context_logged(served, folder, served_context(model.config, max_context), kv_cache_mb)
    raise CheckpointError(folder / "config.json", f"no causal-LM runner {runner!r}")


def held_as(model: torch.nn.Module, dtype: torch.dtype, weights: str) -> str:
    """Group-quantized layers (a GGUF file's blocks, or weights=int4) computed from their codes by our kernel where
    it runs (bf16 on AVX-512 VNNI and BF16), else widened once to dtype (exact in float32; nothing reads codes
    faster there); what the weights are held as, in words."""
    from models.quantize import GroupQuantLinear, widen_groups
    from server.execution import group_gemm

    layers = [m for m in model.modules() if isinstance(m, GroupQuantLinear)]
    if not layers:
        return f"{weights} ({str(dtype).removeprefix('torch.')})" if weights != "native" else "native"
    kinds = sorted({f"{m.bits}-bit codes in groups of {m.group}" for m in layers})
    if dtype == torch.bfloat16 and group_gemm.use_kernel(model):
        return f"{len(layers)} quantized layers in their own bits ({', '.join(kinds)}): our AVX-512 VNNI kernel"
    widen_groups(model, dtype)
    why = "float32 activations" if dtype != torch.bfloat16 else "no AVX-512 VNNI and BF16"
    return f"{len(layers)} quantized layers widened to {str(dtype).removeprefix('torch.')} ({why})"


def cut_context_logged(runner, folder: Path, full: int, kv_cache_mb: int | None):
    """The runner, after one start-up line where kv_cache_mb cut its slots' context."""
    if runner.facts.context_length < full:
        log.warning(
            "%s: %d positions a request (of %d): kv_cache_mb=%d holds no more",
            folder.name, runner.facts.context_length, full, kv_cache_mb,
        )  # fmt: skip
    elif blocks := runner.facts.kv_blocks - 1:
        log.info(
            "%s: KV pool of %d blocks (%d positions) for up to %d requests, each up to %d positions",
            folder.name, blocks, blocks * BLOCK_TOKENS, runner.facts.slots, full,
        )  # fmt: skip
    return runner
