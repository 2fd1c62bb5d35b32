"""Live instruments: memory by kind, KV occupancy, prefix-cache hits and the block map,
latency per request, throughput, per-layer timings and speculative decoding's acceptance by
draft position, drawn with pyqtgraph.

Frames (plain data) go into fixed-size ring buffers as they arrive; a timer redraws a few
times a second with ``setData``, so plotting never grows without end. The live plots keep
steady axis ranges (:class:`SteadyRange`): a pyqtgraph axis lays out its ticks and labels again
whenever its range changes, and with auto-range that happened on every redraw. Each tab exports
its plot as PNG and its series as CSV.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QSizePolicy,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from widgets.block_map import KVBlockMap
from widgets.expert_map import ExpertHeatMap
from widgets.plots import COLOURS, make_plot, pen

REDRAW_MS = 250
HISTORY = 1200  # points per series (5 min at 4 Hz)
WINDOW_S = 120.0  # seconds a live plot shows; it moves on by a quarter of this at a time
LABEL_ANCHORS = [(0.5, 1), (0.5, 1)]  # percentile labels sit above their line


@dataclass(frozen=True, slots=True)
class InstrumentFrame:
    """One metrics snapshot, as the plots need it."""

    t: float  # seconds, any monotonic origin
    memory_mib: dict[str, float]  # kind → MiB, e.g. weights / KV pool / process RSS
    kv_usage: float  # 0..1
    kv_blocks_used: int
    kv_blocks_total: int
    block_owners: tuple[tuple[str, ...], ...]  # per block, the requests holding it (2+: shared)
    generation_tps: float
    block_cached: tuple[bool, ...] = ()  # per block, free but a reusable prefix; (): none
    kv_blocks_cached: int = 0
    kv_blocks_shared: int = 0
    # prompt tokens reused from the prefix cache / prompt tokens so far; None while caching is
    # off or no prompt came yet
    prefix_hit_rate: float | None = None
    layer_attention_ms: tuple[float, ...] = ()
    layer_mlp_ms: tuple[float, ...] = ()
    #: speculative decoding's drafter ("" off); per draft position the draft tokens that
    #: reached it and the share of them accepted; accepted / drafted tokens and the tokens a
    #: verifying step yields (None: nothing drafted yet); seconds spent drafting and verifying
    speculative: str = ""
    spec_draft_tokens_per_pos: tuple[int, ...] = ()
    spec_acceptance_per_pos: tuple[float, ...] = ()
    spec_acceptance_rate: float | None = None
    spec_mean_acceptance_length: float | None = None
    spec_draft_s: float = 0.0
    spec_verify_s: float = 0.0
    #: a mixture of experts: its layers of experts and the tokens routed to each expert of
    #: each since the load (the heat map draws what changed between frames); () dense
    expert_layers: tuple[int, ...] = ()
    expert_tokens: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True, slots=True)
class RequestPoint:
    """One finished request's latencies."""

    ttft_s: float
    tpot_s: float | None


class RingBuffer:
    """Fixed-capacity columns of floats; ``view()`` returns the filled part in order."""

    def __init__(self, capacity: int, columns: int) -> None:
        self.data = np.full((capacity, columns), np.nan)
        self.capacity, self.count, self.next = capacity, 0, 0

    def append(self, row: list[float]) -> None:
        self.data[self.next] = row
        self.next = (self.next + 1) % self.capacity
        self.count = min(self.count + 1, self.capacity)

    def view(self) -> np.ndarray:
        if self.count < self.capacity:
            return self.data[: self.count]
        return np.roll(self.data, -self.next, axis=0)


def nice_ceiling(value: float) -> float:
    """The smallest 1, 2 or 5 × 10^k at or above ``value`` (1 for anything ≤ 0)."""
    if not value > 0:
        return 1.0
    power = 10.0 ** np.floor(np.log10(value))
    return float(next(m * power for m in (1, 2, 5, 10) if m * power >= value))


