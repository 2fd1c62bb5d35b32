"""The batching tuner's view on plain, hand-made data (no engine, no model): sliders and what
they emit, the sweep form, the best setting for an SLO, the Pareto front, the per-step strip,
capacity and the exports."""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import numpy as np
import pytest
from pytestqt.qtbot import QtBot

from engine.bench.load_spec import SLO, LoadResult, LoadSpec, PromptMix
from engine.bench.sweep_analysis import (
    Setting,
    SweepPoint,
    SweepProgress,
    best_for_slo,
    capacity,
    grid,
    knee,
    pareto_front,
    series,
)
from engine.core.metrics import MemoryByKind, MetricsSnapshot, StepRecord
from widgets.tuner import TunerView
from widgets.tuner_live import summarise_steps

pytestmark = pytest.mark.usefixtures("gui_gc")

NAN = math.nan


def make_view(qtbot: QtBot) -> TunerView:
    view = TunerView()
    qtbot.addWidget(view)
    view.timer.stop()  # the tests redraw when they choose
    return view


def stats(median: float, p95: float) -> dict[str, float]:
    return {"mean": median, "median": median, "p95": p95, "p99": p95 * 1.1}


def point(
    limits: dict[str, float],
    users: int,
    *,
    tput: float,
    ttft95: float,
    tpot95: float,
    completed: int = 32,
    duration: float = 10.0,
) -> SweepPoint:
    setting = Setting(limits, LoadSpec(mode="closed", users=users, requests=32))
    result = LoadResult(
        setting=setting.as_dict(), load=setting.load.describe(), completed=completed, failed=0,
        duration=duration, total_input_tokens=3200, total_output_tokens=int(tput * duration),
        request_throughput=completed / duration, output_throughput=tput,
        total_token_throughput=tput + 320, ttft_ms=stats(ttft95 / 2, ttft95),
        tpot_ms=stats(tpot95 / 2, tpot95), itl_ms=stats(NAN, NAN), e2el_ms=stats(NAN, NAN),
        queue_ms=stats(NAN, NAN), preemptions=1, mean_batch_size=float(users),
        mean_tokens_per_request=200.0, request_goodput=1.5, slo_attainment=0.5,
    )  # fmt: skip
    return SweepPoint(setting, result)


#: one setting per batch size at 8 users; b64 is dominated by b32 (less throughput, slower)
FIVE = (
    point({"max_batch_size": 4}, 8, tput=200, ttft95=300, tpot95=40),
    point({"max_batch_size": 8}, 8, tput=350, ttft95=600, tpot95=70),
    point({"max_batch_size": 16}, 8, tput=500, ttft95=1500, tpot95=120),
    point({"max_batch_size": 32}, 8, tput=600, ttft95=2500, tpot95=200),
    point({"max_batch_size": 64}, 8, tput=550, ttft95=3000, tpot95=250),
)


def progress(points: tuple[SweepPoint, ...], total: int | None = None) -> SweepProgress:
    total = len(points) if total is None else total
    return SweepProgress(len(points), total, "done", 0, 0, points)


def step(
    end: float, decode: int, prefill: int, budget: int, ms: float, preempted: int = 0
) -> StepRecord:
    return StepRecord(
        end=end, duration_s=ms / 1e3, batch_size=decode + (prefill > 0), prompt_tokens=prefill,
        generated_tokens=decode, kv_used_blocks=3, decode_tokens=decode, prefill_tokens=prefill,
        token_budget=budget, preempted=preempted, waiting=1,
    )  # fmt: skip


def snapshot(
    t: float,
    steps: tuple[StepRecord, ...] = (),
    limits: dict[str, float] | None = None,
    latency: dict[str, dict[str, float]] | None = None,
) -> MetricsSnapshot:
    return MetricsSnapshot(
        time=t, window_s=30.0, num_requests_running=4, num_requests_waiting=2,
        kv_cache_usage_perc=0.25, kv_blocks_used=25, kv_blocks_total=100, kv_tokens_stored=400,
        kv_waste_slots=0, prompt_throughput_tps=100.0, generation_throughput_tps=50.0 + t,
        mean_batch_size=4.0, mean_step_time_s=0.05, steps=len(steps),
        latency_percentiles=latency or {},
        memory=MemoryByKind(weights_bytes=1, kv_pool_bytes=1, workspace_bytes=None),
        limits=limits or {}, recent_steps=steps, total_preemptions=int(t),
    )  # fmt: skip


