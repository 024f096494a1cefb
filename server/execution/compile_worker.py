"""A process beside the server that builds some of a model's compiled passes while the server's compiler builds the
others (compile_sharing.py says why and which): it loads its own copy of the checkpoint as the server did and
builds its passes into the compile cache, a JSON line on stdout after each; the server stops it while requests run
(compute_thread.py, `HelpersPaused`).

    python -m server.execution.compile_worker   # reads its `WorkerSpec` as JSON on stdin, then waits for EOF
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from pathlib import Path

import torch

from server.execution.compile_sharing import WorkerSpec
from server.execution.compiler import BackgroundCompiler
from server.execution.loader import load_runner


def main() -> None:
    """The worker: build the spec's passes, a JSON line on stdout after each; end when stdin closes (the server
    closed it or ended)."""
    spec = WorkerSpec(**json.loads(sys.stdin.readline()))
    os.nice(19)  # below the server's compute thread, as its own compiler is

    def ended() -> None:
        sys.stdin.read()
        os._exit(0)

    threading.Thread(target=ended, name="server-watch", daemon=True).start()
    # the server logs each pass it loads from here: only what went wrong is said twice
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s compile worker ({spec.name}) %(message)s")
    torch.set_num_threads(spec.threads)
    runner, folder, device, dtype, *rest = spec.load
    runner = load_runner(runner, Path(folder), torch.device(device), getattr(torch, dtype), *rest)
    compiler = BackgroundCompiler(
        runner.compile_passes(spec.compile_max_batch), Path(spec.cache_dir), spec.key, spec.threads, spec.name
    )
    compiler.passes = [p for p in compiler.passes if compiler.label(p.bucket, p.regional) in spec.labels]

    def report(label: str, state: str) -> None:
        seconds = compiler.seconds.get(label, 0.0)
        print(json.dumps({"label": label, "state": state, "seconds": seconds}), flush=True)

    compiler.run(report=report)


if __name__ == "__main__":
    main()
