"""The models being served: loaded from the store at start-up, with the reasons for any refusal.

A newcomer's server answers within seconds: /health says ready once the default completion model is
loaded and warmed up (`ready_after="default"`); the other checkpoints load behind it, then every
model compiles, all on one background thread that yields to requests. A request for a model still
loading gets 503 with Retry-After (`ModelLoadingError`). `models` and `failed` are replaced, never
changed in place: routes on the event loop iterate them while that thread adds to them.
"""

from __future__ import annotations

import functools
import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from model_store import CheckpointError, CheckpointInfo, list_checkpoints, load_mlm, resolve
from model_store.families import Family
from models.sampling import SamplingParams
from server.config import Settings
from server.engine.core import GenerationEngine
from server.execution.compile_cache import cache_key
from server.execution.compile_sharing import WorkerSpec
from server.execution.compiler import BackgroundCompiler
from server.execution.compute_thread import ComputeThread, behind_requests
from server.execution.encoder_step import EncoderStep
from server.execution.loader import load_runner
from server.execution.runner import CausalLMRunner, ModelFacts
from server.serving.placement import Placement, plan
from server.serving.vectors import NamedVectors

log = logging.getLogger("tinyserve")


class UnknownModelError(LookupError):
    """No servable model by that id (the HTTP layer answers 404)."""


class ModelLoadingError(LookupError):
    """The model is loading behind /health's 200 (the HTTP layer answers 503 with Retry-After)."""


@dataclass(kw_only=True)
class ServedModel:
    """A loaded model as every route sees it, whatever its family: its facts are read once, at load."""

    id: str
    family: Family  # its row of model_store/families.py: what serves it and what it does (`kind`)
    model: torch.nn.Module
    tokenizer: object  # the runner's codec for a causal LM, a transformers tokenizer for mlm
    folder: Path
    facts: ModelFacts  # limits, vocabulary, attention shape, the checkpoint's config as loaded
    card: str = ""
    runner: CausalLMRunner | None = None  # completion models only: the model behind the seam
    engine: GenerationEngine | None = None  # completion models only
    encoder_step: EncoderStep | None = None  # fill-mask models only
    compiler: BackgroundCompiler | None = None  # builds the compiled decode step or encoder (compile_models on)

    @property
    def kind(self) -> str:
        """ "causal": any causal LM, ours or transformers' (completion, score, attention); "mlm": fill-mask."""
        return self.family.kind


def compiler_modules() -> None:
    """Import dynamo and inductor (~2 s of Python) while the compute thread loads the weights, which mostly runs
    without the GIL (file reads, copies, the huge pages' faults): a warm start's first kept pass needs them."""
    import torch._inductor.standalone_compile  # noqa: F401  # the kept graphs' loader (compile_cache.py)


def compiler_imports() -> None:
    """Import inductor and let it probe the CPU's vector instructions (C++ test builds, ~1.5 s) beside the warm-up
    and the compiler's start: the first compiled pass loaded from the cache waited ~3 s for them, a third of a warm
    start. After the models load, not while: beside the load the server held ~80 MiB more for good."""
    from torch._inductor import cpu_vec_isa

    cpu_vec_isa.valid_vec_isa_list()


