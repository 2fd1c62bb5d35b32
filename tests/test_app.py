"""The desktop app's chat on the real default model, offscreen (pytest-qt): replies stream
and equal the engine's, stop, regenerate, edit, conversations kept, the instruments, errors
that keep the chat, speculative decoding marked, screenshots.

Each test opens a real :class:`MainWindow` on a fresh data folder; the engine runs in the
window's worker thread exactly as it does for a user.
"""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest
from PySide6.QtCore import Qt, QTimer

from app.conversations import ChatStore
from app.gui.chat_window import stats_text
from app.gui.commands import Delta, Pause, ReplyStats
from app.gui.main_window import MainWindow
from engine.core.engine import LLMEngine
from engine.core.sampling import SamplingParams
from engine.hardware.cpu_paths import cpu_paths
from tests.app_window import (
    LONG_WAIT_MS,
    Recorder,
    open_window,
    send,
    start_long_reply,
    stored,
)

pytestmark = [pytest.mark.real_model, pytest.mark.usefixtures("gui_gc")]
#: replies checked against the engine alone: a real answer of several streamed updates
REPLY_TOKENS = 12
#: replies that only have to be there (history, regenerate, edit, the chat going on)
SHORT = 4


def test_reply_streams_in_several_updates_and_equals_the_engine_alone(
    qtbot: object, window: MainWindow, oracle: LLMEngine
) -> None:
    seen: list[str] = []
    recorder = Recorder(lambda _: seen.append(window.chat.last.view.text))  # type: ignore[union-attr]
    window.worker.deltas.connect(recorder.record)
    window.controls.max_new_tokens.set_value(REPLY_TOKENS)
    send(qtbot, window, "Name three colours of the sea.")
    reply = window.chat.last
    assert reply is not None and reply.view.status == "done"
    texts = [t for t in seen if t]
    assert len(set(texts)) >= 2, "the reply arrived in one piece, not streamed"
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))
    prompt = oracle.chat_prompt_ids([{"role": "user", "content": "Name three colours of the sea."}])
    gen = oracle.generate(prompt, SamplingParams(max_new_tokens=REPLY_TOKENS))
    for _ in gen:
        pass
    assert len(gen.result.token_ids) == REPLY_TOKENS
    assert reply.view.text == gen.result.text
    assert reply.body.text() == gen.result.text
    assert stored(window) == [
        ("user", "Name three colours of the sea.", "done"),
        ("assistant", gen.result.text, "done"),
    ]


def test_stop_ends_within_one_step_and_keeps_the_partial_reply(
    qtbot: object, window: MainWindow
) -> None:
    start_long_reply(qtbot, window)
    engine = window.worker.engine
    assert engine is not None
    (rid,) = list(window.worker._replies)
    produced = len(engine.sequence(rid).output_ids)
    window.chat.stop_button.click()
    qtbot.waitUntil(lambda: window.active is None, timeout=LONG_WAIT_MS)  # type: ignore[attr-defined]
    metrics = engine.request_metrics(rid)
    assert metrics is not None and metrics.finish_reason == "cancelled"
    assert metrics.output_tokens <= produced + 1  # the step in flight, no more
    reply = window.chat.last
    assert reply is not None and reply.view.status == "stopped" and reply.view.text
    assert stored(window)[-1] == ("assistant", reply.view.text, "stopped")
    assert window.chat.send_button.isEnabled()


def test_regenerate_replaces_the_last_reply(qtbot: object, window: MainWindow) -> None:
    window.controls.max_new_tokens.set_value(SHORT)
    send(qtbot, window, "Say hello.")
    first = window.store.messages(window.conversation_id)[-1]  # type: ignore[arg-type]
    window.controls.temperature.set_value(1.0)
    window.controls.seed.set_value(7)
    window.chat.regenerate_button.click()
    qtbot.waitUntil(lambda: window.active is None, timeout=LONG_WAIT_MS)  # type: ignore[attr-defined]
    messages = window.store.messages(window.conversation_id)  # type: ignore[arg-type]
    assert [m.role for m in messages] == ["user", "assistant"]
    assert messages[1].id != first.id and messages[1].status == "done"
    assert len(window.chat.bubbles) == 2
    assert window.chat.last is not None and window.chat.last.view.text == messages[1].content


