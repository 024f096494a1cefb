"""A file's sha256, hashed once per version of the file rather than at every start.

A version is the file's stat stamp: device, inode, size, and modification and change times in nanoseconds (any
write moves the change time, which no user can set back). Digests are remembered in this process (listing the
store and loading a checkpoint both validate it) and in a small JSON file in the user's cache, written atomically
and only where it can be (a read-only home costs the memo, not the check): a restart does not read a
multi-gigabyte checkpoint through sha256 again (2.7 s for a 0.6B model's 2.4 GB in float32).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import threading
from pathlib import Path

STAMPS = Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "tinyserve" / "sha256.json"

_known: dict[str, tuple[list[int], str]] = {}  # resolved path -> (stamp, digest)
_read_from: Path | None = None  # the STAMPS file _known was read from
_lock = threading.Lock()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def stamp(path: Path) -> list[int]:
    s = path.stat()
    return [s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns]


def sha256_of(path: Path) -> str:
    """The file's sha256: remembered where the file is unchanged since it was hashed, else hashed now."""
    path = Path(path).resolve()
    now = stamp(path)
    with _lock:
        known = remembered().get(str(path))
    if known is not None and known[0] == now:
        return known[1]
    digest = sha256_file(path)
    if stamp(path) == now:  # not written while it was read
        with _lock:
            _known[str(path)] = (now, digest)
            keep()
    return digest


def remembered() -> dict[str, tuple[list[int], str]]:
    """The digests known (under _lock), read from STAMPS at first use or when STAMPS is another file."""
    global _read_from
    if _read_from != STAMPS:
        _known.clear()
        _read_from = STAMPS
        with contextlib.suppress(OSError, ValueError, TypeError):
            _known.update({k: (list(v[0]), str(v[1])) for k, v in json.loads(STAMPS.read_text()).items()})
    return _known


def keep() -> None:
    """Write the digests known to STAMPS (under _lock), replacing it whole; nothing where it cannot be written."""
    with contextlib.suppress(OSError):
        STAMPS.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=STAMPS.parent, prefix=".sha256-")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({k: [s, d] for k, (s, d) in _known.items() if Path(k).exists()}, f)
            os.replace(tmp, STAMPS)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
