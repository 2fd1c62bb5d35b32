"""The app's first start on an empty cache: the default model is converted while the window
stays responsive (issue 25), and the pull's child process and lock behave.

The window test pre-seeds the downloaded GGUF (no network) in a fresh ``INFERSIGHT_HOME``; the
conversion runs for real, exactly as after a plain ``pip install``.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest

pytest.importorskip("PySide6")
pytest.importorskip("pytestqt")

from PySide6.QtCore import QObject, QTimer, Slot

from app.gui.gc_guard import settle
from app.gui.main_window import MainWindow
from app.loading import LoadSpec, load_engine
from engine.core.engine import LLMEngine
from engine.errors import CancelledError, ModelLoadError
from engine.store import gguf_import, model_store
from engine.store.gguf_import import Progress
from engine.store.gguf_reader import dequantize_tensor
from engine.store.gguf_subprocess import import_gguf_in_subprocess
from engine.store.model_store import (
    DEFAULT,
    default_gguf_path,
    default_model_path,
    pull_default,
    store_lock,
)

pytestmark = [pytest.mark.real_model, pytest.mark.usefixtures("gui_gc")]

SPEC = LoadSpec("default", "fp32", "cpu", kv_memory_mib=64)
LONG_WAIT_MS = 240_000
HEARTBEAT_MS = 5
#: the issue's limit on the UI thread's longest stall while the model is pulled and converted
WORST_GAP_S = 0.100


def _seed_download(default_gguf: Path) -> None:
    """Put the already-verified GGUF where a pull looks first (the conversion still runs)."""
    target = default_gguf_path()
    target.parent.mkdir(parents=True)
    target.symlink_to(default_gguf)


class Stages(QObject):
    """Receives ``load_progress`` in the UI thread, with the time each stage was first seen."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, int, int]] = []
        self.first: dict[str, float] = {}

    @Slot(str, int, int)
    def record(self, stage: str, done: int, total: int) -> None:
        self.seen.append((stage, done, total))
        self.first.setdefault(stage, time.perf_counter())


@pytest.mark.timing  # a UI heartbeat: run alone (make test)
def test_first_start_converts_the_default_model_without_freezing_the_window(
    qtbot: object,
    tmp_path: Path,
    user_home: Path,
    default_gguf: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 5 ms heartbeat in the UI thread, from the window's first frame until the pull (with
    its conversion) returns: the UI thread may not stall over 100 ms in it. Then the model is
    loaded and answers.

    Measured on a 2-core machine shared with other jobs (load average 4–6): with the conversion
    in the app's own process (before issue 25) the worst gap was 95–257 ms in five runs (the
    GGUF reader, the tokenizer's tables and the largest tensors' dequantization each hold the
    GIL that long), so the limit alone misses it now and then (the check that no tensor was
    dequantized in this process never does). With the conversion in a child process: 22–61 ms
    in seven runs."""
    assert not default_model_path().exists()
    _seed_download(default_gguf)
    pulled: list[float] = []  # when the first pull returned (the loader thread)

    def pull_and_time(*, progress: Progress | None = None) -> Path:
        path = pull_default(progress=progress)
        pulled.append(time.perf_counter())
        return path

    monkeypatch.setattr(model_store, "pull_default", pull_and_time)
    here: list[str] = []  # tensors dequantized in this process (the child's are not seen)

    def dequantize_here(tensor: Any) -> Any:
        here.append(tensor.name)
        return dequantize_tensor(tensor)

    monkeypatch.setattr(gguf_import, "dequantize_tensor", dequantize_here)
    go = threading.Event()

    def loader(spec: LoadSpec, progress: Progress) -> LLMEngine:
        """The app's loader, once the heartbeat beats: the whole pull is measured."""
        assert go.wait(LONG_WAIT_MS / 1000)
        return load_engine(spec, progress)

    settle()  # as run_gui does before its window: no collection of the heap in the pull
    window = MainWindow(tmp_path / "data", spec=SPEC, loader=loader)
    qtbot.addWidget(window)  # type: ignore[attr-defined]
    stages = Stages()
    window.worker.load_progress.connect(stages.record)
    beats: list[float] = []
    heartbeat = QTimer(window, interval=HEARTBEAT_MS)
    heartbeat.timeout.connect(lambda: beats.append(time.perf_counter()))
    with qtbot.waitExposed(window):  # type: ignore[attr-defined]
        window.show()  # its first frame is drawn (in the UI thread, whatever the worker does)
    beats.append(time.perf_counter())
    heartbeat.start()
    go.set()
    try:
        qtbot.waitUntil(lambda: window.model is not None, timeout=LONG_WAIT_MS)  # type: ignore[attr-defined]
        heartbeat.stop()
        # the UI thread's stalls in the pull: each gap between beats, up to the pull's end
        stalls = [min(b, pulled[0]) - a for a, b in itertools.pairwise(beats) if a < pulled[0]]
        after = [b - a for a, b in itertools.pairwise(beats) if a >= pulled[0]]
        worst = max(stalls)
        print(
            f"heartbeat in the pull: {len(stalls)} beats over {pulled[0] - beats[0]:.1f} s, "
            f"worst gap {worst * 1e3:.1f} ms; in the load after it: worst "
            f"{max(after, default=0.0) * 1e3:.1f} ms"
        )
        model = window.model
        assert model is not None and model.name == DEFAULT.name and model.precision == "fp32"
        assert (default_model_path() / "config.json").is_file()
        dequantized = [(d, t) for s, d, t in stages.seen if s == "dequantize"]
        assert dequantized and dequantized[-1][0] == dequantized[-1][1] > 100  # ran for real
        assert ("write", 1, 1) in stages.seen
        assert beats[0] < stages.first["dequantize"] < pulled[0]  # measured while it ran
        assert here == [], "the conversion ran in the app's process, holding its GIL"
        assert len(stalls) > 100
        assert worst < WORST_GAP_S, f"the UI thread stalled {worst * 1e3:.0f} ms in the pull"
        window.chat.input.setPlainText("Hi!")
        window.controls.max_new_tokens.set_value(4)
        window.chat._submit()
        qtbot.waitUntil(lambda: window.active is None, timeout=LONG_WAIT_MS)  # type: ignore[attr-defined]
        assert window.chat.last is not None and window.chat.last.view.status == "done"
    finally:
        heartbeat.stop()
        window.shutdown()


