"""The plots as a user reads them (issue 46, finding 6): at fp32 the weights curve lay exactly
under the KV pool's and could not be seen, legends covered the data, and axes of whole
things (requests, layers) had fractional ticks."""

from __future__ import annotations

import itertools

import pytest
from PySide6.QtCore import Qt

from tests.test_widgets import _frame
from widgets.instruments import InstrumentFrame, InstrumentsPanel
from widgets.plots import IntegerAxis, make_plot

pytestmark = pytest.mark.usefixtures("gui_gc")


def equal_weights_and_pool(t: float) -> InstrumentFrame:
    frame = _frame(t, 4)
    frame.memory_mib.update({"weights": 512.0, "KV pool": 512.0})  # fp32: the same MiB
    return frame


def test_two_equal_memory_curves_both_show(qtbot):
    panel = InstrumentsPanel()
    qtbot.addWidget(panel)
    for t in range(5):
        panel.add_frame(equal_weights_and_pool(float(t)))
    pens = [curve.opts["pen"] for curve in panel._memory_curves.values()]
    looks = {(p.color().name(), p.style(), p.widthF()) for p in pens}
    assert len(looks) == len(pens)  # each curve its own look
    # the curve drawn over another is dashed or dotted: the one under shows in its gaps
    assert all(p.style() != Qt.PenStyle.SolidLine for p in pens[1:])


def test_legends_sit_outside_the_data(qtbot):
    panel = InstrumentsPanel()
    qtbot.addWidget(panel)
    panel.resize(900, 700)
    panel.show()
    for t in range(5):
        panel.add_frame(_frame(float(t), 4))
    qtbot.wait(50)
    for plot in (panel.memory_plot, panel.kv_plot, panel.tps_plot):
        item = plot.getPlotItem()
        assert item.legend.items  # the named curves are in it
        data = item.getViewBox().sceneBoundingRect()
        assert not item.legend.sceneBoundingRect().intersects(data), plot


@pytest.mark.parametrize(("low", "high"), [(0.0, 3.0), (-0.5, 2.5), (0.0, 1.0), (0, 400.0)])
def test_integer_axes_tick_at_whole_numbers_only(qtbot, low, high):
    plot = make_plot("Latency per request", "ms", "request", integer=("bottom",))
    qtbot.addWidget(plot)
    axis = plot.getAxis("bottom")
    assert isinstance(axis, IntegerAxis)
    levels = axis.tickValues(low, high, 400)
    values = list(itertools.chain.from_iterable(v for _, v in levels))
    assert values and all(float(v).is_integer() for v in values)
    assert all(low <= v <= high for v in values)
    plain = make_plot("Latency", "ms").getAxis("bottom")  # time: fractions are fine there
    assert not isinstance(plain, IntegerAxis)
