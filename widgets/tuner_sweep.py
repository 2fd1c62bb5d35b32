"""The tuner's sweep results: the plots of output throughput against p95 TTFT and p95 TPOT
(every setting, the Pareto front, each series' knee, the best setting for the SLO), the
capacity panel (machines for a target request rate, from a knee) and the sweep as a CSV
table. They take a sweep's points (:class:`~engine.bench.sweep_analysis.SweepPoint`, plain
data)."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QWidget,
)

from engine.bench.sweep_analysis import (
    LIMIT_NAMES,
    capacity,
    knee,
    pareto_front,
    series,
    serve_config,
)
from engine.errors import InvalidRequestError
from widgets.plots import COLOURS, make_plot

if TYPE_CHECKING:
    from engine.bench.sweep_analysis import SweepPoint

LATENCIES = {"ttft_ms": "p95 TTFT (ms)", "tpot_ms": "p95 TPOT (ms)"}
WHITE = "#d0d4da"


class SweepPlots(QWidget):
    """One plot per latency in :data:`LATENCIES`, side by side, each point labelled and
    coloured by its series (its limits)."""

    def __init__(self) -> None:
        super().__init__()
        self.labels: dict[str, list[pg.TextItem]] = {key: [] for key in LATENCIES}
        plots_row = QHBoxLayout(self)
        plots_row.setContentsMargins(0, 0, 0, 0)
        self.sweep_plot: dict[str, pg.PlotWidget] = {}
        self.sweep_scatter: dict[str, pg.ScatterPlotItem] = {}
        self.front_curve: dict[str, pg.PlotDataItem] = {}
        self.knee_marks: dict[str, pg.ScatterPlotItem] = {}
        self.best_marks: dict[str, pg.ScatterPlotItem] = {}
        for key, axis in LATENCIES.items():
            plot = make_plot(f"Throughput against {axis[:-5]}", axis, "output tokens/s")
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

    def draw(self, points: Sequence[SweepPoint]) -> None:
        """Every point, the Pareto front and each series' knee (the best is :meth:`mark_best`)."""
        groups = series(points)
        colour_of = {
            id(p): COLOURS[i % len(COLOURS)] for i, pts in enumerate(groups.values()) for p in pts
        }
        knees = [k.point for k in (knee(pts) for pts in groups.values()) if k is not None]
        for key in LATENCIES:
            plot = self.sweep_plot[key]
            for item in self.labels[key]:
                plot.removeItem(item)
            self.labels[key] = []
            shown = [p for p in points if _plottable(p, key)]
            self.sweep_scatter[key].setData(
                [_xy(p, key)[0] for p in shown], [_xy(p, key)[1] for p in shown],
                brush=[pg.mkBrush(colour_of[id(p)]) for p in shown],
            )  # fmt: skip
            front = pareto_front(points, key)
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
                self.labels[key].append(text)

    def mark_best(self, best: SweepPoint | None) -> None:
        for key in LATENCIES:
            if best is not None and _plottable(best, key):
                x, y = _xy(best, key)
                self.best_marks[key].setData([x], [y])
            else:
                self.best_marks[key].setData([], [])


class CapacityPanel(QGroupBox):
    """Machines like this one for a target request rate, with a peak factor and headroom,
    each run at a series' knee (the best setting's series first)."""

    def __init__(self) -> None:
        super().__init__("Capacity")
        self._points: tuple[SweepPoint, ...] = ()
        self._best: SweepPoint | None = None
        cap_form = QFormLayout(self)
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
        #: the model and precision the sweep ran on (a Ray Serve config names them)
        self.model: tuple[str, str] | None = None
        #: the sweep ran on a server: machines of it, no config of ours to export
        self.remote = False
        #: the Ray Serve config of the capacity shown (None: no capacity yet)
        self.serve_config: dict[str, object] | None = None
        self.export_button = QPushButton("Export Ray Serve config…")
        self.export_button.setToolTip(
            "A config of as many replicas as the capacity needs, each taking at most the "
            "knee's requests in progress: `infersight serve --ray --config FILE` runs it "
            "(docs/replicas.md)"
        )
        self.export_button.setEnabled(False)
        self.export_button.clicked.connect(lambda: self.export_config())
        cap_form.addRow("Target rate", self.target_rate)
        cap_form.addRow("Peak factor", self.peak_factor)
        cap_form.addRow("Headroom", self.headroom)
        cap_form.addRow(self.capacity_text)
        cap_form.addRow(self.export_button)

    def set_model(self, path: str, precision: str) -> None:
        """The model the sweeps run on, as the app loaded it."""
        self.model = (path, precision)
        self._update_capacity()

    def export_config(self, path: str | None = None) -> Path | None:
        """Write the Ray Serve config of the capacity shown (JSON, which YAML reads too) to
        ``path`` (None: ask where); the file written, or None."""
        if self.serve_config is None:
            return None
        if path is None:
            path, _ = QFileDialog.getSaveFileName(
                self, "Ray Serve config", "infersight-serve.json", "Ray Serve config (*.json)"
            )
            if not path:
                return None
        out = Path(path)
        out.write_text(json.dumps(self.serve_config, indent=2) + "\n", encoding="utf-8")
        return out

    def set_remote(self, remote: bool) -> None:
        """Whether the sweeps run on a server (its replicas are not ours to configure)."""
        self.remote = remote
        self._update_capacity()

    def set_sweep(self, points: tuple[SweepPoint, ...], best: SweepPoint | None) -> None:
        """The sweep's points and its best setting (``None``: none meets the SLO)."""
        self._points, self._best = points, best
        self._update_capacity()

    def _update_capacity(self) -> None:
        self.serve_config = None
        self.export_button.setEnabled(False)
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
            if self.remote:
                self.capacity_text.setText(
                    self.capacity_text.text() + " (servers like the one measured)"
                )
            elif self.model is not None:
                model, precision = self.model
                self.serve_config = serve_config(k, cap, model=model, precision=precision)
                self.export_button.setEnabled(True)
            return
        self.capacity_text.setText(
            "No knee yet: sizing needs a knee, and a knee needs at least 3 loads of one "
            "setting, run up to where its latency grows faster than the load"
        )


def write_sweep_csv(path: Path, points: Sequence[SweepPoint]) -> None:
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
        for p in points:
            r = p.result
            w.writerow([
                p.label, *(_cell(p.setting.limits.get(k)) for k in LIMIT_NAMES),
                p.setting.load.describe(), r.completed, _cell(r.request_throughput),
                _cell(r.output_throughput), *(_cell(r.ttft_ms.get(s)) for s in stats),
                *(_cell(r.tpot_ms.get(s)) for s in stats), _cell(r.request_goodput),
                _cell(r.slo_attainment), r.preemptions,
            ])  # fmt: skip


def _xy(point: SweepPoint, latency: str) -> tuple[float, float]:
    return point.result.output_throughput, float(getattr(point.result, latency)["p95"])


def _plottable(point: SweepPoint, latency: str) -> bool:
    return all(math.isfinite(v) for v in _xy(point, latency))


def _cell(value: float | None) -> str:
    return "" if value is None else f"{value:.6g}"
