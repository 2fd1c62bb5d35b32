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

The *Sweep* page runs a grid of settings (:func:`engine.bench.sweep_analysis.grid`), each
under a series of loads, and plots output throughput against p95 TTFT and p95 TPOT: the
Pareto front, each series' knee (where latency starts to grow faster than the load) and the
best setting that meets the SLO. From a knee it sizes a deployment (machines for a target
request rate).

Like the rest of ``widgets/``, the view takes plain data (:class:`MetricsSnapshot`,
:class:`LoadResult`, :class:`SweepProgress`) and emits what the user asked for; it runs no
engine and no thread. This module holds the view, its load row and its sweep form; the
limits' sliders are :mod:`widgets.tuner_limits`, the Live page :mod:`widgets.tuner_live`,
the sweep's plots and capacity panel :mod:`widgets.tuner_sweep`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QComboBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QProgressBar,
    QPushButton,
    QSizePolicy,
    QSpinBox,
    QSplitter,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from engine.bench.load_spec import MODES, SLO, LoadSpec, PromptMix
from engine.bench.sweep_analysis import best_for_slo, grid
from engine.errors import InvalidRequestError
from widgets.endpoint_text import PLACEHOLDER, parse_endpoint
from widgets.instruments import REDRAW_MS
from widgets.tuner_limits import LimitsGroup
from widgets.tuner_live import RED, LivePage, _fmt
from widgets.tuner_sweep import CapacityPanel, SweepPlots, write_sweep_csv

if TYPE_CHECKING:
    from engine.bench.load_spec import LoadResult, Mode
    from engine.bench.sweep_analysis import Setting, SweepPoint, SweepProgress
    from engine.core.metrics import MetricsSnapshot

MAX_SETTINGS = 256  # a larger grid is refused (each setting runs its own load)
DEFAULT_SLO = "ttft=2s,tpot=150ms"


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


