"""Cog runner: `cog run -i prompt="..."`, on the same registry and engine as the HTTP server; predictions
at once (up to the engine's batch) share its batch.

One model page, six tasks. The output is always a stream of text (`AsyncConcatenateIterator[str]`, so
completions stream token by token on Replicate); `task=attention` streams one item, the heatmap PNG
as a `data:image/png;base64,...` URI (what cog itself returns for a file output when it has no upload
URL), which `scripts/cog_predict.py` writes to a file; `logit_lens`, `ablate` and `patch` stream one
item, the JSON the /inspect routes answer.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import tarfile
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
from cog import AsyncConcatenateIterator, BaseRunner, Input, concurrent, streaming
from pydantic import ValidationError

from server.api.schemas.base import MAX_EOS_BIAS, MAX_PENALTY, MAX_SEED, MAX_TEMPERATURE, MIN_POSITIVE
from server.api.schemas.chat import ChatMessage, FunctionTool
from server.api.schemas.generation import NEVER, GenerateParameters
from server.api.schemas.inspect import AblateRequest, LogitLensRequest, PatchRequest
from server.api.schemas.steering import SteerPart
from server.config import Settings, default
from server.engine.events import FinishEvent
from server.errors import APIError
from server.features import inspect as inspecting
from server.features.chat import prepare_chat_job, with_constraint
from server.features.completion import events, fill_mask_models, find_model, prepare_completion
from server.features.constraints import Constraint, constrained
from server.features.readouts import attention, attention_png, fill_mask
from server.features.tools import ToolUse
from server.serving.registry import ModelRegistry

AUTO = "auto"
INSPECT = ["logit_lens", "ablate", "patch"]
# the store's folders (validating, i.e. hashing, every checkpoint is setup()'s job, not the import's)
MODELS = [AUTO, *sorted(p.parent.name for p in Settings().store.glob("*/config.json"))]
CAP = default("max_new_tokens_cap")  # the inputs' bounds are the server's settings (raised there, checked again)


def unpacked(weights: str) -> Path:
    """A trained checkpoint (train.py's .tar.gz: a path, or an http(s) URL as Replicate and COG_WEIGHTS give it)
    as a model store of its own."""
    store = Path(tempfile.mkdtemp(prefix="tinyserve-weights-"))
    archive = Path(str(weights))
    if str(weights).startswith(("http://", "https://")):
        archive = store.with_suffix(".tar.gz")
        with httpx.stream("GET", str(weights), follow_redirects=True, timeout=600) as r, archive.open("wb") as f:
            r.raise_for_status()
            for chunk in r.iter_bytes():
                f.write(chunk)
    with tarfile.open(archive) as tar:
        tar.extractall(store, filter="data")  # no member outside the store, no links out of it
    return store


class Runner(BaseRunner):
    def setup(self, weights: str | None = None) -> None:
        """Load every shipped checkpoint (or, given a trained one's weights, that one) once and warm it up
        (TINYSERVE_* variables apply, as for the server)."""
        weights = weights or os.environ.get("COG_WEIGHTS")  # a trained version's, or `cog run -e COG_WEIGHTS=...`
        self.settings = Settings() if not weights else Settings(store=unpacked(weights))
        self.registry = ModelRegistry(self.settings)
        self.registry.load_all()
        self.registry.start()
        self.registry.loaded.wait()  # a prediction may name any model: none may answer "loading"

    @streaming
    # predictions at once: as many as the engine batches (TINYSERVE_MAX_BATCH_SIZE's default; cog reads a literal at
    # build time, tests/test_packaging.py holds them equal; COG_MAX_CONCURRENCY overrides it when it runs)
    @concurrent(max=32)
    async def run(
        self,
        prompt: str = Input(
            description="complete: the prompt. fill-mask: an Esperanto sentence with <mask>. "
            "attention, logit_lens, ablate: the text to look inside. patch: the clean text.",
            min_length=1,
            max_length=default("max_prompt_chars"),
        ),
        task: str = Input(
            default="complete",
            choices=["complete", "fill-mask", "attention", *INSPECT],
            description="What to do (logit_lens, ablate, patch: JSON, as the /inspect routes answer).",
        ),
        model: str = Input(
            default=AUTO,
            choices=MODELS,
            description="auto: the GPT for complete and attention, both EsperBERTo variants for fill-mask.",
        ),
        max_new_tokens: int = Input(default=64, ge=1, le=CAP, description="complete: tokens to generate at most."),
        temperature: float = Input(default=0.8, ge=0.0, le=MAX_TEMPERATURE, description="complete: 0 = greedy."),
        top_k: int = Input(
            default=0, ge=0, le=50_000, description="complete: sample among the k most likely (0 = off)."
        ),
        top_p: float = Input(default=1.0, ge=MIN_POSITIVE, le=1.0, description="complete: nucleus mass (1 = off)."),
        repetition_penalty: float = Input(
            default=1.0, ge=MIN_POSITIVE, le=MAX_PENALTY, description="complete: > 1 discourages repeats."
        ),
        stop: str = Input(default="", max_length=1000, description="complete: stop sequences, separated by '|'."),
        seed: int = Input(
            default=-1, ge=-1, le=MAX_SEED, description="complete: same seed, same output (-1 = random)."
        ),
        eos_bias: float | None = Input(
            default=None,
            ge=NEVER,
            le=MAX_EOS_BIAS,
            description="complete: added to the end-of-text logit; negative = longer outputs, -1e9 = never stop "
            "(unset: the server's TINYSERVE_DEFAULT_EOS_BIAS).",
        ),
        eos_bias_decay: float = Input(
            default=1.0,
            ge=MIN_POSITIVE,
            le=1.0,
            description="complete: the EOS bias shrinks by this factor per token (1 = constant).",
        ),
        min_new_tokens: int = Input(
            default=0, ge=0, le=CAP, description="complete: no end-of-text before this many tokens."
        ),
        top_n: int = Input(default=5, ge=1, le=50, description="fill-mask: candidates per mask."),
        layer: int = Input(default=-1, ge=-1, le=63, description="attention: layer to draw (-1 = all)."),
        head: int = Input(default=-1, ge=-1, le=63, description="attention: head to draw (-1 = all)."),
        heads: str = Input(
            default="each", max_length=10_000, description='ablate: JSON [[layer, head], ...], or "each" alone.'
        ),
        corrupt: str = Input(default="", max_length=default("max_prompt_chars"), description="patch: corrupt text."),
        answer: str = Input(default="", max_length=100, description="patch: the clean answer, one token."),
        foil: str = Input(default="", max_length=100, description="patch: the corrupt answer, one token."),
        messages: str = Input(
            default="",
            max_length=default("max_prompt_chars"),
            description='complete: a chat as JSON, [{"role": "user", "content": "..."}], rendered by the '
            "model's chat template (then `prompt` is ignored).",
        ),
        json_schema: str = Input(
            default="", max_length=100_000, description="complete: output valid for this JSON schema."
        ),
        regex: str = Input(default="", max_length=10_000, description="complete: output matching this regex in full."),
        tools: str = Input(
            default="",
            max_length=100_000,
            description='complete with messages: OpenAI function tools as JSON, [{"type": "function", "function": '
            '{"name", "parameters"}}]; the output is then one item, the assistant message as JSON '
            "({content, tool_calls}).",
        ),
        tool_choice: str = Input(default="auto", description="with tools: auto, none, required, or a function's name."),
        steer: str = Input(
            default="",
            max_length=1_000_000,
            description='complete: activation steering as JSON, [{"layer", "vector" or "name", "scale"}], as the '
            "API's steer: each vector times its scale added after its block (counted from 0, as llama.cpp's "
            "direction.N).",
        ),
    ) -> AsyncConcatenateIterator[str]:
        """Each prediction a request on the shared engine (predictions at once share its batch); the other tasks
        run on the compute thread, awaited off the event loop."""
        try:
            if task == "complete":
                parameters = GenerateParameters(
                    model=None if model == AUTO else model,
                    max_new_tokens=max_new_tokens,
                    do_sample=temperature > 0,
                    temperature=temperature or None,
                    top_k=(top_k or None) if temperature > 0 else None,  # a warper would sample (TGI's rule)
                    top_p=None if top_p >= 1.0 or temperature == 0 else top_p,
                    repetition_penalty=repetition_penalty,
                    stop=[s for s in stop.split("|") if s],
                    seed=None if seed < 0 else seed,
                    eos_bias=eos_bias,
                    eos_bias_decay=None if eos_bias_decay >= 1.0 else eos_bias_decay,
                    min_new_tokens=min_new_tokens,
                    steer=self._steer(steer) if steer else None,
                )
                use = self._tool_use(tools, tool_choice) if tools else None
                async for text in self._complete(parameters, prompt, messages, json_schema, regex, use):
                    yield text
            elif task == "fill-mask":
                for text in await asyncio.to_thread(lambda: list(self._fill_mask(model, prompt, top_n))):
                    yield text
            elif task in INSPECT:
                model_id = None if model == AUTO else model
                asked = (task, model_id, prompt, top_n, heads, corrupt, answer, foil)
                yield json.dumps(await asyncio.to_thread(self._inspect, *asked))
            else:
                yield await asyncio.to_thread(self._attention, model, prompt, layer, head)
        except APIError as e:
            raise ValueError(e.message) from None  # cog reports it as the failure
        except json.JSONDecodeError as e:
            raise ValueError(f"{'heads' if task in INSPECT else 'messages, tools or steer'}: not JSON ({e})") from None
        except ValidationError as e:  # the same request rules as the HTTP API
            raise ValueError(
                "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
            ) from None

    @staticmethod
    def _steer(steer: str) -> list[SteerPart]:
        parsed = json.loads(steer)
        if not isinstance(parsed, list):
            raise APIError(422, "steer: a JSON list of {layer, vector or name, scale}", "steer")
        return [SteerPart.model_validate(p, strict=False) for p in parsed]

    @staticmethod
    def _tool_use(tools: str, choice: str) -> ToolUse:
        parsed = json.loads(tools)
        if not isinstance(parsed, list):
            raise APIError(422, "tools: a JSON list of function tools", "tools")
        listed = [FunctionTool.model_validate(t).model_dump(exclude_none=True) for t in parsed]
        return ToolUse(listed, choice, parallel=True)

    async def _complete(
        self, parameters: GenerateParameters, prompt: str, messages: str, json_schema: str, regex: str,
        tools: ToolUse | None,
    ) -> AsyncIterator[str]:  # fmt: skip
        params = parameters.to_sampling_params(self.settings)
        if json_schema and regex:
            raise APIError(422, "json_schema: give json_schema or regex, not both", "json_schema")
        c = Constraint("json", json_schema, "json_schema") if json_schema else Constraint("regex", regex, "regex")
        c = c if json_schema or regex else None
        turn = None
        if messages:
            parsed = json.loads(messages)
            if not isinstance(parsed, list):
                raise APIError(422, "messages: a JSON list of {role, content}", "messages")
            conversation = [ChatMessage.model_validate(m).model_dump(exclude_none=True) for m in parsed]
            turn = prepare_chat_job(
                self.registry, self.settings, parameters.model, conversation, params, tools, parameters.steer
            )
            turn = with_constraint(turn, c)
            job, c = turn.job, turn.constraint
        elif tools is not None:
            raise APIError(422, "tools: only with messages", "tools")
        else:
            job = prepare_completion(
                self.registry, self.settings, parameters.model, prompt, params, steer=parameters.steer
            )
        if c is not None:  # grammars compile off the event loop
            job = await asyncio.to_thread(constrained, job, c, self.settings)
        if turn is not None and turn.calls is not None:  # one item: the message, its calls read out
            text = [e.text async for e in events(job, self.settings, streaming=False) if isinstance(e, FinishEvent)][0]
            content, calls = turn.calls.parse(text)
            found = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                     for c in calls]  # fmt: skip
            yield json.dumps({"role": "assistant", "content": content, "tool_calls": found})
            return
        async for event in events(job, self.settings):
            text = event.tail if isinstance(event, FinishEvent) else event.text
            if text:
                yield text

    def _fill_mask(self, model_id: str, prompt: str, top_n: int) -> Iterator[str]:
        for m in fill_mask_models(self.registry, None if model_id == AUTO else model_id, "both"):
            result = self.registry.compute.call(
                fill_mask, m, prompt.replace("[MASK]", m.tokenizer.mask_token), top_n, None
            )
            per_mask = result if isinstance(result[0], list) else [result]
            yield f"{m.id} ({m.facts.normaliser})\n"
            for i, candidates in enumerate(per_mask, 1):
                row = ", ".join(f"{c['token_str'].strip()!r} {c['score']:.3f}" for c in candidates)
                yield f"  mask {i}: {row}\n"

    def _attention(self, model_id: str, prompt: str, layer: int, head: int) -> str:
        m = find_model(
            self.registry, None if model_id == AUTO else model_id, "causal" if model_id == AUTO else None, "model"
        )
        result = self.registry.compute.call(
            attention, m, prompt, None if layer < 0 else [layer], None if head < 0 else [head]
        )
        return "data:image/png;base64," + base64.b64encode(attention_png(result)).decode()

    def _inspect(
        self, task: str, model_id: str | None, text: str, top_n: int, heads: str, corrupt: str, answer: str, foil: str
    ) -> dict:
        """The /inspect routes' requests, validated by their schemas, answered by the same functions."""
        compute, settings = self.registry.compute, self.settings
        if task == "logit_lens":
            lens = LogitLensRequest(model=model_id, text=text, top_k=min(top_n, 10))
            m = find_model(self.registry, lens.model, None if lens.model else "causal", "model")
            return inspecting.logit_lens(compute, m, lens.text, lens.top_k, settings)
        if task == "ablate":
            chosen = "each" if heads.strip() == "each" else json.loads(heads)
            body = AblateRequest(model=model_id, text=text, heads=chosen, top_k=min(top_n, 10))
            m = find_model(self.registry, body.model, "causal", "model")
            return inspecting.ablate(compute, m, body.text, body.heads, body.top_k, settings)
        body = PatchRequest(model=model_id, clean=text, corrupt=corrupt, answer=answer, foil=foil)
        m = find_model(self.registry, body.model, "causal", "model")
        return inspecting.patch(compute, m, body.clean, body.corrupt, body.answer, body.foil, settings)
