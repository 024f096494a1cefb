"""Our steering against llama.cpp's control vectors on the same model: the same greedy tokens.

    .venv/bin/python bench/check_control_vector.py --gguf TWIN.gguf --llama-server PATH [--model gpt-wikitext2]

A vector made by POST /inspect/steering-vector (contrasting prompts, one block or all) is exported as llama.cpp's
control-vector file (GET /inspect/steering-vector/{name}.gguf); llama-server serves the model's GGUF (the shipped
GPT's exact twin, ../shared/peers' twin-f32.gguf, or `tinyserve export --format gguf`'s file) with
`--control-vector-scaled FILE:SCALE`; both continue the same prompts (token ids) greedily, EOS masked, plain and
steered. Prints each prompt's tokens agreed of N, and whether the steer changed llama.cpp's tokens at all.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.steering_study import NEUTRAL, PAIRS  # noqa: E402

PROMPTS = NEUTRAL[:4]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_tokens(server: str, gguf: Path, vector: Path | None, scale: float, prompts: list[list[int]], n: int):
    port = free_port()
    cmd = [server, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", "2", "-np", "1", "-c", "512"]
    if vector is not None:
        cmd += ["--control-vector-scaled", f"{vector}:{scale}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited: {proc.stderr.read()[-2000:]}")
            time.sleep(0.2)
        made = []
        for ids in prompts:
            body = {"prompt": ids, "n_predict": n, "ignore_eos": True, "temperature": 0.0, "cache_prompt": False,
                    "return_tokens": True}  # fmt: skip
            made.append(httpx.post(base + "/completion", json=body, timeout=120).json()["tokens"])
        return made
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    from fastapi.testclient import TestClient

    from server.api.app import create_app
    from server.config import Settings

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--model", default="gpt-wikitext2")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    settings = Settings(store=REPO / "model_store", models=[args.model], dtype="float32")
    with TestClient(create_app(settings)) as client, tempfile.TemporaryDirectory() as work:
        pairs = [{"positive": p, "negative": n} for p, n in PAIRS]
        made = client.post("/inspect/steering-vector", json={"model": args.model, "pairs": pairs, "name": "war"})
        assert made.status_code == 200, made.text
        vector = Path(work) / "war.gguf"
        vector.write_bytes(client.get(f"/inspect/steering-vector/war.gguf?model={args.model}").content)
        prompts = [client.post("/tokenize", json={"model": args.model, "text": p}).json()["tokens"] for p in PROMPTS]

        def ours(steer: list | None) -> list[list[int]]:
            out = []
            for text in PROMPTS:
                p = {"model": args.model, "max_new_tokens": args.tokens, "min_new_tokens": args.tokens, "details": True}
                if steer:
                    p["steer"] = steer
                body = client.post("/generate", json={"inputs": text, "parameters": p}).json()
                out.append([t["id"] for t in body["details"]["tokens"]])
            return out

        steer = [{"name": "war", "scale": args.scale}]  # every block the file has, as llama.cpp applies it
        for label, mine, theirs in [
            ("plain", ours(None), llama_tokens(args.llama_server, args.gguf, None, 0, prompts, args.tokens)),
            (f"steered x{args.scale:g}", ours(steer),
             llama_tokens(args.llama_server, args.gguf, vector, args.scale, prompts, args.tokens)),
        ]:  # fmt: skip
            agreed = [next((i for i, (a, b) in enumerate(zip(m, t, strict=True)) if a != b), len(m)) for m, t in
                      zip(mine, theirs, strict=True)]  # fmt: skip
            print(f"{label}: greedy tokens agreed before the first difference, of {args.tokens}: {agreed}")
            if label == "plain":
                plain_llama = theirs
            else:
                print(f"  the steer changed llama.cpp's tokens: {theirs != plain_llama}")


if __name__ == "__main__":
    main()
