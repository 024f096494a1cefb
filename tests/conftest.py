"""Shared fixtures: a tiny corpus, a tokenizer trained on it, and tiny GPTs built on the fly."""

import os
import queue
import tempfile
from pathlib import Path

import pytest
import torch

from model_store import digests
from model_store.store import write_checkpoint, write_manifest
from models import cpu
from models.esperberto import build_model, make_config, save_model
from models.gpt import GPT, GPTConfig
from models.sampling import SamplingParams
from models.tokenizer import eos_id
from server.engine.events import Retired
from training.data import read_split, split_documents
from training.esperberto.data import read_corpus, train_roberta_tokenizer
from training.tokenizer import train_bpe

# Servers built by the tests run float32 and eager unless a test asks otherwise: exact comparisons
# with transformers, and no background compilation (nor compile worker) competing with the suite for the CPU. They are
# ready once every model is loaded, since a route test may call any model at once
# (tests/test_background_loading.py covers the default: ready after the default model).
os.environ.setdefault("TINYSERVE_DTYPE", "float32")
os.environ.setdefault("TINYSERVE_COMPILE_MODELS", "false")
os.environ.setdefault("TINYSERVE_COMPILE_WORKERS", "0")  # where a test compiles, in its own process unless it asks
os.environ.setdefault("TINYSERVE_READY_AFTER", "all")

# The digests of checkpoint files are remembered in a file of the test run's, not of the user's cache
digests.STAMPS = Path(tempfile.mkdtemp(prefix="tinyserve-digests-")) / "sha256.json"