# -- sliders ------------------------------------------------------------------------------------
def test_sliders_emit_only_the_key_moved_and_syncing_emits_nothing(qtbot: QtBot) -> None:
    view = make_view(qtbot)
    emitted: list[dict[str, float]] = []
    view.limits_changed.connect(emitted.append)
    limits = {"max_batch_size": 16, "max_tokens_per_step": 512, "max_wait_ms": 5.0}
    view.set_engine(limits, kv_blocks_total=400, block_size=16)
    assert emitted == []
    assert view.sliders["max_batch_size"].value() == 16
    assert view.sliders["max_tokens_per_step"].value() == 512
    assert view.sliders["max_wait_ms"].value() == 5
    assert view.sliders["kv_blocks"].value() == 400
    assert view.sliders["kv_blocks"].slider.maximum() == 400
    assert "6,400 tokens" in view.sliders["kv_blocks"].label.text()

    view.add_snapshot(snapshot(1.0, limits={**limits, "max_batch_size": 24, "kv_blocks": 200}))
    assert emitted == []
    assert view.sliders["max_batch_size"].value() == 24
    assert view.sliders["kv_blocks"].value() == 200

    view.sliders["max_batch_size"].slider.setValue(32)
    assert emitted == [{"max_batch_size": 32}]
    assert isinstance(emitted[-1]["max_batch_size"], int)
    view.sliders["max_tokens_per_step"].slider.setValue(8)  # positions are 16 tokens apart
    assert emitted[-1] == {"max_tokens_per_step": 128}
    view.sliders["max_wait_ms"].slider.setValue(20)
    assert emitted[-1] == {"max_wait_ms": 20.0} and isinstance(emitted[-1]["max_wait_ms"], float)
    view.sliders["kv_blocks"].slider.setValue(100)
    assert emitted[-1] == {"kv_blocks": 100}
    assert "1,600 tokens" in view.sliders["kv_blocks"].label.text()
    assert len(emitted) == 4


def test_start_emits_a_load_that_runs_until_stopped(qtbot: QtBot) -> None:
    view = make_view(qtbot)
    specs: list[LoadSpec] = []
    stops: list[bool] = []
    view.start_load.connect(specs.append)
    view.stop_requested.connect(lambda: stops.append(True))
    view.mode_combo.setCurrentText("poisson")
    view.rate_spin.setValue(3.5)
    view.output_spin.setValue(64)
    view.start_button.click()
    assert len(specs) == 1
    spec = specs[0]
    assert (spec.mode, spec.rate, spec.requests, spec.duration_s) == ("poisson", 3.5, None, None)
    assert spec.mix.output_median == 64
    view.set_status(True, None, None, "running")
    assert not view.start_button.isEnabled() and view.stop_button.isEnabled()
    view.stop_button.click()
    assert stops == [True]
    view.set_status(False, None, None)
    assert view.start_button.isEnabled() and not view.stop_button.isEnabled()


