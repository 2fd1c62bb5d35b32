"""The engine worker without a window: two engines side by side, limits changed on a live
engine. What the A/B view and the batching tuner will stand on."""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest
from PySide6.QtCore import QObject, Qt, QThread, Slot

from app.gui.commands import (
    Configure,
    Delta,
    Load,
    ModelInfo,
    ReplyStats,
    Resize,
    Send,
    Speculate,
    Stop,
)
from app.gui.worker import EngineWorker, Loader
from app.loading import LoadSpec
from engine.core.engine import LLMEngine
from engine.errors import CancelledError, ModelLoadError
from tests.app_window import SHARED_WEIGHTS

pytestmark = [pytest.mark.real_model, pytest.mark.usefixtures("gui_gc")]
WAIT_MS = 120_000
GREEDY = {"max_new_tokens": 24, "temperature": 0.0}
SHORT = {"max_new_tokens": 4, "temperature": 0.0}  # a reply that only has to come


class Inbox(QObject):
    """Collects one worker's signals in the UI thread; ``timeline`` is shared between inboxes
    and records which worker's text arrived when."""

    def __init__(self, name: str, timeline: list[str]) -> None:
        super().__init__()
        self.name, self.timeline = name, timeline
        self.deltas: list[Delta] = []
        self.stats: list[ReplyStats] = []
        self.models: list[ModelInfo] = []
        self.failures: list[str] = []
        self.notices: list[str] = []
        self.unloaded: list[str] = []
        self.errors: list[str] = []
        self.speculation: list[tuple[str, int, str]] = []
        self.stopped = False

    @Slot(list)
    def on_deltas(self, deltas: list[Delta]) -> None:
        self.deltas.extend(deltas)
        self.timeline.append(self.name)

    @Slot(object)
    def on_stats(self, stats: ReplyStats) -> None:
        self.stats.append(stats)

    @Slot(object)
    def on_loaded(self, info: ModelInfo) -> None:
        self.models.append(info)

    @Slot(str)
    def on_failed(self, message: str) -> None:
        self.failures.append(message)

    @Slot(str)
    def on_notice(self, text: str) -> None:
        self.notices.append(text)

    @Slot(str)
    def on_unloaded(self, text: str) -> None:
        self.unloaded.append(text)

    @Slot(str)
    def on_error(self, text: str) -> None:
        self.errors.append(text)

    @Slot(str, int, str)
    def on_speculation(self, text: str, k: int, error: str) -> None:
        self.speculation.append((text, k, error))

    @Slot()
    def on_stopped(self) -> None:
        self.stopped = True

    def text(self, tag: str, candidate: int = 0) -> str:
        return "".join(d.text for d in self.deltas if (d.tag, d.candidate) == (tag, candidate))


@dataclass
class Running:
    worker: EngineWorker
    thread: QThread
    inbox: Inbox


def start(
    qtbot: object,
    workers: list[Running],
    spec: LoadSpec,
    timeline: list[str] | None = None,
    loader: Loader = SHARED_WEIGHTS,
) -> Running:
    """Start a worker and load ``spec``; ``workers`` holds it from the start, so the fixture
    stops its thread even when the load below fails (a QThread destroyed while it runs aborts
    the process). The loader shares each model's weights in this process, as the windows'
    does (tests/app_window.py): each worker gets an engine of its own, without a load each."""
    running = launch(workers, loader, Inbox(spec.precision, [] if timeline is None else timeline))
    running.worker.post(Load(spec))
    qtbot.waitUntil(lambda: bool(running.inbox.models), timeout=WAIT_MS)  # type: ignore[attr-defined]
    return running


def launch(workers: list[Running], loader: Loader, inbox: Inbox) -> Running:
    worker, thread = EngineWorker(loader), QThread()
    worker.moveToThread(thread)
    thread.started.connect(worker.run)
    worker.stopped.connect(thread.quit, Qt.ConnectionType.DirectConnection)
    worker.deltas.connect(inbox.on_deltas)
    worker.reply_stats.connect(inbox.on_stats)
    worker.loaded.connect(inbox.on_loaded)
    worker.load_failed.connect(inbox.on_failed)
    worker.notice.connect(inbox.on_notice)
    worker.unloaded.connect(inbox.on_unloaded)
    worker.error.connect(inbox.on_error)
    worker.speculation_applied.connect(inbox.on_speculation)
    worker.stopped.connect(inbox.on_stopped)
    running = Running(worker, thread, inbox)
    workers.append(running)
    thread.start()
    return running


def loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "infersight-load" and t.is_alive()]


@pytest.fixture
def workers(qtbot: object, default_model: Path) -> Iterator[list[Running]]:
    running: list[Running] = []
    yield running
    for r in running:
        r.worker.post(Stop())
        assert r.thread.wait(30_000)
    assert not loader_threads()


def test_two_engines_stream_side_by_side(qtbot: object, workers: list[Running]) -> None:
    timeline: list[str] = []
    start(qtbot, workers, LoadSpec("default", "fp32", "cpu", 64), timeline)
    start(qtbot, workers, LoadSpec("default", "int8", "cpu", 64), timeline)
    messages = [{"role": "user", "content": "Describe a harbour at dawn."}]
    # fp32 writes the longer reply: its stream still runs while INT8's first (its prefill)
    # waits on a loaded machine, so that the overlap does not hang on which starts first
    longer = {**GREEDY, "max_new_tokens": 4 * GREEDY["max_new_tokens"]}
    for r, params in zip(workers, (longer, GREEDY), strict=True):
        r.worker.post(Send("ab", messages, params))
    qtbot.waitUntil(lambda: all(r.inbox.stats for r in workers), timeout=WAIT_MS)  # type: ignore[attr-defined]
    (a,), (b,) = (r.inbox.stats for r in workers)
    assert (a.precision, b.precision) == ("fp32", "int8")
    assert workers[0].inbox.text("ab") and workers[1].inbox.text("ab")
    assert workers[0].worker.engine is not workers[1].worker.engine
    # both streamed at once: each one's text started arriving before the other's ended
    first = {n: timeline.index(n) for n in ("fp32", "int8")}
    last = {n: len(timeline) - 1 - timeline[::-1].index(n) for n in ("fp32", "int8")}
    assert first["int8"] < last["fp32"] and first["fp32"] < last["int8"]


def test_scheduler_limits_change_on_a_live_engine(qtbot: object, workers: list[Running]) -> None:
    r = start(qtbot, workers, LoadSpec("default", "fp32", "cpu", 64))
    assert r.worker.engine is not None  # idle: safe to touch from here
    r.worker.engine.collector.window_s = float("inf")  # keep every step, however slow the CPU
    r.worker.post(Configure(limits={"max_batch_size": 1}))
    messages = [{"role": "user", "content": "List some birds."}]
    r.worker.post(Send("n3", messages, GREEDY, candidates=3))
    qtbot.waitUntil(lambda: bool(r.inbox.deltas), timeout=WAIT_MS)  # type: ignore[attr-defined]
    r.worker.post(Configure(limits={"max_batch_size": 3}))
    # each reply's figures come before its last text (the window files them with the reply)
    ended = lambda: sum(1 for d in r.inbox.deltas if d.tag == "n3" and d.finish)  # noqa: E731
    qtbot.waitUntil(lambda: len(r.inbox.stats) == 3 and ended() == 3, timeout=WAIT_MS)  # type: ignore[attr-defined]
    engine = r.worker.engine
    assert engine is not None and engine.scheduler.limits.max_batch_size == 3
    sizes = [s.batch_size for s in engine.collector.steps]
    assert sizes[0] == 1 and max(sizes) == 3  # one at a time, then all three together
    texts = {r.inbox.text("n3", c) for c in range(3)}
    assert len(texts) == 1  # greedy: the same reply three times, however it was batched