# Under pytest-xdist (`make test`: a worker a core) each worker, and the servers it starts, compute on its share of
# the cores: two workers of two OpenMP threads on two cores had every op wait for a descheduled thread (a test
# decoding the shipped GPT ran 6x slower)
if workers := os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    threads = max(1, len(os.sched_getaffinity(0)) // int(workers))
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    torch.set_num_threads(threads)

# A test of a kernel this CPU lacks is skipped with the reason; its branch of the code is still tested
# on every CPU, by monkeypatching models.cpu.cpu_features (`emulate_cpu`).
needs_onednn_bf16 = pytest.mark.skipif(
    not cpu.cpu_features().onednn_bf16, reason="no oneDNN bf16 kernels on this CPU (needs AVX-512 or AVX-NE-CONVERT)"
)
AVX2 = cpu.CPUFeatures(isa="AVX2", onednn_bf16=False, avx512_bf16=False, amx=False, vnni=False)
AVX512_BF16 = cpu.CPUFeatures(isa="AVX512", onednn_bf16=True, avx512_bf16=True, amx=False, vnni=True)


def emulate_cpu(monkeypatch, features: cpu.CPUFeatures) -> None:
    """Every CPU-dependent choice of the code sees these features (kernels still run as the CPU can)."""
    monkeypatch.setattr(cpu, "cpu_features", lambda: features)


FIXTURES = Path(__file__).parent / "fixtures"
TINY_WIKI = FIXTURES / "tiny_wiki"
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return train_bpe(split_documents(read_split(str(TINY_WIKI), "train")), vocab_size=400)


def tiny_config(**overrides) -> GPTConfig:
    base = dict(vocab_size=97, context_length=32, n_layer=2, n_head=4, d_model=32, d_ff=64, dropout=0.0, eos_token_id=0)
    base.update(overrides)
    return GPTConfig(**base)


def tiny_gpt(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(tiny_config(**overrides)).eval()


@pytest.fixture
def tiny_trained_gpt(tiny_tokenizer):
    """A tiny GPT whose vocabulary matches the tiny tokenizer (untrained weights)."""
    return tiny_gpt(vocab_size=tiny_tokenizer.get_vocab_size(), eos_token_id=eos_id(tiny_tokenizer))


@pytest.fixture(scope="session")
def store(tmp_path_factory, tiny_tokenizer):
    """A model store with a tiny GPT, a corrupt GPT, and tiny softmax0/softmax1 EsperBERTos."""
    root = tmp_path_factory.mktemp("store")
    model = tiny_gpt(vocab_size=tiny_tokenizer.get_vocab_size(), eos_token_id=eos_id(tiny_tokenizer), context_length=48)
    write_checkpoint(root / "tiny-gpt", model, tiny_tokenizer, card="# tiny gpt\n", metrics={})
    broken = root / "broken-gpt"
    write_checkpoint(broken, model, tiny_tokenizer, card="# broken\n", metrics={})
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    mlm_tok = train_roberta_tokenizer(read_corpus(str(TINY_WIKI)), 300)
    for variant in ("softmax0", "softmax1"):
        folder = root / f"tiny-mlm-{variant}"
        save_model(build_model(make_config("rotary-tiny", variant, vocab_size=len(mlm_tok)), seed=1), folder)
        mlm_tok.save_pretrained(folder)
        (folder / "README.md").write_text(f"# tiny {variant}\n")
        (folder / "metrics.json").write_text("{}")
        write_manifest(folder)
    return root


@pytest.fixture(scope="session")
def store_client(store):
    """One app over the shared store (a queue of 4, at most 40 new tokens), for the modules that build it alike:
    tests/test_api.py and tests/test_readouts_api.py."""
    from fastapi.testclient import TestClient

    from server.api.app import create_app
    from server.config import Settings

    with TestClient(create_app(Settings(store=store, max_queue=4, max_new_tokens_cap=40))) as c:
        yield c


DEMO_TOKEN = "demo-secret"
DEMO_CARD = """# tiny gpt

A card with a table, an image and raw HTML that must not run.

| split | loss |
|---|---|
| valid | 5.0 |

![loss curve](loss_curve.png)

<script>window.cardScriptRan = true</script>
"""


@pytest.fixture(scope="session")
def demo_store(store, tmp_path_factory):
    """The tiny store, tiny-gpt's card with a table, an image and raw HTML (its manifest rewritten): the demo page's
    (tests/test_demo_page.py and the modules beside it)."""
    import shutil

    root = tmp_path_factory.mktemp("demo-store") / "store"
    shutil.copytree(store, root)
    folder = root / "tiny-gpt"
    (folder / "README.md").write_text(DEMO_CARD)
    shutil.copy(REPO / "docs" / "gpt-wikitext2-loss.png", folder / "loss_curve.png")
    (folder / "secret.png").write_bytes(b"not linked from the card")
    write_manifest(folder)
    return root


@pytest.fixture(scope="session")
def demo_server(demo_store):
    """The real server process over the demo store, behind DEMO_TOKEN: one for the browser tests that use it alike."""
    from scripts.processes import http_server

    with http_server(demo_store, api_token=DEMO_TOKEN) as (base, _):
        yield base


def error_of(response) -> dict:
    """A 4xx body as {"error", "error_type", "field"}: ours as it is, OpenAI's (under /v1) translated.

    Asserts the shape matches the path: OpenAI clients parse {"error": {"message", "type", "param", "code"}}.
    """
    body = response.json()
    if response.request.url.path.startswith("/v1/"):
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"].endswith("_error"), body
        return {"error": err["message"], "error_type": err["code"], "field": err["param"]}
    assert isinstance(body["error"], str), body
    return body


def run_together(engine, prompts: list[list[int]], params: SamplingParams) -> list[tuple[list[int], list, str]]:
    """Every prompt submitted to a GenerationEngine not started yet (all admitted in its first step), then run;
    each one's token ids, logprobs and finish reason. The engine is stopped after."""
    outs = []
    for ids in prompts:
        q: queue.Queue = queue.Queue()
        engine.submit(ids, params, q.put)
        outs.append(q)
    engine.start()
    results = []
    for q in outs:
        events = []
        while not isinstance(event := q.get(timeout=30), Retired):
            events.append(event)
        results.append(([e.id for e in events], [e.logprob for e in events], event.reason))
    engine.stop()
    return results


@pytest.fixture(scope="session")
def tools_client(tmp_path_factory):
    """One app over the tiny tool-calling Llamas (tests/tool_models.py: Hermes, Llama 3 and no-tools templates), for
    tests/test_tools_api.py and tests/test_responses_api.py."""
    from fastapi.testclient import TestClient

    from model_store.ingest import add_checkpoint
    from server.api.app import create_app
    from server.config import Settings
    from tests.tool_models import HERMES_TEMPLATE, LLAMA3_TEMPLATE, PLAIN_TEMPLATE, save_tool_model

    root = tmp_path_factory.mktemp("tools")
    for name, template, eos in [("tiny-hermes", HERMES_TEMPLATE, "<|im_end|>"), ("tiny-llama3", LLAMA3_TEMPLATE,
                                "<|eot_id|>"), ("tiny-plain", PLAIN_TEMPLATE, "<|im_end|>")]:  # fmt: skip
        save_tool_model(root / "src" / name, template, eos)
        add_checkpoint(root / "src" / name, name, root / "store")
    with TestClient(create_app(Settings(store=root / "store", dtype="float32", max_new_tokens_cap=200))) as c:
        yield c