@dataclass
class ModelRegistry:
    settings: Settings
    models: dict[str, ServedModel] = field(default_factory=dict)  # in store order
    failed: dict[str, str] = field(default_factory=dict)  # id -> why it is not served
    loading: dict[str, str] = field(default_factory=dict)  # id -> kind, for checkpoints loading behind ready
    order: list[str] = field(default_factory=list)  # the requested checkpoints' ids, in store order
    compute: ComputeThread = field(default_factory=ComputeThread)  # every torch op of the models runs on it
    loaded: threading.Event = field(default_factory=threading.Event)  # set when nothing is left loading
    compiled: threading.Event = field(default_factory=threading.Event)  # set when compiling is over too
    _behind: list[CheckpointInfo] = field(default_factory=list)  # what start's background thread loads
    _queued: list[Future] | None = None  # the loads /health waits for, once begun
    vectors: NamedVectors | None = None  # the models' named steering vectors

    def __post_init__(self) -> None:
        self.vectors = NamedVectors(self.settings.steering_vectors_kept)

    def begin_loading(self) -> None:
        """Queue on the compute thread (started here) what /health waits for: the default completion model (the first
        valid causal checkpoint in store order), or with ready_after="all" every checkpoint. The others are left to
        `start`; a bad checkpoint is refused. `python -m server` calls this before it imports the HTTP layer, which
        then imports beside the load (most of a load runs without the GIL)."""
        if self._queued is not None:
            return
        self.compute.start()
        if self.settings.compile_models:
            threading.Thread(target=compiler_modules, name="compiler-modules", daemon=True).start()
        wanted = set(self.settings.models) if self.settings.models else None
        found = list_checkpoints(self.settings.store)
        for missing in sorted((wanted or set()) - {info.id for info in found}):
            self.failed = {**self.failed, missing: f"{missing}: no such checkpoint in the model store"}
        infos = [info for info in found if wanted is None or info.id in wanted]
        self.order = [info.id for info in infos]
        now = infos
        if self.settings.ready_after == "default":  # "all" and "compiled" load every model here
            gpts = [info for info in infos if info.ok and info.family.kind == "causal"]
            now = gpts[:1] or infos[:1]
        self._behind = [info for info in infos if info not in now]
        self.loading = {info.id: info.family.kind if info.family else "" for info in self._behind}
        self._queued = [self.compute.submit(self._load_checkpoint, info) for info in now]

    def load_all(self) -> None:
        """Load what /health waits for (`begin_loading`, unless begun already) and wait for it."""
        self.begin_loading()
        for loaded in self._queued:
            loaded.result()
        if self.settings.compile_models and self.placement.device.type == "cpu":
            threading.Thread(target=compiler_imports, name="compiler-imports", daemon=True).start()
        if not self._behind:
            self.loaded.set()

    @functools.cached_property
    def placement(self) -> Placement:
        """Where, in what dtype and on which kernels every model is served, and why (logged once)."""
        placed = plan(self.settings.device, self.settings.dtype, self.settings.weights)
        log.info(
            "placement: %s/%s, %s weights, kernels: %s (%s)",
            placed.device,
            placed.dtype,
            placed.weights,
            placed.kernels,
            placed.why,
        )
        return placed

    def _load_checkpoint(self, info: CheckpointInfo) -> ServedModel | None:
        """Load one checkpoint into `models` (on the compute thread), or record why it is refused."""
        device, dtype = self.placement.device, self.placement.dtype
        served = None
        try:
            if not info.ok:
                raise CheckpointError(info.path, info.error or "invalid")
            if info.family is None:
                raise CheckpointError(info.path / "config.json", "unsupported architecture (model_store/families.py)")
            served = self._load(info.id, info.path, info.family, device, dtype)
            self.compute.guard(served.model)
            if served.engine is not None:
                served.engine.drive_with(self.compute)
            added = {**self.models, info.id: served}
            self.models = {i: added[i] for i in self.order if i in added}
            quantized = served.runner is not None and self.settings.weights != "native"  # completion models only
            weights = f", {self.settings.weights} weights" if quantized else ""
            log.info("loaded %s (%s) on %s/%s%s", info.id, info.family.name, device, dtype, weights)
        except CheckpointError as e:
            log.error("refused %s: %s", info.id, e)
            # clients see paths inside the store only (/health is public): no machine layout
            message = str(e)
            for root in {str(Path(self.settings.store)), str(Path(self.settings.store).resolve())}:
                message = message.replace(f"{root}/", "")
            self.failed = {**self.failed, info.id: message}
        self._loaded(info.id)
        return served

    def _loaded(self, model_id: str) -> None:
        """The checkpoint is served or refused now: no longer loading (after `models` or `failed` has it)."""
        self.loading = {i: kind for i, kind in self.loading.items() if i != model_id}

    def _load(
        self, model_id: str, folder: Path, family: Family, device: torch.device, dtype: torch.dtype
    ) -> ServedModel:
        card = (folder / "README.md").read_text() if (folder / "README.md").exists() else ""
        if family.kind == "causal":
            s = self.settings
            runner = load_runner(*self._runner_arguments(family, folder, device, dtype))
            engine = GenerationEngine(
                runner,
                s.max_batch_size,
                s.max_queue,
                s.max_prefill_tokens,
                s.steps_per_schedule,
                s.draft_tokens,
                s.prefix_caching,
            )
            return ServedModel(
                id=model_id,
                family=family,
                model=runner.model,
                tokenizer=runner.tokenizer,
                folder=folder,
                facts=runner.facts,
                card=card,
                runner=runner,
                engine=engine,
            )
        from models.esperberto.model import max_tokens  # transformers is slow to import: only when needed

        model, tok = load_mlm(folder, device, dtype)
        variant = getattr(model.config, "attention_variant", "softmax0")
        if variant == "softmax0":
            model.set_attn_implementation("eager")  # returns attention weights (for /attention)
        c = model.config
        facts = ModelFacts(
            family=type(model).__name__,
            context_length=max_tokens(c),
            vocab_size=c.vocab_size,
            eos_id=tok.eos_token_id,
            layers=c.num_hidden_layers,
            heads=c.num_attention_heads,
            normaliser=variant,
            attention_settings={
                "softmax": variant,
                "n_head": c.num_attention_heads,
                "architecture": type(model).__name__,
            },
            config=c.to_dict(),
            parameters=sum(p.numel() for p in model.parameters()),
        )
        return ServedModel(
            id=model_id,
            family=family,
            model=model,
            tokenizer=tok,
            folder=folder,
            facts=facts,
            card=card,
            encoder_step=EncoderStep(model, max_tokens(c)),
        )

    def start(self) -> None:
        """Warm the loaded models up with one tiny request each, then start the background thread (it
        yields to requests): it loads and warms the other checkpoints, then compiles every model's
        fixed-shape passes, the default models first (what a request without a model id gets)."""
        for m in self.models.values():
            self._warm_up(m)
        if self._behind or self.settings.compile_models:
            behind_requests(self._behind_ready, self.compute, "loader")
        else:
            self._compiled()

    def _behind_ready(self) -> None:
        try:
            for info in self._behind:
                try:
                    if info.family is not None and info.family.kind == "mlm":
                        import models.esperberto.model  # noqa: F401  # slow transformers import, off the compute thread
                    if (served := self.compute.call(self._load_checkpoint, info)) is not None:
                        self._warm_up(served)
                except Exception as e:  # the server keeps serving what it has; /health lists the failure
                    log.exception("could not load %s", info.id)
                    self.failed = {**self.failed, info.id: f"could not load: {type(e).__name__}: {e}"}
                    self._loaded(info.id)
            self.loaded.set()  # before compiling: what `loaded.wait()` callers wait for
            if self.settings.compile_models:
                for compiler in self._compilers():
                    compiler.run()
            self._compiled()
        finally:
            self.loaded.set()
            self.compiled.set()

    def _compiled(self) -> None:
        """Nothing is left to compile: each runner drops what only the compiler read (the plain weights)."""
        for m in self.models.values():
            if m.runner is not None:
                self.compute.call(m.runner.compiler_done)
        self.compiled.set()

    def _warm_up(self, m: ServedModel) -> None:
        if m.runner is not None:
            m.engine.generate([m.runner.facts.eos_id], SamplingParams(max_new_tokens=2, temperature=0))
        else:
            self.compute.call(self._warm_up_mlm, m)

    def _compilers(self) -> list[BackgroundCompiler]:
        """One compiler per compilable model: the default GPT, the default MLM, then the rest."""
        s = self.settings
        defaults = [self.models_of(kind)[0].id for kind in ("causal", "mlm") if self.models_of(kind)]
        compilers = []
        first = {model_id: i for i, model_id in enumerate(defaults)}
        for m in sorted(self.models.values(), key=lambda m: first.get(m.id, len(first))):
            passes = m.runner.compile_passes(s.compile_max_batch) if m.runner else []
            if m.encoder_step is not None:
                passes = m.encoder_step.compile_passes()
            if not passes:
                continue
            cache_dir = s.compile_cache_dir.expanduser() if s.compile_cache_dir is not None else None
            p = next(m.model.parameters())
            key = cache_key(m.folder, p.dtype, p.device)
            if m.runner is not None:  # its weights' form and KV cache's shape (a package's strides are fixed)
                facts = m.runner.facts
                key = cache_key(m.folder, p.dtype, p.device, s.weights, (facts.slots, facts.context_length))
            threads = self.compute.call(torch.get_num_threads)
            m.compiler = BackgroundCompiler(passes, cache_dir, key, threads, m.id)
            if m.runner is not None and self.placement.device.type == "cpu":  # share_with needs the cache
                m.compiler.share_with(self._worker_spec(m, cache_dir, key, threads), s.compile_workers)
            compilers.append(m.compiler)
        return compilers

    def _runner_arguments(self, family: Family, folder: Path, device: torch.device, dtype: torch.dtype) -> tuple:
        """load_runner's arguments for a causal checkpoint: the server's load, and a compile worker's."""
        s = self.settings
        return family.runner, folder, device, dtype, s.max_batch_size, s.weights, s.max_context, s.kv_cache_mb

    def _worker_spec(self, m: ServedModel, cache_dir: Path, key: str, threads: int) -> WorkerSpec:
        """How a compile worker loads the model's runner as `_load` did, and builds its passes as `_compilers` would."""
        runner, folder, device, dtype, *rest = self._runner_arguments(
            m.family, m.folder, self.placement.device, self.placement.dtype
        )
        return WorkerSpec(
            load=(runner, str(folder), str(device), str(dtype).removeprefix("torch."), *rest),
            compile_max_batch=self.settings.compile_max_batch,
            cache_dir=str(cache_dir),
            key=key,
            threads=threads,
            name=m.id,
            labels=(),
        )

    @staticmethod
    @torch.inference_mode()
    def _warm_up_mlm(m: ServedModel) -> None:
        m.model(**m.tokenizer("warm up", return_tensors="pt").to(next(m.model.parameters()).device))

    def stop(self) -> None:
        """Cancel what is running and end the compute thread."""
        self.compute.stop()

    def get(self, model_id: str, kind: str | None = None) -> ServedModel:
        loading = self.loading  # read before models: a checkpoint joins models before it leaves loading
        m = self.models.get(model_id)  # a served id was resolved when it loaded
        if m is None:
            try:
                resolve(model_id, self.settings.store)  # plain names only: never a path
            except CheckpointError:
                raise UnknownModelError(f"model {model_id!r} is not a valid model id") from None
            if model_id in loading:
                raise ModelLoadingError(f"model {model_id!r} is loading; retry in a few seconds")
            why = self.failed.get(model_id)
            raise UnknownModelError(f"model {model_id!r} is not served" + (f" ({why})" if why else ""))
        if kind is not None and m.kind != kind:
            raise UnknownModelError(f"model {model_id!r} is a {m.kind} model; this endpoint needs a {kind} model")
        return m

    def compiling(self) -> list[str]:
        """Served models whose compiled passes are not all built yet (eager serves them meanwhile)."""
        if not self.settings.compile_models or self.compiled.is_set():
            return []
        return [m.id for m in self.models.values() if m.compiler is None or not m.compiler.done.is_set()]

    def models_of(self, kind: str) -> list[ServedModel]:
        return [m for m in self.models.values() if m.kind == kind]

    def default(self, kind: str) -> ServedModel:
        """The first model of the kind in store order: what a request that names no model gets."""
        loading = self.loading  # before models, as in `get`
        models = self.models
        kinds = {i: models[i].kind if i in models else loading.get(i) for i in self.order}
        first = next((i for i in self.order if kinds[i] == kind), None)
        if first is None:
            raise UnknownModelError(f"no {kind} model is served")
        return self.get(first)