class SlowLoader:
    """Stands for a long download or conversion: reports progress until told to stop."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.cancelled = threading.Event()

    def __call__(self, spec: LoadSpec, progress: Callable[[str, int, int], None]) -> LLMEngine:
        self.started.set()
        deadline = time.monotonic() + WAIT_MS / 1000
        step = 0
        try:
            while time.monotonic() < deadline:
                progress("write", step % 100, 100)
                step += 1
                time.sleep(0.01)
        except CancelledError:
            self.cancelled.set()
            raise
        raise AssertionError("the load was never cancelled")


def test_stop_mid_load_cancels_it_and_leaves_no_thread(
    qtbot: object, workers: list[Running]
) -> None:
    loader = SlowLoader()
    r = launch(workers, loader, Inbox("slow", []))
    r.worker.post(Load(LoadSpec("default", "fp32", "cpu", 64)))
    assert loader.started.wait(30)
    r.worker.post(Stop())
    assert r.thread.wait(30_000), "the worker did not stop while a load ran"
    assert loader.cancelled.is_set()
    assert not loader_threads()
    qtbot.waitUntil(lambda: r.inbox.stopped, timeout=5_000)  # type: ignore[attr-defined]
    assert r.worker.engine is None and not r.inbox.models


def test_a_failed_load_leaves_no_thread_and_the_worker_goes_on(
    qtbot: object, workers: list[Running]
) -> None:
    def failing(spec: LoadSpec, progress: Callable[[str, int, int], None]) -> LLMEngine:
        if spec.precision == "int8":
            raise ModelLoadError("simulated: the weights are unreadable")
        return SHARED_WEIGHTS(spec, progress)

    r = start(qtbot, workers, LoadSpec("default", "fp32", "cpu", 64), loader=failing)
    r.worker.post(Load(LoadSpec("default", "int8", "cpu", 64)))
    qtbot.waitUntil(lambda: bool(r.inbox.failures), timeout=WAIT_MS)  # type: ignore[attr-defined]
    assert "simulated" in r.inbox.failures[0]
    qtbot.waitUntil(lambda: not loader_threads(), timeout=5_000)  # type: ignore[attr-defined]
    assert r.worker.info is not None and r.worker.info.precision == "fp32"
    r.worker.post(Send("after", [{"role": "user", "content": "Hi."}], SHORT))
    qtbot.waitUntil(lambda: len(r.inbox.stats) == 1, timeout=WAIT_MS)  # type: ignore[attr-defined]


def test_stop_mid_step_returns_promptly(qtbot: object, workers: list[Running]) -> None:
    r = start(qtbot, workers, LoadSpec("default", "fp32", "cpu", 64))
    long = {"max_new_tokens": 1000, "temperature": 0.0, "ignore_eos": True}
    r.worker.post(Send("long", [{"role": "user", "content": "Tell a story."}], long))
    qtbot.waitUntil(lambda: len(r.inbox.text("long")) > 20, timeout=WAIT_MS)  # type: ignore[attr-defined]
    r.worker.post(Stop())
    assert r.thread.wait(30_000), "the worker did not stop mid-reply"
    qtbot.waitUntil(lambda: r.inbox.stopped, timeout=5_000)  # type: ignore[attr-defined]
    assert r.worker.engine is None


def only_fits_alone(monkeypatch: pytest.MonkeyPatch, spec: LoadSpec, r: Running) -> None:
    """Free memory such that ``spec`` fits only once the model ``r`` holds is gone (as free
    memory grows when it goes)."""
    from app.loading import plan_load
    from engine.loader import memory_plan

    need, real = plan_load(spec).peak_bytes, memory_plan.free_memory
    monkeypatch.setattr(
        memory_plan,
        "free_memory",
        lambda device: real(device) if r.worker.info is None else float(need - 100 * 2**20),
    )


def test_a_model_that_fits_only_alone_is_loaded_after_the_old_one_goes(
    qtbot: object, workers: list[Running], monkeypatch: pytest.MonkeyPatch
) -> None:
    r = start(qtbot, workers, LoadSpec("default", "fp32", "cpu", 64))
    notes = r.inbox
    # a weak reference: the old engine is freed before the new one is made, and the new one
    # may then be given the old one's address (its id)
    old = weakref.ref(r.worker.engine)
    int8 = LoadSpec("default", "int8", "cpu", 64)
    only_fits_alone(monkeypatch, int8, r)
    r.worker.post(Load(int8))
    qtbot.waitUntil(lambda: len(r.inbox.models) == 2, timeout=WAIT_MS)  # type: ignore[attr-defined]
    assert len(notes.unloaded) == 1 and "do not fit in memory together" in notes.unloaded[0]
    assert "conversation is kept" in notes.unloaded[0]
    assert r.worker.engine is not old() and r.inbox.models[-1].precision == "int8"


def test_when_the_load_after_an_unload_fails_the_old_model_comes_back(
    qtbot: object, workers: list[Running], monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(spec: LoadSpec, progress: Callable[[str, int, int], None]) -> LLMEngine:
        if spec.precision == "int8":
            raise ModelLoadError("simulated: the weights are unreadable")
        return SHARED_WEIGHTS(spec, progress)

    r = start(qtbot, workers, LoadSpec("default", "fp32", "cpu", 64), loader=failing)
    notes = r.inbox
    int8 = LoadSpec("default", "int8", "cpu", 64)
    only_fits_alone(monkeypatch, int8, r)
    r.worker.post(Load(int8))
    qtbot.waitUntil(lambda: len(r.inbox.models) == 2, timeout=WAIT_MS)  # type: ignore[attr-defined]
    assert notes.unloaded and "simulated" in r.inbox.failures[0]
    assert any("again" in n for n in notes.notices)
    assert r.worker.info is not None and r.worker.info.precision == "fp32"


def test_a_new_kv_pool_keeps_the_weights(qtbot: object, workers: list[Running]) -> None:
    r = start(qtbot, workers, LoadSpec("default", "fp32", "cpu", 64))
    notes = r.inbox
    old = r.worker.engine
    assert old is not None
    r.worker.post(Resize(32))
    qtbot.waitUntil(lambda: bool(notes.notices), timeout=WAIT_MS)  # type: ignore[attr-defined]
    new = r.worker.engine
    assert new is not None and new is not old
    assert new.model is old.model  # the very same weights: nothing was loaded again
    assert new.kv.nbytes == pytest.approx(32 * 2**20, rel=0.01)
    assert r.worker.info is not None and r.worker.info.kv_memory_mib == 32
    assert "not reloaded" in notes.notices[0]
    r.worker.post(Send("after", [{"role": "user", "content": "Hi."}], SHORT))
    qtbot.waitUntil(lambda: len(r.inbox.stats) == 1, timeout=WAIT_MS)  # type: ignore[attr-defined]


def test_speculation_follows_new_engines_and_a_failure_keeps_the_model(
    qtbot: object,
    workers: list[Running],
    tiny_model_dir: Callable[[str, bool], tuple[Path, object]],
    tmp_path: Path,
) -> None:
    from tests.conftest import build_tiny_hf, save_tiny

    folder, _ = tiny_model_dir("llama", True)
    other = save_tiny(build_tiny_hf("llama", tied=True, vocab_size=288), tmp_path / "other")
    r = start(qtbot, workers, LoadSpec(str(folder), "fp32", "cpu", 4))
    said = r.inbox.speculation

    def answer(n: int) -> tuple[str, int, str]:
        qtbot.waitUntil(lambda: len(said) >= n, timeout=WAIT_MS)  # type: ignore[attr-defined]
        return said[n - 1]

    assert said == [("", 8, "")]  # the load says what runs: nothing
    r.worker.post(Speculate("lookup", 3))
    assert answer(2) == ("lookup", 3, "")
    engine = r.worker.engine
    assert engine is not None and engine.speculator is not None
    assert (engine.speculator.label, engine.speculator.config.k) == ("lookup", 3)

    # a draft folder that is not there: said, and lookup goes on
    r.worker.post(Speculate(f"model:{tmp_path / 'missing'}", 2))
    text, k, error = answer(3)
    assert (text, k) == ("lookup", 3) and "could not start" in error
    assert any("stays lookup" in e for e in r.inbox.errors)
    assert engine.speculator is not None and engine.speculator.label == "lookup"

    # a new KV pool keeps the weights and the speculation
    loads = len(r.inbox.models)
    r.worker.post(Resize(2))
    assert answer(4) == ("lookup", 3, "")
    # the swap says what it drafts with before it announces the engine: wait for the latter
    qtbot.waitUntil(lambda: len(r.inbox.models) == loads + 1, timeout=WAIT_MS)  # type: ignore[attr-defined]
    resized = r.worker.engine
    assert resized is not None and resized is not engine and resized.speculator is not None

    # the same weights drafting for themselves, then a model whose tokenizer differs: the
    # loader tries the drafter on it, cannot, and the model loads with speculation off
    r.worker.post(Speculate(f"model:{folder}", 2))
    assert answer(5) == (f"model:{folder}", 2, "")
    assert resized.speculator is not None and resized.speculator.label == f"model:{folder}"
    r.worker.post(Load(LoadSpec(str(other), "fp32", "cpu", 4)))
    text, k, error = answer(6)
    assert (text, k) == ("", 2) and "same tokenizer" in error
    loaded = lambda: r.inbox.models[-1].path == str(other)  # noqa: E731
    qtbot.waitUntil(loaded, timeout=WAIT_MS)  # type: ignore[attr-defined]
    assert r.worker.info is not None and r.worker.info.path == str(other)
    assert r.worker.engine is not None and r.worker.engine.speculator is None
    assert any("off for" in e for e in r.inbox.errors)
