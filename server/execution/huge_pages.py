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
import threading
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


def huge_pages_offered() -> bool:
    return thp_mode() != "never" and hasattr(mmap, "MADV_HUGEPAGE")


class HugePageBlock:
    """A block advised for huge pages that a checkpoint's tensors are read straight into (model_store/placement.py's
    Arena), its pages faulted in by a thread of its own meanwhile (ctypes lets go of the GIL): fresh huge pages are
    slow to come on a VM (docs/BENCHMARKS.md, "Start-up"), and the reads then no longer wait for them all."""

    def __init__(self) -> None:
        self.block: mmap.mmap | None = None
        self.base = self.start = self.end = 0  # the block's address; where its tensors begin and end in it

    def place(self, groups: list[list[tuple[torch.dtype, torch.Size]]]) -> list[list[torch.Tensor]]:
        if self.block is not None:
            raise RuntimeError("a block holds one checkpoint's tensors")
        sizes = [[shape.numel() * dtype.itemsize for dtype, shape in group] for group in groups]
        total = sum(aligned(sum(group)) for group in sizes)
        self.block = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.base = address(self.block)
        self.start = -self.base % HUGE_PAGE
        self.end = self.start + total
        if total:
            self.block.madvise(mmap.MADV_HUGEPAGE, self.start, total)
            faulting = threading.Thread(target=populate, args=(self.base + self.start, total), daemon=True)
            faulting.start()
        offset, placed = self.start, []
        for group, group_sizes in zip(groups, sizes, strict=True):
            placed.append([])
            for (dtype, shape), size in zip(group, group_sizes, strict=True):
                placed[-1].append(self.tensor(offset, size, dtype, shape))
                offset += size
            offset = self.start + aligned(offset - self.start)
        return placed

    def span(self, parts: list[torch.Tensor]) -> torch.Tensor | None:
        first, rest = parts[0], parts[0].shape[1:]
        adjacent = all(
            p.dtype == first.dtype and p.is_contiguous() and p.shape[1:] == rest and self.holds(p) for p in parts
        ) and all(b.data_ptr() == a.data_ptr() + a.nbytes for a, b in zip(parts, parts[1:], strict=False))
        if not adjacent or not first.dim():
            return None
        offset = first.data_ptr() - self.base
        shape = torch.Size([sum(p.shape[0] for p in parts), *rest])
        return self.tensor(offset, sum(p.nbytes for p in parts), first.dtype, shape)

    def tensor(self, offset: int, size: int, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
        """A tensor over the block's bytes at offset, with a storage of its own (see on_huge_pages)."""
        if not size:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(self.block, dtype=torch.uint8, count=size, offset=offset).view(dtype).view(shape)

    def holds(self, t: torch.Tensor) -> bool:
        if self.block is None or t.device.type != "cpu" or not t.nbytes:
            return False
        return self.base + self.start <= t.data_ptr() and t.data_ptr() + t.nbytes <= self.base + self.end


def aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


def on_huge_pages(model: torch.nn.Module, placed: HugePageBlock | None = None) -> int:
    """Every CPU parameter and buffer of the model moved into one block advised for huge pages, in place (the
    modules keep their tensors, now views of the block), but for those already `placed` in one; the bytes moved (0
    on another device or without THP)."""
    tensors = [t for t in distinct_tensors(model) if t.device.type == "cpu" and not (placed and placed.holds(t))]
    if not huge_pages_offered() or not tensors:
        return 0
    sizes = [aligned(t.numel() * t.element_size()) for t in tensors]
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
