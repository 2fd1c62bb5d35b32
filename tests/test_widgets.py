"""Widgets on their own (no model): the block map, ring buffers, exports, scrolling, the chat's
rendering and marks, garbage collection in the UI thread; the widgets import no torch. The
controls panel is in test_controls.py."""

from __future__ import annotations

import csv
import gc
import os
import subprocess
import sys
import threading
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PySide6.QtCore import QPoint, QRect

from app.gui.commands import Delta
from app.gui.worker_loop import _coalesce
from widgets.block_map import CACHED, FREE, KVBlockMap, owner_colour
from widgets.chat_pane import ChatPane, MessageView
from widgets.instruments import InstrumentFrame, InstrumentsPanel, RequestPoint, RingBuffer

pytestmark = pytest.mark.usefixtures("gui_gc")


def test_block_map_counts_and_hit_testing(qtbot: object) -> None:
    m = KVBlockMap()
    qtbot.addWidget(m)  # type: ignore[attr-defined]
    m.resize(300, 100)
    owners: list[tuple[str, ...]] = [(), ("a",), ("a",), (), ("b",)] * 20
    m.set_blocks(owners)
    assert m.used_cells == 60 and m.total_cells == 100
    assert m.shared_cells == m.cached_cells == 0 and m.cached() == [False] * 100
    cols, _, cell = m._grid()
    for index in range(len(owners)):
        row, col = divmod(index, cols)
        assert m.block_at(QPoint(col * cell + cell // 2, row * cell + cell // 2)) == index
    m.show()
    assert not m.grab().isNull()


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 20_000),
    width=st.integers(20, 1600),
    height=st.integers(20, 900),
)
def test_block_map_grid_fits_every_block(n: int, width: int, height: int) -> None:
    m = KVBlockMap()
    m.set_blocks([()] * n)
    m.resize(width, height)
    width, height = m.width(), m.height()  # the widget has a minimum size
    cols, rows, cell = m._grid()
    assert cols * rows >= n
    assert cols * cell <= width
    assert cell == 1 or rows * cell <= height  # below one pixel a cell, the map may overflow


def _cell_colours(m: KVBlockMap, index: int) -> set[int]:
    """The colours (RGB) drawn inside block ``index``'s cell, its gap left out."""
    cols, _, cell = m._grid()
    row, col = divmod(index, cols)
    image = m.grab().toImage()
    rect = QRect(col * cell, row * cell, cell - 1, cell - 1)
    return {
        image.pixelColor(x, y).rgb()
        for x in range(rect.left(), rect.right() + 1)
        for y in range(rect.top(), rect.bottom() + 1)
    }


def test_block_map_draws_shared_blocks_striped_and_cached_ones_apart(qtbot: object) -> None:
    m = KVBlockMap()
    qtbot.addWidget(m)  # type: ignore[attr-defined]
    m.resize(240, 120)
    m.set_blocks(
        [("a",), ("b", "a"), ("c", "a", "b"), (), (), ("b",)],
        [False, True, False, True, False, False],  # a held block's flag changes nothing
    )
    m.show()
    assert m._grid()[2] >= 8
    assert (m.total_cells, m.used_cells, m.shared_cells, m.cached_cells) == (6, 4, 2, 1)
    assert m.owners()[1] == ("a", "b")  # sorted, so the stripes come out the same each time
    a, b, c = (owner_colour(o).rgb() for o in "abc")
    assert _cell_colours(m, 0) == {a}
    assert _cell_colours(m, 1) == {a, b}
    assert _cell_colours(m, 2) == {a, b, c}
    assert _cell_colours(m, 3) == {CACHED.rgb()}
    assert _cell_colours(m, 4) == {FREE.rgb()} != {CACHED.rgb()}
    assert all(CACHED.rgb() != owner_colour(o).rgb() for o in "abc")
    assert [m.describe(i) for i in range(6)] == [
        "block 0: a",
        "block 1: shared by a, b",
        "block 2: shared by a, b, c",
        "block 3: cached prefix (free, reusable)",
        "block 4: empty",
        "block 5: b",
    ]
    before = m._image
    m.set_blocks([("a",), ("a", "b"), ("a", "b", "c"), (), (), ("b",)], m.cached())
    assert m._image is before  # the same blocks: nothing to draw again
    m.set_blocks([("a", "b")] * 6)
    assert m._image.isNull() and m.cached_cells == 0
    with pytest.raises(ValueError, match="2 cached flags for 6 blocks"):
        m.set_blocks([()] * 6, [True, False])


