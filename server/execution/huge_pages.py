"""A model's weights moved into one block of memory on 2 MB pages (transparent huge pages), where Linux offers them.

A decode step of few rows streams every weight from memory once. On 4 KB pages the CPU's prefetchers stop at
every page boundary and the TLB misses: on a 2-vCPU Sapphire Rapids Xeon one pass over 0.23 GB read 21-22 GB/s on
4 KB pages and 31-32 GB/s on 2 MB ones (bench/bench_skinny_gemm.py). torch's allocator asks for huge pages only
for allocations of 2 MB or more, and only when THP_MEM_ALLOC_ENABLE is set before it starts (for every allocation:
the server was no faster with it, and its start-up slower); most of a small model's tensors are smaller. So the
weights are copied, one tensor at a time, into one anonymous mapping advised
MADV_HUGEPAGE before it is touched (with THP "always" or "madvise"; with "never" this changes nothing but where
the tensors live).
"""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import torch

from server.execution.compute_thread import LIBC, MALLOC_TRIM
from server.execution.graph_call import distinct_tensors

HUGE_PAGE = 2 * 2**20
ALIGN = 64  # each tensor on its own cache lines (the kernels' vector loads)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Python 3.11 lacks the name
SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str:
    """The kernel's transparent huge page mode: "always", "madvise" or "never" (also where it has none)."""
    try:
        text = SETTING.read_text()
    except OSError:
        return "never"
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else "never"


def on_huge_pages(model: torch.nn.Module) -> int:
    """Every CPU parameter and buffer of the model moved into one block advised for huge pages, in place (the
    modules keep their tensors, now views of the block); the bytes moved (0 on another device or without THP)."""
    tensors = [t for t in distinct_tensors(model) if t.device.type == "cpu"]
    if thp_mode() == "never" or not hasattr(mmap, "MADV_HUGEPAGE") or not tensors:
        return 0
    sizes = [-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in tensors]
    # private (a shared anonymous mapping is shmem, whose huge pages are another setting), untouched: its pages
    # come at the first write, after the advice
    block = mmap.mmap(-1, sum(sizes) + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = address(block)
    start = -base % HUGE_PAGE  # huge pages cover 2 MB-aligned ranges
    block.madvise(mmap.MADV_HUGEPAGE, start, sum(sizes))
    offset = start
    with torch.no_grad():
        for t, size in zip(tensors, sizes, strict=True):
            # Linux 5.14+: the tensor's pages faulted in at once, 3x quicker than by the copy; one tensor at a time,
            # so that the block grows as the old storages go (all at once, the weights were held twice)
            populate(base + offset - offset % mmap.PAGESIZE, size + offset % mmap.PAGESIZE)
            # a storage of its own over the block (each keeps the mapping alive): tensors that share a storage
            # would be aliases to dynamo, which refuses them as inputs of a nested compile region
            nbytes = t.numel() * t.element_size()
            view = torch.frombuffer(block, dtype=torch.uint8, count=nbytes, offset=offset).view(t.dtype).view(t.shape)
            view.copy_(t)
            t.data = view  # the old storage is freed here where nothing else holds it
            offset += size
    if MALLOC_TRIM is not None:
        MALLOC_TRIM(0)  # the C heap's freed weights handed back
    return offset - start


def populate(begin: int, length: int) -> None:
    """madvise(MADV_POPULATE_WRITE) through ctypes, which lets go of the GIL (mmap.madvise holds it): the page
    faults of a 1B model's block took seconds on a fresh VM, which another thread's imports may use. Where it
    fails (Linux before 5.14) the copy faults the pages in."""
    LIBC.madvise(ctypes.c_void_p(begin), ctypes.c_size_t(length), MADV_POPULATE_WRITE)


def address(block: mmap.mmap) -> int:
    return torch.frombuffer(block, dtype=torch.uint8, count=1).data_ptr()
