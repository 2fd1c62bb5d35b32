"""Widgets on their own (no model): fields, the block map, ring buffers, exports, scrolling."""

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

from app.gui.worker import Delta, _coalesce
from engine.core.sampling import SamplingParams
from widgets.block_map import CACHED, FREE, KVBlockMap, owner_colour
from widgets.chat_pane import ChatPane, MessageView
from widgets.controls import ControlsPanel, NumberField
from widgets.instruments import InstrumentFrame, InstrumentsPanel, RequestPoint, RingBuffer

pytestmark = pytest.mark.usefixtures("gui_gc")


def test_number_field_refuses_out_of_range_and_keeps_the_last_good_value(qtbot: object) -> None:
    f = NumberField("top-p", 0.9, lo=0, hi=1, lo_open=True)
    qtbot.addWidget(f)  # type: ignore[attr-defined]
    said: list[str] = []
    changed: list[bool] = []
    f.invalid.connect(said.append)
    f.changed.connect(lambda: changed.append(True))
    for bad in ("0", "1.5", "abc", "", "nan"):
        f.setText(bad)
        f.editingFinished.emit()
        assert f.text() == "0.9" and f.value() == 0.9
    assert len(said) == 5 and all("top-p" in s for s in said)
    assert "must be in (0, 1]" in said[0] and "must be a number" in said[2]
    f.setText("0.5")
    f.editingFinished.emit()
    assert f.value() == 0.5 and changed == [True]


def test_optional_integer_field(qtbot: object) -> None:
    f = NumberField("seed", None, lo=0, hi=100, integer=True, optional=True)
    qtbot.addWidget(f)  # type: ignore[attr-defined]
    assert f.value() is None
    f.setText("1.5")
    f.editingFinished.emit()
    assert f.value() is None
    f.setText("42")
    f.editingFinished.emit()
    assert f.value() == 42


def test_controls_give_valid_sampling_params_and_round_trip_their_state(qtbot: object) -> None:
    c = ControlsPanel()
    qtbot.addWidget(c)  # type: ignore[attr-defined]
    c.top_k.set_value(40)
    c.seed.set_value(3)
    c.stop_strings.setText("###, User:")
    c.window_on.setChecked(True)
    params = SamplingParams(**c.sampling())  # the engine accepts what the panel holds
    assert params.top_k == 40 and params.seed == 3 and params.stop == ("###", "User:")
    assert c.cache_window() == (4, 256)
    other = ControlsPanel()
    qtbot.addWidget(other)  # type: ignore[attr-defined]
    other.restore(c.state())
    assert other.sampling() == c.sampling() and other.cache_window() == c.cache_window()
    other.restore({"temperature": "99", "top_k": "x"})  # unreadable values keep defaults
    assert other.sampling()["temperature"] == c.sampling()["temperature"]


SMOL = {"temperature": 0.2, "top_k": 50, "top_p": 0.9, "min_p": 0.0, "repetition_penalty": 1.0}


