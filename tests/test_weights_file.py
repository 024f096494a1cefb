"""Weights read tensor by tensor (model_store/weights_file.py): what safe_open reads, without holding the file."""

import subprocess
import sys

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from model_store.weights_file import WeightsFile


def test_every_tensor_reads_as_safe_open_reads_it(tmp_path):
    state = {
        "w": torch.randn(3, 5),
        "half": torch.randn(7).bfloat16(),
        "fp16": torch.randn(2, 2).half(),
        "ids": torch.arange(6, dtype=torch.int64).view(2, 3),
        "mask": torch.tensor([True, False]),
        "codes": torch.randint(0, 255, (4, 4), dtype=torch.uint8),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with WeightsFile(tmp_path / "model.safetensors") as f, safe_open(tmp_path / "model.safetensors", "pt") as g:
        assert sorted(f.keys()) == sorted(g.keys()) == sorted(state)
        for name in state:
            got = f.get_tensor(name)
            assert got.dtype == state[name].dtype and torch.equal(got, g.get_tensor(name)), name


PEAK = """
import sys, torch
from model_store.weights_file import WeightsFile
def hwm():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) // 1024
before = hwm()
with WeightsFile(sys.argv[1]) as f:
    kept = [f.get_tensor(k).bfloat16() for k in f.keys()]
print(hwm() - before)
"""


def test_casting_a_float32_file_holds_one_float32_tensor_at_a_time(tmp_path):
    """Four float32 tensors of 64 MiB cast to bf16: 128 MiB kept, one 64 MiB read at a time (a mapped file would
    add the 256 MiB it read)."""
    path = tmp_path / "model.safetensors"
    save_file({f"w{i}": torch.randn(16 * 2**20) for i in range(4)}, str(path))
    read = subprocess.run([sys.executable, "-c", PEAK, str(path)], capture_output=True, text=True, check=True)
    grown = int(read.stdout)
    assert grown < 128 + 64 + 48, grown