@pytest.mark.parametrize(("width", "n", "cell"), [(200, 2_000, 2), (130, 7_000, 1)])
def test_block_map_shows_shared_blocks_in_tiny_cells(
    qtbot: object, width: int, n: int, cell: int
) -> None:
    m = KVBlockMap()
    qtbot.addWidget(m)  # type: ignore[attr-defined]
    m.resize(width, 60)
    m.set_blocks([("a", "b")] * n)
    m.show()
    assert m._grid()[2] == cell
    image = m.grab().toImage()
    drawn = {image.pixelColor(x, y).rgb() for x in range(4) for y in range(4)}
    a, b = owner_colour("a").rgb(), owner_colour("b").rgb()
    if cell > 1:  # one-pixel stripes
        assert drawn == {a, b}
    else:  # one pixel a block: the first owner's colour, lightened
        assert len(drawn) == 1 and not drawn & {a, b, FREE.rgb(), CACHED.rgb()}


def test_ring_buffer_keeps_the_last_points_in_order() -> None:
    r = RingBuffer(4, 2)
    for i in range(10):
        r.append([i, 10 * i])
    assert r.view()[:, 0].tolist() == [6, 7, 8, 9]
    assert r.view()[:, 1].tolist() == [60, 70, 80, 90]


def _frame(t: float, used: int, hit_rate: float | None = None) -> InstrumentFrame:
    """``used`` of 10 blocks held, the first by two requests; the next two free but cached."""
    owners: list[tuple[str, ...]] = [("r1", "r2"), *[("r1",)] * (used - 1)] if used else []
    owners += [()] * (10 - used)
    return InstrumentFrame(
        t=t,
        memory_mib={"weights": 100.0, "KV pool": 10.0, "process RSS": 300.0 + t},
        kv_usage=used / 10,
        kv_blocks_used=used,
        kv_blocks_total=10,
        block_owners=tuple(owners),
        generation_tps=5.0 * t,
        block_cached=tuple(used <= i < used + 2 for i in range(10)),
        kv_blocks_cached=2,
        kv_blocks_shared=min(used, 1),
        prefix_hit_rate=hit_rate,
        layer_attention_ms=(1.0, 2.0),
        layer_mlp_ms=(3.0, 4.0),
    )


def read_csv(path: Path) -> list[list[str]]:
    with open(path, encoding="utf-8", newline="") as f:
        return list(csv.reader(f))


def test_instruments_export_png_and_csv(qtbot: object, tmp_path: Path) -> None:
    panel = InstrumentsPanel()
    qtbot.addWidget(panel)  # type: ignore[attr-defined]
    panel.resize(500, 700)
    panel.show()
    panel.add_frame(_frame(100.0, 0))
    assert panel.block_label.text() == "KV blocks: 0 / 10 used (0.0%) · 0 shared · 2 cached"
    for t in range(1, 5):  # the hit rate unknown at first (no prompt yet), then 40…80%
        panel.add_frame(_frame(100.0 + t, t, None if t < 2 else t / 5))
    panel.add_request(RequestPoint(0.25, 0.02))
    panel.add_request(RequestPoint(0.5, None))
    assert panel.block_label.text() == (
        "KV blocks: 4 / 10 used (40.0%) · 1 shared · 2 cached · prefix hits 80%"
    )
    block_map = panel.block_map
    assert (block_map.used_cells, block_map.shared_cells, block_map.cached_cells) == (4, 1, 2)
    assert block_map.owners()[:2] == [("r1", "r2"), ("r1",)]
    panel.redraw()
    x, y = panel.prefix_curve.getData()
    assert x.tolist() == [0, 1, 2, 3, 4] and y[2:].tolist() == pytest.approx([40, 60, 80])
    assert np.isnan(y[:2]).all()
    panel.export_png(tmp_path / "memory.png")
    assert (tmp_path / "memory.png").stat().st_size > 1000
    panel.export_csv(tmp_path / "memory.csv")
    rows = read_csv(tmp_path / "memory.csv")
    assert rows[0] == [
        "time_s",
        "weights_mib",
        "KV pool_mib",
        "process RSS_mib",
        "kv_usage_perc",
        "prefix_hit_perc",
    ]
    assert [float(r[0]) for r in rows[1:]] == [0, 1, 2, 3, 4]
    assert [float(r[-2]) for r in rows[1:]] == [0, 10, 20, 30, 40]
    assert [r[-1] for r in rows[1:]] == ["", "", "40", "60", "80"]  # unknown: left empty
    panel.tabs.setCurrentIndex(1)
    panel.export_csv(tmp_path / "latency.csv")
    rows = read_csv(tmp_path / "latency.csv")
    assert rows[1:] == [["1", "0.25", "0.02"], ["2", "0.5", ""]]
    panel.tabs.setCurrentIndex(2)
    panel.export_csv(tmp_path / "layers.csv")
    rows = read_csv(tmp_path / "layers.csv")
    assert rows[1:] == [["0", "1", "3"], ["1", "2", "4"]]


