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

    def get_tensor(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        begin, end = entry["data_offsets"]
        data = torch.empty(end - begin, dtype=torch.uint8)
        view, done = memoryview(data.numpy()), 0
        while done < len(view):  # a read may return fewer bytes than asked
            read = os.preadv(self.fd, [view[done:]], self.start + begin + done)
            if read == 0:
                raise ValueError(f"tensor {name} runs past the end of the file")
            done += read
        return data.view(DTYPES[entry["dtype"]]).view(entry["shape"])