def test_controls_show_the_model_default_sampling_and_reset_restores_it(qtbot: object) -> None:
    c = ControlsPanel()
    qtbot.addWidget(c)  # type: ignore[attr-defined]
    c.set_model_defaults("default", SMOL)
    s = c.sampling()
    assert (s["temperature"], s["top_k"], s["top_p"], s["min_p"]) == (0.2, 50, 0.9, 0)
    assert c.sampling_source.text() == "model default"
    assert not c.reset_sampling_button.isEnabled()
    assert "temperature 0.2, top-k 50, top-p 0.9" in c.sampling_source.toolTip()
    c.temperature.setText("0.8")  # the user's own value
    c.temperature.editingFinished.emit()
    assert c.sampling_source.text() == "your own values" and c.reset_sampling_button.isEnabled()
    c.set_model_defaults("default", SMOL)  # the same model again (say, another precision)
    assert c.sampling()["temperature"] == 0.8
    saved = c.state()
    c.reset_sampling_button.click()
    assert c.sampling()["temperature"] == 0.2 and c.sampling_source.text() == "model default"
    c.temperature.set_value(1.0)
    c.set_model_defaults("/models/other", {"temperature": 0.0, "repetition_penalty": 1.1})
    s = c.sampling()  # another model: its own defaults
    assert (s["temperature"], s["top_k"], s["top_p"], s["repetition_penalty"]) == (0, 0, 1, 1.1)
    assert c.sampling_source.text() == "model default"

    after_restart = ControlsPanel()  # the user's values survive a restart with that model
    qtbot.addWidget(after_restart)  # type: ignore[attr-defined]
    after_restart.restore(saved)
    after_restart.set_model_defaults("default", SMOL)
    assert after_restart.sampling()["temperature"] == 0.8
    old_settings = ControlsPanel()  # saved before models had defaults: the model's win
    qtbot.addWidget(old_settings)  # type: ignore[attr-defined]
    old_settings.restore({"temperature": "0.7", "top_p": "0.95"})
    old_settings.set_model_defaults("default", SMOL)
    assert old_settings.sampling()["temperature"] == 0.2
    assert old_settings.sampling()["top_p"] == 0.9


def test_device_choice_offers_auto_and_shows_where_it_runs(qtbot: object) -> None:
    c = ControlsPanel()
    qtbot.addWidget(c)  # type: ignore[attr-defined]
    c.set_devices(["auto", "cpu", "cuda:0"])
    assert c.device_combo.itemText(0) == "auto" and c.device() == "auto"
    requested: list[str] = []
    c.device_requested.connect(requested.append)
    c.show_model("default", "fp32", "auto", "cpu")
    assert c.device() == "auto" and c.device_combo.currentText() == "auto → cpu"
    c.device_combo.activated.emit(0)
    assert requested == ["auto"]
    c.show_model("default", "fp32", "cuda:0", "cuda:0")
    assert c.device() == "cuda:0"
    c.set_devices(["auto", "cpu"])  # the chosen device is gone: back to auto
    assert c.device() == "auto"


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


def test_a_streaming_reply_is_rendered_at_most_once_per_interval(qtbot: object) -> None:
    from widgets.chat_pane import STREAM_RENDER_MS, MarkdownView

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


def test_controls_prefix_cache_switch_clear_button_and_label(qtbot: object) -> None:
    c = ControlsPanel()
    qtbot.addWidget(c)  # type: ignore[attr-defined]
    assert c.prefix_cache() and c.clear_prefix_cache.isEnabled()  # on by default
    assert c.prefix_cache_label.text() == "no prompts yet"
    toggled: list[bool] = []
    cleared: list[bool] = []
    c.prefix_cache_toggled.connect(toggled.append)
    c.prefix_cache_clear_requested.connect(lambda: cleared.append(True))
    c.clear_prefix_cache.click()
    assert cleared == [True]
    c.show_prefix_cache(0.64, 20)
    assert c.prefix_cache_label.text() == "hits 64% · 20 blocks cached"
    c.show_prefix_cache(1.0, 1)
    assert c.prefix_cache_label.text() == "hits 100% · 1 block cached"
    c.prefix_cache_on.click()  # off: no clearing, the label says so
    assert toggled == [False] and not c.prefix_cache()
    assert not c.clear_prefix_cache.isEnabled() and c.prefix_cache_label.text() == "off"
    c.show_prefix_cache(None, 0)  # a snapshot while off keeps saying off
    assert c.prefix_cache_label.text() == "off"
    c.prefix_cache_on.click()
    assert toggled == [False, True] and c.clear_prefix_cache.isEnabled()
    assert c.prefix_cache_label.text() == "no prompts yet"

    c.prefix_cache_on.setChecked(False)
    saved = c.state()
    other = ControlsPanel()
    qtbot.addWidget(other)  # type: ignore[attr-defined]
    restored: list[bool] = []
    other.prefix_cache_toggled.connect(restored.append)
    other.restore(saved)  # a saved 'off' reaches whoever listens: the engine follows it
    assert not other.prefix_cache() and restored == [False]
    assert not other.clear_prefix_cache.isEnabled()
    other.restore({"temperature": "0.5"})  # saved before the prefix cache existed: on
    assert other.prefix_cache() and other.clear_prefix_cache.isEnabled()
    other.restore({"prefix_cache": "false"})  # as a settings store may hand it back
    assert not other.prefix_cache()


