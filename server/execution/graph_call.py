"""Calling a compiled graph without dynamo: the graph inductor built, bound to the compiled function's
arguments by dynamo's sources, or dynamo's function with its guards skipped (server/execution/compiler.py builds
both; the engine's compute thread calls them)."""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable

import torch


class GraphCapture:
    """A torch.compile backend that keeps what it was handed and what it built, so the built graph can be
    called without dynamo: its frame evaluation and wrappers, guards skipped, are a noticeable share of a small
    model's one-row step (docs/BENCHMARKS.md, "Why these paths"). That needs a graph whose inputs are
    the function's arguments, as a frozen CPU graph's are (its weights are constants), or also the weights,
    bound once (`bind_weights`: the CPU's regional graphs); otherwise the function is called through dynamo
    (CUDA, whose captured CUDA graphs replay without it). Like vLLM's compile
    wrapper, which also skips the guards, it relies on the caller: each bucket's step is called only
    with inputs shaped and strided as the traced ones (its preallocated views)."""

    def __init__(self, backend: Callable | str) -> None:
        self.backend = torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend
        # (each graph input's source, a weak reference to the tensor it was traced with, the compiled graph): weak,
        # or the scratch inputs (a bucket's whole cache) would live as long as the graph
        self.graphs: list[tuple[list, list, Callable]] = []

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
        sources = [node.meta["grapharg"].source for node in graph.graph.nodes if node.op == "placeholder"]
        compiled = self.backend(graph, example_inputs)
        examples = [weakref.ref(t) if isinstance(t, torch.Tensor) else None for t in example_inputs]
        self.graphs.append((sources, examples, compiled))
        return compiled

    def direct(self, fn: Callable, returns_tensor: bool, bind_weights: bool = False) -> Callable | None:
        """The one graph as a function of fn's arguments, returning a tensor or a tuple of them as fn does;
        None where it isn't one graph of those arguments alone. bind_weights: a tensor input fn reads from
        elsewhere (its model's weights, through its closure) is bound to the tensor it was traced with, so a
        graph that takes the weights as inputs is called directly too (the caller's weights never change)."""
        if len(self.graphs) != 1:
            return None
        sources, examples, compiled = self.graphs[0]
        getters = [argument_getter(source, fn) for source in sources]
        if bind_weights:  # the weights are alive: the function's closure holds them
            tensors = [ref() if ref is not None else None for ref in examples]
            getters = [
                g if g is not None or t is None else (lambda args, t=t: t)
                for g, t in zip(getters, tensors, strict=True)
            ]
        if any(g is None for g in getters):
            return None

        def call(*args):
            outputs = compiled(*[get(args) for get in getters])
            return outputs[0] if returns_tensor and len(outputs) == 1 else tuple(outputs)

        return call


def argument_getter(source, fn: Callable) -> Callable[[tuple], object] | None:
    """How to read a graph input (dynamo's source: an argument, an item of one, a tensor's size or
    stride) from fn's positional arguments; None for anything else (a global, a module's attribute)."""
    from torch._dynamo.source import GetItemSource, LocalSource, TensorProperty, TensorPropertySource

    if isinstance(source, LocalSource):
        code = fn.__code__
        names = code.co_varnames[: code.co_argcount]
        if source.local_name in names:
            i = names.index(source.local_name)
            return lambda args: args[i]
        if code.co_flags & inspect.CO_VARARGS and source.local_name == code.co_varnames[code.co_argcount]:
            n = code.co_argcount
            return lambda args: args[n:]
        return None
    base = argument_getter(getattr(source, "base", None), fn) if hasattr(source, "base") else None
    if base is None:
        return None
    if isinstance(source, GetItemSource) and isinstance(source.index, int) and not source.index_is_slice:
        index = source.index
        return lambda args: base(args)[index]
    if isinstance(source, TensorPropertySource):
        dim = source.idx
        if source.prop is TensorProperty.SIZE:
            return lambda args: base(args).size(dim)
        if source.prop is TensorProperty.STRIDE:
            return lambda args: base(args).stride(dim)
    return None


def skipping_guards(compiled: Callable) -> Callable:
    """A dynamo-compiled function called without evaluating its guards (a noticeable share of a one-row step:
    docs/BENCHMARKS.md, "Why these paths"): each function holds one graph, built for inputs strided as its
    callers'."""

    def call(*args):
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            return compiled(*args)

    return call