# -- the sweep form -------------------------------------------------------------------------------
def test_run_sweep_emits_the_grid_of_the_form(qtbot: QtBot) -> None:
    view = make_view(qtbot)
    got: list[tuple[tuple[Setting, ...], SLO | None]] = []
    view.start_sweep.connect(lambda settings, slo: got.append((settings, slo)))
    view.sweep_mode.setCurrentText("closed")
    view.loads_edit.setText("1 2, 4")
    view.batch_edit.setText("4 16")
    view.tokens_edit.setText("256")
    view.wait_edit.setText("0 2.5")
    view.requests_spin.setValue(12)
    view.sweep_output_spin.setValue(48)
    view.slo_edit.setText("ttft=1s,tpot=80ms")
    view.run_button.click()
    expected = grid(
        LoadSpec(mode="closed", requests=12, mix=PromptMix(output_median=48)),
        max_batch_size=[4, 16], max_tokens_per_step=[256], max_wait_ms=[0.0, 2.5],
        loads=[1, 2, 4],
    )  # fmt: skip
    assert len(got) == 1
    settings, slo = got[0]
    assert [s.label() for s in settings] == [s.label() for s in expected]
    assert [s.limits for s in settings] == [s.limits for s in expected]
    assert list(settings) == expected
    assert slo == SLO(1.0, 0.08)
    assert view.sweep_error.text() == ""

    view.sweep_mode.setCurrentText("constant")
    view.loads_edit.setText("0.5 2")
    view.slo_edit.setText("")
    view.run_button.click()
    settings, slo = got[1]
    assert [s.load.rate for s in settings][:2] == [0.5, 2.0] and slo is None
    assert all(s.load.mode == "constant" for s in settings)


@pytest.mark.parametrize(
    ("field", "text", "words"),
    [
        ("slo_edit", "ttft=fast", "cannot read the SLO"),
        ("loads_edit", "1 two 4", "'two'"),
        ("loads_edit", "1 2.5", "whole numbers"),
        ("loads_edit", "", "at least one load"),
        ("batch_edit", "0 4", "max batch sizes must be >= 1"),
    ],
)
def test_invalid_sweep_input_shows_an_error_and_emits_nothing(
    qtbot: QtBot, field: str, text: str, words: str
) -> None:
    view = make_view(qtbot)
    got: list[object] = []
    view.start_sweep.connect(lambda settings, slo: got.append(settings))
    getattr(view, field).setText(text)
    view.run_button.click()
    assert got == []
    assert words in view.sweep_error.text()


# -- reading a sweep ------------------------------------------------------------------------------
def test_best_follows_the_slo_and_apply_emits_its_limits(qtbot: QtBot) -> None:
    view = make_view(qtbot)
    applied: list[dict[str, float]] = []
    view.apply_limits.connect(applied.append)
    assert not view.apply_button.isEnabled() and view.best_label() is None
    view.set_status(False, None, progress(FIVE))
    assert view.sweep_points() == FIVE

    expected = best_for_slo(FIVE, SLO.parse("ttft=2s,tpot=150ms"))  # the default field
    assert expected is not None and expected.label == FIVE[2].label
    assert view.best_label() == expected.label
    assert expected.label in view.best_text.text()
    x, y = view.best_marks["ttft_ms"].getData()
    assert (list(x), list(y)) == ([500.0], [1500.0])
    view.apply_button.click()
    assert applied == [{"max_batch_size": 16}]

    view.slo_edit.setText("ttft=1s,tpot=100ms")  # no re-run: the best is read again
    assert view.best_label() == FIVE[1].label
    view.apply_button.click()
    assert applied[-1] == {"max_batch_size": 8}

    view.slo_edit.setText("ttft=100ms")
    assert view.best_label() is None and "No setting meets" in view.best_text.text()
    assert not view.apply_button.isEnabled()
    assert len(view.best_marks["ttft_ms"].getData()[0]) == 0

    view.slo_edit.setText("tpot=oops")
    assert view.best_label() is None and "SLO" in view.best_text.text()


def test_the_pareto_front_drawn_is_pareto_front(qtbot: QtBot) -> None:
    view = make_view(qtbot)
    view.set_status(True, None, progress(FIVE[:3], total=5))
    assert view.cancel_button.isEnabled() and not view.run_button.isEnabled()
    assert view.progress.maximum() == 5 and view.progress.value() == 3
    view.set_status(False, None, progress(FIVE))
    for key in ("ttft_ms", "tpot_ms"):
        front = pareto_front(FIVE, key)
        assert FIVE[4] not in front and len(front) == 4
        x, y = view.front_curve[key].getData()
        assert list(x) == [p.result.output_throughput for p in front]
        assert list(y) == [getattr(p.result, key)["p95"] for p in front]
        assert len(view.sweep_scatter[key].data) == 5
        labels = [item.toPlainText() for item in view._labels[key]]
        assert sorted(labels) == sorted(p.label for p in FIVE)


