"""A safetensors file read one tensor at a time with plain reads.

safetensors' `safe_open` maps the whole file, and every page a read touches counts in the process's resident memory
until the file is closed: loading a float32 file into bf16 held the file and the cast weights at once (a
Llama-3.2-1B shape peaked at 6.1 GB for 2.5 GB of weights). Reading each tensor into its own buffer holds only the
tensor being cast. The format (https://huggingface.co/docs/safetensors): an 8-byte little-endian header length, a
JSON header (name -> dtype, shape, data_offsets into the data after the header), then the data.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class WeightsFile:
    """keys() and get_tensor(name) as safe_open's, without the mapping (use as a context manager)."""

    def __init__(self, path: Path | str) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        (length,) = struct.unpack("<Q", os.pread(self.fd, 8, 0))
        header = json.loads(os.pread(self.fd, length, 8))
        header.pop("__metadata__", None)
        self.start, self.entries = 8 + length, header

    def __enter__(self) -> WeightsFile:
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)

    def keys(self) -> list[str]:
        return list(self.entries)

    def dtype(self, name: str) -> torch.dtype:
        return DTYPES[self.entries[name]["dtype"]]

    def shape(self, name: str) -> torch.Size:
        return torch.Size(self.entries[name]["shape"])

    def get_tensor(self, name: str) -> torch.Tensor:
        out = torch.empty(self.shape(name), dtype=self.dtype(name))
        self.read_into(name, out)
        return out

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """The tensor's bytes read into `out` (contiguous, of its dtype and shape: a place made for it)."""
        begin, end = self.entries[name]["data_offsets"]
        if out.dtype != self.dtype(name) or out.shape != self.shape(name) or not out.is_contiguous():
            raise ValueError(f"tensor {name}: no place for its {self.dtype(name)} {list(self.shape(name))}")
        view, done = memoryview(out.view(-1).view(torch.uint8).numpy()), 0
        if len(view) != end - begin:
            raise ValueError(f"tensor {name}: {end - begin} bytes in the file for {len(view)}")
        while done < len(view):  # a read may return fewer bytes than asked
            read = os.preadv(self.fd, [view[done:]], self.start + begin + done)
            if read == 0:
                raise ValueError(f"tensor {name} runs past the end of the file")
            done += read
