"""The batching tuner in the real app on the default model (pytest-qt, offscreen): a slider
moved mid-run reaches the engine at its next step, Stop leaves no block behind and the chat
works after it, and a sweep run in the app measures what ``infersight tune --json`` measures
for the same settings."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest

from app.cli.main import main
from app.gui.commands import EngineView
from app.gui.main_window import MainWindow
from tests.app_window import LONG_WAIT_MS, Recorder, open_window, send

pytestmark = [pytest.mark.real_model, pytest.mark.usefixtures("gui_gc")]
CHAT_TOKENS = 4  # the chat answers after the tuner: a few tokens show it


@pytest.fixture
def window(qtbot: object, tmp_path: Path, default_model: Path) -> Iterator[MainWindow]:
    w = open_window(qtbot, tmp_path / "data")
    w.show_page(w.tuner)
    yield w
    w.shutdown()


def latest(views: Recorder) -> EngineView:
    view = views.values[-1]
    assert isinstance(view, EngineView)
    return view


def test_a_slider_reaches_the_engine_at_the_next_step_and_stop_frees_everything(
    qtbot: object, window: MainWindow
) -> None:
    views = Recorder()
    window.worker.metrics.connect(views.record)
    tuner = window.tuner
    tuner.users_spin.setValue(6)
    tuner.output_spin.setValue(48)
    tuner.conversations_spin.setValue(0.0)  # short prompts: the run is about decoding
    tuner.start_button.click()
    qtbot.waitUntil(  # type: ignore[attr-defined]
        lambda: bool(views.values) and latest(views).snapshot.num_requests_running >= 4,
        timeout=LONG_WAIT_MS,
    )
    tuner.sliders["max_batch_size"].slider.setValue(2)  # as a user's drag ends there

    def limited() -> bool:  # three steps scheduled under the new limit, as each recorded it
        steps = latest(views).snapshot.recent_steps
        return sum(r.max_batch_size == 2 for r in steps) >= 3

    qtbot.waitUntil(limited, timeout=LONG_WAIT_MS)  # type: ignore[attr-defined]
    snapshot = latest(views).snapshot
    assert snapshot.limits["max_batch_size"] == 2
    recorded = [r.max_batch_size for r in snapshot.recent_steps]
    moved = recorded.index(2)
    before, after = snapshot.recent_steps[:moved], snapshot.recent_steps[moved:]
    # mid-run: batched wider under the old limit, then every step under the new one held it
    assert before and max(r.batch_size for r in before) > 2, recorded
    assert all(r.max_batch_size == 2 for r in after), recorded
    assert all(r.batch_size <= 2 for r in after), [r.batch_size for r in after]
    assert window.controls.max_batch_size.value() == 2  # the panel shows the same limit

    tuner.stop_button.click()
    qtbot.waitUntil(  # type: ignore[attr-defined]
        lambda: (
            (s := latest(views).snapshot).kv_blocks_used == 0
            and s.num_requests_running == 0
            and s.num_requests_waiting == 0
        ),
        timeout=LONG_WAIT_MS,
    )
    assert "stopped" in tuner.status_label.text()
    window.controls.max_new_tokens.set_value(CHAT_TOKENS)
    send(qtbot, window, "Hello!")
    assert window.chat.last is not None and window.chat.last.view.text.strip()


def test_turning_the_users_mid_run_reaches_the_engines_running_set(
    qtbot: object, window: MainWindow
) -> None:
    views = Recorder()
    window.worker.metrics.connect(views.record)
    tuner = window.tuner
    tuner.users_spin.setValue(1)
    tuner.output_spin.setValue(64)
    tuner.conversations_spin.setValue(0.0)
    tuner.start_button.click()
    running: list[int] = []

    def seen(n: int) -> bool:
        if views.values:
            running.append(latest(views).snapshot.num_requests_running)
        return bool(running) and running[-1] == n

    qtbot.waitUntil(lambda: seen(1), timeout=LONG_WAIT_MS)  # type: ignore[attr-defined]
    tuner.users_spin.setValue(5)  # four users join at the next tick
    qtbot.waitUntil(lambda: seen(5), timeout=LONG_WAIT_MS)  # type: ignore[attr-defined]
    tuner.stop_button.click()
    qtbot.waitUntil(tuner.start_button.isEnabled, timeout=LONG_WAIT_MS)  # type: ignore[attr-defined]
    assert max(running) == 5


def test_a_load_that_fails_ends_with_its_message_and_the_chat_goes_on(
    qtbot: object, window: MainWindow, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.bench.loadgen import LoadGenerator

    def broken(self: LoadGenerator, events: object) -> None:
        raise RuntimeError("a bug in the load generator")

    monkeypatch.setattr(LoadGenerator, "observe", broken)
    window.tuner.users_spin.setValue(2)
    window.tuner.conversations_spin.setValue(0.0)
    window.tuner.start_button.click()
    qtbot.waitUntil(  # type: ignore[attr-defined]
        lambda: "a bug in the load generator" in window.tuner.status_label.text(),
        timeout=LONG_WAIT_MS,
    )
    assert window.tuner.start_button.isEnabled()
    window.controls.max_new_tokens.set_value(CHAT_TOKENS)
    send(qtbot, window, "Hello!")
    assert window.chat.last is not None and window.chat.last.view.text.strip()
    assert window.engine_thread.isRunning()


def test_a_sweep_in_the_app_measures_what_the_command_line_measures(
    qtbot: object, window: MainWindow, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two points of four short requests each (the shortest output the mix draws: a median of
    16 tokens), both batched: 2 and 4 users. The command runs in this process, as ``main``
    (``python -m app.cli`` is no more than that), on a model of its own."""
    tuner = window.tuner
    tuner.sweep_mode.setCurrentText("closed")
    tuner.loads_edit.setText("2 4")
    tuner.batch_edit.setText("4")
    tuner.tokens_edit.setText("256")
    tuner.wait_edit.setText("0")
    tuner.requests_spin.setValue(4)
    tuner.sweep_output_spin.setValue(16)
    tuner.conversations_spin.setValue(0.0)
    # An SLO every point meets on any CPU (this test compares the app with the CLI, not
    # speeds): the best point is then the highest throughput, and must be one of the sweep's.
    tuner.slo_edit.setText("ttft=600s,tpot=60s")
    started = time.perf_counter()
    tuner.run_button.click()
    qtbot.waitUntil(lambda: tuner.progress.maximum() == 2, timeout=10_000)  # type: ignore[attr-defined]
    qtbot.waitUntil(lambda: len(tuner.sweep_points()) == 2, timeout=3 * LONG_WAIT_MS)  # type: ignore[attr-defined]
    app_s = time.perf_counter() - started
    app_points = {p.label: p.result.as_json() for p in tuner.sweep_points()}
    assert tuner.best_label() in app_points
    csv_path, png_path = tmp_path / "sweep.csv", tmp_path / "sweep.png"
    tuner.export_sweep_csv(csv_path)
    tuner.export_sweep_png(png_path)
    assert len(csv_path.read_text().splitlines()) == 3 and png_path.stat().st_size > 5_000

    capsys.readouterr()
    started = time.perf_counter()
    assert main(["tune", "--model", "default", "--kv-memory", str(64 * 2**20), "--users", "2",
                 "4", "--max-batch-size", "4", "--max-tokens-per-step", "256", "--requests",
                 "4", "--output-median", "16", "--conversations", "0", "--json"]) == 0  # fmt: skip
    cli_s = time.perf_counter() - started
    report = json.loads(capsys.readouterr().out)
    cli_points = {p["label"]: p for p in report["points"]}
    assert set(cli_points) == set(app_points)
    for label, ours in app_points.items():
        theirs = cli_points[label]
        # the same seeded requests: token counts are exact
        for key in ("completed", "failed", "total_input_tokens", "total_output_tokens"):
            assert ours[key] == theirs[key], (label, key)
        assert (ours["completed"], ours["failed"]) == (4, 0)
    # Timings differ from run to run (the app's UI shares the cores): each side's figures are
    # checked against its own clock instead, the one the test kept around each sweep.
    for points, took in ((app_points, app_s), (cli_points, cli_s)):
        assert sum(p["duration"] for p in points.values()) <= took
        for p in points.values():
            assert p["output_throughput"] == pytest.approx(p["total_output_tokens"] / p["duration"])
            assert p["request_throughput"] == pytest.approx(p["completed"] / p["duration"])
            # a request's latency lies within its run, and its TPOT within its latency
            assert 0 < p["median_tpot_ms"] <= p["p99_e2el_ms"] <= p["duration"] * 1e3
            assert 0 < p["median_ttft_ms"] <= p["p99_e2el_ms"]


