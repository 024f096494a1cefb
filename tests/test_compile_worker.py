"""A compile worker beside the server (server/execution/compile_sharing.py, compile_sharing.py): which passes it
builds, and how the server's compiler takes them in."""

import threading

import pytest

from server.execution import compile_sharing
from server.execution.compile_sharing import split
from server.execution.compiler import BackgroundCompiler
from server.execution.decoder.runner import GPTRunner
from server.execution.passes import Pass
from tests.conftest import tiny_gpt

SMOLLM2_PASSES = [  # a bf16 model's on an AVX-512 BF16 CPU, in build order (GPTRunner.compile_passes)
    ("DecodeStep_1_regional", None),
    ("PromptPass_regional", None),
    ("DecodeStep_32_regional", "rows"),
    ("DecodeStep_2_regional", "rows"),
    ("DecodeStep_4_regional", "rows"),
    ("DecodeStep_8_regional", "rows"),
    ("DecodeStep_16_regional", "rows"),
    ("VerifyPass_1x4_regional", None),
]


def test_the_buckets_sharing_a_graph_go_to_one_process_and_the_server_keeps_the_first_pass():
    labels, shares = zip(*SMOLLM2_PASSES, strict=True)
    server, worker = split(labels, shares, 1)
    assert server == ["DecodeStep_1_regional", *labels[2:7]]
    assert worker == ["PromptPass_regional", "VerifyPass_1x4_regional"]
    assert split(labels, shares, 0) == [list(labels)]
    assert split(labels[:1], shares[:1], 2) == [list(labels[:1])]  # no worker without a pass
    three = split(labels, shares, 2)
    assert sorted(sum(three, [])) == sorted(labels) and len(three) == 3


class FakeWorker:
    """Reports as a worker process would, once the test lets it."""

    def __init__(self, spec, states: dict[str, str | None]) -> None:
        self.labels = set(spec.labels)
        self.seconds = dict.fromkeys(states, 7.0)
        self.states, self.ready, self.closed = states, threading.Event(), False

    def result(self, label: str, wait: bool = True) -> str | None:
        if wait:
            self.ready.wait()
        return self.states[label] if self.ready.is_set() else None

    def close(self) -> None:
        self.closed = True


def test_the_servers_compiler_loads_what_its_worker_built_and_builds_what_it_did_not(tmp_path, monkeypatch):
    step = GPTRunner(tiny_gpt(vocab_size=97, context_length=64), None, 2).step
    passes = [Pass(step, 1, True), Pass(step, 2, True), Pass(step, 4, True), Pass(step, 1), Pass(step, 2)]
    compiler = BackgroundCompiler(passes, tmp_path, "key", name="tiny")
    compiler.share_with(compile_sharing.WorkerSpec(*[None] * 6, labels=()), 1)
    assert compiler.handed[0].labels == ("DecodeStep_2_regional", "DecodeStep_1")  # every other pass
    reported = {"DecodeStep_2_regional": "not built: StepMismatchError: row 0 trails", "DecodeStep_1": "built"}
    workers: list[FakeWorker] = []
    monkeypatch.setattr(
        compile_sharing.CompileWorker, "started", lambda spec: workers.append(FakeWorker(spec, reported)) or workers[-1]
    )
    built: list[str] = []

    def build(bucket, regional=False):  # loads what the worker kept, builds the rest; a graph names its pass
        label = compiler.label(bucket, regional)
        built.append(label)
        if label == "DecodeStep_1_regional":
            workers[0].ready.set()  # the worker is done while the server builds its first pass
        return label

    compiler.build = build
    said = []
    compiler.run(report=lambda label, state: said.append((label, state)))
    # the worker's frozen one-row graph, loaded after the server's first build, stays: the later pass of its bucket
    assert step.compiled == {1: "DecodeStep_1", 2: "DecodeStep_2", 4: "DecodeStep_4_regional"}
    assert built == ["DecodeStep_1_regional", "DecodeStep_1", "DecodeStep_4_regional", "DecodeStep_2"]
    assert compiler.states() == {
        "DecodeStep_1_regional": "built",
        "DecodeStep_2_regional": "not built: StepMismatchError: row 0 trails",  # as the worker said: not built here
        "DecodeStep_4_regional": "built",
        "DecodeStep_1": "built",
        "DecodeStep_2": "built",
    }
    assert compiler.seconds["DecodeStep_1"] == 7.0  # the worker's build time
    assert list(compiler.build_seconds()) == [label for label, state in compiler.states().items() if state == "built"]
    assert sorted(said) == sorted(compiler.states().items()) and workers[0].closed


@pytest.mark.parametrize("reported", [{}, {"DecodeStep_2_regional": None}])
def test_a_pass_the_worker_ended_without_is_built_by_the_server(tmp_path, monkeypatch, reported):
    step = GPTRunner(tiny_gpt(vocab_size=97, context_length=64), None, 2).step
    compiler = BackgroundCompiler([Pass(step, 1, True), Pass(step, 2, True)], tmp_path, "key", name="tiny")
    compiler.share_with(compile_sharing.WorkerSpec(*[None] * 6, labels=()), 1)

    def ended(spec):
        worker = FakeWorker(spec, {"DecodeStep_2_regional": None})
        worker.ready.set()
        return worker

    monkeypatch.setattr(compile_sharing.CompileWorker, "started", ended if reported else lambda spec: None)
    compiler.build = lambda bucket, regional=False: compiler.label(bucket, regional)
    compiler.run()
    assert step.compiled == {1: "DecodeStep_1_regional", 2: "DecodeStep_2_regional"}
    assert set(compiler.states().values()) == {"built"}


def test_without_a_cache_nothing_is_handed_out(tmp_path):
    step = GPTRunner(tiny_gpt(vocab_size=97, context_length=64), None, 2).step
    compiler = BackgroundCompiler([Pass(step, 1, True), Pass(step, 2, True)], None, "key", name="tiny")
    compiler.share_with(compile_sharing.WorkerSpec(*[None] * 6, labels=()), 1)
    assert compiler.handed == []


def test_what_the_cache_holds_is_not_handed_out(tmp_path):
    """A warm start loads its kept passes in a second: a worker would only add its start to the wait."""
    step = GPTRunner(tiny_gpt(vocab_size=97, context_length=64), None, 2).step
    passes = [Pass(step, 1, True), Pass(step, 2, True), Pass(step, 1), Pass(step, 2)]
    (tmp_path / "key").mkdir()
    (tmp_path / "key" / "DecodeStep_2_regional.shared").touch()  # served by a graph its buckets share
    compiler = BackgroundCompiler(passes, tmp_path, "key", name="tiny")
    compiler.share_with(compile_sharing.WorkerSpec(*[None] * 6, labels=()), 1)
    assert [spec.labels for spec in compiler.handed] == [("DecodeStep_1",)]
    for label in ("DecodeStep_1_regional.bin", "DecodeStep_1.bin", "DecodeStep_1.pt2", "DecodeStep_2.pt2"):
        (tmp_path / "key" / label).touch()
    compiler = BackgroundCompiler(passes, tmp_path, "key", name="tiny")
    compiler.share_with(compile_sharing.WorkerSpec(*[None] * 6, labels=()), 1)
    assert compiler.handed == []