class SteadyRange:
    """Axis ranges of a live time plot that change only when they must.

    Re-laying out the axes of the two live plots on each redraw took 25–30 ms of UI-thread
    time (pyqtgraph regenerates an axis's ticks and labels when its range changes); with the
    engine busy on both cores of a 2-core CPU that stretched to 100+ ms pauses of the window.
    With steady ranges a redraw took about 5 ms. So the time axis shows :data:`WINDOW_S`
    seconds and jumps on by a quarter window when the data reaches its right edge, and the
    value axis ends at a round number, changed only when the data outgrows it or falls under
    a third of it.
    """

    def __init__(self, plot: pg.PlotWidget, fixed_top: float | None = None) -> None:
        self.plot = plot
        self.fixed_top = fixed_top
        self.x0: float | None = None
        self.top: float | None = None
        plot.getPlotItem().disableAutoRange()
        plot.setXRange(0, WINDOW_S, padding=0)
        plot.setYRange(0, fixed_top or 1.0, padding=0)

    def follow(self, t_last: float, y_max: float) -> None:
        x0 = self.x0 if self.x0 is not None else 0.0
        if t_last > x0 + WINDOW_S:
            x0 = t_last - 0.75 * WINDOW_S
        top = self.fixed_top or self.top or 0.0
        if self.fixed_top is None and (y_max > top or y_max < top / 3):
            top = nice_ceiling(1.1 * y_max)
        if (x0, top) != (self.x0, self.top):
            self.x0, self.top = x0, top
            self.plot.setXRange(x0, x0 + WINDOW_S, padding=0)
            self.plot.setYRange(0, top, padding=0)


def _visible_max(series: np.ndarray, t_last: float) -> float:
    """The largest value (columns 1…) over the last window of ``series`` (column 0: time)."""
    recent = series[series[:, 0] >= t_last - WINDOW_S, 1:]
    return float(np.nanmax(recent)) if recent.size and not np.isnan(recent).all() else 0.0


