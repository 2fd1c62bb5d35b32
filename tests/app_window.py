"""What the app's window tests share: a window on the real default model, offscreen, whose
engines share one load of the weights per test process; helpers to send a message and read
the chat back. The ``window`` and ``oracle`` fixtures are in ``tests/conftest.py``."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import QObject, Slot

from app.gui.main_window import MainWindow
from app.loading import LoadSpec, load_engine, resolve_device
from engine.core.engine import LLMEngine

SPEC = LoadSpec("default", "fp32", "cpu", kv_memory_mib=64)


LONG_WAIT_MS = 120_000


class SharedWeights:
    """The windows' loader: one load of each (model, precision, device) per test process, and
    each window an engine of its own on those weights (:meth:`LLMEngine.sibling`: its own KV
    pool, limits and instruments, as the A/B lab's engines are), so that tests do not pay a
    model load per window. A model that an earlier window left with hooks or eager reasons
    on it (layer timings) is not shared: that window's engine would still be timing it."""

    def __init__(self) -> None:
        self._bases: dict[tuple[str, str, str], LLMEngine] = {}

    def __call__(
        self, spec: LoadSpec, progress: Callable[..., None] | None = None, *, config=None
    ) -> LLMEngine:
        from app.loading import engine_config

        config = config or engine_config(spec)
        key = (spec.model, spec.precision, resolve_device(spec.device))
        base = self._bases.get(key)
        if base is None or _in_use(base):
            base = self._bases[key] = load_engine(spec, progress, config=config)
        elif progress:
            progress("load", 1, 1)
        return base.sibling(config)


def _in_use(engine: LLMEngine) -> bool:
    model = engine.model
    hooked = any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    return hooked or bool(engine.runner.executor.eager_reasons)


SHARED_WEIGHTS = SharedWeights()


def open_window(
    qtbot: object,
    data_dir: Path,
    *,
    loader: Callable[..., LLMEngine] = SHARED_WEIGHTS,
    wait: bool = True,
    size: tuple[int, int] = (1280, 800),
) -> MainWindow:
    window = MainWindow(data_dir, spec=SPEC, loader=loader)
    qtbot.addWidget(window)  # type: ignore[attr-defined]
    window.resize(*size)
    window.show()
    if wait:
        qtbot.waitUntil(lambda: window.model is not None, timeout=LONG_WAIT_MS)  # type: ignore[attr-defined]
    window.controls.temperature.set_value(0)
    window.controls.repetition_penalty.set_value(1.0)
    window.controls.max_new_tokens.set_value(24)
    return window


class Recorder(QObject):
    """Receives a worker signal in the UI thread (a lambda would run in the worker's)."""

    def __init__(self, then: Callable[[object], None] | None = None) -> None:
        super().__init__()
        self.values: list[object] = []
        self.then = then

    @Slot(object)
    def record(self, value: object) -> None:
        self.values.append(value)
        if self.then is not None:
            self.then(value)


def send(qtbot: object, window: MainWindow, text: str) -> None:
    window.chat.input.setPlainText(text)
    window.chat._submit()
    assert window.active is not None
    qtbot.waitUntil(lambda: window.active is None, timeout=LONG_WAIT_MS)  # type: ignore[attr-defined]


def start_long_reply(qtbot: object, window: MainWindow) -> None:
    """Send a prompt with a long answer and return once some of it has streamed."""
    window.controls.max_new_tokens.set_value(400)
    window.chat.input.setPlainText("Tell me a long story about a lighthouse keeper.")
    window.chat._submit()
    qtbot.waitUntil(lambda: len(window.chat.last.view.text) > 20, timeout=LONG_WAIT_MS)  # type: ignore[union-attr, attr-defined]


def stored(window: MainWindow) -> list[tuple[str, str, str]]:
    assert window.conversation_id is not None
    return [(m.role, m.content, m.status) for m in window.store.messages(window.conversation_id)]


class GatedLoader:
    """The real loader, but precisions in ``gated`` wait until :meth:`release`."""

    def __init__(self, *gated: str) -> None:
        self.gated = set(gated)
        self.gate = threading.Event()
        self.waiting = threading.Event()

    def __call__(self, spec: LoadSpec, progress: Callable[[str, int, int], None]) -> LLMEngine:
        if spec.precision in self.gated:
            self.waiting.set()
            assert self.gate.wait(LONG_WAIT_MS / 1000)
        return SHARED_WEIGHTS(spec, progress)

    def release(self) -> None:
        self.gate.set()
