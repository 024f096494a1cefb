"""The CPU's features decide the dtype, the prepacking and the int8 kernel; /info says which and why."""

from dataclasses import replace

import torch

from models import cpu
from server.execution import skinny_gemm
from server.serving.placement import plan
from tests.conftest import AVX2, AVX512_BF16, emulate_cpu


def test_the_probe_reads_torchs_view_of_the_cpu():
    f = cpu.cpu_features()
    assert f.isa == torch.backends.cpu.get_cpu_capability()
    assert f.native_bf16 == (f.avx512_bf16 or f.amx)
    if not f.isa.startswith("AVX512"):  # AVX-512 features are never claimed by an AVX2 (or emulated AVX2) CPU
        assert not (f.avx512_bf16 or f.amx)


def test_auto_dtype_is_bf16_only_where_the_cpu_computes_it_natively(monkeypatch):
    emulate_cpu(monkeypatch, AVX512_BF16)
    p = plan("cpu", "auto", "native")
    kernels = "our AVX-512 BF16 kernel up to 32 rows" if skinny_gemm.usable() else "prepacked oneDNN bf16"
    assert p.dtype == torch.bfloat16 and "native bf16" in p.why and kernels in p.kernels
    monkeypatch.setattr(skinny_gemm, "usable", lambda: False)  # where the skinny kernel could not be built
    p = plan("cpu", "auto", "native")
    assert p.dtype == torch.bfloat16 and "prepacked oneDNN bf16" in p.kernels and "GEMM template" in p.kernels
    emulate_cpu(monkeypatch, AVX2)
    p = plan("cpu", "auto", "native")
    assert p.dtype == torch.float32 and "no AVX512-BF16 or AMX" in p.why and "cpu avx2" in p.why
    emulate_cpu(monkeypatch, replace(AVX512_BF16, amx=True))  # a Xeon since Sapphire Rapids
    p = plan("cpu", "auto", "native")
    assert p.dtype == torch.bfloat16 and p.why.endswith("; cpu amx (AVX512)")


def test_explicit_bf16_without_onednn_bf16_serves_on_atens_kernels_and_says_so(monkeypatch):
    emulate_cpu(monkeypatch, AVX2)
    p = plan("cpu", "bfloat16", "native")
    assert p.dtype == torch.bfloat16 and "fallback" in p.kernels and "needs AVX-512" in p.why
    assert p.describe()["cpu"]["name"] == "avx2" and p.describe()["dtype"] == "bfloat16"


def test_info_gives_the_placement_and_why(store):
    from fastapi.testclient import TestClient

    from server.api.app import create_app
    from server.config import Settings

    with TestClient(create_app(Settings(store=store, device="cpu"))) as client:  # the CPU's placement, on any machine
        placement = client.get("/info").json()["placement"]
    assert placement["dtype"] == "float32" and placement["cpu"]["isa"] in placement["why"].upper()