def test_a_cancelled_pull_stops_its_child_and_leaves_nothing(
    user_home: Path, default_gguf: Path
) -> None:
    """A progress callback that raises mid-conversion (the app closing) ends the child at once,
    and no partial folder is left (the next pull starts clean: test_model_store.py)."""
    _seed_download(default_gguf)
    started: list[float] = []

    def cancel_midway(stage: str, done: int, total: int) -> None:
        if stage == "dequantize" and done >= 1:  # the first tensor: nearly all still to come
            started.append(time.perf_counter())
            raise CancelledError("the load was cancelled because the engine is stopping")

    with pytest.raises(CancelledError):
        pull_default(progress=cancel_midway)
    assert time.perf_counter() - started[0] < 6.0  # terminated, not converted to the end
    models = default_model_path().parent
    assert list(models.iterdir()) == []


def test_a_broken_gguf_fails_in_the_child_with_the_load_error(tmp_path: Path) -> None:
    """The child's error comes back as the same class and message, with no traceback."""
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF but not really")
    with pytest.raises(ModelLoadError, match="not a readable GGUF") as err:
        import_gguf_in_subprocess(broken, tmp_path / "out")
    assert "Traceback" not in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.gguf"]


def test_a_pull_waits_for_another_process_pull_and_uses_its_model(user_home: Path) -> None:
    """While another holds the store's lock (a pull in another pytest-xdist worker), a pull
    waits (reporting that it does), leaves the other's partial folder alone, and then uses the
    model the other made, converting nothing."""
    dest = default_model_path()
    theirs = dest.parent / f".{dest.name}.partial-theirs"
    waiting = threading.Event()
    pulled: list[Path] = []

    def report(stage: str, done: int, total: int) -> None:
        assert (stage, done, total) == ("download", 0, 1)
        waiting.set()

    with store_lock(dest.name):
        theirs.mkdir(parents=True)
        puller = threading.Thread(target=lambda: pulled.append(pull_default(progress=report)))
        puller.start()
        assert waiting.wait(10)
        assert theirs.is_dir() and puller.is_alive()
        dest.mkdir()  # what the other pull renames into place when it is done
        (dest / "config.json").write_text("{}")
        theirs.rmdir()
    puller.join(10)
    assert pulled == [dest]
    assert json.loads((dest / "generation_config.json").read_text())["temperature"] == 0.2
    assert sorted(p.name for p in dest.iterdir()) == ["config.json", "generation_config.json"]
