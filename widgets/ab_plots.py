"""The A/B lab's plots: KL(A‖B) per token along one column's text (with the noise floor and
the first divergence), and the layer scan's bars (the KL with only one block quantized, per
layer, the blocks a plan keeps at high precision outlined). Each holds its pyqtgraph
``widget`` and draws the report's or the scan's plain data."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt

from widgets.ab_format import ACCENT
from widgets.plots import make_plot

#: The log-scale KL plot cannot show 0 (identical distributions); such points sit here.
KL_PLOT_FLOOR = 1e-8
BAR_COLOURS = {"attn": "#4e9af1", "mlp": "#f1a04e"}
UPGRADED_COLOURS = {"attn": "#a9cdfa", "mlp": "#f8cf9f"}


class KLPlot:
    """KL(A‖B) per token on a log scale, the noise floor (A against A′) as a band under it
    and the first divergence as a dashed line."""

    def __init__(self) -> None:
        self.widget = plot = make_plot(
            "KL(A‖B) per token", "KL (nats)", "token", integer=("bottom",)
        )
        plot.setLogMode(y=True)
        plot.getAxis("left").setWidth(64)  # room for 10⁻⁶-style ticks and the label
        floor_pen = pg.mkPen(0, 0, 0, 0)
        self.noise_bottom = pg.PlotDataItem(pen=floor_pen)
        self.noise_top = pg.PlotDataItem(pen=pg.mkPen(150, 160, 175, 90))
        plot.addItem(self.noise_bottom, ignoreBounds=True)
        plot.addItem(self.noise_top)
        self.noise_band = pg.FillBetweenItem(
            self.noise_bottom, self.noise_top, brush=pg.mkBrush(150, 160, 175, 50)
        )
        plot.addItem(self.noise_band)
        self.curve = plot.plot(
            name="KL(A‖B)",
            pen=pg.mkPen(BAR_COLOURS["mlp"], width=1.5),
            symbol="o",
            symbolSize=4,
            symbolBrush=BAR_COLOURS["mlp"],
            symbolPen=None,
        )
        legend = plot.getPlotItem().legend
        # the band's edge stands for it: a legend sample of a FillBetweenItem crashed Qt
        # (pyqtgraph 0.14, a segfault in the plot's paintEvent)
        legend.addItem(self.noise_top, "noise floor (A vs A′)")
        self.divergence_line = pg.InfiniteLine(
            angle=90,
            movable=False,
            pen=pg.mkPen(ACCENT, style=Qt.PenStyle.DashLine),
            label="first divergence",
            labelOpts={"color": ACCENT, "position": 0.9},
        )
        self.divergence_line.setVisible(False)
        plot.addItem(self.divergence_line)
        self.noise_band.setVisible(False)

    def clear(self) -> None:
        """No figures (a run started: the last report's belong to other text)."""
        self.curve.setData([], [])
        self.noise_top.setData([], [])
        self.noise_bottom.setData([], [])
        self.noise_band.setVisible(False)
        self.divergence_line.setVisible(False)

    def draw(self, side: str, figures: dict[str, Any], divergence: int | None) -> None:
        """``side``'s column figures (``kl``, ``noise_kl``) and the first divergence's index."""
        kl = np.asarray(figures.get("kl") or [], dtype=float)
        self.curve.setData(np.arange(len(kl)), np.maximum(kl, KL_PLOT_FLOOR))
        noise = figures.get("noise_kl")
        if noise:
            values = np.maximum(np.asarray(noise, dtype=float), KL_PLOT_FLOOR)
            x = np.arange(len(values))
            self.noise_bottom.setData(x, np.full(len(values), KL_PLOT_FLOOR))
            self.noise_top.setData(x, values)
        else:
            self.noise_bottom.setData([], [])
            self.noise_top.setData([], [])
        self.noise_band.setVisible(bool(noise))
        self.noise_top.setVisible(bool(noise))
        self.divergence_line.setVisible(divergence is not None)
        if divergence is not None:
            self.divergence_line.setValue(divergence)
        self.widget.setTitle(
            f"KL(A‖B) per token, along {side.upper()}'s text", color="#d0d4da", size="10pt"
        )


class ScanPlot:
    """The layer scan: per layer, a bar for its attention and one for its MLP."""

    def __init__(self) -> None:
        self.widget = plot = make_plot(
            "KL with only this block quantized",
            "KL (nats)",
            "layer",
            integer=("bottom",),
        )
        # top right: the first layers' bars are often the tallest
        self.attn_bars = pg.BarGraphItem(x=[], height=[], width=0.4, brush=BAR_COLOURS["attn"])
        self.mlp_bars = pg.BarGraphItem(x=[], height=[], width=0.4, brush=BAR_COLOURS["mlp"])
        plot.addItem(self.attn_bars)
        plot.addItem(self.mlp_bars)
        legend = plot.getPlotItem().legend
        legend.addItem(self.attn_bars, "attention")
        legend.addItem(self.mlp_bars, "MLP")

    def draw(self, blocks: list[dict[str, Any]], upgraded: set[tuple[int, str]]) -> None:
        """The scan's blocks (``layer``, ``part``, ``kl``); ``upgraded`` ones outlined."""
        for part, bars, shift in (("attn", self.attn_bars, -0.2), ("mlp", self.mlp_bars, 0.2)):
            mine = [b for b in blocks if b.get("part") == part]
            kept = [(b["layer"], part) in upgraded for b in mine]
            bars.setOpts(
                x=np.array([b["layer"] for b in mine], dtype=float) + shift,
                height=np.array([b["kl"] for b in mine], dtype=float),
                width=0.4,
                brushes=[UPGRADED_COLOURS[part] if u else BAR_COLOURS[part] for u in kept],
                pens=[pg.mkPen("w", width=2) if u else pg.mkPen(None) for u in kept],
            )