class InstrumentsPanel(QWidget):
    layer_timing_toggled = Signal(bool)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.tabs = QTabWidget()
        # every tab in view, their names shortened where the dock is narrow (no scroll arrows)
        self.tabs.setUsesScrollButtons(False)
        self.tabs.setElideMode(Qt.TextElideMode.ElideRight)
        self._t0: float | None = None
        self._kinds: list[str] = []
        self._memory: RingBuffer | None = None
        self._kv = RingBuffer(HISTORY, 4)  # t, usage %, generation tok/s, prefix hits %
        self._requests: list[RequestPoint] = []
        self._layers: tuple[tuple[float, ...], tuple[float, ...]] = ((), ())
        self._spec: tuple[tuple[int, ...], tuple[float, ...]] = ((), ())  # drafts, acceptance
        self._dirty = False
        self.last_frame: InstrumentFrame | None = None

        # memory and KV
        self.memory_plot = make_plot("Memory by kind", "MiB")
        self._memory_curves: dict[str, pg.PlotDataItem] = {}
        self.kv_plot = make_plot("KV cache", "% of blocks")
        self.kv_curve = self.kv_plot.plot(name="KV usage", pen=pg.mkPen(COLOURS[1], width=2))
        self.prefix_curve = self.kv_plot.plot(  # % of prompt tokens reused; gaps while unknown
            name="prefix hits", pen=pg.mkPen(COLOURS[4], width=2), connect="finite"
        )
        self.block_map = KVBlockMap()
        self.block_label = QLabel("KV blocks: –")
        self.block_label.setWordWrap(True)  # a narrow dock: on two lines, not cut
        # Its text changes four times a second; a width that followed the text would lay the
        # whole tab out again each time (measured: the worst UI pause fell from ~55 to ~30 ms).
        self.block_label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Fixed)
        tab = QWidget()
        col = QVBoxLayout(tab)
        col.addWidget(self.memory_plot, 3)
        col.addWidget(self.kv_plot, 2)
        col.addWidget(self.block_label)
        col.addWidget(self.block_map, 2)
        self.tabs.addTab(tab, "Memory && KV")

        # latency and throughput
        self.ttft_plot = make_plot("Latency per request", "ms", "request", integer=("bottom",))
        self.ttft_scatter = pg.ScatterPlotItem(
            name="TTFT", brush=pg.mkBrush(COLOURS[0]), size=7, pen=None
        )
        self.tpot_scatter = pg.ScatterPlotItem(
            name="TPOT", brush=pg.mkBrush(COLOURS[2]), size=7, pen=None
        )
        self.ttft_plot.addItem(self.ttft_scatter)
        self.ttft_plot.addItem(self.tpot_scatter)
        self.pct_lines = {
            name: pg.InfiniteLine(
                angle=0, movable=False, pen=pg.mkPen(colour, style=style),
                label=name,
                labelOpts={"color": colour, "position": position, "anchors": LABEL_ANCHORS},
            )
            for name, colour, style, position in (
                ("TTFT p50", COLOURS[0], Qt.PenStyle.DashLine, 0.55),
                ("TTFT p95", COLOURS[0], Qt.PenStyle.DotLine, 0.85),
                ("TPOT p50", COLOURS[2], Qt.PenStyle.DashLine, 0.55),
                ("TPOT p95", COLOURS[2], Qt.PenStyle.DotLine, 0.85),
            )
        }  # fmt: skip
        for line in self.pct_lines.values():
            line.setVisible(False)
            self.ttft_plot.addItem(line)
        self.tps_plot = make_plot("Throughput", "tokens/s")
        self.tps_curve = self.tps_plot.plot(name="generated", pen=pg.mkPen(COLOURS[2], width=2))
        self._ranges = {
            "memory": SteadyRange(self.memory_plot),
            "kv": SteadyRange(self.kv_plot, fixed_top=100.0),
            "tps": SteadyRange(self.tps_plot),
        }
        tab = QWidget()
        col = QVBoxLayout(tab)
        col.addWidget(self.ttft_plot)
        col.addWidget(self.tps_plot)
        self.tabs.addTab(tab, "Latency")

        # layers
        self.layer_switch = QCheckBox("Time each layer (costs some speed)")
        self.layer_switch.setToolTip(
            "Measures attention and MLP of every layer on each step (CUDA events on a GPU); "
            "the hooks slow the engine down, so it is off by default"
        )
        self.layer_switch.toggled.connect(self.layer_timing_toggled)
        self.layer_plot = make_plot("Per-layer time, last step", "ms", "layer", integer=("bottom",))
        self.attention_bars = pg.BarGraphItem(x=[], height=[], width=0.4, brush=COLOURS[0])
        self.mlp_bars = pg.BarGraphItem(x=[], height=[], width=0.4, brush=COLOURS[1])
        self.layer_plot.addItem(self.attention_bars)
        self.layer_plot.addItem(self.mlp_bars)
        legend = self.layer_plot.getPlotItem().legend
        legend.addItem(self.attention_bars, "attention")
        legend.addItem(self.mlp_bars, "MLP")
        tab = QWidget()
        col = QVBoxLayout(tab)
        col.addWidget(self.layer_switch)
        col.addWidget(self.layer_plot)
        self.tabs.addTab(tab, "Layers")

        # speculative decoding
        self.spec_label = QLabel()
        self.spec_label.setWordWrap(True)
        self.spec_label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.spec_plot = make_plot(
            "Acceptance by draft position", "% accepted", "draft position", integer=("bottom",)
        )
        self.spec_plot.getPlotItem().disableAutoRange()
        self.spec_plot.setYRange(0, 100, padding=0)
        self.spec_plot.setXRange(0.5, 4.5, padding=0)
        self.spec_bars = pg.BarGraphItem(x=[], height=[], width=0.6, brush=COLOURS[2])
        self.spec_plot.addItem(self.spec_bars)
        self._spec_positions = 0  # the x range drawn covers this many positions
        self._spec_drawn: tuple[float, ...] = ()
        tab = QWidget()
        col = QVBoxLayout(tab)
        col.addWidget(self.spec_label)
        col.addWidget(self.spec_plot, 1)
        self.tabs.addTab(tab, "Speculation")
        self._show_speculation(None)

        # a mixture of experts' routing
        self.expert_map = ExpertHeatMap()
        self.tabs.addTab(self.expert_map, "Experts")

        export_png = QPushButton("Export PNG…")
        export_png.setToolTip("Save the plots of this tab as an image")
        export_png.clicked.connect(self._ask_png)
        export_csv = QPushButton("Export CSV…")
        export_csv.setToolTip("Save the series behind this tab as CSV")
        export_csv.clicked.connect(self._ask_csv)
        row = QHBoxLayout()
        row.addStretch(1)
        row.addWidget(export_png)
        row.addWidget(export_csv)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(2, 2, 2, 2)
        layout.addWidget(self.tabs)
        layout.addLayout(row)

        self.timer = QTimer(self, interval=REDRAW_MS)
        self.timer.timeout.connect(self.redraw)
        self.timer.start()

    # -- data in -----------------------------------------------------------------------------
    def add_frame(self, frame: InstrumentFrame) -> None:
        if self._t0 is None:
            self._t0 = frame.t
        t = frame.t - self._t0
        kinds = list(frame.memory_mib)
        if kinds != self._kinds or self._memory is None:
            self._kinds = kinds
            self._memory = RingBuffer(HISTORY, 1 + len(kinds))
            self.memory_plot.getPlotItem().clear()
            self._memory_curves = {
                k: self.memory_plot.plot(name=k, pen=pen(i, width=3 if i == 0 else 2))
                for i, k in enumerate(kinds)
            }
        self._memory.append([t, *(frame.memory_mib[k] for k in kinds)])
        hits = frame.prefix_hit_rate
        hits_perc = np.nan if hits is None else 100.0 * hits
        self._kv.append([t, 100.0 * frame.kv_usage, frame.generation_tps, hits_perc])
        self.block_map.set_blocks(frame.block_owners, frame.block_cached)
        self.block_label.setText(
            f"KV blocks: {frame.kv_blocks_used} / {frame.kv_blocks_total} used "
            f"({100 * frame.kv_usage:.1f}%) · {frame.kv_blocks_shared} shared · "
            f"{frame.kv_blocks_cached} cached"
            + ("" if hits is None else f" · prefix hits {hits_perc:.0f}%")
        )
        if frame.layer_attention_ms:
            self._layers = (frame.layer_attention_ms, frame.layer_mlp_ms)
        self._show_speculation(frame)
        self.expert_map.set_load(frame.expert_layers, frame.expert_tokens)
        self.last_frame = frame
        self._dirty = True

    def add_request(self, point: RequestPoint) -> None:
        self._requests.append(point)
        self._dirty = True

    def _show_speculation(self, frame: InstrumentFrame | None) -> None:
        """The speculation tab's text, and its bars' data (drawn by :meth:`redraw`)."""
        on = frame is not None and bool(frame.speculative)
        self.spec_plot.setVisible(on)
        if frame is None or not on:
            self._spec = ((), ())
            self.spec_label.setText(
                "Speculative decoding is off. Choose a drafter under Controls → Speculative "
                "decoding to see how often its drafts are accepted at each position."
            )
            return
        self._spec = (frame.spec_draft_tokens_per_pos, frame.spec_acceptance_per_pos)
        rate, length = frame.spec_acceptance_rate, frame.spec_mean_acceptance_length
        if rate is None or length is None:
            self.spec_label.setText(f"{frame.speculative}: nothing drafted yet")
            return
        self.spec_label.setText(
            f"{frame.speculative}: {rate:.0%} of draft tokens accepted · mean acceptance "
            f"length {length:.2f} tokens per verifying step · drafting {frame.spec_draft_s:.2f} "
            f"s, verifying {frame.spec_verify_s:.2f} s in all"
        )

    # -- drawing -----------------------------------------------------------------------------
    def redraw(self) -> None:
        if not self._dirty:
            return
        self._dirty = False
        if self._memory is not None:
            m = self._memory.view()
            for i, kind in enumerate(self._kinds):
                self._memory_curves[kind].setData(m[:, 0], m[:, 1 + i])
            self._ranges["memory"].follow(m[-1, 0], _visible_max(m, m[-1, 0]))
        kv = self._kv.view()
        self.kv_curve.setData(kv[:, 0], kv[:, 1])
        self.prefix_curve.setData(kv[:, 0], kv[:, 3])
        self.tps_curve.setData(kv[:, 0], kv[:, 2])
        if len(kv):
            self._ranges["kv"].follow(kv[-1, 0], 100.0)
            self._ranges["tps"].follow(kv[-1, 0], _visible_max(kv[:, [0, 2]], kv[-1, 0]))
        if self._requests:
            x = np.arange(1, len(self._requests) + 1)
            ttft = 1e3 * np.array([r.ttft_s for r in self._requests])
            tpot = 1e3 * np.array(
                [np.nan if r.tpot_s is None else r.tpot_s for r in self._requests]
            )
            self.ttft_scatter.setData(x, ttft)
            ok = ~np.isnan(tpot)
            self.tpot_scatter.setData(x[ok], tpot[ok])
            for name, values in (("TTFT", ttft), ("TPOT", tpot[ok])):
                for p in (50, 95):
                    line = self.pct_lines[f"{name} p{p}"]
                    line.setVisible(len(values) > 0)
                    if len(values):
                        line.setValue(float(np.percentile(values, p)))
        attention, mlp = self._layers
        if attention:
            x = np.arange(len(attention))
            self.attention_bars.setOpts(x=x - 0.2, height=attention, width=0.4)
            self.mlp_bars.setOpts(x=x + 0.2, height=mlp, width=0.4)
        acceptance = self._spec[1]
        positions = len(acceptance)
        if acceptance != self._spec_drawn:
            self._spec_drawn = acceptance
            self.spec_bars.setOpts(
                x=np.arange(1, positions + 1),
                height=100.0 * np.asarray(acceptance, dtype=float),
                width=0.6,
            )
        if positions > self._spec_positions:  # the range only grows: steady axes
            self._spec_positions = positions
            self.spec_plot.setXRange(0.5, max(positions, 4) + 0.5, padding=0)

    # -- export ------------------------------------------------------------------------------
    def export_png(self, path: Path) -> None:
        self.redraw()
        if not self.tabs.currentWidget().grab().save(str(path)):
            raise OSError(f"could not write {path}")

    def export_csv(self, path: Path) -> None:
        """The series of the current tab."""
        index = self.tabs.currentIndex()
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            if index == 0:
                w.writerow(
                    [
                        "time_s",
                        *(f"{k}_mib" for k in self._kinds),
                        "kv_usage_perc",
                        "prefix_hit_perc",
                    ]
                )
                m = self._memory.view() if self._memory is not None else np.empty((0, 1))
                kv = self._kv.view()
                for row_m, row_kv in zip(m, kv, strict=False):  # an unknown hit rate: empty
                    w.writerow(
                        ["" if np.isnan(v) else f"{v:.6g}" for v in (*row_m, *row_kv[[1, 3]])]
                    )
            elif index == 1:
                w.writerow(
                    ["request", "time_to_first_token_seconds", "time_per_output_token_seconds"]
                )
                for i, r in enumerate(self._requests, 1):
                    w.writerow(
                        [i, f"{r.ttft_s:.6g}", "" if r.tpot_s is None else f"{r.tpot_s:.6g}"]
                    )
            elif index == 2:
                w.writerow(["layer", "attention_ms", "mlp_ms"])
                for i, (a, b) in enumerate(zip(*self._layers, strict=True)):
                    w.writerow([i, f"{a:.6g}", f"{b:.6g}"])
            else:
                w.writerow(["draft_position", "draft_tokens", "acceptance"])
                for i, (n, a) in enumerate(zip(*self._spec, strict=False), 1):
                    w.writerow([i, n, f"{a:.6g}"])

    def _ask_png(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Export plot", "infersight.png", "PNG (*.png)")
        if path:
            self.export_png(Path(path))

    def _ask_csv(self) -> None:
        path, _ = QFileDialog.getSaveFileName(
            self, "Export series", "infersight.csv", "CSV (*.csv)"
        )
        if path:
            self.export_csv(Path(path))