def test_chat_follows_the_end_unless_scrolled_up(qtbot: object) -> None:
    pane = ChatPane()
    qtbot.addWidget(pane)  # type: ignore[attr-defined]
    pane.resize(700, 500)
    pane.show()
    for i in range(12):
        pane.add_message(MessageView("user" if i % 2 == 0 else "assistant", [f"message {i}"]))
    bar = pane.scroll_area.verticalScrollBar()
    qtbot.waitUntil(lambda: bar.maximum() > 0 and bar.value() == bar.maximum())  # type: ignore[attr-defined]
    pane.add_message(MessageView("assistant", [""], "streaming"))
    for _ in range(20):
        pane.append_to_last(0, "more text, line after line.\n\n")
    qtbot.waitUntil(lambda: bar.value() == bar.maximum())  # type: ignore[attr-defined]
    bar.setValue(0)  # the user scrolls up to read
    assert not pane.following
    for _ in range(10):
        pane.append_to_last(0, "still streaming.\n\n")
    qtbot.wait(50)  # type: ignore[attr-defined]
    assert bar.value() == 0
    bar.setValue(bar.maximum())  # back at the end: following again
    assert pane.following


def test_deltas_are_coalesced_per_candidate_in_order() -> None:
    deltas = [
        Delta("t", 0, "a"),
        Delta("t", 1, "x"),
        Delta("t", 0, "b"),
        Delta("t", 1, "y", "stop"),
        Delta("u", 0, "z"),
    ]
    assert _coalesce(deltas) == [
        Delta("t", 0, "ab"),
        Delta("t", 1, "xy", "stop"),
        Delta("u", 0, "z"),
    ]