def test_edit_last_takes_the_message_back(qtbot: object, window: MainWindow) -> None:
    window.controls.max_new_tokens.set_value(SHORT)
    send(qtbot, window, "Say hello.")
    window.chat.edit_button.click()
    assert window.chat.input.toPlainText() == "Say hello."
    assert stored(window) == [] and window.chat.bubbles == []


def test_conversation_survives_closing_and_reopening(
    qtbot: object, tmp_path: Path, default_model: Path
) -> None:
    data = tmp_path / "data"
    first = open_window(qtbot, data)
    first.controls.max_new_tokens.set_value(SHORT)
    send(qtbot, first, "What is a lighthouse?")
    first.chat.system_prompt.setText("Be brief.")
    first.chat.system_prompt.editingFinished.emit()
    texts = [b.view.text for b in first.chat.bubbles]
    first.close()  # closeEvent: the worker stops, the store closes
    second = open_window(qtbot, data, wait=False)
    try:
        assert [b.view.text for b in second.chat.bubbles] == texts
        assert second.chat.system_prompt.text() == "Be brief."
        assert second.chat.conversation_list.count() == 1
        assert second.chat.conversation_list.item(0).text() == "What is a lighthouse?"
    finally:
        second.shutdown()


def test_conversations_can_be_renamed_deleted_and_switched(
    qtbot: object, window: MainWindow
) -> None:
    window.controls.max_new_tokens.set_value(SHORT)
    send(qtbot, window, "First chat.")
    first = window.conversation_id
    window.chat.new_button.click()
    second = window.conversation_id
    assert second != first and window.chat.bubbles == []
    assert not window.chat.regenerate_button.isEnabled()  # nothing to regenerate yet
    send(qtbot, window, "Second chat.")
    window.chat.rename_requested.emit(second, "Renamed")
    titles = [window.chat.conversation_list.item(i).text() for i in range(2)]
    assert titles == ["Renamed", "First chat."]
    window.chat.conversation_list.setCurrentRow(1)  # the user clicks the first chat
    assert window.conversation_id == first
    assert window.chat.bubbles[0].view.text == "First chat."
    window.chat.delete_requested.emit(first)
    assert window.conversation_id == second
    assert [c.id for c in window.store.conversations()] == [second]
    assert window.chat.bubbles[0].view.text == "Second chat."


def test_a_crash_mid_reply_loses_only_that_reply(tmp_path: Path) -> None:
    store = ChatStore(tmp_path / "chats.sqlite3")
    conv = store.create_conversation()
    store.add_message(conv, "user", "hi")
    store.add_message(conv, "assistant", "", "streaming")
    # no close(): the process "dies" here
    reopened = ChatStore(tmp_path / "chats.sqlite3")
    assert [(m.role, m.content, m.status) for m in reopened.messages(conv)] == [
        ("user", "hi", "done"),
        ("assistant", "", "interrupted"),
    ]
    reopened.close()
    store.close()


