"""A pytest plugin that says where a run's compile time goes: per test, the g++ runs inductor made (count and
seconds), dynamo's whole compile time and inductor's FX-graph cache outcomes.

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) .venv/bin/python -m pytest -q -n auto -p bench.compile_report

Each worker (pytest-xdist's, or the one process) writes its rows to `compile-report-<worker>.json` in
runs/compile-report/ (gitignored; COMPILE_REPORT_DIR to choose another); `python -m bench.compile_report [DIR]` sums
them and lists the slowest tests.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

TIMED = ("compile_file", "_compile.compile_inner")  # one g++ run; one dynamo frame compiled, inductor's work inside
CACHE = ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")
DEFAULT_DIR = "runs/compile-report"
_rows: list[dict] = []
_started: dict[str, tuple[float, Counter]] = {}


def _now() -> Counter:
    """Running totals of torch's own compile metrics (a test's share is the difference across it)."""
    totals: Counter = Counter()
    if "torch" not in sys.modules:
        return totals
    from torch._dynamo.utils import compilation_time_metrics, counters

    for name in TIMED:
        times = compilation_time_metrics.get(name, [])
        totals[f"{name} runs"], totals[f"{name} s"] = len(times), sum(times)
    for name in CACHE:
        totals[name] = counters["inductor"][name]
    return totals


def pytest_runtest_setup(item) -> None:
    _started[item.nodeid] = (time.monotonic(), _now())


def pytest_runtest_logfinish(nodeid: str, location) -> None:
    if nodeid not in _started:
        return
    began, before = _started.pop(nodeid)
    after = _now()
    # torch._dynamo.reset() inside a test empties the metrics: a negative difference is not the test's
    row = {key: round(after[key] - before[key], 2) for key in after if after[key] - before[key] > 0}
    _rows.append({"test": nodeid, "s": round(time.monotonic() - began, 2), **row})


def pytest_sessionfinish(session) -> None:
    folder = Path(os.environ.get("COMPILE_REPORT_DIR", DEFAULT_DIR))
    folder.mkdir(parents=True, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    (folder / f"compile-report-{worker}.json").write_text(json.dumps(_rows))


def summary(folder: Path, top: int = 30) -> str:
    rows = [row for path in sorted(folder.glob("compile-report-*.json")) for row in json.loads(path.read_text())]
    totals = Counter()
    for row in rows:
        totals.update({key: value for key, value in row.items() if key != "test"})
    lines = [
        f"{len(rows)} tests, {totals['s']:.0f} s of test time; "
        f"g++ {totals['compile_file runs']:.0f} runs, {totals['compile_file s']:.0f} s; "
        f"dynamo compiles {totals['_compile.compile_inner runs']:.0f}, {totals['_compile.compile_inner s']:.0f} s"
    ]
    for row in sorted(rows, key=lambda r: -r["s"])[:top]:
        n = Counter(row)  # 0 where the test made none
        lines.append(
            f"{n['s']:7.1f} s  g++ {n['compile_file runs']:3.0f} runs {n['compile_file s']:6.1f} s  "
            f"dynamo {n['_compile.compile_inner s']:6.1f} s  fx miss/hit/bypass "
            f"{n['fxgraph_cache_miss']:.0f}/{n['fxgraph_cache_hit']:.0f}/{n['fxgraph_cache_bypass']:.0f}  {row['test']}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(Path(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_DIR)))