@pytest.mark.skipif(
    not os.environ.get("INFERSIGHT_SCREENSHOTS"), reason="renders for the README (make screenshots)"
)
def test_tuner_screenshots(qtbot: object, window: MainWindow) -> None:
    """The tuner mid-run (a live closed loop of 8 users with long conversations, the per-step
    strip filling) and a finished sweep (2 batch sizes × 4 loads), at 1280×800."""
    out = Path(os.environ["INFERSIGHT_SCREENSHOTS"])
    tuner = window.tuner
    tuner.tabs.setCurrentIndex(0)
    tuner.users_spin.setValue(8)
    tuner.start_button.click()
    qtbot.waitUntil(lambda: len(tuner.step_rows()) >= 150, timeout=5 * LONG_WAIT_MS)  # type: ignore[attr-defined]
    tuner.sliders["max_tokens_per_step"].slider.setValue(256 // 16)
    qtbot.waitUntil(lambda: len(tuner.step_rows()) >= 200, timeout=5 * LONG_WAIT_MS)  # type: ignore[attr-defined]
    tuner.redraw()
    window.grab().save(str(out / "tuner-live.png"))
    tuner.stop_button.click()
    qtbot.waitUntil(tuner.run_button.isEnabled, timeout=LONG_WAIT_MS)  # type: ignore[attr-defined]
    tuner.tabs.setCurrentIndex(1)
    tuner.loads_edit.setText("1 2 4 8")
    tuner.batch_edit.setText("4 16")
    tuner.tokens_edit.setText("256")
    tuner.requests_spin.setValue(8)
    tuner.sweep_output_spin.setValue(32)
    tuner.conversations_spin.setValue(0.1)
    tuner.run_button.click()
    qtbot.waitUntil(lambda: len(tuner.sweep_points()) == 8, timeout=30 * LONG_WAIT_MS)  # type: ignore[attr-defined]
    tuner.target_rate.setValue(2.0)
    tuner.redraw()
    window.grab().save(str(out / "tuner-sweep.png"))
    for name in ("tuner-live.png", "tuner-sweep.png"):
        assert (out / name).stat().st_size > 10_000