# -- capacity -------------------------------------------------------------------------------------
def knee_series() -> tuple[SweepPoint, ...]:
    """Four loads of one setting; TTFT grows slowly, then sharply: the knee is at 4 users."""
    rows = ((1, 100, 100), (2, 190, 110), (4, 350, 130), (8, 380, 900))
    return tuple(
        point({"max_batch_size": 16}, users, tput=tput, ttft95=ttft, tpot95=50,
              completed=8 * users)
        for users, tput, ttft in rows
    )  # fmt: skip


def test_capacity_from_a_knee_and_the_sentence_without_one(qtbot: QtBot) -> None:
    view = make_view(qtbot)
    view.set_status(False, None, progress(FIVE))  # one load per setting: no knee
    assert "at least 3 loads" in view.capacity_text.text()
    assert len(view.knee_marks["ttft_ms"].getData()[0]) == 0

    points = knee_series()
    k = knee(next(iter(series(points).values())))
    assert k is not None and k.load == 4
    view.target_rate.setValue(10.0)
    view.peak_factor.setValue(2.0)
    view.headroom.setValue(1.25)
    view.set_status(False, None, progress(points))
    expected = capacity(k, 10.0, peak_factor=2.0, headroom=1.25).describe()
    assert expected in view.capacity_text.text()
    x, y = view.knee_marks["ttft_ms"].getData()
    assert (list(x), list(y)) == ([350.0], [130.0])
    view.target_rate.setValue(20.0)  # the text follows the fields
    assert capacity(k, 20.0, peak_factor=2.0, headroom=1.25).describe() in (
        view.capacity_text.text()
    )


def test_the_capacity_exports_a_ray_serve_config_that_serve_ray_takes(qtbot, tmp_path) -> None:
    """The button writes as many engine replicas as the capacity needs, each taking at most
    the knee's 4 users' requests; `serve --ray --config` plans exactly that. Before a model
    is known (or without a knee) there is nothing to export."""
    import json

    from app.cli.main import build_parser
    from app.cli.serve_ray import plan

    view = make_view(qtbot)
    panel = view.capacity
    view.set_status(False, None, progress(knee_series()))
    assert not panel.export_button.isEnabled()  # no model yet
    panel.set_model("default", "int8")
    view.target_rate.setValue(10.0)
    k = knee(next(iter(series(knee_series()).values())))
    assert k is not None and panel.export_button.isEnabled()
    machines = capacity(k, 10.0, peak_factor=view.peak_factor.value(),
                        headroom=view.headroom.value()).machines  # fmt: skip
    written = panel.export_config(str(tmp_path / "serve.json"))
    assert written is not None
    app = json.loads(written.read_text())["applications"][0]
    assert app["deployments"] == [
        {"name": "engine", "num_replicas": machines, "max_ongoing_requests": 4}
    ]
    args = build_parser().parse_args(["serve", "--ray", "--config", str(written)])
    todo = plan(args)
    assert todo["engine"]["num_replicas"] == machines > 1
    assert todo["options"]["precision"] == "int8" and todo["options"]["max_batch_size"] == 16


# -- the per-step strip ---------------------------------------------------------------------------
def test_step_strip_counts_each_step_once_with_its_unused_budget(qtbot: QtBot) -> None:
    view = make_view(qtbot)
    a = step(1.00, decode=4, prefill=0, budget=64, ms=40)
    b = step(1.05, decode=4, prefill=60, budget=64, ms=90, preempted=1)
    c = step(1.10, decode=6, prefill=20, budget=64, ms=60)
    d = step(1.15, decode=70, prefill=0, budget=64, ms=50)  # over budget: nothing unused
    view.add_snapshot(snapshot(1.0, (a, b)))
    view.add_snapshot(snapshot(1.2, (a, b, c)))  # a and b again: not drawn twice
    view.add_snapshot(snapshot(1.4, (b, c, d)))
    view.redraw()
    steps = (a, b, c, d)
    rows = view.step_rows()
    assert len(rows) == 4
    expected_unused = [max(0, s.token_budget - s.decode_tokens - s.prefill_tokens) for s in steps]
    assert expected_unused == [60, 0, 38, 0]
    assert list(rows[:, 2]) == expected_unused
    assert list(view.unused_bars.opts["height"]) == expected_unused
    assert list(view.decode_bars.opts["height"]) == [4, 4, 6, 70]
    assert list(view.prefill_bars.opts["height"]) == [0, 60, 20, 0]
    assert list(view.prefill_bars.opts["y0"]) == [4, 4, 6, 70]  # stacked on decode
    assert list(view.unused_bars.opts["y0"]) == [4, 64, 26, 70]
    assert np.allclose(view.duration_bars.opts["height"], [40, 90, 60, 50])
    x, y = view.preempt_marks.getData()
    assert list(x) == [1.0] and np.allclose(y, [90.0])
    assert view.step_summary.text() == (
        "last 4 steps: prefill in 50%, mean step 75 ms with prefill vs 45 ms without, 1 preemption"
    )


