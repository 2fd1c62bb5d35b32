"""The tuner's *Live* page: output throughput, TTFT and TPOT percentiles, batch and queue, KV
use and preemptions over time, and below them the per-step strip: one bar per step, split
into decode tokens, prefill chunk tokens and unused budget, above how long that step took.
It takes metrics snapshots (:class:`~engine.core.metrics.MetricsSnapshot`) and redraws when
asked (the view's timer)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QGridLayout, QLabel, QSplitter, QVBoxLayout, QWidget

from widgets.instruments import (
    HISTORY,
    RingBuffer,
    SteadyRange,
    _visible_max,
    nice_ceiling,
)
from widgets.plots import COLOURS, make_plot

if TYPE_CHECKING:
    from engine.core.metrics import MetricsSnapshot, StepRecord

STEP_HISTORY = 200  # steps the per-step strip keeps
SUMMARY_STEPS = 50  # steps the strip's live sentence reads
STEP_CAPTION = (
    "Each bar is one step: decode tokens, prefill chunk tokens, unused budget; "
    "below: how long it took (red ▼: the step preempted a sequence)"
)
REMOTE_NOTE = (
    "A server's load, seen from here: throughput and latency by the client's clock; batch, "
    "queue, KV use and preemptions from the server's /metrics where it exposes them (vLLM's, "
    "SGLang's or llama.cpp's names; ours are vLLM's), else the batch is the requests in "
    "flight as the client counts them and the rest is blank. How a server batched each step "
    "is not visible remotely: the per-step strip needs the engine in this process."
)
RED = "#e0533d"
GREY = "#5f6670"
#: live columns: time, tok/s, TTFT p50/p95, TPOT p50/p95 (ms), batch, waiting, KV %, preemptions
_T, _TPS, _TTFT50, _TTFT95, _TPOT50, _TPOT95, _BATCH, _WAIT, _KV, _PRE = range(10)
#: per-step columns: decode, prefill, unused budget (tokens), duration (ms), preempted
_DEC, _PRE_TOK, _UNUSED, _DUR, _PREEMPT = range(5)


def _steady_top(top: float | None, y_max: float) -> float:
    """A value axis top that changes only when the data outgrows it or falls under a third."""
    if top is None or y_max > top or y_max < top / 3:
        return nice_ceiling(1.1 * y_max)
    return top


def _fmt(value: float | None, digits: str = ".0f") -> str:
    if value is None or math.isnan(value):
        return "–"
    return format(value, digits)


class LivePage(QSplitter):
    """The live plots above the per-step strip (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__(Qt.Orientation.Vertical)
        self._t0: float | None = None
        self._live = RingBuffer(HISTORY, 10)
        self._steps = RingBuffer(STEP_HISTORY, 5)
        self._last_step_end = -math.inf
        self._live_dirty = self._steps_dirty = False
        self._preempt_top: float | None = None
        self._token_top: float | None = None
        self._duration_top: float | None = None
        self._failures: list[tuple[float, str]] = []
        self.remote: str | None = None  # the server whose figures it shows (None: the engine's)

        self.tps_plot = make_plot("Output throughput", "tokens/s")
        self.tps_curve = self.tps_plot.plot(name="generated", pen=pg.mkPen(COLOURS[2], width=2))
        self.latency_plot = make_plot("Latency", "ms")
        self.latency_curves = {
            column: self.latency_plot.plot(name=name, pen=pg.mkPen(colour, width=w, style=style))
            for column, name, colour, w, style in (
                (_TTFT50, "TTFT p50", COLOURS[0], 1, Qt.PenStyle.SolidLine),
                (_TTFT95, "TTFT p95", COLOURS[0], 2, Qt.PenStyle.DashLine),
                (_TPOT50, "TPOT p50", COLOURS[1], 1, Qt.PenStyle.SolidLine),
                (_TPOT95, "TPOT p95", COLOURS[1], 2, Qt.PenStyle.DashLine),
            )
        }
        self.batch_plot = make_plot("Batch and queue", "requests", integer=("left",))
        self.batch_curve = self.batch_plot.plot(name="batch", pen=pg.mkPen(COLOURS[4], width=2))
        self.queue_curve = self.batch_plot.plot(name="waiting", pen=pg.mkPen(COLOURS[3], width=2))
        self.kv_plot = make_plot("KV cache and preemptions", "% of blocks")
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
        # where a server failed a request of the load (a server's figures only)
        self.failure_marks = pg.ScatterPlotItem(
            name="failed", symbol="t1", size=10, brush=pg.mkBrush(RED), pen=None
        )
        self.tps_plot.addItem(self.failure_marks)
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
        self.remote_note = QLabel(REMOTE_NOTE)  # in the strip's place for a server's load
        self.remote_note.setWordWrap(True)
        self.remote_note.setVisible(False)
        grid_layout.addWidget(self.remote_note, 2, 0, 1, 2)

        # the per-step strip
        self.token_plot = make_plot(
            "Each step's token budget", "tokens", "step (oldest → newest)", integer=("bottom",)
        )
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
        self.duration_plot = make_plot("", "step ms", "step (oldest → newest)", integer=("bottom",))
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

        self.strip = strip
        self.addWidget(plots)
        self.addWidget(strip)
        self.setStretchFactor(0, 1)
        self.setStretchFactor(1, 1)

    def _align_preempt_view(self) -> None:
        vb = self.kv_plot.getPlotItem().vb
        self.preempt_view.setGeometry(vb.sceneBoundingRect())
        self.preempt_view.linkedViewChanged(vb, self.preempt_view.XAxis)

    # -- data in ----------------------------------------------------------------------------
    def show_remote(self, name: str | None) -> None:
        """Show a server's figures from now on (``name``), or the engine's again (None): the
        plots start afresh, and the per-step strip, which only the engine can fill, gives way
        to a note that says so."""
        self.remote = name
        self._t0 = None
        self._live = RingBuffer(HISTORY, 10)
        self._steps = RingBuffer(STEP_HISTORY, 5)
        self._last_step_end = -math.inf
        self._failures = []
        self.failure_marks.setData([], [])
        self._live_dirty = self._steps_dirty = True
        self.remote_note.setVisible(name is not None)
        self.strip.setVisible(name is None)

    def add_point(
        self, at: float, tps: float, ttft_ms: tuple[float, float], tpot_ms: tuple[float, float],
        batch: float, waiting: float, kv_perc: float, preemptions: float,
        failures: tuple[tuple[float, str], ...] = (),
    ) -> None:  # fmt: skip
        """One reading at ``at`` (``time.perf_counter``): output tokens/s, TTFT and TPOT p50
        and p95 (ms), batch, queue, KV use (%) and preemptions (NaN: not known), and the
        failures since the last reading (``at`` of each, how it failed)."""
        if self._t0 is None:
            self._t0 = at
        self._live.append([at - self._t0, tps, *ttft_ms, *tpot_ms, batch, waiting, kv_perc,
                           preemptions])  # fmt: skip
        if failures:
            self._failures += [(t - self._t0, kind) for t, kind in failures]
            xs = [t for t, _ in self._failures]
            self.failure_marks.setData(xs, [0.0] * len(xs))
        self._live_dirty = True

    def failures(self) -> list[tuple[float, str]]:
        """Where the server failed requests: seconds into the plots, how."""
        return list(self._failures)

    def add_snapshot(self, snapshot: MetricsSnapshot) -> None:
        """Feed the live plots and the per-step strip (each step once)."""
        if self.remote is not None:  # the plots show a server's load
            return
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
        self.add_point(
            snapshot.time, snapshot.generation_throughput_tps,
            (1e3 * ttft.get("p50", math.nan), 1e3 * ttft.get("p95", math.nan)),
            (1e3 * tpot.get("p50", math.nan), 1e3 * tpot.get("p95", math.nan)),
            batch, float(snapshot.num_requests_waiting), 100.0 * snapshot.kv_cache_usage_perc,
            float(snapshot.total_preemptions),
        )  # fmt: skip

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
        if self._steps_dirty and self.remote is None:
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


def summarise_steps(rows: np.ndarray) -> str:
    """``last 50 steps: prefill in 12%, mean step 85 ms with prefill vs 41 ms without,
    3 preemptions`` for rows of :meth:`LivePage.step_rows`."""
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
