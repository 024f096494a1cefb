"""Named steering vectors of the served models: those in a store model's folder (vectors/NAME.gguf, llama.cpp's
control-vector files: `tinyserve store add-vector`) and those made by POST /inspect/steering-vector, kept in memory,
the oldest dropped first past `kept`. A vector is a set of directions, block -> (C,): a request names it to add
them all, or one block's."""

from __future__ import annotations

import collections
import functools
import threading
from pathlib import Path

import torch

from model_store.control_vectors import NAME, VECTORS, ControlVectorError, read_control_vector

Directions = dict[int, torch.Tensor]  # block (llama.cpp's N: added after 0-based block N) -> (C,) float32


class NamedVectors:
    def __init__(self, kept: int) -> None:
        self.kept = kept
        self._made: collections.OrderedDict[tuple[str, str], Directions] = collections.OrderedDict()
        self._lock = threading.Lock()  # routes add and read from the event loop's worker threads

    def add(self, model_id: str, name: str, directions: Directions) -> None:
        with self._lock:
            self._made.pop((model_id, name), None)
            self._made[(model_id, name)] = directions
            while len(self._made) > self.kept:
                self._made.popitem(last=False)

    def get(self, model_id: str, folder: Path, name: str) -> Directions | None:
        """The model's vector of that name (one made here first, then its folder's file); None where it has none.
        A name is a file name in vectors/ and nothing else (NAME): no path a client sends is opened."""
        with self._lock:
            made = self._made.get((model_id, name))
        if made is not None or NAME.fullmatch(name) is None:
            return made
        path = folder / VECTORS / f"{name}.gguf"
        if not path.is_file():
            return None
        return self._read(path, path.stat().st_mtime_ns)

    @staticmethod
    @functools.lru_cache(maxsize=64)
    def _read(path: Path, stamp: int) -> Directions | None:
        """A file's directions, read once while it is unchanged (each request naming it would read it again)."""
        try:
            return read_control_vector(path)
        except ControlVectorError:
            return None

    def names(self, model_id: str, folder: Path) -> list[str]:
        """The model's vector names: its files' and those made here."""
        with self._lock:
            made = [name for mid, name in self._made if mid == model_id]
        files = sorted(p.stem for p in (folder / VECTORS).glob("*.gguf")) if (folder / VECTORS).is_dir() else []
        return sorted({*files, *made})
