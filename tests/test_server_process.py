"""The real server: `python -m server` under uvicorn on 127.0.0.1, spoken to over the socket."""

import httpx
import pytest

from model_store.store import write_checkpoint
from models.tokenizer import eos_id
from scripts.processes import http_server, server_output
from tests.conftest import tiny_gpt

pytestmark = pytest.mark.slow


def test_uvicorn_process_serves_generate(tmp_path, tiny_tokenizer):
    model = tiny_gpt(vocab_size=tiny_tokenizer.get_vocab_size(), eos_token_id=eos_id(tiny_tokenizer), context_length=48)
    write_checkpoint(tmp_path / "tiny-gpt", model, tiny_tokenizer, card="# tiny\n", metrics={})
    with http_server(tmp_path) as (base, proc):
        r = httpx.post(
            f"{base}/generate", json={"inputs": "The castle", "parameters": {"max_new_tokens": 5}}, timeout=30
        )
        assert r.status_code == 200 and isinstance(r.json()["generated_text"], str)
        with httpx.stream(
            "POST", f"{base}/generate_stream", json={"inputs": "The", "parameters": {"max_new_tokens": 3}}, timeout=30
        ) as s:
            assert sum(line.startswith("data:") for line in s.iter_lines()) >= 1
        proc.terminate()
        proc.wait(timeout=90)
        output = server_output(proc)
    # uvicorn drains, then re-raises SIGTERM so the exit status says how it ended
    assert proc.returncode in (0, -15) and "Application shutdown complete" in output, output[-2000:]
