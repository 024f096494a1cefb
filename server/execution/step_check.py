"""The check a compiled pass passes before it serves (server/execution/compiler.py builds, then checks).

A compiled pass serves once, on inputs a real request gives (each target's `real_inputs`: prompts of real text
prefilled into a scratch cache), its next-token distribution is the eager pass's within the dtype's rounding: the
log-probabilities of eager's top tokens, and the token it picks, which must be eager's first or within the tolerance
of it (a near-tie). A fused kernel rounds in other places than the eager ops, and a logit's rounding grows with its
size, so the tolerance is a fraction of each row's logit range (max - min): half precision keeps 8 (bf16) or 11
(fp16) significant bits, float32 differs in its sums' order alone. A fixed bound on random inputs refused every step
of a real 30-layer model in bf16, whose tokens were right.
"""

from __future__ import annotations

import torch

# int8: activations rounded to int8 per group of 32 (a quantized GGUF file's layers on our kernel): a step of 1/127 of
# the group's largest value, up to 2^-5 of a typical one, where bf16 keeps 2^-8 of each; a compiled pass's other
# rounding moves some values across a step (at 2^-6 random-weight Gemma and Qwen steps missed by 0.4 %)
RANGE_FRACTION = {torch.float32: 2e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.int8: 2**-5}
TOP_TOKENS = 8  # eager's most likely tokens whose log-probabilities are compared


class StepMismatchError(RuntimeError):
    """The compiled function's next-token distribution is not the eager one's within the dtype's rounding."""


def disagreement(expected: torch.Tensor, got: torch.Tensor, dtype: torch.dtype) -> str | None:
    """Why logits `got` do not stand for `expected` (both (..., vocab)), or None where they do."""
    want, have = expected.float().flatten(0, -2), got.float().flatten(0, -2)  # (N, vocab)
    span = want.amax(-1) - want.amin(-1)
    tolerance = RANGE_FRACTION[dtype] * span  # (N,) in nats
    want, have = want.log_softmax(-1), have.log_softmax(-1)
    top = want.topk(min(TOP_TOKENS, want.shape[-1]), -1).indices
    drift = (have.gather(-1, top) - want.gather(-1, top)).abs().amax(-1)  # (N,); NaN where got has one
    behind = want.amax(-1) - want.gather(-1, have.argmax(-1, keepdim=True))[:, 0]  # eager's view of got's pick
    checks = (("log-probabilities of eager's top tokens differ by", drift), ("its pick trails eager's by", behind))
    for name, error in checks:
        if bad := (~(error <= tolerance)).nonzero().flatten().tolist():
            i = bad[0]
            return (
                f"row {i}: {name} {error[i]:.2e} nats > {tolerance[i]:.2e} ({RANGE_FRACTION[dtype]:.1e} of its logit "
                f"range {span[i]:.1f}; {len(bad)} of {len(span)} rows)"
            )
    return None
