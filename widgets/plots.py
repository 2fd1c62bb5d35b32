"""How every plot of the app is made (the instruments, the tuner, the A/B lab): a dark plot
whose legend sits under it, never over the data; integer axes (requests, layers, steps) with
whole ticks only; and curves told apart by dash as well as colour, so that two that coincide
(weights and the KV pool at fp32, say) both stay visible."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import pyqtgraph as pg
from PySide6.QtCore import Qt

COLOURS = ("#4e9af1", "#f1a04e", "#6cc070", "#d05c8a", "#b28df0", "#9aa0a6")
#: the dash of the i-th curve of a plot, after the first solid one: a curve drawn over an
#: equal one leaves it showing in the gaps
STYLES = (Qt.PenStyle.SolidLine, Qt.PenStyle.DashLine, Qt.PenStyle.DotLine,
          Qt.PenStyle.DashDotLine)  # fmt: skip


class IntegerAxis(pg.AxisItem):  # type: ignore[misc]  # pyqtgraph is untyped
    """An axis of whole things (requests, layers, steps, tokens): ticks at integers only."""

    def tickValues(self, minVal: float, maxVal: float, size: float) -> list[Any]:
        levels = [
            (spacing, [v for v in values if float(v).is_integer()])
            for spacing, values in super().tickValues(minVal, maxVal, size)
            if spacing >= 1
        ]
        levels = [(spacing, values) for spacing, values in levels if values]
        if levels:
            return levels
        first, last = math.ceil(minVal), math.floor(maxVal)
        return [(1.0, [float(v) for v in range(first, last + 1)])] if last >= first else []


def make_plot(
    title: str,
    left: str,
    bottom: str = "time (s)",
    *,
    integer: Iterable[str] = (),
) -> pg.PlotWidget:
    """A plot titled ``title``, its axes labelled ``left`` and ``bottom`` (the unit in the
    label); the axes named in ``integer`` ("left", "bottom") tick at whole numbers only; the
    legend (curves plotted with a ``name``) in a row under the plot."""
    axes = {name: IntegerAxis(orientation=name) for name in integer}
    w = pg.PlotWidget(background="#1e2127", axisItems=axes)
    w.setTitle(title, color="#d0d4da", size="10pt")
    w.setLabel("left", left)
    w.setLabel("bottom", bottom)
    for axis in ("left", "bottom"):
        w.getAxis(axis).enableAutoSIPrefix(False)  # the unit is in the label
    w.showGrid(x=True, y=True, alpha=0.2)
    w.setMinimumHeight(120)
    item = w.getPlotItem()
    # two columns: a legend's width is the plot's least (a wider one would cut the plot off)
    below = pg.LegendItem(colCount=2, labelTextSize="8pt", horSpacing=12)
    item.layout.addItem(below, 4, 1)  # the row under the bottom axis: outside the data
    item.legend = below  # curves plotted with a name join it
    return w


def pen(index: int, *, width: float = 2, colour: str | None = None) -> Any:
    """The ``index``-th curve's pen: its colour, and a dash that differs from the curves
    before it."""
    style = STYLES[index % len(STYLES)]
    return pg.mkPen(colour or COLOURS[index % len(COLOURS)], width=width, style=style)
