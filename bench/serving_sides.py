"""The sides bench/bench_serving.py compares, each in a process of its own (`Worker`, driven over a pipe):
our engine, transformers' generate() on a static batch, the decode step's matrix products alone, and
fill-mask both ways. No two OpenMP teams meet in one process.

    python bench/serving_sides.py KIND ARGS...   # one side's process (what Worker starts)
"""

from __future__ import annotations

import json
import queue
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from model_store import STORE_ROOT, load_gpt  # noqa: E402
from models.device import resolve_device  # noqa: E402
from models.sampling import SamplingParams  # noqa: E402
from server.config import Settings  # noqa: E402
from server.engine.events import Retired  # noqa: E402
from server.serving.registry import ModelRegistry, ServedModel  # noqa: E402

PROMPT = "The history of the city begins in the early Middle Ages , when"


def hf_twin(model, dtype: torch.dtype):
    """A transformers GPT-2 with our model's sizes (random weights: speed does not depend on them)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    c = model.config
    sizes = dict(n_positions=c.context_length, n_embd=c.d_model, n_layer=c.n_layer, n_head=c.n_head, n_inner=c.d_ff)
    special = dict(bos_token_id=c.eos_token_id, eos_token_id=c.eos_token_id, pad_token_id=c.eos_token_id)
    return GPT2LMHeadModel(GPT2Config(vocab_size=c.vocab_size, **sizes, **special)).to(dtype).eval()


# Every side runs where the server runs (TINYSERVE_DEVICE; CUDA when present), so a peer is timed on the same device.
DEVICE = resolve_device(Settings().device)


def seconds(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)
    return time.perf_counter() - t


# -- the sides, each in its own process --------------------------------------------------------------


class HFPeer:
    """transformers' generate() on a static batch: every row runs until the batch's longest is done.

    model: a store id or folder. A transformers checkpoint (config.json names `architectures`) is loaded as
    it is; for ours, a GPT-2 of the same sizes stands in (`hf_twin`)."""

    def __init__(self, model: str, dtype: str) -> None:
        folder = Path(model) if Path(model).is_dir() else STORE_ROOT / model
        if "architectures" in json.loads((folder / "config.json").read_text()):
            from tokenizers import Tokenizer
            from transformers import AutoModelForCausalLM

            self.twin = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
            tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        else:
            ours, tok = load_gpt(folder)
            self.twin = hf_twin(ours, getattr(torch, dtype))
        self.twin.to(DEVICE)
        self.prompt_ids = tok.encode(PROMPT, add_special_tokens=False).ids

    def generate(self, prompts: list[list[int]], new: int) -> None:
        x = torch.tensor(prompts, device=DEVICE)
        with torch.inference_mode():
            self.twin.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new, do_sample=False
            )

    def tokens_per_s(self, lengths: list[int], batch: int) -> float:
        """Requests for `lengths` new tokens, in batches of `batch`: requested tokens per second."""

        def run() -> None:
            for i in range(0, len(lengths), batch):
                n = lengths[i : i + batch]
                self.generate([self.prompt_ids] * len(n), max(n))

        return sum(lengths) / seconds(run)

    def prompt(self) -> list[int]:
        return self.prompt_ids

    def batch_s(self, prompts: list[list[int]], new: int) -> float:
        """Seconds for one batch of prompts (of one length) to get `new` tokens each."""
        return seconds(lambda: self.generate(prompts, new))


def served_compiled(settings: Settings, model_id: str) -> tuple[ModelRegistry, ServedModel]:
    """A model loaded and started as the server does, once its compiled passes are built."""
    registry = ModelRegistry(settings)
    registry.load_all()
    registry.start()
    registry.compiled.wait()
    served = registry.get(model_id)
    return registry, served


class EngineSide:
    """Our engine as the server runs it (registry, compute thread, compiled steps), without HTTP."""

    def __init__(self, model_id: str) -> None:
        settings = Settings(models=[model_id], max_batch_size=32, max_queue=128)
        self.registry, self.served = served_compiled(settings, model_id)
        self.prompt_ids = self.served.tokenizer.encode(PROMPT)

    def info(self) -> dict:
        m = self.served
        compiled = sorted(m.runner.step.compiled) if m.runner else []
        return {
            "dtype": str(next(m.model.parameters()).dtype),
            "compiled": compiled,
            "params": m.model.num_parameters(),
        }

    def tokens_per_s(self, n: int, new_tokens: int) -> float:
        """n requests for new_tokens each, submitted at once: aggregate tokens/s."""
        p = SamplingParams(max_new_tokens=new_tokens, temperature=0, eos_bias=float("-inf"))
        done: queue.Queue = queue.Queue()
        t = time.perf_counter()
        for _ in range(n):
            self.served.engine.submit(self.prompt_ids, p, lambda e: isinstance(e, Retired) and done.put(e))
        for _ in range(n):
            done.get()
        return n * new_tokens / (time.perf_counter() - t)

    def request_s(self, new_tokens: int) -> float:
        p = SamplingParams(max_new_tokens=new_tokens, temperature=0, eos_bias=float("-inf"))
        return statistics.median(seconds(lambda: self.served.engine.generate(self.prompt_ids, p)) for _ in range(5))


class MatmulFloor:
    """The decode step's matrix products alone (the model's weights, the serving dtype, no Python between)."""

    def __init__(self, model_id: str, dtype: str) -> None:
        model, _ = load_gpt(STORE_ROOT / model_id)
        dt = getattr(torch, dtype)
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        self.weights = [(m.weight.detach().to(DEVICE, dt), m.bias) for m in linears]
        self.weights = [(w, None if b is None else b.detach().to(DEVICE, dt)) for w, b in self.weights]
        self.dtype = dt

    @torch.inference_mode()
    def step_ms(self, rows: int) -> float:
        widths = {w.shape[1] for w, _ in self.weights}
        inputs = {d: torch.randn(rows, 1, d, dtype=self.dtype, device=DEVICE) for d in widths}

        def chain() -> None:
            for w, b in self.weights:
                torch.nn.functional.linear(inputs[w.shape[1]], w, b)

        for _ in range(20):
            chain()
        return statistics.median(seconds(lambda: [chain() for _ in range(50)]) / 50 for _ in range(5)) * 1e3


class FillMaskOurs:
    def __init__(self, folder: str) -> None:
        from server.features.readouts import fill_mask

        folder = Path(folder)
        self.registry, served = served_compiled(Settings(store=folder.parent, models=[folder.name]), folder.name)
        self.fill = lambda text: self.registry.compute.call(fill_mask, served, text, 5, None)

    def p50_s(self, text: str) -> float:
        return statistics.median(seconds(lambda: self.fill(text)) for _ in range(15))


class FillMaskHF:
    def __init__(self, folder: str) -> None:
        import transformers

        self.pipe = transformers.pipeline("fill-mask", model=folder, device=DEVICE)

    def p50_s(self, text: str) -> float:
        return statistics.median(seconds(lambda: self.pipe(text, top_k=5)) for _ in range(15))


SIDES = {"hf": HFPeer, "engine": EngineSide, "floor": MatmulFloor, "fill-ours": FillMaskOurs, "fill-hf": FillMaskHF}
MARK = "@@bench "  # a reply line; anything else a library prints on stdout is passed through


def serve_side(kind: str, args: list[str]) -> None:
    """The worker's loop: build the side, then answer one JSON command per line ([method, *args])."""
    side = SIDES[kind](*args)
    print(MARK + json.dumps("ready"), flush=True)
    for line in sys.stdin:
        method, *params = json.loads(line)
        print(MARK + json.dumps(getattr(side, method)(*params)), flush=True)


class Worker:
    """A side in its own process: `python bench/serving_sides.py KIND ARGS...`."""

    def __init__(self, kind: str, *args: str) -> None:
        cmd = [sys.executable, __file__, kind, *args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._reply()

    def __call__(self, method: str, *args):
        self.proc.stdin.write(json.dumps([method, *args]) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def _reply(self):
        while line := self.proc.stdout.readline():
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])
        raise RuntimeError(f"benchmark worker exited with {self.proc.wait()}")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


if __name__ == "__main__":
    serve_side(sys.argv[1], sys.argv[2:])
