"""CUDA graphs over the compiled steps, captured on the thread that replays them.

Inductor's own CUDA graphs (mode="reduce-overhead", cudagraph trees) keep their state per thread and
skip a graph whose inputs it writes to. Our steps are compiled on a background thread and run on the
compute thread, and they write the KV cache they are given: with inductor's graphs the first bucket ran
without graphs and then failed on the compute thread, and the others failed to build. A step's inputs
are fixed tensors per shape (DecodeStep.inputs), so one graph per shape, captured at the shape's first
call on the compute thread, replays the whole step with one launch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import Any

import torch

log = logging.getLogger("tinyserve")


class CUDAGraphs:
    """One captured graph per key (a step's shape); its outputs are the same tensors at every replay."""

    def __init__(self) -> None:
        self.graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, Any]] = {}
        self.failed: dict[Hashable, str] = {}  # key -> why it runs without a graph
        self._pool: Any = None  # one memory pool for all: the graphs replay one at a time, on one stream

    def __call__(self, key: Hashable, fn: Callable[..., Any], *args: torch.Tensor) -> Any:
        """fn(*args) as a graph replay. args must be the same tensors at every call with this key."""
        if key in self.failed:
            return fn(*args)
        if key not in self.graphs:
            try:
                self.graphs[key] = self.capture(fn, args)
            except Exception as e:  # e.g. a host synchronisation inside fn: it runs as it is
                self.failed[key] = f"{type(e).__name__}: {e}"
                log.warning("no CUDA graph for %s: %s", key, self.failed[key])
                return fn(*args)
        graph, outputs = self.graphs[key]
        graph.replay()
        return outputs

    def capture(self, fn: Callable[..., Any], args: tuple[torch.Tensor, ...]) -> tuple[torch.cuda.CUDAGraph, Any]:
        """A warm-up run on a side stream (libraries set up their handles outside the capture; a step's
        writes to the cache are repeated alike by the replay that follows), then the capture."""
        main = torch.cuda.current_stream(args[0].device)
        side = torch.cuda.Stream(args[0].device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            fn(*args)
        main.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = fn(*args)
        self._pool = graph.pool()
        return graph, outputs
