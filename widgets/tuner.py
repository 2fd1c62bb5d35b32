"""The batching tuner tab: move the scheduler's limits while load runs and watch what each
one does, or sweep a grid of limits and loads and read off the best setting for an SLO.

Four limits decide how the engine batches, and each trades one latency for another:

* **max batch size** caps the sequences decoded together in one step. More of them means
  more tokens per second overall (decode is memory-bound: one pass over the weights serves
  the whole batch), but each step takes longer, so every request's TPOT grows with it.
* **max tokens per step** is the step's token budget: one token per decoding sequence plus
  prompt tokens. A long prompt is prefilled in chunks of what the budget leaves over, and a
  step that carries a chunk takes longer *for everyone decoding in it*. A large budget gets
  prompts through quickly (low TTFT) at the price of TPOT spikes; a small one keeps TPOT
  steady and makes TTFT wait.
* **max wait** holds a lone request back for a few milliseconds, hoping for company to
  batch with: throughput at light load, paid for in TTFT.
* **the KV pool cap** bounds the tokens all running sequences may hold. When it fills, the
  scheduler preempts a sequence (its blocks go back and it is recomputed later), which costs
  the recomputation and that request's latency.

The *Live* page shows the figures as they move (throughput, TTFT and TPOT percentiles,
batch and queue, KV use and preemptions) and, below them, the *why*: one bar per step, split
into decode tokens, prefill chunk tokens and unused budget, above how long that step took.
Steps that carry a prefill chunk are the tall ones; that is where TPOT goes.

The *Sweep* page runs a grid of settings (:func:`engine.bench.tuning.grid`), each under a series
of loads, and plots output throughput against p95 TTFT and p95 TPOT: the Pareto front, each
series' knee (where latency starts to grow faster than the load) and the best setting that
meets the SLO. From a knee it sizes a deployment (machines for a target request rate).

Like the rest of ``widgets/``, the view takes plain data (:class:`MetricsSnapshot`,
:class:`LoadResult`, :class:`SweepProgress`) and emits what the user asked for; it runs no
engine and no thread.
"""

from __future__ import annotations

import csv
import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QComboBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QGridLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QProgressBar,
    QPushButton,
    QSizePolicy,
    QSlider,
    QSpinBox,
    QSplitter,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from engine.bench.loadgen import MODES, SLO, LoadResult, LoadSpec, Mode, PromptMix
