"""What tool calling costs: time per token of chat requests whose reply is held to a tool's schema (tool_choice
"required", calls after calls) against the same prompt unconstrained (tool_choice "none"), over HTTP.

    .venv/bin/python bench/bench_tool_calls.py [--shape smollm2-135m] [--streams 1,8] [--rounds 5]

A random checkpoint at the shape (bench/bench_families.py: our 16k-token vocabulary, where the `<tool_call>`
marker is text, so the lazy grammar path runs) gets a Hermes chat template (tests/tool_models.py) and is served
in its own process, its compiled steps built first. Each request is greedy, 64 tokens exactly (the end of a turn
never chosen); rounds alternate the kinds; for each stream count, the median per-round time per token and the
ratio held / free.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.bench_families import make_checkpoint  # noqa: E402
from bench.bench_structured import compared  # noqa: E402
from model_store.ingest import add_checkpoint  # noqa: E402
from scripts.processes import http_server, wait_compiled  # noqa: E402
from tests.tool_models import HERMES_TEMPLATE  # noqa: E402

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
# the same prompt (tool_choice none renders the tools too), free or held to the tool's schema
KINDS = {"free": {"tools": TOOLS, "tool_choice": "none"}, "tools": {"tools": TOOLS, "tool_choice": "required"}}


def request(url: str, extra: dict) -> int:
    body = {"model": "tool-model", "messages": [{"role": "user", "content": "The weather in Paris and Rome?"}],
            "max_tokens": 64, "temperature": 0, "eos_bias": -1e9, **extra}  # fmt: skip
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    r.raise_for_status()
    assert r.json()["usage"]["completion_tokens"] == 64, r.json()  # per token over the same work
    return 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    streams_list = [int(s) for s in args.streams.split(",")]
    with tempfile.TemporaryDirectory() as work:
        source, store = Path(work) / "source", Path(work) / "store"
        make_checkpoint(args.shape, source)
        config = json.loads((source / "tokenizer_config.json").read_text())
        (source / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": HERMES_TEMPLATE}))
        add_checkpoint(source, "tool-model", store)
        batch = str(max(streams_list))
        with http_server(store, compile_max_batch=batch, max_batch_size=batch) as (url, _):
            wait_compiled(url)  # time the compiled steps, not eager ones
            for streams in streams_list:
                sends = {kind: functools.partial(request, url, extra) for kind, extra in KINDS.items()}
                row = compared(sends, streams, args.rounds)
                print(f"{args.shape}, {streams} streams, per token: {row}", flush=True)


if __name__ == "__main__":
    main()
