"""A checkpoint's tensors read straight into the memory they are served from (an `Arena`: the server's huge-page
block), the ones a family's mapping joins (q/k/v, gate/up: `torch.cat` of rows) laid end to end so that the join
is the span over them, not a copy.

Reading into buffers, joining, then moving every tensor into the block touched each weight's bytes three times, in
fresh memory each time: most of a large model's warm start (docs/BENCHMARKS.md, "Start-up"). Which tensors a
mapping joins is learned by running it on meta tensors first, so the families' code (model_store/families.py) stays
as it reads; what a mapping computes otherwise (a transpose, a norm's +1) is read into a buffer of its own as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

import torch
from torch.overrides import TorchFunctionMode

from model_store.weights_file import WeightsFile

Mapping = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


class Arena(Protocol):
    """Memory that tensors are placed in, each group's laid end to end."""

    def place(self, groups: list[list[tuple[torch.dtype, torch.Size]]]) -> list[list[torch.Tensor]]:
        """An empty tensor for each (dtype, shape), each with a storage of its own, a group's adjacent in order."""
        ...

    def span(self, parts: list[torch.Tensor]) -> torch.Tensor | None:
        """One tensor (a storage of its own) over adjacent parts of one group, their rows stacked; None where they
        are not such parts."""
        ...


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() else t


def read_placed(f: WeightsFile, names: list[str], dtype: torch.dtype, mapping: Mapping, arena: Arena) -> dict:
    """The file's tensors `names`, floating ones in `dtype`: those the mapping serves as they are or joins, read into
    the arena (the joined ones adjacent in the mapping's order); the rest into buffers of their own."""
    target = {n: dtype if f.dtype(n).is_floating_point else f.dtype(n) for n in names}
    groups = placed_groups(mapping, {n: (target[n], f.shape(n)) for n in names})
    places = arena.place([[(target[n], f.shape(n)) for n in group] for group in groups])
    state = {}
    for group, tensors in zip(groups, places, strict=True):
        for name, place in zip(group, tensors, strict=True):
            if f.dtype(name) == place.dtype:
                f.read_into(name, place)
            else:  # cast on the way in
                place.copy_(f.get_tensor(name))
            state[name] = place
    placed = set(state)
    for name in names:
        if name not in placed:
            state[name] = cast(f.get_tensor(name), dtype)
    return state


def placed_groups(mapping: Mapping, specs: dict[str, tuple[torch.dtype, torch.Size]]) -> list[list[str]]:
    """The tensors to place, a group each: a join's parts in its order, or one tensor the mapping serves as it is.
    Learned from the mapping run on meta tensors; nothing where it fails there (the real run says why)."""
    meta = {n: torch.empty(shape, dtype=dt, device="meta") for n, (dt, shape) in specs.items()}
    names = {id(t): n for n, t in meta.items()}
    joins: list[list[str]] = []

    class Joins(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            parts = rows_joined(func, args, kwargs)
            if parts is None or not all(id(p) in names for p in parts):
                return func(*args, **(kwargs or {}))
            joins.append([names[id(p)] for p in parts])
            # its result made here: a meta torch.cat imports dynamo, which the server imports beside the load
            shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
            out = torch.empty(shape, dtype=parts[0].dtype, device="meta")
            names[id(out)] = ""  # not a file tensor served as it is
            return out

    try:
        with Joins():
            served = mapping(dict(meta))
    except Exception:  # noqa: BLE001 - the real run raises it, with the checkpoint's error
        return []
    joined = [n for group in joins for n in group]
    as_is = {names[id(t)] for t in served.values() if names.get(id(t))}
    if len(set(joined)) != len(joined) or as_is & set(joined):  # a tensor joined twice, or also served alone
        joins = []
    return joins + [[n] for n in specs if n in as_is and n not in set(joined)]


def rows_joined(func: Callable, args: tuple, kwargs: dict | None) -> list[torch.Tensor] | None:
    """The parts of a torch.cat along the rows, else None."""
    kwargs = kwargs or {}
    dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
    parts = args[0] if args else kwargs.get("tensors")
    if func is not torch.cat or dim != 0 or not parts:
        return None
    return list(parts)


@contextmanager
def joining_in(arena: Arena) -> Iterator[None]:
    """Inside, torch.cat of adjacent parts of the arena along the rows gives the span over them (no copy)."""

    class Spans(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            parts = rows_joined(func, args, kwargs)
            if parts is not None and (span := arena.span(parts)) is not None:
                return span
            return func(*args, **(kwargs or {}))

    with Spans():
        yield
