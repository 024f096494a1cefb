"""Calling a compiled graph without dynamo: the graph inductor built, bound to the compiled function's
arguments by dynamo's sources, or dynamo's function with its guards skipped (server/execution/compiler.py builds
both; the engine's compute thread calls them)."""

from __future__ import annotations

import inspect
import types
import weakref
from collections.abc import Callable

import torch


def own_code(fn: Callable, name: str) -> Callable:
    """fn with a code object of its own: dynamo keeps compiled graphs per code object, so each bucket's
    graph is the only entry of its cache (no recompile limit to hit, no chain of guards per call)."""
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def layout(output: torch.Tensor | tuple[torch.Tensor, ...]) -> list:
    """What a step returns, element by element: (dtype, shape), or the value of what is not a tensor."""
    outputs = output if isinstance(output, tuple) else (output,)
    return [(t.dtype, tuple(t.shape)) if isinstance(t, torch.Tensor) else t for t in outputs]


class GraphCapture:
    """A torch.compile backend that keeps what it was handed and what it built, so the built graph can be
    called without dynamo: its frame evaluation and wrappers, guards skipped, are a noticeable share of a small
    model's one-row step (docs/BENCHMARKS.md, "Why these paths"). That needs a graph whose inputs are
    the function's arguments, as a frozen CPU graph's are (its weights are constants), or also the weights,
    bound once by their names in the model (the CPU's regional graphs): the same names bind a graph saved by an
    earlier process (compiler.py), so a restart calls it without tracing anything. Otherwise the function is called
    through dynamo (CUDA, whose captured CUDA graphs replay without it). Like vLLM's compile
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

    def recipes(self, fn: Callable, weights: dict[int, str] | None = None) -> list[Recipe] | None:
        """How to find each input of the one graph from fn's arguments (`argument_recipe`), and with `weights` (a
        tensor's id -> its name in the model fn reads) a weight by name; None where it isn't one graph of those."""
        if len(self.graphs) != 1:
            return None
        sources, examples, _ = self.graphs[0]
        recipes = [argument_recipe(source, fn) for source in sources]
        if weights is not None:  # the weights are alive: the function's closure holds them
            traced = [ref() if ref is not None else None for ref in examples]
            names = [weights.get(id(t)) if t is not None else None for t in traced]
            recipes = [r if r is not None or n is None else ("weight", n) for r, n in zip(recipes, names, strict=True)]
        return None if any(r is None for r in recipes) else recipes

    def direct(
        self, fn: Callable, returns_tensor: bool, weights: dict[str, torch.Tensor] | None = None
    ) -> BoundGraph | None:
        """The one graph as a function of fn's arguments, returning a tensor or a tuple of them as fn does;
        None where it isn't one graph of those arguments alone. weights: the tensors fn reads from elsewhere (its
        model's weights, through its closure) by name, bound once, so a graph that takes the weights as inputs is
        called directly too (the caller's weights never change)."""
        names = {id(t): name for name, t in weights.items()} if weights is not None else None
        recipes = self.recipes(fn, names)
        return None if recipes is None else BoundGraph(self.graphs[0][2], recipes, weights or {}, returns_tensor)


def distinct_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The model's parameters and buffers, each once (a tied head, a table every block shares)."""
    return list({id(t): t for t in [*model.parameters(), *model.buffers()]}.values())


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor a model holds by a name: its parameters, buffers and tensor attributes (a prepacked layer's
    packed weight), the first name of a tensor held twice (tied weights)."""
    named: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for prefix, module in model.named_modules(remove_duplicate=False):
        held = [*module._parameters.items(), *module._buffers.items(), *vars(module).items()]
        for name, t in held:
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                named[f"{prefix}.{name}" if prefix else name] = t
    return named


# How a graph input is found: ("arg", i), ("varargs", n) (the arguments from n on), ("item", recipe, i),
# ("size" | "stride", recipe, dim), ("weight", name): kept beside a saved graph (JSON), bound again at a restart.
Recipe = tuple


def argument_recipe(source, fn: Callable) -> Recipe | None:
    """How to read a graph input (dynamo's source: an argument, an item of one, a tensor's size or
    stride) from fn's positional arguments; None for anything else (a global, a module's attribute)."""
    from torch._dynamo.source import GetItemSource, LocalSource, TensorProperty, TensorPropertySource

    if isinstance(source, LocalSource):
        code = fn.__code__
        names = code.co_varnames[: code.co_argcount]
        if source.local_name in names:
            return ("arg", names.index(source.local_name))
        if code.co_flags & inspect.CO_VARARGS and source.local_name == code.co_varnames[code.co_argcount]:
            return ("varargs", code.co_argcount)
        return None
    base = argument_recipe(source.base, fn) if hasattr(source, "base") else None
    if base is None:
        return None
    if isinstance(source, GetItemSource) and isinstance(source.index, int) and not source.index_is_slice:
        return ("item", base, source.index)
    if isinstance(source, TensorPropertySource) and source.prop in (TensorProperty.SIZE, TensorProperty.STRIDE):
        return ("size" if source.prop is TensorProperty.SIZE else "stride", base, source.idx)
    return None


def getter(recipe: Recipe, weights: dict[str, torch.Tensor]) -> Callable[[tuple], object]:
    """The function of fn's positional arguments that reads what `recipe` names."""
    kind, *rest = recipe
    if kind == "arg":
        return lambda args, i=rest[0]: args[i]
    if kind == "varargs":
        return lambda args, n=rest[0]: args[n:]
    if kind == "weight":
        return lambda args, t=weights[rest[0]]: t
    base, index = getter(tuple(rest[0]), weights), rest[1]
    if kind == "item":
        return lambda args: base(args)[index]
    if kind == "size":
        return lambda args: base(args).size(index)
    return lambda args: base(args).stride(index)


class BoundGraph:
    """A compiled graph (of flat inputs) called with a function's positional arguments, its inputs found by
    `recipes`: returns a tensor, or a tuple of them, as the function does."""

    def __init__(self, graph: Callable, recipes: list, weights: dict[str, torch.Tensor], returns_tensor: bool):
        self.graph, self.recipes, self.returns_tensor = graph, recipes, returns_tensor
        self.getters = [getter(tuple(r), weights) for r in recipes]

    def __call__(self, *args):
        outputs = self.graph(*[get(args) for get in self.getters])
        return outputs[0] if self.returns_tensor and len(outputs) == 1 else tuple(outputs)


def skipping_guards(compiled: Callable) -> Callable:
    """A dynamo-compiled function called without evaluating its guards (a noticeable share of a one-row step:
    docs/BENCHMARKS.md, "Why these paths"): each function holds one graph, built for inputs strided as its
    callers'."""

    def call(*args):
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            return compiled(*args)

    return call