def test_step_strip_keeps_a_bounded_history(qtbot: QtBot) -> None:
    view = make_view(qtbot)
    for i in range(6):
        batch = tuple(step(i + j / 100, 2, 0, 32, 10) for j in range(50))
        view.add_snapshot(snapshot(float(i), batch))
    view.redraw()
    assert len(view.step_rows()) == 200
    assert len(view.decode_bars.opts["height"]) == 200
    assert "last 50 steps" in view.step_summary.text()
    assert summarise_steps(view.step_rows()[:0]) == "no steps yet"


def test_live_plots_take_latency_in_ms_and_skip_missing_percentiles(qtbot: QtBot) -> None:
    view = make_view(qtbot)
    view.add_snapshot(snapshot(100.0))
    latency = {
        "time_to_first_token_seconds": {"p50": 0.2, "p95": 0.5},
        "time_per_output_token_seconds": {"p50": 0.04, "p95": 0.06},
    }
    view.add_snapshot(snapshot(101.0, latency=latency))
    view.redraw()
    x, y = view.tps_curve.getData()
    assert list(x) == [0.0, 1.0] and list(y) == [150.0, 151.0]
    ttft95 = view.latency_curves[3].getData()[1]
    assert math.isnan(ttft95[0]) and ttft95[1] == pytest.approx(500.0)
    assert list(view.kv_curve.getData()[1]) == [25.0, 25.0]
    assert list(view.preempt_curve.getData()[1]) == [100.0, 101.0]


# -- export ---------------------------------------------------------------------------------------
def test_export_sweep_csv_and_png(qtbot: QtBot, tmp_path: Path) -> None:
    view = make_view(qtbot)
    view.resize(1000, 700)
    view.show()
    view.tabs.setCurrentIndex(1)
    view.set_status(False, None, progress(FIVE))
    view.export_sweep_csv(tmp_path / "sweep.csv")
    with open(tmp_path / "sweep.csv", encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["label"] for r in rows] == [p.label for p in FIVE]
    assert [r["max_batch_size"] for r in rows] == ["4", "8", "16", "32", "64"]
    assert rows[0]["kv_blocks"] == "" and rows[0]["load"] == "8 users"
    assert float(rows[2]["output_throughput"]) == 500 and float(rows[2]["p95_ttft_ms"]) == 1500
    assert rows[0]["completed"] == "32" and rows[0]["preemptions"] == "1"
    png = tmp_path / "sweep.png"
    view.export_sweep_png(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000


def test_a_target_that_names_no_server_is_refused_not_taken_for_the_engine(qtbot: QtBot) -> None:
    view = make_view(qtbot)
    loads: list[object] = []
    sweeps: list[object] = []
    view.start_load.connect(loads.append)
    view.start_sweep.connect(lambda *a: sweeps.append(a))
    view.target_edit.setText("localhost:8000")  # no scheme: not a URL
    view.start_button.click()
    view.run_button.click()
    assert loads == [] and sweeps == []
    assert "is no server's URL" in view.status_label.text()
    assert "is no server's URL" in view.sweep_error.text()
    view.target_edit.setText("")  # empty: this engine, as before
    view.start_button.click()
    assert len(loads) == 1