def test_controls_speculation_emits_text_and_k_and_round_trips(
    qtbot: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = ControlsPanel()
    qtbot.addWidget(c)  # type: ignore[attr-defined]
    asked: list[tuple[str, int]] = []
    c.speculation_changed.connect(lambda text, k: asked.append((text, k)))
    assert c.speculation() == ("", 8) and c.spec_label.text() == "off"  # off by default
    assert not c.spec_precision.isEnabled() and not c.spec_folder.isEnabled()

    def choose(method: str) -> None:
        c.spec_method.setCurrentIndex(c.spec_method.findData(method))

    choose("lookup")
    assert asked == [("lookup", 8)] and c.spec_label.text() == "applying…"
    c.show_speculation("lookup", 8)  # the worker's answer, then a metrics snapshot
    assert c.spec_label.text() == "lookup · no drafts yet"
    c.show_speculation_stats(0.62, 2.94)
    assert c.spec_label.text() == "lookup · 62% accepted · 2.9 tokens/step"
    c.spec_k.setValue(6)
    c.spec_k.setValue(20)  # clamped to 16
    assert asked[1:] == [("lookup", 6), ("lookup", 16)]
    choose("self")
    assert c.spec_precision.isEnabled() and asked[-1] == ("self:int4-g32+head", 16)
    assert c.spec_label.text() == "loading the drafter…"
    c.spec_precision.setCurrentText("int8+head")
    assert asked[-1] == ("self:int8+head", 16)
    for text, k in asked[1:]:  # the answers to the four changes since
        c.show_speculation(text, k)
    n = len(asked)
    choose("model")  # no folder yet: nothing asked, the running drafter is named
    assert len(asked) == n and c.speculation() is None and c.spec_browse.isEnabled()
    assert c.spec_label.text() == "choose the draft model's folder (self:int8+head runs meanwhile)"
    monkeypatch.setattr(
        "widgets.controls.QFileDialog.getExistingDirectory", lambda *a, **k: "/models/draft-135m"
    )
    c.spec_browse.click()
    assert asked[-1] == ("model:/models/draft-135m", 16)
    # the folder is refused: the controls go back to what runs and say why
    c.show_speculation("self:int8+head", 16, "speculative decoding with model:… could not start")
    assert c.spec_method.currentData() == "self" and c.spec_precision.currentText() == "int8+head"
    assert c.spec_label.text().startswith("⚠ speculative decoding with model:")
    assert len(asked) == n + 1  # going back asks for nothing

    choose("model")  # the folder is kept: this asks for it again
    assert asked[-1] == ("model:/models/draft-135m", 16)
    c.show_speculation("model:/models/draft-135m", 16)
    c.show_speculation_stats(0.5, 2.0)
    assert c.spec_label.text() == "model:draft-135m · 50% accepted · 2.0 tokens/step"
    other = ControlsPanel()
    qtbot.addWidget(other)  # type: ignore[attr-defined]
    restored: list[tuple[str, int]] = []
    other.speculation_changed.connect(lambda text, k: restored.append((text, k)))
    other.restore(c.state())  # a saved choice reaches whoever listens: the engine follows it
    assert restored == [("model:/models/draft-135m", 16)] and other.speculation() == c.speculation()
    other.restore({"temperature": "0.5"})  # saved before speculative decoding existed: off
    assert restored[-1] == ("", 8) and other.spec_method.currentData() == ""
    other.restore({"speculation": {"method": "self", "precision": "int4-g64", "k": "x"}})
    assert restored[-1] == ("self:int4-g64", 8)  # an unreadable k keeps the default
    choose("")
    assert asked[-1] == ("", 16)


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
    from widgets.chat_pane import SPECULATION_MARKS

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
