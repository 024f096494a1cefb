"""The compile cache's key: what a compiled graph depends on, so that no entry serves another model, dtype or CPU."""

import torch

from model_store.store import write_checkpoint
from server.execution.compile_cache import cache_key
from tests.conftest import AVX2, AVX512_BF16, emulate_cpu, tiny_gpt


def test_cache_key_names_weights_dtype_and_cpu_class(tmp_path, tiny_tokenizer, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    write_checkpoint(a, tiny_gpt(seed=0), tiny_tokenizer, card="# a\n", metrics={})
    write_checkpoint(b, tiny_gpt(seed=1), tiny_tokenizer, card="# b\n", metrics={})
    cpu = torch.device("cpu")
    assert cache_key(a, torch.float32, cpu) == cache_key(a, torch.float32, cpu)
    assert cache_key(a, torch.float32, cpu) != cache_key(b, torch.float32, cpu)  # new weights: a new entry
    assert cache_key(a, torch.float32, cpu) != cache_key(a, torch.bfloat16, cpu)
    keys = {}
    for name, features in (("avx2", AVX2), ("avx512_bf16", AVX512_BF16)):  # another CPU class: another entry
        with monkeypatch.context() as m:
            emulate_cpu(m, features)
            keys[name] = cache_key(a, torch.float32, cpu)
    assert keys["avx2"] != keys["avx512_bf16"]
