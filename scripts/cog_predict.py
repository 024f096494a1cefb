"""`cog run -i key=value` without Docker: start cog's HTTP server on predict.py, run one prediction.

    python -m scripts.cog_predict -i prompt="The history of" -i max_new_tokens=40
    python -m scripts.cog_predict -i task=attention -i prompt="The cat sat" -i layer=0 -o attention.png

Starts `python -m cog.server.http` (coglet) with COG_PREDICT_TYPE_STUB=predict.py:Runner, waits for
/health-check to say READY, POSTs /predictions with server-sent events and prints the text as it
streams. A `data:` URI output (the attention PNG) is written to a file, as `cog run` does.
Values are converted with the types of `.cog/openapi_schema.json` (run scripts/cog_schema.py first).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from scripts.cog_schema import declared_concurrency
from scripts.processes import free_port

ROOT = Path(__file__).resolve().parent.parent
SCHEMA_PATH = ROOT / ".cog" / "openapi_schema.json"


def parse_inputs(pairs: list[str], schema: dict) -> dict:
    """key=value strings -> JSON values typed by the schema's Input properties."""
    props = schema["components"]["schemas"]["Input"]["properties"]
    enums = schema["components"]["schemas"]
    inputs = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in props:
            sys.exit(f"-i {pair!r}: expected key=value with key one of {', '.join(props)}")
        prop = props[key]
        kind = prop.get("type") or enums[prop["allOf"][0]["$ref"].rsplit("/", 1)[1]]["type"]
        try:
            inputs[key] = {"integer": int, "number": float, "boolean": lambda v: v.lower() in ("1", "true", "yes")}.get(
                kind, str
            )(value)
        except ValueError:
            sys.exit(f"-i {pair!r}: {key} must be {kind}")
    return inputs


def start_server(port: int, env: dict | None = None, train: bool = False) -> subprocess.Popen:
    """coglet on predict.py's runner (or, `train`, on train.py's trainer at /trainings)."""
    # as `cog build` writes them into the image: the runner, its predictions at once, the trainer
    concurrency = str(declared_concurrency(ROOT / "predict.py", "Runner", "run"))
    env = {"COG_MAX_CONCURRENCY": concurrency, **os.environ, **(env or {}), "PORT": str(port),
           "COG_PREDICT_TYPE_STUB": "predict.py:Runner", "COG_TRAIN_TYPE_STUB": "train.py:train"}  # fmt: skip
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # the worker runs `python`
    cmd = [sys.executable, "-m", "cog.server.http", "--host", "127.0.0.1", *(["--x-mode", "train"] if train else [])]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def wait_ready(base: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"cog server exited with {proc.returncode}:\n{proc.stdout.read().decode()}")
        try:
            health = httpx.get(f"{base}/health-check", timeout=2).json()
            if health.get("status") == "READY":
                return
            if health.get("status") == "SETUP_FAILED":
                raise RuntimeError(f"setup failed:\n{health.get('setup', {}).get('logs', '')}")
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"cog server not READY after {timeout_s} s")


def predict_stream(base: str, inputs: dict):
    """Yield (event, data) pairs of one streamed prediction."""
    headers = {"Accept": "text/event-stream"}
    with httpx.stream("POST", f"{base}/predictions", json={"input": inputs}, headers=headers, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode()}")
        event = None
        for line in r.iter_lines():
            if line.startswith("event:"):
                event = line.split(":", 1)[1].strip()
            elif line.startswith("data:"):
                yield event, json.loads(line.split(":", 1)[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-i", "--input", action="append", default=[], metavar="KEY=VALUE", help="an input")
    parser.add_argument("-o", "--output", default="output.png", help="where a file output is written")
    args = parser.parse_args()
    inputs = parse_inputs(args.input, json.loads(SCHEMA_PATH.read_text()))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_server(port)
    try:
        wait_ready(base, proc)
        for event, data in predict_stream(base, inputs):
            chunk = data.get("chunk") if event == "output" else None
            if isinstance(chunk, str) and chunk.startswith("data:"):
                Path(args.output).write_bytes(base64.b64decode(chunk.split(",", 1)[1]))
                print(f"wrote {args.output}")
            elif chunk is not None:
                print(chunk, end="", flush=True)
            elif event == "completed":
                if data.get("status") != "succeeded":
                    sys.exit(f"\nprediction {data.get('status')}: {data.get('error')}")
                print()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
