"""EleutherAI's lm-evaluation-harness, unchanged, against a real server: `local-completions` on two small
local tasks (a rolling-loglikelihood one and a multiple-choice one), in token-id and in string mode.
The harness's numbers must be the model's own for the same windows."""

import json
import math

import pytest
import torch

from model_store.store import load_gpt, write_checkpoint
from models.tokenizer import eos_id
from scripts.processes import http_server
from tests.conftest import TINY_WIKI, tiny_gpt
from training.data import detokenize_wikitext, read_split

lm_eval = pytest.importorskip("lm_eval")

pytestmark = pytest.mark.slow
CONTEXT = 64
PARAGRAPHS = [p for p in detokenize_wikitext(read_split(str(TINY_WIKI), "test")).splitlines() if len(p) > 80][:4]
QUESTIONS = [
    {"question": "The castle was built in", "choices": ["1350.", "the river.", "green"], "answer": 0},
    {"question": "The river runs", "choices": ["north", "castle was", "12"], "answer": 0},
]


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_tokenizer):
    store = tmp_path_factory.mktemp("lm-eval-store")
    model = tiny_gpt(
        vocab_size=tiny_tokenizer.get_vocab_size(), eos_token_id=eos_id(tiny_tokenizer), context_length=CONTEXT
    )
    write_checkpoint(store / "tiny-gpt", model, tiny_tokenizer, card="# tiny\n", metrics={})
    with http_server(store) as (base, _):
        yield base, store / "tiny-gpt"


def write_tasks(folder) -> None:
    (folder / "rolling.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in PARAGRAPHS))
    (folder / "mc.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    common = "dataset_path: json\ntest_split: test\n"
    (folder / "tiny_rolling.yaml").write_text(
        f"task: tiny_rolling\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'rolling.jsonl'}\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n"
    )
    (folder / "tiny_mc.yaml").write_text(
        f"task: tiny_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n"
    )


def own_loglikelihood(model, context: list[int], continuation: list[int]) -> float:
    """Sum of log p(continuation | context) from the model's own forward pass."""
    ids = context + continuation
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return sum(float(logp[len(context) + i - 1, t]) for i, t in enumerate(continuation))


@pytest.mark.parametrize("tokenized", [True, False], ids=["token-ids", "strings"])
def test_lm_eval_local_completions_gives_the_models_own_numbers(served, tmp_path, tokenized):
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    base, folder = served
    write_tasks(tmp_path)
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "model": "tiny-gpt",
            "base_url": f"{base}/v1/completions",
            "tokenizer_backend": "huggingface",
            "tokenizer": str(folder),
            "max_length": CONTEXT,
            "tokenized_requests": tokenized,
        },
        tasks=["tiny_rolling", "tiny_mc"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True,
    )
    model, tok = load_gpt(folder)
    eos = model.config.eos_token_id

    # rolling: the harness's windows, scored by the model itself
    total_nll, total_tokens = 0.0, 0
    for sample in results["samples"]["tiny_rolling"]:
        ids = tok.encode(sample["doc"]["text"], add_special_tokens=False).ids
        windows = [
            make_disjoint_window(w)
            for w in get_rolling_token_windows(ids, prefix_token=eos, max_seq_len=CONTEXT - 2, context_len=1)
        ]
        own = sum(own_loglikelihood(model, ctx, cont) for ctx, cont in windows)
        harness = sample["resps"][0][0]
        assert abs(harness - own) / len(ids) < 1e-3, (harness, own)
        total_nll, total_tokens = total_nll - own, total_tokens + len(ids)
    words = sum(len(p.split()) for p in PARAGRAPHS)
    word_ppl = results["results"]["tiny_rolling"]["word_perplexity,none"]
    assert word_ppl == pytest.approx(math.exp(total_nll / words), rel=1e-3)

    # multiple choice: each choice's loglikelihood given the question
    for sample in results["samples"]["tiny_mc"]:
        q = sample["doc"]
        context = tok.encode(q["question"], add_special_tokens=False).ids
        for choice, resp in zip(q["choices"], sample["resps"], strict=True):
            # the harness joins question and choice with its default target delimiter, one space
            continuation = tok.encode(f"{q['question']} {choice}", add_special_tokens=False).ids[len(context) :]
            own = own_loglikelihood(model, context, continuation)
            assert abs(resp[0][0] - own) / len(continuation) < 1e-3, (choice, resp, own)
    assert 0.0 <= results["results"]["tiny_mc"]["acc,none"] <= 1.0
