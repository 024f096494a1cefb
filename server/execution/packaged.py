"""A whole CPU pass kept as an AOTInductor package in the compile cache, so a restart loads it in about a second.

Inductor's own cache cannot hold a frozen graph (its oneDNN constants do not pickle: torch/_inductor/codecache.py,
"mkldnn tensors unpickleable"), nor can `aot_compile` (freezing has no serializable compiler), so the frozen
buckets were built again at every start (70-90 s each for a 135M model). A package holds the compiled graph; its
constants (the frozen, packed weights) are kept beside it in the archive, not in its shared library, and loaded as
tensors the caller manages: every package of a model then binds one tensor per distinct constant
(`SharedConstants`). The C++ GEMM template packs a weight alike for every row count it serves, so a model's frozen
buckets and its draft check share one packed copy of the weights, and their norms and embedding are the model's own
(docs/BENCHMARKS.md, "Memory"). The server's compiler (compiler.py) packages a target's whole pass where the target
says how to export it (`exported`) and a cache folder is set; without one it compiles in its own process."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import zipfile
from collections.abc import Callable, Hashable, Iterable, Iterator
from pathlib import Path
from typing import Protocol

import torch

from server.execution.compute_thread import one_openmp_thread

# the constants go beside the graph as tensors (data/weights/, named in weights_config.json), not into its .so
CONSTANTS_BESIDE = {
    "aot_inductor.package_constants_in_so": False,
    "aot_inductor.package_constants_on_disk_format": "pickle_weights",
}


class Exportable(Protocol):
    model: torch.nn.Module  # whose parameters the export freezes: a package's constants may be them

    def exported(self, bucket: Hashable) -> tuple[WholePass, tuple[torch.Tensor, ...], tuple]:
        """(the traced function over its model, scratch inputs, each input's dynamic sizes as torch.export takes
        them: None, or {dimension: torch.export.Dim})."""
        ...


class WholePass(torch.nn.Module):
    """A pass's function as a module whose parameters are its model's (what the export freezes)."""

    def __init__(self, model: torch.nn.Module, fn: Callable[..., tuple[torch.Tensor, ...]]) -> None:
        super().__init__()
        self.model, self.fn = model, fn

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.fn(*inputs)


def package(target: Exportable, bucket: Hashable, path: Path, settings: dict) -> None:
    """Export the bucket's pass and compile it into an AOTInductor package at `path`. Inductor's own torch ops
    (freezing's constant folding) run on one OpenMP thread (compute_thread.py says why)."""
    from torch.fx.experimental import proxy_tensor  # torch's tracer, imported by export

    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with torch.inference_mode(False), torch.no_grad(), one_openmp_thread():  # export takes no inference tensors
            module, args, shapes = target.exported(bucket)
            program = torch.export.export(module, args, dynamic_shapes=(shapes,), strict=False)  # (shapes,): *inputs
            configs = {**settings, **CONSTANTS_BESIDE}
            with distinct_constant_names(), templates_compiled_once():
                torch._inductor.aoti_compile_and_package(program, package_path=str(path), inductor_configs=configs)
    finally:
        # torch 2.13's tracer keeps the last traced graph's nodes in this map (for export's leak report) until the
        # next trace; that graph holds the model's plain weights, which must go once the compiler is done
        proxy_tensor._FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT.clear()


@contextlib.contextmanager
def distinct_constant_names() -> Iterator[None]:
    """torch 2.13's inductor names an unnamed constant `constant<count>` and records that as its original name
    before making the name unique (GraphLowering.allocate_non_dup_const_name): the packed weights of a GELU MLP's
    two products then shared one, and a package with its constants beside it kept only one of their tensors.
    Meanwhile each unnamed constant gets a name no other constant has."""
    from torch._inductor.graph import GraphLowering  # inductor's, imported when a package is built

    allocate = GraphLowering.allocate_non_dup_const_name

    def distinct(graph: GraphLowering, name: str | None, data: torch.Tensor) -> str:
        taken = set(graph.constants) | set(graph.allocated_constant_name.values())
        count = len(graph.constants)
        while name is None and f"constant{count}" in taken:
            count += 1
        return allocate(graph, name if name is not None else f"constant{count}", data)

    GraphLowering.allocate_non_dup_const_name = distinct
    try:
        yield
    finally:
        GraphLowering.allocate_non_dup_const_name = allocate


@contextlib.contextmanager
def templates_compiled_once() -> Iterator[None]:
    """torch 2.13's C++ GEMM template compiles its jinja sources again for every product it renders (a 30-layer
    step renders ~200; a sixth of a package's Python): meanwhile each source is compiled once. The same kernels,
    ~12 s less a package of SmolLM2-135M (docs/BENCHMARKS.md, "Start-up")."""
    from torch._inductor.codegen.common import KernelTemplate  # inductor's, imported when a package is built

    compile_source = KernelTemplate._template_from_string
    KernelTemplate._template_from_string = staticmethod(functools.lru_cache(maxsize=None)(compile_source))
    try:
        yield
    finally:
        KernelTemplate._template_from_string = staticmethod(compile_source)


class SharedConstants:
    """One tensor for each distinct constant of a model's packages: found by content (its bytes' digest, computed
    only once another tensor of its dtype and shape arrives), so that equal constants of two packages, or a
    package's and the model's parameters, are one tensor in memory."""

    def __init__(self) -> None:
        self._alike: dict[tuple, list[list]] = {}  # (dtype, shape, stride) -> [[digest or None, tensor], ...]
        self._seen: set[int] = set()  # ids of the tensors given to `add`
        self._offered: set[int] = set()  # ids of the kept tensors `add` gave (the model's own)
        self._bound: set[int] = set()  # ids of the kept tensors a package binds (its handles do not own them)

    def add(self, tensors: Iterable[torch.Tensor]) -> None:
        """Offer tensors already in memory (the model's parameters) for packages' constants to bind."""
        for tensor in tensors:
            if id(tensor) not in self._seen:
                self._seen.add(id(tensor))
                self._offered.add(id(self.shared(tensor.detach())))

    def bind(self, tensors: Iterable[torch.Tensor]) -> None:
        """Note the tensors a loaded package binds: they are kept as long as this is."""
        self._bound.update(id(t) for t in tensors)

    def forget_offered(self) -> None:
        """Drop the offered tensors no package binds (every package is loaded: the model may free them)."""
        for alike in self._alike.values():
            alike[:] = [e for e in alike if id(e[1]) not in self._offered or id(e[1]) in self._bound]
        self._offered &= self._bound
        self._seen.clear()

    def __len__(self) -> int:
        return sum(len(alike) for alike in self._alike.values())

    def shared(self, tensor: torch.Tensor, digest: str | None = None) -> torch.Tensor:
        """The kept tensor equal to `tensor`, or `tensor`, kept from now on (`digest`: its content_digest, if known)."""
        meta = tensor_meta(tensor)
        if self._alike.get(meta):  # a digest only where another tensor of the layout is kept
            digest = digest or content_digest(tensor)
            if (kept := self._with_digest(meta, digest)) is not None and torch.equal(kept, tensor):
                return kept
        self._alike.setdefault(meta, []).append([digest, tensor])
        return tensor

    def from_model(self, tensor: torch.Tensor) -> bool:
        """Whether the tensor was offered by `add` (the model's own)."""
        return id(tensor) in self._offered

    def held(self, noted: list, digest: str) -> torch.Tensor | None:
        """The kept tensor of this layout (`noted_meta`'s, as JSON gives it back) and digest, if there is one."""
        dtype, shape, stride = noted
        return self._with_digest((getattr(torch, dtype), tuple(shape), tuple(stride)), digest)

    def _with_digest(self, meta: tuple, digest: str) -> torch.Tensor | None:
        """The kept tensor of this layout whose bytes have this digest (each one's computed once, when asked)."""
        for entry in self._alike.get(meta, []):
            entry[0] = entry[0] or content_digest(entry[1])
            if entry[0] == digest:
                return entry[1]
        return None


def tensor_meta(tensor: torch.Tensor) -> tuple:
    return tensor.dtype, tuple(tensor.shape), tuple(tensor.stride())


def noted_meta(tensor: torch.Tensor) -> tuple:
    """`tensor_meta` as JSON keeps it."""
    return str(tensor.dtype).removeprefix("torch."), list(tensor.shape), list(tensor.stride())


def content_digest(tensor: torch.Tensor) -> str:
    """The sha1 of the tensor's bytes (to find equal tensors, not for security)."""
    data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha1(memoryview(data), usedforsecurity=False).hexdigest()


# Added to a package at its first load: each constant's layout and digest, so that a later load reads from the archive
# only the constants not held already (another package's, the model's)
DIGESTS = "tinyserve/constants.json"


def load(path: Path, constants: SharedConstants) -> Callable[..., tuple[torch.Tensor, ...]]:
    """The packaged pass, called with the traced function's arguments; returns its outputs. Its constants are
    bound from `constants` (the package's own tensors where no equal one is there yet). A constant is read from
    the archive once (its CRC and unpickling: seconds a GB); it is then kept by digest in `constants/` beside the
    packages, which later loads map into memory."""
    compiled = torch._inductor.aoti_load_package(str(path))
    kept = path.parent / "constants"
    with zipfile.ZipFile(path) as archive:
        members = {name.split("/", 1)[1]: name for name in archive.namelist()}  # the archive's top folder dropped
        config = json.loads(archive.read(members["data/aotinductor/model/weights_config.json"]))
        known = json.loads(archive.read(members[DIGESTS])) if DIGESTS in members else {}
        files: dict[str, torch.Tensor] = {}
        bound = {}
        for name, (file, shape, stride, offset) in config.items():
            noted, digest = known.get(name, (None, None))
            tensor = constants.held(noted, digest) if digest is not None else None
            if tensor is None and digest is not None and (mapped := kept / f"{digest}.pt").exists():
                tensor = constants.shared(torch.load(mapped, mmap=True, weights_only=True), digest)
            if tensor is None:
                if file not in files:
                    with archive.open(members[f"data/weights/{file}"]) as f:
                        files[file] = torch.load(f, weights_only=True)
                tensor = constants.shared(files[file].as_strided(shape, stride, offset), digest)
            bound[name] = tensor
    compiled.load_constants(bound, check_full_update=True, user_managed=True)  # its tensors, not copies
    constants.bind(bound.values())
    if not known:  # noted once, at the load that follows the build
        top = next(iter(members.values())).split("/", 1)[0]
        noted = {name: (noted_meta(t), content_digest(t)) for name, t in bound.items()}
        with contextlib.suppress(OSError):  # a read-only cache: read from the archive again
            with zipfile.ZipFile(path, "a") as archive:
                archive.writestr(f"{top}/{DIGESTS}", json.dumps(noted))
            keep(bound, noted, constants, kept)
    return compiled


def keep(bound: dict[str, torch.Tensor], noted: dict, constants: SharedConstants, folder: Path) -> None:
    """The package's constants that are not the model's own, each in a file of its own named by its digest."""
    folder.mkdir(exist_ok=True)
    for name, tensor in bound.items():
        file = folder / f"{noted[name][1]}.pt"
        if not constants.from_model(tensor) and not file.exists():
            partial = file.with_suffix(".partial")
            torch.save(torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype).copy_(tensor), partial)
            partial.replace(file)
