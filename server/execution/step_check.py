"""The check a compiled pass passes before it serves (server/execution/compiler.py builds, then checks).

A compiled pass serves once, on inputs a real request gives (each target's `real_inputs`: prompts of real text
prefilled into a scratch cache), its next-token distribution is the eager pass's within the dtype's rounding: the
log-probabilities of eager's top tokens, and the token it picks, which must be eager's first or within the tolerance
of it (a near-tie). A fused kernel rounds in other places than the eager ops, and a logit's rounding grows with its
size, so the tolerance is a fraction of each row's logit range (max - min): half precision keeps 8 (bf16) or 11
(fp16) significant bits, float32 differs in its sums' order alone. A fixed bound on random inputs refused every step
of a real 30-layer model in bf16, whose tokens were right.

In half precision eager's own rounding grows with depth, and a fused kernel, which keeps float32 between the ops it
fuses, rounds less: the two may differ by more than one rounding while the compiled pass is the closer to the exact
one. So there the reference is the same pass computed in float32 (`Float32Reference`: the half-precision weights and
cache, every op's arithmetic in float32), and the compiled pass may stray from it as far as eager does, plus the
tolerance.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

# int8: activations rounded to int8 per group of 32 (a quantized GGUF file's layers on our kernel): a step of 1/127 of
# the group's largest value, up to 2^-5 of a typical one, where bf16 keeps 2^-8 of each; a compiled pass's other
# rounding moves some values across a step (at 2^-6 random-weight Gemma and Qwen steps missed by 0.4 %)
RANGE_FRACTION = {torch.float32: 2e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.int8: 2**-5}
TOP_TOKENS = 8  # the reference's most likely tokens whose log-probabilities are compared
HALF = (torch.bfloat16, torch.float16)
LINEAR_OPS = ("tinyserve::skinny_linear", "tinyserve::prepacked_linear")  # server/execution/decoder/prepacked.py
EXACT = (torch.ops.aten.embedding.default,)  # rounds nothing: run on the half-precision table, not a float32 copy


log = logging.getLogger("tinyserve")


class StepMismatchError(RuntimeError):
    """The compiled function's next-token distribution is not the eager one's within the dtype's rounding."""


class Float32Reference(TorchDispatchMode):
    """Runs the aten ops and our linear layers' ops in float32 where their inputs are half precision (a cast to half
    precision, too): the pass as exact as its weights allow, at no more memory than one op's upcast inputs. Views and
    writes run as they are, so a write into a half-precision cache still reaches it (rounded, as a real step's)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._schema.is_mutable:  # a write into a half-precision tensor takes its values rounded to it
            schema = func._schema.arguments
            values = [args[i] if i < len(args) else kwargs.get(a.name) for i, a in enumerate(schema)]
            written = next(
                (v for v, a in zip(values, schema, strict=True) if a.alias_info and a.alias_info.is_write), None
            )
            if isinstance(written, torch.Tensor) and written.dtype in HALF:
                args, kwargs = tree_map(lambda t: as_dtype(t, torch.float32, written.dtype), (args, kwargs))
            return func(*args, **kwargs)
        if func._schema.name in LINEAR_OPS and args[1] is not None:  # our linear layers' ops: (x, weight, packed, bias)
            x, weight, bias = (as_dtype(t, HALF, torch.float32) for t in (args[0], args[1], args[3]))
            return torch.nn.functional.linear(x, weight, bias)
        if func.namespace != "aten":  # another library's op (a prepacked weight alone): in the half precision it takes
            half = next((t.dtype for t in args if isinstance(t, torch.Tensor) and t.dtype in HALF), None)
            if half is not None:
                args, kwargs = tree_map(lambda t: as_dtype(t, torch.float32, half), (args, kwargs))
            return func(*args, **kwargs)
        if func.is_view or func in EXACT:
            return func(*args, **kwargs)
        if kwargs.get("dtype") in HALF:
            kwargs = {**kwargs, "dtype": torch.float32}
        args, kwargs = tree_map(lambda t: as_dtype(t, HALF, torch.float32), (args, kwargs))
        return func(*args, **kwargs)


def as_dtype(t, source: torch.dtype | tuple[torch.dtype, ...], dtype: torch.dtype):
    """t in dtype where it is a tensor of the source dtype(s); anything else as it is."""
    sources = source if isinstance(source, tuple) else (source,)
    return t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype in sources else t


def errors(reference: torch.Tensor, got: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of (N, vocab) logits: how far got's log-probabilities of the reference's top tokens are from the
    reference's, and how far got's pick trails the reference's best (in the reference's view), in nats."""
    want, have = reference.log_softmax(-1), got.log_softmax(-1)
    top = want.topk(min(TOP_TOKENS, want.shape[-1]), -1).indices
    drift = (have.gather(-1, top) - want.gather(-1, top)).abs().amax(-1)  # (N,); NaN where got has one
    behind = want.amax(-1) - want.gather(-1, have.argmax(-1, keepdim=True))[:, 0]
    return drift, behind


def disagreement(
    expected: torch.Tensor, got: torch.Tensor, dtype: torch.dtype, eager: torch.Tensor | None = None
) -> str | None:
    """Why logits `got` do not stand for `expected` (both (..., vocab)), or None where they do. eager: the pass
    run eagerly in half precision where `expected` is its float32 reference: got may miss it as far as eager does."""
    want, have = expected.float().flatten(0, -2), got.float().flatten(0, -2)  # (N, vocab)
    span = want.amax(-1) - want.amin(-1)
    tolerance = RANGE_FRACTION[dtype] * span  # (N,) in nats
    own = (torch.zeros_like(span),) * 2 if eager is None else errors(want, eager.float().flatten(0, -2))
    names = ("log-probabilities of the reference's top tokens differ by", "its pick trails the reference's by")
    for name, error, allowed in zip(names, errors(want, have), own, strict=True):
        if bad := (~(error <= tolerance + allowed)).nonzero().flatten().tolist():
            i = bad[0]
            besides = "" if eager is None else f" + eager's own {allowed[i]:.2e}"
            return (
                f"row {i}: {name} {error[i]:.2e} nats > {tolerance[i]:.2e} ({RANGE_FRACTION[dtype]:.1e} of its logit "
                f"range {span[i]:.1f}){besides}; {len(bad)} of {len(span)} rows"
            )
    return None


def mismatch(target, bucket: Hashable, reference: Callable, compiled: Callable, label: str) -> str | None:
    """Why the target's compiled function fails the check on a real request's inputs, or None: its next-token
    distribution is the reference's (run eagerly), or in half precision strays from the reference's float32 run no
    further than the eager one does."""
    eager = target.logits(reference(*target.real_inputs(bucket)))
    got = target.logits(compiled(*target.real_inputs(bucket)))
    why = disagreement(eager, got, target.check_rounding)
    if why is not None and target.check_rounding in HALF:  # eager's own rounding, measured against float32
        inputs = target.real_inputs(bucket)
        with Float32Reference():
            exact = target.logits(reference(*inputs))
        direct, why = why, disagreement(exact, got, target.check_rounding, eager=eager)
        if why is None:
            log.info("%s: as near float32 as eager, which it differs from (%s)", label, direct)
    return why
