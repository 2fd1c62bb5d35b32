"""The engine worker without a window: two engines side by side, limits changed on a live
engine. What the A/B view and the batching tuner will stand on."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest

pytest.importorskip("PySide6")
pytest.importorskip("pytestqt")

from PySide6.QtCore import QObject, Qt, QThread, Slot

from app.worker import (
    Configure,
    Delta,
    EngineWorker,
    Load,
    LoadSpec,
    ModelInfo,
    ReplyStats,
    Send,
    Stop,
)

pytestmark = [pytest.mark.real_model, pytest.mark.usefixtures("gui_gc")]
WAIT_MS = 120_000
GREEDY = {"max_new_tokens": 48, "temperature": 0.0}


class Inbox(QObject):
    """Collects one worker's signals in the UI thread; ``timeline`` is shared between inboxes
    and records which worker's text arrived when."""

    def __init__(self, name: str, timeline: list[str]) -> None:
        super().__init__()
        self.name, self.timeline = name, timeline
        self.deltas: list[Delta] = []
        self.stats: list[ReplyStats] = []
        self.models: list[ModelInfo] = []

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

    def text(self, tag: str, candidate: int = 0) -> str:
        return "".join(d.text for d in self.deltas if (d.tag, d.candidate) == (tag, candidate))


@dataclass
class Running:
    worker: EngineWorker
    thread: QThread
    inbox: Inbox


def start(qtbot: object, spec: LoadSpec, timeline: list[str] | None = None) -> Running:
    worker, thread = EngineWorker(), QThread()
    inbox = Inbox(spec.precision, [] if timeline is None else timeline)
    worker.moveToThread(thread)
    thread.started.connect(worker.run)
    worker.stopped.connect(thread.quit, Qt.ConnectionType.DirectConnection)
    worker.deltas.connect(inbox.on_deltas)
    worker.reply_stats.connect(inbox.on_stats)
    worker.loaded.connect(inbox.on_loaded)
    thread.start()
    worker.post(Load(spec))
    qtbot.waitUntil(lambda: bool(inbox.models), timeout=WAIT_MS)  # type: ignore[attr-defined]
    return Running(worker, thread, inbox)


@pytest.fixture
def workers(qtbot: object, default_model: Path) -> Iterator[list[Running]]:
    running: list[Running] = []
    yield running
    for r in running:
        r.worker.post(Stop())
        assert r.thread.wait(30_000)


def test_two_engines_stream_side_by_side(qtbot: object, workers: list[Running]) -> None:
    timeline: list[str] = []
    workers.append(start(qtbot, LoadSpec("default", "fp32", "cpu", 64), timeline))
    workers.append(start(qtbot, LoadSpec("default", "int8", "cpu", 64), timeline))
    messages = [{"role": "user", "content": "Describe a harbour at dawn."}]
    for r in workers:
        r.worker.post(Send("ab", messages, GREEDY))
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
    r = start(qtbot, LoadSpec("default", "fp32", "cpu", 64))
    workers.append(r)
    r.worker.post(Configure(limits={"max_batch_size": 1}))
    messages = [{"role": "user", "content": "List some birds."}]
    r.worker.post(Send("n3", messages, GREEDY, candidates=3))
    qtbot.waitUntil(lambda: bool(r.inbox.deltas), timeout=WAIT_MS)  # type: ignore[attr-defined]
    r.worker.post(Configure(limits={"max_batch_size": 3}))
    qtbot.waitUntil(lambda: len(r.inbox.stats) == 3, timeout=WAIT_MS)  # type: ignore[attr-defined]
    engine = r.worker.engine
    assert engine is not None and engine.scheduler.limits.max_batch_size == 3
    sizes = [s.batch_size for s in engine.collector.steps]
    assert sizes[0] == 1 and max(sizes) == 3  # one at a time, then all three together
    texts = {r.inbox.text("n3", c) for c in range(3)}
    assert len(texts) == 1  # greedy: the same reply three times, however it was batched