def test_garbage_is_collected_in_the_ui_thread_only(qtbot: object) -> None:
    """Cyclic garbage made in another thread (as the engine and loader threads do) is
    collected, but only by the UI thread's timer (``app.gc_guard``, on via ``gui_gc``)."""
    in_main: list[bool] = []

    def watch(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            in_main.append(threading.current_thread() is threading.main_thread())

    def churn() -> None:
        for _ in range(100_000):
            cycle: list[object] = []
            cycle.append(cycle)

    gc.callbacks.append(watch)
    try:
        worker = threading.Thread(target=churn)
        worker.start()
        worker.join()
        qtbot.waitUntil(lambda: bool(in_main), timeout=5000)  # type: ignore[attr-defined]
    finally:
        gc.callbacks.remove(watch)
    assert all(in_main)


def test_no_display_prints_what_to_do_instead_of_a_qt_backtrace() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY")}
    env.pop("QT_QPA_PLATFORM", None)
    out = subprocess.run(
        [sys.executable, "-m", "app.cli"], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2
    assert "no display found" in out.stderr and "xvfb-run" in out.stderr
    assert "Traceback" not in out.stderr


def test_widgets_import_no_torch() -> None:
    """Every module of widgets/ (found, so a new one is covered) imports without torch, not
    even through an engine module: the views take plain data, and open without a model."""
    code = (
        "import importlib, pkgutil, sys, widgets\n"
        "names = [m.name for m in pkgutil.iter_modules(widgets.__path__, 'widgets.')]\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "print(' '.join(names))\n"
        "print('torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    names, torch_imported = done.stdout.split("\n")[:2]
    assert {"widgets.tuner", "widgets.ab_view", "widgets.controls"} <= set(names.split())
    assert torch_imported == "False"


def test_a_streaming_reply_is_rendered_at_most_once_per_interval(qtbot: object) -> None:
    from widgets.chat_pane import STREAM_RENDER_MS
    from widgets.markdown_view import MarkdownView

    pane = ChatPane()
    qtbot.addWidget(pane)  # type: ignore[attr-defined]
    pane.add_message(MessageView("assistant", [""], "streaming"))
    renders: list[str] = []
    body = pane.last.body  # type: ignore[union-attr]
    real = MarkdownView.set_text

    def counting(view: MarkdownView, text: str) -> None:
        renders.append(text)
        real(view, text)

    body.set_text = counting.__get__(body)  # type: ignore[method-assign]
    for i in range(100):  # a burst of deltas, faster than any frame
        pane.append_to_last(0, f"word{i} ")
    assert renders == []  # kept, not yet parsed
    assert pane.last.view.text.count("word") == 100  # type: ignore[union-attr]
    qtbot.waitUntil(lambda: len(renders) == 1, timeout=10 * STREAM_RENDER_MS)  # type: ignore[attr-defined]
    assert body.text() == pane.last.view.text  # type: ignore[union-attr]
    pane.append_to_last(0, "last")
    pane.finish_last("done")  # the end is rendered at once, whatever was pending
    assert body.text().endswith("last") and len(renders) == 2


def test_settle_freezes_survivors_and_reclaims_what_was_dropped_since() -> None:
    import weakref

    from app.gui.gc_guard import settle

    class Node:
        pass

    a = Node()
    a.self_ref = a  # type: ignore[attr-defined]  # a cycle: only the collector frees it
    gone = weakref.ref(a)
    try:
        settle()
        assert gc.get_freeze_count() > 0 and gone() is not None
        del a  # dropped while frozen: a plain collection skips it …
        gc.collect()
        assert gone() is not None
        settle()  # … the next settle unfreezes first, so it goes
        assert gone() is None
    finally:
        gc.unfreeze()


def test_emitting_signals_keeps_reference_counts() -> None:
    """PySide6 6.12.0 dropped a reference to ``True`` on every ``emit`` from Python; the app
    emits thousands a minute, and the interpreter then aborted in ``bool_dealloc``. That
    version is excluded in pyproject.toml; this catches it, or a release like it, here."""
    from PySide6.QtCore import QObject, Signal

    class Emitter(QObject):
        value = Signal(object)
        values = Signal(list)

    emitter, seen = Emitter(), []
    emitter.value.connect(seen.append)
    emitter.values.connect(seen.append)
    before = {name: sys.getrefcount(obj) for name, obj in (("True", True), ("None", None))}
    for _ in range(200):  # few enough that a leaking build fails here rather than aborts
        emitter.value.emit(1)
        emitter.values.emit([1, 2])
    after = {name: sys.getrefcount(obj) for name, obj in (("True", True), ("None", None))}
    assert len(seen) == 400
    # other threads may take or drop a few references meanwhile; a leak per emit is hundreds
    assert all(abs(after[k] - before[k]) < 50 for k in before), (before, after)


def _colours(body: object) -> list[tuple[str, str | None]]:
    """The text shown and each run's background colour (None: none), run by run."""
    from PySide6.QtCore import Qt
    from PySide6.QtGui import QTextCursor

    doc = body.document()  # type: ignore[attr-defined]
    cursor = QTextCursor(doc)
    runs: list[tuple[str, str | None]] = []
    for pos in range(1, doc.characterCount()):
        cursor.setPosition(pos)
        char = doc.characterAt(pos - 1)
        brush = cursor.charFormat().background()
        colour = None if brush.style() == Qt.BrushStyle.NoBrush else brush.color().name()
        if runs and runs[-1][1] == colour:
            runs[-1] = (runs[-1][0] + char, colour)
        else:
            runs.append((char, colour))
    return runs


def test_chat_marks_streamed_pieces_by_how_they_came(qtbot: object) -> None:
    from widgets.markdown_view import SPECULATION_MARKS

    accepted, corrected, bonus = (
        SPECULATION_MARKS[k][0] for k in ("accepted", "corrected", "bonus")
    )
    pane = ChatPane()
    qtbot.addWidget(pane)  # type: ignore[attr-defined]
    assert not pane.mark_speculation.isChecked()  # off by default
    pane.add_message(MessageView("assistant", [""], "streaming"))
    pane.append_to_last(0, "One ")  # a plain step first
    pane.append_to_last(0, "two three", (("two ", "accepted"), ("three", "corrected")))
    pane.append_to_last(0, " four", ((" four", "bonus"),))
    pane.append_to_last(0, "!")
    pane.finish_last("done")
    bubble = pane.last
    assert bubble is not None
    assert bubble.view.text == "One two three four!"  # the message's text stays plain
    assert not bubble.body.marked and bubble.body.text() == "One two three four!"
    assert all(colour is None for _, colour in _colours(bubble.body))

    pane.mark_speculation.setChecked(True)
    assert bubble.body.marked and not pane.speculation_legend.isHidden()
    assert _colours(bubble.body) == [
        ("One ", None), ("two ", accepted), ("three", corrected), (" four", bonus), ("!", None),
    ]  # fmt: skip
    assert bubble.view.text == "One two three four!"
    # a reply from the history has no pieces: shown as Markdown whatever the switch
    old = pane.add_message(MessageView("assistant", ["**plain**"]))
    assert not old.body.marked and old.body.text() == "**plain**"

    pane.mark_speculation.setChecked(False)
    assert not bubble.body.marked and pane.speculation_legend.isHidden()
    assert bubble.body.text() == "One two three four!"


def test_instruments_plot_speculation_acceptance_by_draft_position(
    qtbot: object, tmp_path: Path
) -> None:
    from dataclasses import replace

    panel = InstrumentsPanel()
    qtbot.addWidget(panel)  # type: ignore[attr-defined]
    panel.add_frame(_frame(1.0, 2))
    panel.redraw()
    assert panel.spec_plot.isHidden() and "off" in panel.spec_label.text()
    spec = replace(
        _frame(2.0, 2), speculative="lookup", spec_draft_tokens_per_pos=(8, 4, 4),
        spec_acceptance_per_pos=(1.0, 0.5, 0.25), spec_acceptance_rate=0.625,
        spec_mean_acceptance_length=2.25, spec_draft_s=0.01, spec_verify_s=0.5,
    )  # fmt: skip
    panel.add_frame(spec)
    panel.redraw()
    assert not panel.spec_plot.isHidden()
    assert panel.spec_bars.opts["x"].tolist() == [1, 2, 3]
    assert panel.spec_bars.opts["height"].tolist() == [100, 50, 25]
    assert "62% of draft tokens accepted" in panel.spec_label.text()
    assert "mean acceptance length 2.25" in panel.spec_label.text()
    panel.tabs.setCurrentIndex(3)
    panel.export_csv(tmp_path / "spec.csv")
    rows = read_csv(tmp_path / "spec.csv")
    assert rows == [
        ["draft_position", "draft_tokens", "acceptance"],
        ["1", "8", "1"], ["2", "4", "0.5"], ["3", "4", "0.25"],
    ]  # fmt: skip
    panel.add_frame(_frame(3.0, 2))  # switched off: the plot goes, its bars emptied
    panel.redraw()
    assert panel.spec_plot.isHidden() and len(panel.spec_bars.opts["height"]) == 0


def test_deltas_keep_speculation_pieces_when_coalesced() -> None:
    deltas = [
        Delta("t", 0, "a"),
        Delta("t", 0, "bc", pieces=(("b", "accepted"), ("c", "accepted"))),
        Delta("t", 0, "d", pieces=(("d", "bonus"),)),
        Delta("t", 0, "e", "stop"),
    ]
    (merged,) = _coalesce(deltas)
    assert merged.text == "abcde" and merged.finish == "stop"
    assert merged.pieces == (("a", ""), ("bc", "accepted"), ("d", "bonus"), ("e", ""))
    assert _coalesce([Delta("t", 0, "a"), Delta("t", 0, "b")])[0].pieces == ()