from engine.bench.tuning import (
    LIMIT_NAMES,
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
from engine.core.metrics import MetricsSnapshot, StepRecord
from engine.errors import InvalidRequestError
from widgets.instruments import (
    COLOURS,
    HISTORY,
    REDRAW_MS,
    RingBuffer,
    SteadyRange,
    _plot,
    _visible_max,
    nice_ceiling,
)

STEP_HISTORY = 200  # steps the per-step strip keeps
SUMMARY_STEPS = 50  # steps the strip's live sentence reads
MAX_SETTINGS = 256  # a larger grid is refused (each setting runs its own load)
DEFAULT_SLO = "ttft=2s,tpot=150ms"
STEP_CAPTION = (
    "Each bar is one step: decode tokens, prefill chunk tokens, unused budget; "
    "below: how long it took (red ▼: the step preempted a sequence)"
)
LATENCIES = {"ttft_ms": "p95 TTFT (ms)", "tpot_ms": "p95 TPOT (ms)"}
RED = "#e0533d"
GREY = "#5f6670"
WHITE = "#d0d4da"
#: live columns: time, tok/s, TTFT p50/p95, TPOT p50/p95 (ms), batch, waiting, KV %, preemptions
_T, _TPS, _TTFT50, _TTFT95, _TPOT50, _TPOT95, _BATCH, _WAIT, _KV, _PRE = range(10)
#: per-step columns: decode, prefill, unused budget (tokens), duration (ms), preempted
_DEC, _PRE_TOK, _UNUSED, _DUR, _PREEMPT = range(5)


def parse_numbers(text: str, name: str, *, integer: bool, lo: float) -> list[float]:
    """``"1 2 4"`` or ``"1, 2, 4"`` → numbers, each ≥ ``lo`` (whole numbers if ``integer``);
    raises :class:`InvalidRequestError` with a message for the user."""
    values: list[float] = []
    for raw in filter(None, re.split(r"[\s,;]+", text.strip())):
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or (integer and value != int(value)):
            kind = "whole numbers" if integer else "numbers"
            raise InvalidRequestError(f"{name}: {raw!r} is not a number; give {kind} like 1 2 4")
        if value < lo:
            raise InvalidRequestError(f"{name} must be >= {lo:g}; {raw} is not")
        values.append(float(int(value)) if integer else value)
    return values


def _steady_top(top: float | None, y_max: float) -> float:
    """A value axis top that changes only when the data outgrows it or falls under a third."""
    if top is None or y_max > top or y_max < top / 3:
        return nice_ceiling(1.1 * y_max)
    return top


def _fmt(value: float | None, digits: str = ".0f") -> str:
    if value is None or math.isnan(value):
        return "–"
    return format(value, digits)


class LimitSlider(QWidget):
    """A horizontal slider over one scheduler limit, with its value shown beside it.

    Positions are ``value / step``; :meth:`set_value` moves it without emitting ``moved``
    (the engine's own value is shown as it is, even off the slider's grid or range)."""

    moved = Signal(str, float)  # key, value: the user moved it

    def __init__(
        self,
        key: str,
        lo: int,
        hi: int,
        *,
        step: int = 1,
        describe: Callable[[float], str] | None = None,
        tip: str = "",
    ) -> None:
        super().__init__()
        self.key, self.step = key, step
        self._describe = describe or (lambda v: f"{v:g}")
        self.slider = QSlider(Qt.Orientation.Horizontal)
        self.slider.setToolTip(tip)
        self.label = QLabel()
        self.label.setMinimumWidth(150)
        self.set_range(lo, hi)
        self.slider.valueChanged.connect(self._moved)
        row = QHBoxLayout(self)
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(self.slider, 1)
        row.addWidget(self.label)

    def set_range(self, lo: int, hi: int) -> None:
        self.slider.blockSignals(True)
        try:
            self.slider.setRange(lo // self.step, max(lo, hi) // self.step)
        finally:
            self.slider.blockSignals(False)

    def value(self) -> float:
        return float(self.slider.value() * self.step)

    def set_value(self, value: float) -> None:
        self.slider.blockSignals(True)
        try:
            self.slider.setValue(round(value / self.step))
        finally:
            self.slider.blockSignals(False)
        self.label.setText(self._describe(value))

    def refresh(self) -> None:
        """Describe the current position again (the description depends on other state)."""
        self.label.setText(self._describe(self.value()))

    def _moved(self, position: int) -> None:
        value = float(position * self.step)
        self.label.setText(self._describe(value))
        self.moved.emit(self.key, value)


class TunerView(QWidget):
    """The tuner tab (see the module docstring)."""

    limits_changed = Signal(dict)  # the key(s) a slider changed → value
    start_load = Signal(object)  # LoadSpec, runs until stopped
    start_sweep = Signal(object, object)  # tuple[Setting, ...], SLO | None
    stop_requested = Signal()
    apply_limits = Signal(dict)  # the best setting's limits

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._block_size = 16
        self._t0: float | None = None
        self._live = RingBuffer(HISTORY, 10)
        self._steps = RingBuffer(STEP_HISTORY, 5)
        self._last_step_end = -math.inf
        self._live_dirty = self._steps_dirty = False
        self._preempt_top: float | None = None
        self._token_top: float | None = None
        self._duration_top: float | None = None
        self._points: tuple[SweepPoint, ...] = ()
        self._best: SweepPoint | None = None
        self._labels: dict[str, list[Any]] = {key: [] for key in LATENCIES}

        self.tabs = QTabWidget()
        self.tabs.addTab(self._live_page(), "Live")
        self.tabs.addTab(self._sweep_page(), "Sweep")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(2, 2, 2, 2)
        layout.addWidget(self._limits_group())
        layout.addLayout(self._load_row())
        layout.addWidget(self.tabs, 1)

        self.timer = QTimer(self, interval=REDRAW_MS)
        self.timer.timeout.connect(self.redraw)
        self.timer.start()
        self.set_status(False, None, None)

    # -- building ----------------------------------------------------------------------------
    def _limits_group(self) -> QGroupBox:
        box = QGroupBox("Scheduler limits (applied as you move them)")
        grid_layout = QGridLayout(box)
        self.sliders: dict[str, LimitSlider] = {
            "max_batch_size": LimitSlider(
                "max_batch_size", 1, 64, describe=lambda v: f"{v:g} sequences",
                tip="Sequences decoded together per step. More: more tokens/s overall, and "
                "each step (so each request's TPOT) takes longer",
            ),
            "max_tokens_per_step": LimitSlider(
                "max_tokens_per_step", 16, 2048, step=16, describe=lambda v: f"{v:g} tokens",
                tip="The step's token budget: decode tokens plus prompt chunks. Larger: prompts "
                "get through faster (TTFT), and a step carrying a chunk stalls everyone's TPOT",
            ),
            "max_wait_ms": LimitSlider(
                "max_wait_ms", 0, 500, describe=lambda v: f"{v:g} ms",
                tip="How long a lone request is held hoping for company to batch with",
            ),
            "kv_blocks": LimitSlider(
                "kv_blocks", 1, 1, describe=self._describe_blocks,
                tip="The KV pool's usable blocks. When they run out, a running sequence is "
                "preempted (recomputed later)",
            ),
        }  # fmt: skip
        titles = ("Max batch size", "Max tokens / step", "Max wait", "KV pool")
        for i, (title, slider) in enumerate(zip(titles, self.sliders.values(), strict=True)):
            grid_layout.addWidget(QLabel(title), i // 2, 2 * (i % 2))
            grid_layout.addWidget(slider, i // 2, 2 * (i % 2) + 1)
            slider.moved.connect(self._slider_moved)
        return box

    def _describe_blocks(self, blocks: float) -> str:
        return f"{blocks:g} blocks = {blocks * self._block_size:,.0f} tokens"

    def _load_row(self) -> QHBoxLayout:
        self.mode_combo = QComboBox()
        self.mode_combo.addItems(list(MODES))
        self.mode_combo.setToolTip(
            "closed: a fixed number of users, each sending again once answered. constant / "
            "poisson: requests arriving at a rate whatever the engine does (evenly, or random)"
        )
        self.users_spin = QSpinBox()
        self.users_spin.setRange(1, 256)
        self.users_spin.setValue(8)
        self.users_spin.setSuffix(" users")
        self.rate_spin = QDoubleSpinBox()
        self.rate_spin.setRange(0.05, 1000.0)
        self.rate_spin.setDecimals(2)
        self.rate_spin.setValue(2.0)
        self.rate_spin.setSuffix(" req/s")
        self.output_spin = _output_spin()
        self.start_button = QPushButton("Start")
        self.start_button.setToolTip("Run this load until Stop; move the limits as it runs")
        self.start_button.clicked.connect(self._start_clicked)
        self.stop_button = QPushButton("Stop")
        self.stop_button.clicked.connect(self.stop_requested)
        self.mode_combo.currentTextChanged.connect(self._mode_changed)
        self._mode_changed(self.mode_combo.currentText())
        self.load_figures = QLabel("–")
        self.status_label = QLabel("")
        self.status_label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Fixed)
        row = QHBoxLayout()
        row.addWidget(QLabel("Live load"))
        for w in (self.mode_combo, self.users_spin, self.rate_spin):
            row.addWidget(w)
        row.addWidget(QLabel("output median"))
        row.addWidget(self.output_spin)
        row.addWidget(self.start_button)
        row.addWidget(self.stop_button)
        row.addWidget(self.load_figures)
        row.addWidget(self.status_label, 1)
        return row

    def _live_page(self) -> QWidget:
        self.tps_plot = _plot("Output throughput", "tokens/s")
        self.tps_curve = self.tps_plot.plot(name="generated", pen=pg.mkPen(COLOURS[2], width=2))
        self.latency_plot = _plot("Latency", "ms")
        self.latency_curves = {
            column: self.latency_plot.plot(name=name, pen=pg.mkPen(colour, width=w, style=style))
            for column, name, colour, w, style in (
                (_TTFT50, "TTFT p50", COLOURS[0], 1, Qt.PenStyle.SolidLine),
                (_TTFT95, "TTFT p95", COLOURS[0], 2, Qt.PenStyle.DashLine),
                (_TPOT50, "TPOT p50", COLOURS[1], 1, Qt.PenStyle.SolidLine),
                (_TPOT95, "TPOT p95", COLOURS[1], 2, Qt.PenStyle.DashLine),
            )
        }
        self.batch_plot = _plot("Batch and queue", "requests")
        self.batch_curve = self.batch_plot.plot(name="batch", pen=pg.mkPen(COLOURS[4], width=2))
        self.queue_curve = self.batch_plot.plot(name="waiting", pen=pg.mkPen(COLOURS[3], width=2))
        self.kv_plot = _plot("KV cache and preemptions", "% of blocks")
        self.kv_curve = self.kv_plot.plot(name="KV usage", pen=pg.mkPen(COLOURS[1], width=2))
        # preemptions (a count) on their own axis at the right, in a second view box
        item = self.kv_plot.getPlotItem()
        self.preempt_view = pg.ViewBox()
        self.preempt_view.setMouseEnabled(x=False, y=False)
        item.showAxis("right")
        item.scene().addItem(self.preempt_view)
        item.getAxis("right").linkToView(self.preempt_view)
        item.getAxis("right").setLabel("preemptions (total)")
        item.getAxis("right").enableAutoSIPrefix(False)
        self.preempt_view.setXLink(item)
        self.preempt_curve = pg.PlotDataItem(pen=pg.mkPen(RED, width=2))
        self.preempt_view.addItem(self.preempt_curve)
        self.preempt_view.disableAutoRange()
        self.preempt_view.setYRange(0, 1, padding=0)
        item.legend.addItem(self.preempt_curve, "preemptions")
        item.vb.sigResized.connect(self._align_preempt_view)
        self._ranges = {
            "tps": SteadyRange(self.tps_plot),
            "latency": SteadyRange(self.latency_plot),
            "batch": SteadyRange(self.batch_plot),
            "kv": SteadyRange(self.kv_plot, fixed_top=100.0),
        }
        plots = QWidget()
        grid_layout = QGridLayout(plots)
        grid_layout.setContentsMargins(0, 0, 0, 0)
        for i, plot in enumerate((self.tps_plot, self.latency_plot, self.batch_plot, self.kv_plot)):
            grid_layout.addWidget(plot, i // 2, i % 2)

        # the per-step strip
        self.token_plot = _plot("Each step's token budget", "tokens", "step (oldest → newest)")
        self.decode_bars = pg.BarGraphItem(x=[], height=[], width=0.8, brush=COLOURS[2], pen=None)
        self.prefill_bars = pg.BarGraphItem(x=[], height=[], width=0.8, brush=COLOURS[1], pen=None)
        self.unused_bars = pg.BarGraphItem(x=[], height=[], width=0.8, brush=GREY, pen=None)
        legend = self.token_plot.getPlotItem().legend
        legend.setBrush(pg.mkBrush(30, 33, 39, 210))  # readable over the bars
        for bars, name in (
            (self.decode_bars, "decode"),
            (self.prefill_bars, "prefill chunk"),
            (self.unused_bars, "unused budget"),
        ):
            self.token_plot.addItem(bars)
            legend.addItem(bars, name)
        self.duration_plot = _plot("", "step ms", "step (oldest → newest)")
        self.duration_bars = pg.BarGraphItem(x=[], height=[], width=0.8, brush=COLOURS[0], pen=None)
        self.duration_plot.addItem(self.duration_bars)
        self.preempt_marks = pg.ScatterPlotItem(
            name="preempted", symbol="t", size=9, brush=pg.mkBrush(RED), pen=None
        )
        self.duration_plot.addItem(self.preempt_marks)
        for plot in (self.token_plot, self.duration_plot):
            plot.getPlotItem().disableAutoRange()
            plot.setXRange(-0.5, STEP_HISTORY - 0.5, padding=0)
            plot.setYRange(0, 1, padding=0)
        self.duration_plot.setXLink(self.token_plot)
        caption = QLabel(STEP_CAPTION)
        caption.setWordWrap(True)
        self.step_summary = QLabel("no steps yet")
        strip = QWidget()
        col = QVBoxLayout(strip)
        col.setContentsMargins(0, 0, 0, 0)
        col.addWidget(caption)
        col.addWidget(self.token_plot, 3)
        col.addWidget(self.duration_plot, 2)
        col.addWidget(self.step_summary)

        split = QSplitter(Qt.Orientation.Vertical)
        split.addWidget(plots)
        split.addWidget(strip)
        split.setStretchFactor(0, 1)
        split.setStretchFactor(1, 1)
        return split

    def _sweep_page(self) -> QWidget:
        form_box = QGroupBox("Sweep")
        form = QFormLayout(form_box)
        self.sweep_mode = QComboBox()
        self.sweep_mode.addItems(list(MODES))
        self.sweep_mode.currentTextChanged.connect(self._sweep_mode_changed)
        self.loads_label = QLabel("Users")
        self.loads_edit = QLineEdit("1 2 4 8")
        self.loads_edit.setToolTip(
            "The loads each setting runs under, lowest first: users (closed loop) or "
            "requests/s (constant, poisson). Three or more show where latency turns up (knee)"
        )
        self.batch_edit = QLineEdit("8 32")
        self.batch_edit.setToolTip("Max batch sizes to try (empty: the engine's own)")
        self.tokens_edit = QLineEdit("512")
        self.tokens_edit.setToolTip("Max tokens per step to try (empty: the engine's own)")
        self.wait_edit = QLineEdit("0")
        self.wait_edit.setToolTip("Max wait (ms) to try (empty: the engine's own)")
        self.requests_spin = QSpinBox()
        self.requests_spin.setRange(1, 100_000)
        self.requests_spin.setValue(32)
        self.requests_spin.setToolTip("Requests sent under each setting and load")
        self.sweep_output_spin = _output_spin()
        self.conversations_spin = QDoubleSpinBox()
        self.conversations_spin.setRange(0.0, 0.75)
        self.conversations_spin.setSingleStep(0.05)
        self.conversations_spin.setValue(PromptMix().conversations)
        self.conversations_spin.setToolTip(
            "Share of requests that continue a long conversation (500–1200 prompt tokens): "
            "the prefills that stretch everyone's decode steps"
        )
        self.slo_edit = QLineEdit(DEFAULT_SLO)
        self.slo_edit.setToolTip(
            "p95 TTFT and TPOT a setting must meet, e.g. ttft=2s,tpot=150ms (empty: none); "
            "the best setting is the highest throughput that meets it"
        )
        self.slo_edit.textChanged.connect(self._evaluate_best)
        form.addRow("Mode", self.sweep_mode)
        form.addRow(self.loads_label, self.loads_edit)
        form.addRow("Max batch sizes", self.batch_edit)
        form.addRow("Max tokens / step", self.tokens_edit)
        form.addRow("Max wait (ms)", self.wait_edit)
        form.addRow("Requests per setting", self.requests_spin)
        form.addRow("Output median", self.sweep_output_spin)
        form.addRow("Long conversations", self.conversations_spin)
        form.addRow("SLO", self.slo_edit)
        self.run_button = QPushButton("Run sweep")
        self.run_button.clicked.connect(self._run_clicked)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.clicked.connect(self.stop_requested)
        buttons = QHBoxLayout()
        buttons.addWidget(self.run_button)
        buttons.addWidget(self.cancel_button)
        form.addRow(buttons)
        self.sweep_error = QLabel("")
        self.sweep_error.setWordWrap(True)
        self.sweep_error.setStyleSheet(f"color: {RED}")
        form.addRow(self.sweep_error)

        cap_box = QGroupBox("Capacity")
        cap_form = QFormLayout(cap_box)
        self.target_rate = QDoubleSpinBox()
        self.target_rate.setRange(0.01, 1e6)
        self.target_rate.setValue(1.0)
        self.target_rate.setSuffix(" req/s")
        self.target_rate.setToolTip("The average request rate to serve")
        self.peak_factor = QDoubleSpinBox()
        self.peak_factor.setRange(1.0, 100.0)
        self.peak_factor.setValue(3.0)
        self.peak_factor.setToolTip("How far the busiest minute rises above the average")
        self.headroom = QDoubleSpinBox()
        self.headroom.setRange(1.0, 10.0)
        self.headroom.setSingleStep(0.1)
        self.headroom.setValue(1.5)
        self.headroom.setToolTip("Spare capacity on top of the peak (failures, deploys)")
        for spin in (self.target_rate, self.peak_factor, self.headroom):
            spin.valueChanged.connect(self._update_capacity)
        self.capacity_text = QLabel("")
        self.capacity_text.setWordWrap(True)
        cap_form.addRow("Target rate", self.target_rate)
        cap_form.addRow("Peak factor", self.peak_factor)
        cap_form.addRow("Headroom", self.headroom)
        cap_form.addRow(self.capacity_text)

        left = QWidget()
        left_col = QVBoxLayout(left)
        left_col.setContentsMargins(0, 0, 0, 0)
        left_col.addWidget(form_box)
        left_col.addWidget(cap_box)
        left_col.addStretch(1)

        self.progress = QProgressBar()
        self.progress.setRange(0, 1)
        self.progress.setValue(0)
        self.progress.setFormat("no sweep yet")
        self.sweep_plots = QWidget()
        plots_row = QHBoxLayout(self.sweep_plots)
        plots_row.setContentsMargins(0, 0, 0, 0)
        self.sweep_plot: dict[str, pg.PlotWidget] = {}
        self.sweep_scatter: dict[str, pg.ScatterPlotItem] = {}
        self.front_curve: dict[str, pg.PlotDataItem] = {}
        self.knee_marks: dict[str, pg.ScatterPlotItem] = {}
        self.best_marks: dict[str, pg.ScatterPlotItem] = {}
        for key, axis in LATENCIES.items():
            plot = _plot(f"Throughput against {axis[:-5]}", axis, "output tokens/s")
            plot.getViewBox().setDefaultPadding(0.1)  # room for the points' labels
            self.sweep_scatter[key] = pg.ScatterPlotItem(name="settings", size=9, pen=None)
            self.front_curve[key] = pg.PlotDataItem(
                name="Pareto front", pen=pg.mkPen(WHITE, width=1, style=Qt.PenStyle.DashLine)
            )
            self.knee_marks[key] = pg.ScatterPlotItem(
                name="knee", symbol="d", size=15, brush=pg.mkBrush("#f1d04e"), pen=None
            )
            self.best_marks[key] = pg.ScatterPlotItem(
                name="best for SLO", symbol="o", size=24, brush=None,
                pen=pg.mkPen(COLOURS[2], width=3),
            )  # fmt: skip
            for it in (self.front_curve, self.sweep_scatter, self.knee_marks, self.best_marks):
                plot.addItem(it[key])
            self.sweep_plot[key] = plot
            plots_row.addWidget(plot)
        self.best_text = QLabel("no sweep yet")
        self.best_text.setWordWrap(True)
        self.apply_button = QPushButton("Apply best")
        self.apply_button.setToolTip("Set the engine's limits to the best setting's")
        self.apply_button.clicked.connect(self._apply_clicked)
        best_row = QHBoxLayout()
        best_row.addWidget(self.best_text, 1)
        best_row.addWidget(self.apply_button)
        export_png = QPushButton("Export PNG…")
        export_png.setToolTip("Save the sweep's plots as an image")
        export_png.clicked.connect(self._ask_png)
        export_csv = QPushButton("Export CSV…")
        export_csv.setToolTip("Save every setting's figures as CSV")
        export_csv.clicked.connect(self._ask_csv)
        export_row = QHBoxLayout()
        export_row.addStretch(1)
        export_row.addWidget(export_png)
        export_row.addWidget(export_csv)
        right = QWidget()
        right_col = QVBoxLayout(right)
        right_col.setContentsMargins(0, 0, 0, 0)
        right_col.addWidget(self.progress)
        right_col.addWidget(self.sweep_plots, 1)
        right_col.addLayout(best_row)
        right_col.addLayout(export_row)

        split = QSplitter(Qt.Orientation.Horizontal)
        split.addWidget(left)
        split.addWidget(right)
        split.setStretchFactor(1, 1)
        self._evaluate_best()
        return split

    def _align_preempt_view(self) -> None:
        vb = self.kv_plot.getPlotItem().vb
        self.preempt_view.setGeometry(vb.sceneBoundingRect())
        self.preempt_view.linkedViewChanged(vb, self.preempt_view.XAxis)

    # -- engine state in -------------------------------------------------------------------
    def set_engine(self, limits: dict[str, float], kv_blocks_total: int, block_size: int) -> None:
        """A model loaded: the KV slider's range and every slider's position (no signal)."""
        self._block_size = max(1, block_size)
        self.sliders["kv_blocks"].set_range(1, max(1, kv_blocks_total))
        self._sync_sliders({"kv_blocks": kv_blocks_total, **limits})

    def _sync_sliders(self, limits: dict[str, float]) -> None:
        for key, value in limits.items():
            slider = self.sliders.get(key)
            if slider is not None and not slider.slider.isSliderDown():
                slider.set_value(float(value))

    def _slider_moved(self, key: str, value: float) -> None:
        self.limits_changed.emit({key: value if key == "max_wait_ms" else int(value)})

    def add_snapshot(self, snapshot: MetricsSnapshot) -> None:
        """Feed the live plots and the per-step strip, and show the limits in force."""
        if self._t0 is None:
            self._t0 = snapshot.time
        new = [s for s in snapshot.recent_steps if s.end > self._last_step_end]
        for step in new:
            self._add_step(step)
        if new:
            self._last_step_end = new[-1].end
            self._steps_dirty = True
            batch = sum(s.batch_size for s in new) / len(new)
        else:
            batch = float(snapshot.num_requests_running)
        lat = snapshot.latency_percentiles
        ttft = lat.get("time_to_first_token_seconds", {})
        tpot = lat.get("time_per_output_token_seconds", {})
        self._live.append([
            snapshot.time - self._t0, snapshot.generation_throughput_tps,
            1e3 * ttft.get("p50", math.nan), 1e3 * ttft.get("p95", math.nan),
            1e3 * tpot.get("p50", math.nan), 1e3 * tpot.get("p95", math.nan),
            batch, float(snapshot.num_requests_waiting), 100.0 * snapshot.kv_cache_usage_perc,
            float(snapshot.total_preemptions),
        ])  # fmt: skip
        self._live_dirty = True
        if snapshot.limits:
            self._sync_sliders(snapshot.limits)

    def _add_step(self, step: StepRecord) -> None:
        unused = max(0, step.token_budget - step.decode_tokens - step.prefill_tokens)
        self._steps.append([
            float(step.decode_tokens), float(step.prefill_tokens), float(unused),
            1e3 * step.duration_s, float(step.preempted),
        ])  # fmt: skip

    def step_rows(self) -> np.ndarray:
        """The strip's steps, oldest first: decode, prefill, unused budget, ms, preempted."""
        return self._steps.view().copy()

    # -- drawing ----------------------------------------------------------------------------
    def redraw(self) -> None:
        if self._live_dirty:
            self._live_dirty = False
            self._redraw_live()
        if self._steps_dirty:
            self._steps_dirty = False
            self._redraw_steps()

    def _redraw_live(self) -> None:
        v = self._live.view()
        if not len(v):
            return
        t = v[:, _T]
        t_last = float(t[-1])
        self.tps_curve.setData(t, v[:, _TPS])
        for column, curve in self.latency_curves.items():
            curve.setData(t, v[:, column], connect="finite")
        self.batch_curve.setData(t, v[:, _BATCH])
        self.queue_curve.setData(t, v[:, _WAIT])
        self.kv_curve.setData(t, v[:, _KV])
        self.preempt_curve.setData(t, v[:, _PRE])
        self._ranges["tps"].follow(t_last, _visible_max(v[:, [_T, _TPS]], t_last))
        latency = v[:, [_T, _TTFT50, _TTFT95, _TPOT50, _TPOT95]]
        self._ranges["latency"].follow(t_last, _visible_max(latency, t_last))
        self._ranges["batch"].follow(t_last, _visible_max(v[:, [_T, _BATCH, _WAIT]], t_last))
        self._ranges["kv"].follow(t_last, 100.0)
        top = _steady_top(self._preempt_top, max(1.0, float(v[-1, _PRE])))
        if top != self._preempt_top:
            self._preempt_top = top
            self.preempt_view.setYRange(0, top, padding=0)

    def _redraw_steps(self) -> None:
        s = self._steps.view()
        x = np.arange(len(s), dtype=float)
        decode, prefill, unused, ms = s[:, _DEC], s[:, _PRE_TOK], s[:, _UNUSED], s[:, _DUR]
        self.decode_bars.setOpts(x=x, y0=np.zeros(len(s)), height=decode, width=0.8)
        self.prefill_bars.setOpts(x=x, y0=decode, height=prefill, width=0.8)
        self.unused_bars.setOpts(x=x, y0=decode + prefill, height=unused, width=0.8)
        self.duration_bars.setOpts(x=x, height=ms, width=0.8)
        hit = s[:, _PREEMPT] > 0
        self.preempt_marks.setData(x[hit], ms[hit])
        total = float(np.max(decode + prefill + unused)) if len(s) else 0.0
        top = _steady_top(self._token_top, max(total, 1.0))
        if top != self._token_top:
            self._token_top = top
            self.token_plot.setYRange(0, top, padding=0)
        top = _steady_top(self._duration_top, max(float(np.max(ms)) if len(s) else 0.0, 1e-3))
        if top != self._duration_top:
            self._duration_top = top
            self.duration_plot.setYRange(0, top * 1.08, padding=0)  # room for the ▼ marks
        self.step_summary.setText(summarise_steps(s[-SUMMARY_STEPS:]))

    # -- status in --------------------------------------------------------------------------
    def set_status(
        self,
        running: bool,
        load: LoadResult | None,
        sweep: SweepProgress | None,
        message: str = "",
    ) -> None:
        """The tune's state: buttons, the sweep's progress, the live load's figures."""
        self.start_button.setEnabled(not running)
        self.run_button.setEnabled(not running)
        self.stop_button.setEnabled(running)
        self.cancel_button.setEnabled(running)
        sweeping = running and sweep is not None
        for slider in self.sliders.values():  # a sweep sets the limits itself
            slider.setEnabled(not sweeping)
        self.status_label.setText(message)
        if load is not None:
            self.load_figures.setText(
                f"{load.completed} done · {load.output_throughput:.1f} out tok/s · "
                f"p95 TTFT {_fmt(load.ttft_ms.get('p95'))} ms · "
                f"p95 TPOT {_fmt(load.tpot_ms.get('p95'))} ms · {load.preemptions} preempted"
            )
        if sweep is not None:
            self.progress.setRange(0, max(1, sweep.total))
            self.progress.setValue(min(sweep.index, sweep.total))
            text = f"{min(sweep.index + 1, sweep.total)}/{sweep.total}: {sweep.label}"
            if sweep.index < sweep.total:
                text += f" · {sweep.completed} requests done"
            else:
                text = f"{sweep.total}/{sweep.total} done"
            self.progress.setFormat(text.replace("%", "%%"))
            if sweep.points and sweep.points != self._points:
                self.show_points(sweep.points)

    # -- the sweep --------------------------------------------------------------------------
    def show_points(self, points: Sequence[SweepPoint]) -> None:
        """Draw a sweep's points (also what :meth:`set_status` does when they change)."""
        self._points = tuple(points)
        groups = series(self._points)
        colour_of = {
            id(p): COLOURS[i % len(COLOURS)] for i, pts in enumerate(groups.values()) for p in pts
        }
        knees = [k.point for k in (knee(pts) for pts in groups.values()) if k is not None]
        for key in LATENCIES:
            plot = self.sweep_plot[key]
            for item in self._labels[key]:
                plot.removeItem(item)
            self._labels[key] = []
            shown = [p for p in self._points if _plottable(p, key)]
            self.sweep_scatter[key].setData(
                [_xy(p, key)[0] for p in shown], [_xy(p, key)[1] for p in shown],
                brush=[pg.mkBrush(colour_of[id(p)]) for p in shown],
            )  # fmt: skip
            front = pareto_front(self._points, key)
            self.front_curve[key].setData(
                [_xy(p, key)[0] for p in front], [_xy(p, key)[1] for p in front]
            )
            marked = [p for p in knees if _plottable(p, key)]
            self.knee_marks[key].setData(
                [_xy(p, key)[0] for p in marked], [_xy(p, key)[1] for p in marked]
            )
            for p in shown:
                text = pg.TextItem(p.label, color=WHITE, anchor=(0, 1))
                text.setPos(*_xy(p, key))
                plot.addItem(text)
                self._labels[key].append(text)
        self._evaluate_best()

    def sweep_points(self) -> tuple[SweepPoint, ...]:
        return self._points

    def best_label(self) -> str | None:
        return self._best.label if self._best is not None else None

    def _slo(self) -> SLO | None:
        """The SLO field's SLO (``None`` when empty); raises InvalidRequestError."""
        text = self.slo_edit.text().strip()
        return SLO.parse(text) if text else None

    def _evaluate_best(self) -> None:
        self._best = None
        try:
            slo = self._slo()
        except InvalidRequestError as exc:
            self.best_text.setText(f"SLO: {exc}")
            slo = None
        else:
            if self._points:
                self._best = best_for_slo(self._points, slo or SLO())
                self.best_text.setText(self._describe_best(slo))
            else:
                self.best_text.setText("no sweep yet: run one to find the best setting")
        for key in LATENCIES:
            best = self._best
            if best is not None and _plottable(best, key):
                x, y = _xy(best, key)
                self.best_marks[key].setData([x], [y])
            else:
                self.best_marks[key].setData([], [])
        self.apply_button.setEnabled(self._best is not None)
        self._update_capacity()

    def _describe_best(self, slo: SLO | None) -> str:
        wanted = f"the SLO {slo.describe()} at p95" if slo else "no SLO (highest throughput)"
        best = self._best
        if best is None:
            return (
                f"No setting meets {wanted}: relax the SLO, or try smaller batches, a smaller "
                "token budget or lighter loads"
            )
        r = best.result
        return (
            f"Best for {wanted}: {best.label}: {r.output_throughput:.1f} out tok/s, "
            f"p95 TTFT {_fmt(r.ttft_ms['p95'])} ms, p95 TPOT {_fmt(r.tpot_ms['p95'])} ms"
        )

    def _update_capacity(self) -> None:
        groups = series(self._points)
        order = list(groups.items())
        if self._best is not None:  # the recommended setting's own series first
            order.sort(key=lambda item: self._best not in item[1])
        for name, pts in order:
            k = knee(pts)
            if k is None:
                continue
            try:
                cap = capacity(
                    k, self.target_rate.value(), peak_factor=self.peak_factor.value(),
                    headroom=self.headroom.value(),
                )  # fmt: skip
            except InvalidRequestError as exc:
                self.capacity_text.setText(f"{name}: {exc}")
                return
            self.capacity_text.setText(
                f"{name}: knee at load {k.load:g} ({k.request_throughput:.2f} req/s, "
                f"{k.output_throughput:.0f} out tok/s). {cap.describe()}"
            )
            return
        self.capacity_text.setText(
            "No knee yet: sizing needs a knee, and a knee needs at least 3 loads of one "
            "setting, run up to where its latency grows faster than the load"
        )

    def _apply_clicked(self) -> None:
        if self._best is not None:
            self.apply_limits.emit(dict(self._best.setting.limits))

    # -- what the user asks for ---------------------------------------------------------------
    def _mode_changed(self, mode: str) -> None:
        closed = mode == "closed"
        self.users_spin.setVisible(closed)
        self.rate_spin.setVisible(not closed)

    def _sweep_mode_changed(self, mode: str) -> None:
        self.loads_label.setText("Users" if mode == "closed" else "Rates (req/s)")

    def live_spec(self) -> LoadSpec:
        """The live load's spec (runs until stopped; its share of long conversations is the
        sweep form's)."""
        mode: Mode = _mode(self.mode_combo.currentText())
        return LoadSpec(
            mode=mode, users=self.users_spin.value(), rate=self.rate_spin.value(),
            requests=None, duration_s=None,
            mix=PromptMix(
                output_median=self.output_spin.value(),
                conversations=self.conversations_spin.value(),
            ),
        )  # fmt: skip

    def _start_clicked(self) -> None:
        try:
            spec = self.live_spec()
        except InvalidRequestError as exc:
            self.status_label.setText(str(exc))
            return
        self.start_load.emit(spec)

    def sweep_settings(self) -> tuple[tuple[Setting, ...], SLO | None]:
        """The sweep form's settings and SLO; raises InvalidRequestError for bad input."""
        mode = _mode(self.sweep_mode.currentText())
        closed = mode == "closed"
        loads = parse_numbers(
            self.loads_edit.text(), "users" if closed else "rates", integer=closed,
            lo=1 if closed else 1e-9,
        )  # fmt: skip
        if not loads:
            raise InvalidRequestError("give at least one load, e.g. 1 2 4 8")
        batch = parse_numbers(self.batch_edit.text(), "max batch sizes", integer=True, lo=1)
        tokens = parse_numbers(self.tokens_edit.text(), "max tokens / step", integer=True, lo=1)
        wait = parse_numbers(self.wait_edit.text(), "max wait", integer=False, lo=0)
        slo = self._slo()
        base = LoadSpec(
            mode=mode, requests=self.requests_spin.value(),
            mix=PromptMix(
                output_median=self.sweep_output_spin.value(),
                conversations=self.conversations_spin.value(),
            ),
        )  # fmt: skip
        count = len(loads) * math.prod(max(1, len(v)) for v in (batch, tokens, wait))
        if count > MAX_SETTINGS:
            raise InvalidRequestError(
                f"that grid has {count} settings; give at most {MAX_SETTINGS} (fewer values)"
            )
        settings = grid(
            base, max_batch_size=[int(b) for b in batch],
            max_tokens_per_step=[int(t) for t in tokens], max_wait_ms=wait, loads=loads,
        )  # fmt: skip
        return tuple(settings), slo

    def _run_clicked(self) -> None:
        try:
            settings, slo = self.sweep_settings()
        except InvalidRequestError as exc:
            self.sweep_error.setText(str(exc))
            return
        self.sweep_error.setText("")
        self.start_sweep.emit(settings, slo)

    # -- export -----------------------------------------------------------------------------
    def export_sweep_csv(self, path: Path) -> None:
        """One row per point: its setting, load and vLLM-bench figures."""
        stats = ("median", "p95", "p99")
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow([
                "label", *LIMIT_NAMES, "load", "completed", "request_throughput",
                "output_throughput", *(f"{s}_ttft_ms" for s in stats),
                *(f"{s}_tpot_ms" for s in stats), "request_goodput", "slo_attainment",
                "preemptions",
            ])  # fmt: skip
            for p in self._points:
                r = p.result
                w.writerow([
                    p.label, *(_cell(p.setting.limits.get(k)) for k in LIMIT_NAMES),
                    p.setting.load.describe(), r.completed, _cell(r.request_throughput),
                    _cell(r.output_throughput), *(_cell(r.ttft_ms.get(s)) for s in stats),
                    *(_cell(r.tpot_ms.get(s)) for s in stats), _cell(r.request_goodput),
                    _cell(r.slo_attainment), r.preemptions,
                ])  # fmt: skip

    def export_sweep_png(self, path: Path) -> None:
        if self.sweep_plots.size().isEmpty():
            self.sweep_plots.resize(self.sweep_plots.sizeHint())
        if not self.sweep_plots.grab().save(str(path)):
            raise OSError(f"could not write {path}")

    def _ask_png(self) -> None:
        path, _ = QFileDialog.getSaveFileName(
            self, "Export sweep plots", "infersight-sweep.png", "PNG (*.png)"
        )
        if path:
            self.export_sweep_png(Path(path))

    def _ask_csv(self) -> None:
        path, _ = QFileDialog.getSaveFileName(
            self, "Export sweep", "infersight-sweep.csv", "CSV (*.csv)"
        )
        if path:
            self.export_sweep_csv(Path(path))


# -- helpers ------------------------------------------------------------------------------------
def summarise_steps(rows: np.ndarray) -> str:
    """``last 50 steps: prefill in 12%, mean step 85 ms with prefill vs 41 ms without,
    3 preemptions`` for rows of :meth:`TunerView.step_rows`."""
    if not len(rows):
        return "no steps yet"
    with_prefill = rows[:, _PRE_TOK] > 0
    ms = rows[:, _DUR]
    mean_with = float(ms[with_prefill].mean()) if with_prefill.any() else math.nan
    mean_without = float(ms[~with_prefill].mean()) if (~with_prefill).any() else math.nan
    preempted = int(rows[:, _PREEMPT].sum())
    return (
        f"last {len(rows)} steps: prefill in {with_prefill.mean():.0%}, mean step "
        f"{_fmt(mean_with)} ms with prefill vs {_fmt(mean_without)} ms without, "
        f"{preempted} preemption{'' if preempted == 1 else 's'}"
    )


def _output_spin() -> QSpinBox:
    spin = QSpinBox()
    defaults = PromptMix()
    spin.setRange(defaults.output_min, defaults.output_max)
    spin.setValue(defaults.output_median)
    spin.setSuffix(" tokens")
    spin.setToolTip("The median reply length (lengths vary log-normally around it)")
    return spin


def _mode(text: str) -> Mode:
    for mode in MODES:
        if mode == text:
            return mode
    raise InvalidRequestError(f"load mode must be one of {', '.join(MODES)}")


def _xy(point: SweepPoint, latency: str) -> tuple[float, float]:
    return point.result.output_throughput, float(getattr(point.result, latency)["p95"])


def _plottable(point: SweepPoint, latency: str) -> bool:
    return all(math.isfinite(v) for v in _xy(point, latency))


def _cell(value: float | None) -> str:
    return "" if value is None else f"{value:.6g}"