@pytest.mark.timing  # measures time: run alone (make test)
def test_ui_stays_responsive_while_a_reply_streams(qtbot: object, window: MainWindow) -> None:
    """The UI thread runs while the engine steps: a 1 ms heartbeat in the UI thread, from a
    200-token reply's first text to its end with every plot live, set against the engine's own
    steps (their start and end, on the same clock).

    Measured in the engine's steps, not in milliseconds, so that it holds on a CPU of any
    speed (the UI's work and the step scale together): a step that blocks the UI thread (run
    on it, or holding a lock the UI waits for) leaves no beat inside any step, and UI work of
    a sizeable part of a step per token stalls the heartbeat for much of the reply. On a busy
    2-core AVX-512 EPYC (~18 tok/s, 55 ms steps), three runs: a beat inside 100% of the steps,
    2% of the time in stalls longer than a quarter step. The engine's step run on the UI
    thread, or behind a lock the heartbeat takes: 0% of the steps. 20 ms of UI work per token:
    37% of the time stalled."""
    from bisect import bisect_right

    window.controls.max_new_tokens.set_value(200)
    engine = window.worker.engine
    assert engine is not None
    engine.collector.window_s = float("inf")  # keep every step of the reply
    beats: list[float] = []
    heartbeat = QTimer(window, interval=1, timerType=Qt.TimerType.PreciseTimer)
    heartbeat.timeout.connect(lambda: beats.append(time.perf_counter()))

    def streaming(_: object) -> None:  # from the first text on: the reply streams
        if not heartbeat.isActive():
            beats.append(time.perf_counter())
            heartbeat.start()

    recorder = Recorder(streaming)
    window.worker.deltas.connect(recorder.record)
    send(qtbot, window, "Write a long paragraph about rain in the city.")
    heartbeat.stop()
    assert len(window.chat.last.view.text) > 400  # type: ignore[union-attr]
    first, last = beats[0], beats[-1]
    steps = [(r.end - r.duration_s, r.end) for r in list(engine.collector.steps)
             if first < r.end - r.duration_s and r.end < last]  # fmt: skip
    assert len(steps) >= 100  # the reply's decode steps while the heartbeat ran

    def beat_inside(start: float, end: float) -> bool:
        i = bisect_right(beats, start)
        return i < len(beats) and beats[i] < end

    inside = sum(beat_inside(*step) for step in steps) / len(steps)
    step_s = sorted(end - start for start, end in steps)[len(steps) // 2]
    gaps = [b - a for a, b in itertools.pairwise(beats)]
    stalled = sum(g for g in gaps if g > 0.25 * step_s) / (last - first)
    print(
        f"heartbeat: {len(beats)} beats in {last - first:.1f} s, {len(steps)} steps of "
        f"{step_s * 1e3:.1f} ms, {inside:.0%} with a beat inside; worst gap "
        f"{max(gaps) * 1e3:.1f} ms, {stalled:.0%} of the time in gaps over a quarter step"
    )
    assert inside > 0.5, "the engine's steps block the UI thread"
    assert stalled < 0.15, "the UI thread works for much of a step per token"


def test_instruments_show_the_engines_figures(qtbot: object, window: MainWindow) -> None:
    recorder = Recorder()
    window.worker.reply_stats.connect(recorder.record)
    stats: list[ReplyStats] = recorder.values  # type: ignore[assignment]
    window.controls.max_new_tokens.set_value(SHORT)
    send(qtbot, window, "Count to five.")
    (s,) = stats
    engine = window.worker.engine
    assert engine is not None
    m = engine.request_metrics(s.request_id)
    assert m is not None and m.time_per_output_token_seconds and m.time_to_first_token_seconds
    assert window.status_speed.text() == f"{1 / m.time_per_output_token_seconds:.1f} tok/s"
    assert window.status_ttft.text() == f"TTFT {m.time_to_first_token_seconds * 1e3:.0f} ms"
    assert window.status_context.text() == (
        f"context {m.prompt_tokens + m.output_tokens} / {engine.context_length}"
    )
    assert window.chat.last is not None  # the engine's figures, then the settings it had
    assert window.chat.last.view.stats == f"{stats_text(s)} · {window.status_settings.text()}"
    # the second turn finds the first in the prefix cache, and says so
    send(qtbot, window, "And to ten.")
    second = stats[1].metrics
    assert second.cached_prompt_tokens >= m.prompt_tokens // 16 * 16 > 0
    assert second.cached_prompt_tokens + second.computed_prompt_tokens == second.prompt_tokens
    assert f"{second.cached_prompt_tokens} cached)" in window.chat.last.view.stats
    assert f"{second.cached_prompt_tokens} cached)" in window.status_ttft.toolTip()
    qtbot.waitUntil(  # type: ignore[attr-defined]
        lambda: window.controls.prefix_cache_label.text().startswith("hits "), timeout=5_000
    )
    tip = window.status_model.toolTip()  # which CPU paths and kernels this model runs
    assert cpu_paths().summary() in tip.splitlines()
    assert engine.threads_report.endswith(", as asked")  # the tests fix the count
    assert {engine.threads_report, engine.graph.summary()} <= set(tip.splitlines())
    assert {f"{g.kind}: {g.form}" for g in engine.weight_groups} <= set(tip.splitlines())

    # the block map, frozen mid-reply, against a recount of the block tables
    window.controls.max_new_tokens.set_value(300)
    window.chat.input.setPlainText("Tell me about the moon.")
    window.chat._submit()
    qtbot.waitUntil(lambda: len(window.chat.last.view.text) > 10, timeout=LONG_WAIT_MS)  # type: ignore[union-attr, attr-defined]
    paused = Recorder()  # not qtbot.waitSignal: its handler would run in the worker thread
    window.worker.paused.connect(paused.record)
    window.worker.post(Pause(True))
    qtbot.waitUntil(lambda: paused.values == [True], timeout=10_000)  # type: ignore[attr-defined]
    mgr = engine.kv.manager
    held = len({b for table in mgr.tables.values() for b in table if b >= 0})
    block_map = window.instruments.block_map
    assert held > 0
    assert block_map.used_cells == held == mgr.num_used
    assert block_map.total_cells == mgr.num_blocks
    assert block_map.owners() == [tuple(sorted(o)) for o in mgr.owners()]
    assert block_map.cached() == mgr.cached_blocks()
    window.worker.post(Pause(False))
    window.stop()
    qtbot.waitUntil(lambda: window.active is None, timeout=LONG_WAIT_MS)  # type: ignore[attr-defined]


def test_out_of_range_value_is_refused_with_a_message(window: MainWindow) -> None:
    field = window.controls.temperature
    field.setText("9")
    field.editingFinished.emit()
    assert field.text() == "0"
    assert window.chat.notice.isVisible()
    assert "temperature must be in [0, 5]" in window.chat.notice.text()
    assert window.controls.sampling()["temperature"] == 0
    window.controls.max_batch_size.setText("0")
    window.controls.max_batch_size.editingFinished.emit()
    assert window.controls.limits()["max_batch_size"] == 16
    assert "max batch size must be in [1, 256]" in window.chat.notice.text()


def test_engine_exception_ends_the_reply_with_an_error_and_the_chat_goes_on(
    qtbot: object, window: MainWindow
) -> None:
    window.controls.max_new_tokens.set_value(SHORT)  # the third forward fails: mid-reply
    send(qtbot, window, "First question.")
    engine = window.worker.engine
    assert engine is not None
    calls = [0]
    real_forward = engine.model.forward

    def failing(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("simulated device fault")
        return real_forward(*args, **kwargs)

    engine.model.forward = failing  # type: ignore[method-assign]
    window.chat.input.setPlainText("Second question.")
    window.chat._submit()
    qtbot.waitUntil(lambda: window.active is None, timeout=LONG_WAIT_MS)  # type: ignore[attr-defined]
    reply = window.chat.last
    assert reply is not None and reply.view.status == "error"
    assert "simulated device fault" in window.chat.notice.text()
    assert reply.view.text  # the tokens before the fault are kept
    assert stored(window)[-1] == ("assistant", reply.view.text, "error")
    assert engine.kv.manager.num_free == engine.kv.manager.num_blocks  # nothing leaked
    send(qtbot, window, "Third question.")
    assert window.chat.last is not None and window.chat.last.view.status == "done"
    assert [r for r, _, _ in stored(window)] == ["user", "assistant"] * 3


def test_candidates_are_batched_into_tabs(qtbot: object, window: MainWindow) -> None:
    window.controls.candidates.set_value(3)
    window.controls.temperature.set_value(1.0)
    window.controls.seed.set_value(11)
    window.controls.max_new_tokens.set_value(SHORT)
    deltas: list[Delta] = []
    recorder = Recorder(deltas.extend)  # type: ignore[arg-type]
    window.worker.deltas.connect(recorder.record)
    send(qtbot, window, "Invent a name for a cat.")
    reply = window.chat.last
    assert reply is not None and len(reply.view.candidates) == 3
    assert reply.tabs.isVisible() and reply.tabs.count() == 3
    assert all(reply.view.candidates)
    assert {d.candidate for d in deltas} == {0, 1, 2}
    reply.tabs.setCurrentIndex(2)
    assert reply.body.text() == reply.view.candidates[2]


def test_lookup_speculation_marks_the_tokens_and_keeps_the_greedy_reply(
    qtbot: object, window: MainWindow, oracle: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    from app.gui import worker as worker_module
    from engine.speculative.config import VerifyCost, parse_speculative
    from widgets.markdown_view import SPECULATION_MARKS

    # the verify cost fixed, not timed: how far each step drafts then depends on nothing
    # a busy CPU could change
    monkeypatch.setattr(
        worker_module, "speculative_config",
        lambda text, k: parse_speculative(text, k=k, verify_cost=VerifyCost()) if text else None,
    )  # fmt: skip
    prompt = "Repeat this sentence exactly, twice: The quick brown fox jumps over the lazy dog."
    gen = oracle.generate(  # the reply without speculation
        oracle.chat_prompt_ids([{"role": "user", "content": prompt}]),
        SamplingParams(max_new_tokens=24),
    )
    for _ in gen:
        pass
    plain = gen.result.text
    deltas: list[Delta] = []
    recorder = Recorder(deltas.extend)  # type: ignore[arg-type]
    window.worker.deltas.connect(recorder.record)
    controls = window.controls
    controls.spec_method.setCurrentIndex(controls.spec_method.findData("lookup"))
    qtbot.waitUntil(lambda: controls.spec_label.text().startswith("lookup"), timeout=30_000)  # type: ignore[attr-defined]
    window.chat.mark_speculation.setChecked(True)
    send(qtbot, window, prompt)
    reply = window.chat.last
    assert reply is not None and reply.view.text == plain  # greedy: token for token the same
    # The recorder's slot is queued after the window's: its last delta may arrive a moment
    # after the window saw the reply end.
    qtbot.waitUntil(lambda: any(d.finish for d in deltas), timeout=30_000)  # type: ignore[attr-defined]
    pieces = [p for d in deltas for p in d.pieces or ((d.text, ""),)]
    assert "".join(text for text, _ in pieces) == plain
    kinds = {kind for _, kind in pieces}
    assert "accepted" in kinds and kinds <= {"", "accepted", "corrected", "bonus"}
    assert reply.body.marked and SPECULATION_MARKS["accepted"][0] in reply.body.toHtml()
    assert stored(window)[-1] == ("assistant", plain, "done")  # the history stays plain text
    qtbot.waitUntil(  # type: ignore[attr-defined]
        lambda: (
            " accepted · " in controls.spec_label.text()
            and window.instruments.last_frame is not None
            and bool(window.instruments.last_frame.spec_acceptance_per_pos)
        ),
        timeout=10_000,
    )
    frame = window.instruments.last_frame
    assert frame is not None and frame.speculative == "lookup"
    assert frame.spec_acceptance_per_pos[0] > 0
    window.instruments.redraw()
    heights = window.instruments.spec_bars.opts["height"].tolist()
    assert heights == pytest.approx([100 * a for a in frame.spec_acceptance_per_pos])
    if os.environ.get("INFERSIGHT_SCREENSHOTS"):  # make screenshots: the overlay and the plot
        tabs = window.instruments.tabs
        tabs.setCurrentIndex(next(i for i in range(tabs.count()) if "Specul" in tabs.tabText(i)))
        window.instruments.redraw()
        window.grab().save(str(Path(os.environ["INFERSIGHT_SCREENSHOTS"]) / "speculation.png"))
        tabs.setCurrentIndex(0)


def test_screenshots(qtbot: object, window: MainWindow, tmp_path: Path) -> None:
    """Mid-reply with the plots populated; ``make screenshots`` keeps the PNGs. What was
    rendered is checked: the block map shows each of the three batched replies in its colour,
    and each memory curve ends inside the plot's visible range at the latest frame's value."""
    from widgets.block_map import owner_colour

    out = Path(os.environ.get("INFERSIGHT_SCREENSHOTS", tmp_path / "screenshots"))
    out.mkdir(parents=True, exist_ok=True)
    # every tab (the A/B lab's forms are the widest) fits a 1280×800 window with the docks
    assert window.minimumSizeHint().width() <= 1280, window.minimumSizeHint()
    assert (window.width(), window.height()) == (1280, 800)
    window.instruments.layer_switch.setChecked(True)
    send(qtbot, window, "What is a KV cache?")
    window.controls.max_new_tokens.set_value(200)
    window.controls.candidates.set_value(3)  # three replies batched: three owners in the map
    window.controls.temperature.set_value(0.7)
    window.controls.seed.set_value(1)
    window.chat.input.setPlainText(
        "Show me a Python function that reverses a string, in a code block."
    )
    window.chat._submit()
    qtbot.waitUntil(lambda: len(window.chat.last.view.text) > 150, timeout=LONG_WAIT_MS)  # type: ignore[union-attr, attr-defined]
    window.worker.post(Pause(True))  # the same figures in every picture and check
    qtbot.wait(300)  # type: ignore[attr-defined]
    window.instruments.redraw()
    owners = {o for held in window.instruments.block_map.owners() for o in held}
    # the three candidates share the prompt's full blocks (prefix caching): striped cells
    assert window.instruments.block_map.shared_cells > 0
    block_map = window.instruments.block_map.grab().toImage()
    drawn = {
        block_map.pixelColor(x, y).rgb()
        for x in range(0, block_map.width(), 2)
        for y in range(0, block_map.height(), 2)
    }
    assert len(owners) == 3, owners
    assert {owner_colour(o).rgb() for o in owners} <= drawn
    plot = window.instruments.memory_plot  # every kind's curve drawn inside the visible range
    (x_lo, x_hi), (y_lo, y_hi) = plot.getPlotItem().viewRange()
    frame = window.instruments.last_frame
    assert frame is not None
    for kind, curve in window.instruments._memory_curves.items():
        x, y = curve.getData()
        assert x is not None and len(x) > 1, kind
        assert x_lo <= x[-1] <= x_hi and y_lo <= y[-1] <= y_hi, (kind, x[-1], y[-1])
        assert y[-1] == pytest.approx(frame.memory_mib[kind])
    window.grab().save(str(out / "main-window.png"))
    cells = window.instruments.block_map.grab()  # three times over, so the stripes show
    cells.scaled(cells.size() * 3, mode=Qt.TransformationMode.FastTransformation).save(
        str(out / "kv-blocks.png")
    )
    window.instruments.tabs.setCurrentIndex(1)
    window.instruments.redraw()
    window.instruments_dock.grab().save(str(out / "latency.png"))
    window.instruments.tabs.setCurrentIndex(2)
    window.instruments.redraw()
    window.instruments_dock.grab().save(str(out / "layers.png"))
    window.instruments.tabs.setCurrentIndex(0)
    window.controls_dock.raise_()
    window.controls_dock.grab().save(str(out / "controls.png"))
    window.instruments_dock.raise_()
    window.worker.post(Pause(False))
    window.stop()
    qtbot.waitUntil(lambda: window.active is None, timeout=LONG_WAIT_MS)  # type: ignore[attr-defined]
    for name in ("main-window.png", "latency.png", "layers.png", "controls.png"):
        assert (out / name).stat().st_size > 10_000
    assert (out / "kv-blocks.png").stat().st_size > 1_000  # cells of flat colour compress well


@pytest.mark.skipif(
    not os.environ.get("INFERSIGHT_SCREENSHOTS"), reason="renders for the README (make screenshots)"
)
def test_lab_screenshots(qtbot: object, window: MainWindow) -> None:
    """The A/B lab on the default model, fp32 against int4-g32, and its layer sensitivity scan
    (a real one: about two minutes on a 2-core CPU), at 1280×800."""
    out = Path(os.environ["INFERSIGHT_SCREENSHOTS"])
    lab, view = window.lab, window.ab_view
    window.show_page(view)
    view.forms["b"].precision.setCurrentText("int4-g32")
    view.max_new_tokens.setValue(64)
    view.prompt.setPlainText("Explain in two sentences why the sky is blue.")
    view.run_button.click()
    qtbot.waitUntil(lambda: view.report() is not None, timeout=LONG_WAIT_MS)  # type: ignore[attr-defined]
    qtbot.waitUntil(lambda: not lab.busy, timeout=LONG_WAIT_MS)  # type: ignore[attr-defined]
    window.grab().save(str(out / "ab-lab.png"))
    view.tabs.setCurrentIndex(1)
    view.scan_button.click()
    qtbot.waitUntil(lambda: lab.scan is not None, timeout=10 * LONG_WAIT_MS)  # type: ignore[attr-defined]
    qtbot.wait(600)  # type: ignore[attr-defined]  # the plan for the slider's first budget
    window.grab().save(str(out / "sensitivity.png"))
    for name in ("ab-lab.png", "sensitivity.png"):
        assert (out / name).stat().st_size > 10_000
