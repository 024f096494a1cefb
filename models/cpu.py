"""What this CPU computes natively: the one place every CPU-dependent choice reads (serving dtype,
prepacked layers, the int8 kernel, the compiled step's GEMM).

Most laptops and many cloud machines have AVX2 but no AVX-512 (Intel client CPUs since Alder Lake,
AMD before Zen 4). There oneDNN has no bf16 kernels (its weight reorder raises) and aten's int8 kernel
is vectorized for bf16 activations only. The probe reads torch's own view of the CPU, so the
emulation switches torch honours are honoured here too: `ATEN_CPU_CAPABILITY=avx2` (aten's kernels
and inductor's vector ISA) and `ONEDNN_MAX_CPU_ISA=AVX2` (oneDNN) make an AVX-512 machine plan and run
as an AVX2 one. Tests switch a branch by monkeypatching `cpu_features`.
"""

from __future__ import annotations

import functools
import os
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class CPUFeatures:
    isa: str  # the vector ISA of aten's kernels and inductor's code: "AVX512", "AVX2", "DEFAULT" (no AVX2)...
    onednn_bf16: bool  # oneDNN computes bf16 (AVX512BW/VL/DQ or AVX-NE-CONVERT): prepacked bf16 layers
    avx512_bf16: bool  # bf16 dot products in hardware
    amx: bool  # AMX tiles (bf16/int8 matrix units)
    vnni: bool  # int8 dot products (AVX512-VNNI or AVX-VNNI)

    @property
    def avx512(self) -> bool:
        """AVX-512 kernels in aten and inductor (what splits the CPU classes this project measures)."""
        return self.isa.startswith("AVX512")

    @property
    def native_bf16(self) -> bool:
        """bf16 arithmetic as fast as its bytes suggest: what makes bf16 the CPU's serving dtype."""
        return self.avx512_bf16 or self.amx

    @property
    def name(self) -> str:
        """One word for logs and /info: the best of amx, avx512_bf16, avx512, avx2, default."""
        if self.amx:
            return "amx"
        if self.avx512_bf16:
            return "avx512_bf16"
        return self.isa.lower()

    def as_dict(self) -> dict:
        return {"name": self.name, **asdict(self)}


def _onednn_limit() -> str:
    return os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "ALL")).upper()


@functools.cache
def cpu_features() -> CPUFeatures:
    """The probe, once per process."""
    isa = torch.backends.cpu.get_cpu_capability()  # honours ATEN_CPU_CAPABILITY
    avx512 = isa.startswith("AVX512")
    limit = _onednn_limit()
    onednn_avx512 = limit == "ALL" or limit.startswith(("AVX512", "AVX10", "AMX"))
    mkldnn = torch.backends.mkldnn.is_available()
    return CPUFeatures(
        isa=isa,
        onednn_bf16=mkldnn and onednn_avx512 and torch.ops.mkldnn._is_mkldnn_bf16_supported(),
        avx512_bf16=avx512 and torch.cpu._is_avx512_bf16_supported(),
        amx=avx512 and onednn_avx512 and torch.cpu._is_amx_tile_supported(),
        vnni=torch.cpu._is_vnni_supported() and (avx512 or isa == "AVX2"),
    )
