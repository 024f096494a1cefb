"""Real server processes on 127.0.0.1, for the end-to-end tests and the scripts: free ports, `python -m server`."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def http_server(store: Path, **settings: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """`python -m server` on a free port over `store`; yields (base URL, process) once /health is 200.

    The server's output goes to a file (`server_output(proc)` reads it), not a pipe: a pipe nobody
    reads fills after a few thousand access-log lines and then blocks the server.
    """
    port = free_port()
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))  # the caller's folders kept
    env = {**os.environ, "TINYSERVE_STORE": str(store), "TINYSERVE_PORT": str(port), "PYTHONPATH": path}
    env.update({f"TINYSERVE_{k.upper()}": v for k, v in settings.items()})
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "server"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        proc.log = log
        base = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(base, proc, 60, lambda: server_output(proc)[-2000:])
            yield base, proc
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=90)


def wait_healthy(base: str, proc: subprocess.Popen, timeout_s: float, output: Callable[[], str]) -> float:
    """Seconds until `base`/health answers 200; AssertionError (with `output()`) if the process exits first. One
    client for every probe: `httpx.get` builds a client (its TLS context) at each call, ~20 ms of CPU, which every
    50 ms took a third of a core from the server starting beside it."""
    start = time.monotonic()
    with httpx.Client(timeout=1) as client:
        while time.monotonic() - start < timeout_s:
            if proc.poll() is not None:
                raise AssertionError(f"server exited with {proc.returncode}: {output()}")
            try:
                if client.get(f"{base}/health").status_code == 200:
                    return time.monotonic() - start
            except httpx.TransportError:
                pass
            time.sleep(0.05)
    raise AssertionError(f"server did not become healthy in {timeout_s:.0f} s")


def wait_loaded(base: str, timeout_s: float) -> float:
    """Seconds until `base`/health lists nothing loading (the models behind the default one)."""
    return _wait_listed_none(base, "loading", timeout_s)


def wait_compiled(base: str, timeout_s: float = 900, probes: int = 1) -> float:
    """Seconds until `probes` /health answers in a row list nothing compiling (behind Ray Serve, ask
    for enough probes to reach every replica): a model still compiling serves eagerly."""
    return _wait_listed_none(base, "compiling", timeout_s, probes)


def _wait_listed_none(base: str, key: str, timeout_s: float, probes: int = 1) -> float:
    start, quiet = time.monotonic(), 0
    with httpx.Client(timeout=5) as client:  # one client for every probe (wait_healthy says why)
        while quiet < probes:
            if time.monotonic() - start > timeout_s:
                raise AssertionError(f"/health still lists models {key} after {timeout_s:.0f} s")
            quiet = 0 if client.get(f"{base}/health").json().get(key) else quiet + 1
            if not quiet:
                time.sleep(0.1)
    return time.monotonic() - start


def server_output(proc: subprocess.Popen) -> str:
    """Everything an `http_server` process has printed so far."""
    proc.log.seek(0)
    return proc.log.read().decode(errors="replace")