class TunerView(QWidget):
    """The tuner tab (see the module docstring)."""

    limits_changed = Signal(dict)  # the key(s) a slider changed → value
    start_load = Signal(object)  # LoadSpec, runs until stopped
    start_sweep = Signal(object, object)  # tuple[Setting, ...], SLO | None
    stop_requested = Signal()
    apply_limits = Signal(dict)  # the best setting's limits
    load_turned = Signal(int, float)  # the live load's users and rate, as the user turns them
    export_guidellm = Signal(str)  # a path: the last runs on a server as GuideLLM's report

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._points: tuple[SweepPoint, ...] = ()
        self._best: SweepPoint | None = None

        target = self._target_row()  # before the sweep page, whose best reads it
        self.live = LivePage()
        self.tabs = QTabWidget()
        self.tabs.addTab(self.live, "Live")
        self.tabs.addTab(self._sweep_page(), "Sweep")
        self.limits_group = LimitsGroup()
        self.limits_group.changed.connect(self.limits_changed)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(2, 2, 2, 2)
        layout.addLayout(target)
        layout.addWidget(self.limits_group)
        layout.addLayout(self._load_row())
        layout.addWidget(self.tabs, 1)
        # the parts' widgets, under the view's names (what the app and the tests read)
        self.sliders = self.limits_group.sliders
        live = self.live
        self.tps_curve, self.latency_curves = live.tps_curve, live.latency_curves
        self.kv_curve, self.preempt_curve = live.kv_curve, live.preempt_curve
        self.decode_bars, self.prefill_bars = live.decode_bars, live.prefill_bars
        self.unused_bars, self.duration_bars = live.unused_bars, live.duration_bars
        self.preempt_marks, self.step_summary = live.preempt_marks, live.step_summary
        plots = self.sweep_plots
        self.sweep_scatter, self.front_curve = plots.sweep_scatter, plots.front_curve
        self.knee_marks, self.best_marks = plots.knee_marks, plots.best_marks
        self._labels = plots.labels
        cap = self.capacity
        self.target_rate, self.peak_factor = cap.target_rate, cap.peak_factor
        self.headroom, self.capacity_text = cap.headroom, cap.capacity_text

        self.timer = QTimer(self, interval=REDRAW_MS)
        self.timer.timeout.connect(self.redraw)
        self.timer.start()
        self.set_status(False, None, None)

    # -- building ----------------------------------------------------------------------------
    def _target_row(self) -> QHBoxLayout:
        self.target_edit = QLineEdit()
        self.target_edit.setPlaceholderText(f"this engine, or a server: {PLACEHOLDER}")
        self.target_edit.setToolTip(
            "Empty: the load runs on the engine in this process, its limits on the sliders. "
            "A URL: it runs on that OpenAI-compatible server (vLLM, llama.cpp, Ollama, "
            "infersight serve …), by the client's clock; the limits are the server's own. "
            "The key comes from the keyring or INFERSIGHT_ENDPOINT_KEY"
        )
        self.target_edit.textChanged.connect(self._target_changed)
        self.target_note = QLabel("limits: this engine's")
        row = QHBoxLayout()
        row.addWidget(QLabel("Target"))
        row.addWidget(self.target_edit, 1)
        row.addWidget(self.target_note)
        return row

    def endpoint(self) -> tuple[str, str] | None:
        """The server the load targets (URL, model id), or None: this engine."""
        return parse_endpoint(self.target_edit.text())

    def _check_target(self) -> None:
        """A target that names no server (``localhost:8000``) is refused, not taken for this
        engine; raises InvalidRequestError."""
        text = self.target_edit.text().strip()
        if text and self.endpoint() is None:
            raise InvalidRequestError(
                f"target {text!r} is no server's URL: give one like {PLACEHOLDER}, or leave it "
                "empty for this engine"
            )

    def _target_changed(self, _text: str) -> None:
        remote = self.endpoint() is not None
        self.limits_group.setVisible(not remote)  # the plots take its room
        for edit in (self.batch_edit, self.tokens_edit, self.wait_edit):
            edit.setEnabled(not remote)
        self.target_note.setText("limits: the server's own" if remote else "limits: this engine's")
        self.capacity.set_remote(remote)
        self._evaluate_best()

    def _load_row(self) -> QVBoxLayout:
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
        # turned while a load runs, they turn it: users join or leave, arrivals speed or slow
        self.users_spin.valueChanged.connect(self._load_turned)
        self.rate_spin.valueChanged.connect(self._load_turned)
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
        row.addStretch(1)
        # the figures and the state on a line of their own: they never widen the page
        self.load_figures.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Fixed)
        figures = QHBoxLayout()
        figures.addWidget(self.load_figures, 1)
        figures.addWidget(self.status_label, 1)
        both = QVBoxLayout()
        both.addLayout(row)
        both.addLayout(figures)
        return both

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

        self.capacity = CapacityPanel()

        left = QWidget()
        left_col = QVBoxLayout(left)
        left_col.setContentsMargins(0, 0, 0, 0)
        left_col.addWidget(form_box)
        left_col.addWidget(self.capacity)
        left_col.addStretch(1)

        self.progress = QProgressBar()
        self.progress.setRange(0, 1)
        self.progress.setValue(0)
        self.progress.setFormat("no sweep yet")
        self.sweep_plots = SweepPlots()
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
        export_guidellm = QPushButton("Export GuideLLM JSON…")
        export_guidellm.setToolTip(
            "Save the last load or sweep on a server as GuideLLM's benchmarks.json (guidellm "
            "export and its console, CSV and HTML outputs read it)"
        )
        export_guidellm.clicked.connect(self._ask_guidellm)
        export_row = QHBoxLayout()
        export_row.addStretch(1)
        export_row.addWidget(export_png)
        export_row.addWidget(export_csv)
        export_row.addWidget(export_guidellm)
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

    # -- engine state in -------------------------------------------------------------------
    def set_engine(self, limits: dict[str, float], kv_blocks_total: int, block_size: int) -> None:
        """A model loaded: the KV slider's range and every slider's position (no signal)."""
        self.limits_group.set_engine(limits, kv_blocks_total, block_size)

    def add_snapshot(self, snapshot: MetricsSnapshot) -> None:
        """Feed the live plots and the per-step strip, and show the limits in force."""
        self.live.add_snapshot(snapshot)
        if snapshot.limits:
            self.limits_group.sync(snapshot.limits)

    def step_rows(self) -> np.ndarray:
        """The strip's steps, oldest first: decode, prefill, unused budget, ms, preempted."""
        return self.live.step_rows()

    def redraw(self) -> None:
        self.live.redraw()

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
        self.status_label.setToolTip(message)  # the whole line, where the label cuts it
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
        self.sweep_plots.draw(self._points)
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
        self.sweep_plots.mark_best(self._best)
        self.apply_button.setEnabled(self._best is not None and self.endpoint() is None)
        self.capacity.set_sweep(self._points, self._best)

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

    def _apply_clicked(self) -> None:
        if self._best is not None:
            self.apply_limits.emit(dict(self._best.setting.limits))

    # -- what the user asks for ---------------------------------------------------------------
    def _mode_changed(self, mode: str) -> None:
        closed = mode == "closed"
        self.users_spin.setVisible(closed)
        self.rate_spin.setVisible(not closed)

    def _load_turned(self, *_: object) -> None:
        if self.stop_button.isEnabled():  # a load runs
            self.load_turned.emit(self.users_spin.value(), self.rate_spin.value())

    def _sweep_mode_changed(self, mode: str) -> None:
        self.loads_label.setText("Users" if mode == "closed" else "Rates (req/s)")

    def live_spec(self) -> LoadSpec:
        """The live load's spec (runs until stopped; its share of long conversations is the
        sweep form's)."""
        self._check_target()
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
        self._check_target()
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
        if self.endpoint() is not None:  # a server's limits are its own: loads only
            batch = tokens = wait = []
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
        write_sweep_csv(path, self._points)

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

    def _ask_guidellm(self) -> None:
        path, _ = QFileDialog.getSaveFileName(
            self, "Export as GuideLLM's report", "benchmarks.json", "JSON (*.json)"
        )
        if path:
            self.export_guidellm.emit(path)

    def _ask_csv(self) -> None:
        path, _ = QFileDialog.getSaveFileName(
            self, "Export sweep", "infersight-sweep.csv", "CSV (*.csv)"
        )
        if path:
            self.export_sweep_csv(Path(path))


# -- helpers ------------------------------------------------------------------------------------
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
