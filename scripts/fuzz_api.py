"""Fuzz the HTTP API from its own OpenAPI schema with schemathesis, against a real server process.

    .venv/bin/python -m scripts.fuzz_api                      # the long run: shipped store, >= 1,000 cases
    .venv/bin/python -m scripts.fuzz_api --max-examples 10    # short (CI runs this on tiny models)

Passes when no generated case gets a 5xx or hangs past the request timeout, and /health is still 200
afterwards. Generation is capped at a few tokens so that the run measures the API, not the model.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from model_store import STORE_ROOT
from scripts.processes import http_server


@dataclass
class FuzzResult:
    cases: int  # generated test cases, all phases
    failures: int  # cases that failed the checks (5xx) or errored (hang, dropped connection)
    healthy_after: bool
    seconds: float
    output_tail: str

    @property
    def ok(self) -> bool:
        return self.failures == 0 and self.healthy_after and self.cases > 0


def fuzz(store: Path, max_examples: int, seed: int = 1, max_time_s: int = 1200, workers: int = 1) -> FuzzResult:
    with http_server(store, max_new_tokens_cap="4", request_timeout_s="20") as (base, _):
        start = time.monotonic()
        command = [
            str(Path(sys.executable).with_name("schemathesis")),
            "run",
            f"{base}/openapi.json",
            f"--max-examples={max_examples}",
            f"--seed={seed}",
            "--checks=not_a_server_error",
            "--request-timeout=30",
            f"--max-time={max_time_s}",
            f"--workers={workers}",
            "--generation-deterministic",
        ]
        env = {**os.environ, "NO_COLOR": "1", "SCHEMATHESIS_TELEMETRY": "false"}
        run = subprocess.run(command, capture_output=True, text=True, env=env)
        seconds = time.monotonic() - start
        healthy = httpx.get(f"{base}/health", timeout=10).status_code == 200
    output = run.stdout + run.stderr
    counts = re.search(r"(\d+) generated(?:, (\d+) passed)?(?:, (\d+) failed)?(?:, (\d+) errored)?", output)
    cases = int(counts.group(1)) if counts else 0
    failures = sum(int(n) for n in counts.groups()[2:] if n) if counts else 0
    if run.returncode != 0 and failures == 0:
        failures = 1  # schemathesis failed for a reason its summary line does not count
    return FuzzResult(cases, failures, healthy, round(seconds, 1), output[-6000:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", type=Path, default=STORE_ROOT, help="model store to serve")
    p.add_argument("--max-examples", type=int, default=100, help="examples per operation and phase")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-time", type=int, default=1200, help="time budget in seconds")
    p.add_argument(
        "--workers", type=int, default=1, help="schemathesis workers (> 1 can crash the fuzzer on Python 3.11)"
    )
    p.add_argument("--json", type=Path, help="also write the result here")
    args = p.parse_args()
    result = fuzz(args.store, args.max_examples, args.seed, args.max_time, args.workers)
    print(result.output_tail)
    summary = {k: v for k, v in asdict(result).items() if k != "output_tail"}
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    sys.exit(0 if result.ok else 1)


if __name__ == "__main__":
    main()
