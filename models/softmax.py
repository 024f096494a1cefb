"""Attention normalisers: standard softmax and softmax1 ("Attention Is Off By One").

softmax1(x)_i = exp(x_i) / (1 + sum_j exp(x_j)) is softmax with an extra, always-present zero
logit: a head can put its mass on "nothing" instead of being forced to attend somewhere. This is the
single implementation used by the from-scratch GPT and by EsperBERTo.
"""

from collections.abc import Callable

import torch

SoftmaxFn = Callable[[torch.Tensor, int], torch.Tensor]


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """fp16/bf16 -> fp32 for the arithmetic; fp32 and fp64 stay as they are."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Standard softmax computed in (at least) fp32; a row that is entirely -inf yields zeros, not NaN."""
    return torch.softmax(_upcast(x), dim).nan_to_num(0.0).to(x.dtype)  # only such a row makes NaN: 0 / 0


def softmax1(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """exp(x_i) / (1 + sum_j exp(x_j)), stable in fp32/fp16/bf16.

    Shifting by m = max(0, max_j x_j) gives exp(x_i - m) / (exp(-m) + sum_j exp(x_j - m)): no term
    overflows, the denominator is at least exp(-m) > 0 or 1, so rows of huge, very negative or fully
    masked (-inf) scores never produce NaN. Computed in (at least) fp32, returned in the input dtype.
    """
    xf = _upcast(x)
    m = xf.amax(dim, keepdim=True).clamp_min(0.0)
    e = torch.exp(xf - m)
    return (e / (torch.exp(-m) + e.sum(dim, keepdim=True))).to(x.dtype)


# "softmax0" is the standard softmax in both model families (the name of the softmax1 paper's study)
SOFTMAX_FUNCTIONS: dict[str, SoftmaxFn] = {"softmax0": softmax, "softmax1": softmax1}
LEGACY_NAMES = {"softmax": "softmax0"}  # what configs written before the rename store


def get_softmax(name: str) -> SoftmaxFn:
    """Look up an attention normaliser by the name stored in a model config."""
    try:
        return SOFTMAX_FUNCTIONS[LEGACY_NAMES.get(name, name)]
    except KeyError:
        raise ValueError(f"unknown softmax {name!r}; choose one of {sorted(SOFTMAX_FUNCTIONS)}") from None
