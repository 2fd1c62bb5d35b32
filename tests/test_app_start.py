"""The app's start as a user meets it (issue 46's findings, one test each): a plain start
loads what the user left, not the defaults."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
from PySide6.QtCore import QObject, QSettings, Slot

from app.cli.main import build_parser
from app.gui.launch import start_overrides
from app.gui.main_window import MainWindow
from app.gui.status import model_label
from tests.app_window import LONG_WAIT_MS, SHARED_WEIGHTS, open_window, send

pytestmark = [pytest.mark.real_model, pytest.mark.usefixtures("gui_gc")]


def settings_of(data: Path) -> QSettings:
    return QSettings(str(data / "settings.ini"), QSettings.Format.IniFormat)


def test_a_plain_start_loads_the_precision_and_pool_the_user_left(qtbot, tmp_path, default_model):
    """Finding 1: ``infersight`` with no options built its own spec (``--device`` defaults to
    ``auto``, which the start took for a choice), so the saved precision and KV pool were
    thrown away and settings.ini rewritten to fp32."""
    data = tmp_path / "data"
    data.mkdir()
    saved = settings_of(data)
    saved.setValue("model", "default")
    saved.setValue("precision", "int8")
    saved.setValue("device", "cpu")
    saved.setValue("controls", json.dumps({"kv_memory": "96"}))
    saved.sync()
    assert start_overrides(build_parser().parse_args(["app"])) == {}
    window = MainWindow(data, overrides={}, loader=SHARED_WEIGHTS)
    qtbot.addWidget(window)
    qtbot.waitUntil(lambda: window.model is not None, timeout=LONG_WAIT_MS)
    try:
        assert (window.model.precision, window.model.kv_memory_mib) == ("int8", 96)
        assert settings_of(data).value("precision") == "int8"
    finally:
        window.shutdown()


def test_the_command_line_overrides_only_what_it_gives():
    parse = build_parser().parse_args
    assert start_overrides(parse(["app", "--precision", "bf16"])) == {"precision": "bf16"}
    assert start_overrides(parse(["app", "--device", "cpu", "--tensor-parallel", "2"])) == {
        "device": "cpu",
        "tensor_parallel": 2,
    }
    assert start_overrides(parse(["app", "--device", "auto"])) == {}


def test_a_pool_larger_than_the_engine_takes_shows_what_it_took(window, qtbot):
    """Finding 2: a pool of 999,999 MiB is clamped by the engine to what the model can use,
    but the field, the Memory line and settings.ini kept 999,999."""
    field = window.controls.kv_memory
    field.setText("999999")
    field.editingFinished.emit()
    qtbot.waitUntil(lambda: window.model.kv_memory_mib != 64, timeout=LONG_WAIT_MS)
    took = window.model.kv_memory_mib
    engine_mib = window.worker.engine.kv.nbytes / 2**20
    assert took == round(engine_mib) < 999_999
    qtbot.waitUntil(lambda: field.value() == took, timeout=LONG_WAIT_MS)
    plan = window.controls.plan_label  # the Memory line; its tooltip is the whole plan
    qtbot.waitUntil(lambda: f"(pool {took:,.1f} MiB" in plan.toolTip(), timeout=10_000)
    assert float(window.controls.state()["kv_memory"]) == took  # what settings.ini keeps


def test_new_chat_clicked_again_opens_the_empty_one(window, qtbot):
    """Finding 7: each click of "New chat" added another empty chat (21 seen)."""
    before = len(window.store.conversations())
    for _ in range(5):
        window.chat.new_button.click()
    empty = window.conversation_id
    assert len(window.store.conversations()) <= before + 1
    assert window.chat.conversation_list.count() == len(window.store.conversations())
    send(qtbot, window, "Hello there.")  # once it holds a message, the next is a new one
    window.chat.new_button.click()
    assert window.conversation_id != empty
    assert window.chat.bubbles == []


def test_a_reply_header_is_whole_at_1280_by_800_and_says_why_it_ended(window, qtbot):
    """Finding 5: headers were cut ("prefill 5432 ms: 42 prompt toke…"), hiding the cached
    tokens and the only hint of a length stop."""
    window.controls.max_new_tokens.set_value(4)
    send(qtbot, window, "Tell me about the sea.")
    bubble = window.chat.last
    label = bubble.status_label
    qtbot.waitUntil(lambda: "cached" in label.text(), timeout=LONG_WAIT_MS)
    assert "cut at the token limit" in label.text()
    assert label.text().endswith("greedy · top-k 50 · top-p 0.9 · ≤ 4 tokens")  # what applied
    qtbot.wait(50)  # laid out
    assert label.width() < label.fontMetrics().horizontalAdvance(label.text())  # it would be cut
    assert label.height() >= label.heightForWidth(label.width())  # but it wraps, whole
    assert label.toolTip() == label.text()


def test_the_status_bar_says_what_replies_are_made_with(window):
    """Finding 9: the status bar said model · precision · device only; sampling changes, the
    cache window and the processes were nowhere."""
    status = window.status_settings
    assert status.text().startswith("greedy") and "≤ 24 tokens" in status.text()
    window.controls.temperature.set_value(0.7)
    assert status.text().startswith("temperature 0.7")
    window.controls.window_on.setChecked(True)
    sink, size = window.controls.cache_window()
    assert f"window {sink} sinks + {size}" in status.text()
    window.controls.prefix_cache_on.setChecked(False)
    assert "prefix cache off" in status.text()
    info = dataclasses.replace(window.model, tensor_parallel=2)
    assert model_label(info).endswith(" · 2 processes")


def test_a_long_prompt_shows_how_far_it_has_been_read(window, qtbot):
    """Finding 10: a long conversation prefilled again (4,456 tokens, 45 s) showed only "…";
    now the pending reply has a bar, tokens read of all, that moves with each chunk."""
    from app.gui.commands import Configure

    window.controls.max_tokens_per_step.set_value(128)
    window.worker.post(Configure(limits=window.controls.limits()))
    window.controls.max_new_tokens.set_value(2)
    seen: list[tuple[int, int, bool]] = []

    class Watch(QObject):  # in the UI thread, after the window's own slot
        @Slot(str, int, int)
        def record(self, tag: str, done: int, total: int) -> None:
            seen.append((done, total, window.chat.last.prefill_bar.isVisible()))

    watch = Watch()
    window.worker.prefill_progress.connect(watch.record)
    prompt = " ".join(f"lighthouse{i % 50} keeper storm sea" for i in range(160))
    send(qtbot, window, prompt)
    assert len(seen) >= 5, seen  # one per chunk of 128 tokens
    dones = [d for d, _, _ in seen]
    totals = {t for _, t, _ in seen}
    assert dones == sorted(dones) and len(totals) == 1 and dones[-1] <= totals.pop()
    assert all(visible for _, _, visible in seen[1:])
    bar = window.chat.last.prefill_bar
    assert not bar.isVisible() and bar.maximum() > 600  # gone once the reply began


def test_the_menu_bar_reaches_every_page_panel_and_help(window, qtbot):
    """Finding 11: no menu bar, no About, no help, no shortcuts."""
    from app.gui import menus

    assert list(window.menus) == ["File", "Model", "View", "Help"]
    by_text = {a.text().replace("&", ""): a for m in window.menus.values() for a in m.actions()}
    by_text["A/B lab"].trigger()
    assert window.tabs.currentWidget() is window.pages[window.ab_view]
    by_text["Chat"].trigger()
    assert window.tabs.currentWidget() is window.chat
    controls = window.controls_dock.toggleViewAction()
    window.controls_dock.raise_()  # (behind its tab, the action brings it to the front)
    qtbot.wait(20)
    controls.trigger()  # hidden from the View menu, and back
    assert window.controls_dock.isHidden()
    controls.trigger()
    assert not window.controls_dock.isHidden()
    before = len(window.store.conversations())
    send(qtbot, window, "Hi.")
    by_text["New chat"].trigger()
    assert len(window.store.conversations()) == before + 1 and window.chat.bubbles == []
    about = menus.about_text(window)
    assert f"Infersight {menus.version()}" in about and window.model.name in about
    shortcuts = menus.shortcuts_text(window.menus)
    assert "Ctrl+N: File → New chat" in shortcuts and "Ctrl+2: View → A/B lab" in shortcuts


def test_regenerate_keeps_the_earlier_answers_as_versions(window, qtbot):
    """Finding 11: Regenerate replaced the old answer; now each is a version (a tab)."""
    window.controls.max_new_tokens.set_value(6)
    send(qtbot, window, "Name a colour.")
    first = window.chat.last.view.text
    for _ in range(2):
        window.chat.regenerate_button.click()
        qtbot.waitUntil(lambda: window.active is None, timeout=LONG_WAIT_MS)
    bubble = window.chat.last
    assert len(bubble.view.candidates) == 3 and bubble.view.candidates[0] == first
    assert bubble.view.selected == 2 and bubble.tabs.count() == 3 and bubble.tabs.isVisible()
    stored = window.store.messages(window.conversation_id)[-1]
    assert stored.meta["candidates"] == bubble.view.candidates and stored.meta["selected"] == 2
    assert len(window.store.messages(window.conversation_id)) == 2  # one answer, 3 versions
    window.select_conversation(window.conversation_id)  # opened again: the versions are there
    assert window.chat.last.view.candidates == stored.meta["candidates"]


def test_reply_as_json_holds_the_chat_to_a_json_object(window, qtbot):
    """Structured output in the chat (issue 47): the toggle holds the reply to a JSON object at
    temperature 1, and the header says so."""
    import json

    window.controls.temperature.set_value(1.0)
    window.controls.max_new_tokens.set_value(120)
    window.chat.json_reply.setChecked(True)
    send(qtbot, window, "Tell me about cats.")
    bubble = window.chat.last
    assert bubble.view.status == "done", bubble.view.text
    assert isinstance(json.loads(bubble.view.text), dict)
    qtbot.waitUntil(lambda: "cached" in bubble.status_label.text(), timeout=LONG_WAIT_MS)
    assert bubble.status_label.text().endswith("· JSON")


def test_a_load_shows_its_stages_in_the_status_bar(qtbot, tmp_path, tiny_model_dir):
    """Finding 11 (progress everywhere): a model load showed only "loading …"; now its
    stages, tensor by tensor, then settling, on a bar in the status bar, gone once loaded."""
    from app.loading import LoadSpec, load_engine

    folder, _ = tiny_model_dir("llama", False)
    seen: list[tuple[str, int, int, bool, str]] = []

    class Watch(QObject):  # in the UI thread, after the window's own slot
        @Slot(str, int, int)
        def record(self, stage: str, done: int, total: int) -> None:
            bar = window.status_load
            seen.append((stage, done, total, bar.isVisible(), bar.text()))

    watch = Watch()
    window = MainWindow(tmp_path / "data", spec=LoadSpec(str(folder), "int8", "cpu", 16),
                        loader=load_engine)  # fmt: skip
    qtbot.addWidget(window)
    window.worker.load_progress.connect(watch.record)
    window.show()
    try:
        qtbot.waitUntil(lambda: window.model is not None, timeout=LONG_WAIT_MS)
        stages = [s for s, *_ in seen]
        assert "quantize" in stages and stages.index("quantize") < stages.index("settle")
        quantized = [(d, t, shown, text) for s, d, t, shown, text in seen if s == "quantize"]
        assert quantized[-1][0] == quantized[-1][1] > 5 and all(q[2] for q in quantized)
        assert quantized[-1][3].startswith("reading and quantizing the weights")
        bar = window.status_load  # its text fits it (it read "reading and / quantizing the")
        assert bar.fontMetrics().horizontalAdvance(quantized[-1][3]) < bar.minimumWidth()
        assert not window.status_load.isVisible()  # gone once loaded
    finally:
        window.shutdown()


def test_the_first_start_pull_shows_its_bytes_and_time_left(qtbot):
    """Finding 11: the first start showed its pull only in the terminal, then a dialog with
    "0 / 1"; now the dialog gives pip's bytes of the wheel and the time left, and a pip too old
    to tell bytes leaves the stage alone (no "0 / 1", no "0.0 MiB")."""
    from PySide6.QtWidgets import QProgressBar, QWidget

    from app.gui.status import LoadProgress

    parent = QWidget()
    qtbot.addWidget(parent)
    progress = LoadProgress(parent, QProgressBar(parent))
    progress.report("download", 0, 1, "SmolLM2")
    assert progress.dialog is not None
    assert progress.dialog.labelText() == "Downloading the model…"
    progress.started["download"] -= 3.0  # three seconds in
    progress.report("download", 30 << 20, 90 << 20, "SmolLM2")
    text = progress.dialog.labelText()
    assert text.startswith("Downloading the model: 30.0 MiB of 90.0 MiB · 3 s, about 6 s left")
    assert progress.dialog.value() == 33
    progress.report("dequantize", 12, 272, "SmolLM2")
    assert progress.dialog.labelText().startswith("Converting tensors: 12 / 272")
    progress.close()
    assert progress.dialog is None


def test_a_long_paste_is_folded_and_unfolds(window, qtbot):
    """Finding 11: long pastes were not folded: a pasted log filled the conversation."""
    window.controls.max_new_tokens.set_value(2)
    pasted = "\n".join(f"2026-12-06 07:{i % 60:02d} INFO step {i} done" for i in range(200))
    send(qtbot, window, "What went wrong?\n" + pasted)
    user = window.chat.bubbles[-2]
    shown = user.body.text()
    assert len(shown.splitlines()) < 20 and shown.endswith("…")
    assert user.fold_button.isVisible() and "201 lines" in user.fold_button.text()
    stored = window.store.messages(window.conversation_id)[-2]
    assert stored.content.endswith("step 199 done")  # folded on screen only; the model saw all
    user.fold_button.click()
    assert user.body.text() == stored.content and user.fold_button.text() == "Fold"
    assert not window.chat.last.fold_button.isVisible()  # the model's answers are not folded


def test_rename_and_delete_are_buttons_in_view(window, qtbot, monkeypatch):
    """Finding 11: Rename and Delete were only on right-click."""
    from PySide6.QtWidgets import QInputDialog

    send(qtbot, window, "First.")
    first = window.conversation_id
    monkeypatch.setattr(QInputDialog, "getText", lambda *a, **k: ("Renamed", True))
    assert window.chat.rename_button.isVisible() and window.chat.delete_button.isVisible()
    window.chat.rename_button.click()
    assert window.store.conversation(first).title == "Renamed"
    window.chat.new_button.click()
    send(qtbot, window, "Second.")
    second = window.conversation_id
    window.chat.conversation_list.setCurrentRow(1)  # the first, now below the second
    assert window.conversation_id == first
    window.chat.delete_button.click()
    assert [c.id for c in window.store.conversations()] == [second]


@pytest.mark.skipif(
    not os.environ.get("INFERSIGHT_SCREENSHOTS"), reason="renders for the docs (make screenshots)"
)
def test_start_screenshots(qtbot, tmp_path, tiny_model_dir, default_model):
    """docs/screenshots: a load's stages on the status bar, a long prompt being read, and
    Controls and Instruments side by side on a 1920×1080 window."""
    from app.gui.commands import Configure
    from app.loading import LoadSpec, load_engine

    out = Path(os.environ["INFERSIGHT_SCREENSHOTS"])
    folder, _ = tiny_model_dir("llama", False)
    window = MainWindow(tmp_path / "load", spec=LoadSpec(str(folder), "int8", "cpu", 16),
                        loader=load_engine)  # fmt: skip
    qtbot.addWidget(window)
    window.resize(1280, 800)
    shots: list[str] = []

    class Shoot(QObject):
        @Slot(str, int, int)
        def load(self, stage: str, done: int, total: int) -> None:
            if stage == "quantize" and done == total // 2 and not shots:
                window.grab().save(str(out / "first-start-load.png"))
                shots.append("load")

    shoot = Shoot()
    window.worker.load_progress.connect(shoot.load)
    window.show()
    qtbot.waitUntil(lambda: window.model is not None, timeout=LONG_WAIT_MS)
    window.shutdown()
    assert shots == ["load"]

    window = open_window(qtbot, tmp_path / "chat")
    try:
        window.controls.max_tokens_per_step.set_value(64)
        window.worker.post(Configure(limits=window.controls.limits()))
        window.controls.max_new_tokens.set_value(8)

        class Prefill(QObject):
            @Slot(str, int, int)
            def seen(self, tag: str, done: int, total: int) -> None:
                if done >= total // 2 and "prefill" not in shots:
                    window.grab().save(str(out / "chat-prefill.png"))
                    shots.append("prefill")

        prefill = Prefill()
        window.worker.prefill_progress.connect(prefill.seen)
        text = "Summarise this log.\n" + "\n".join(
            f"07:{i % 60:02d} worker {i % 7} took {40 + i % 13} ms" for i in range(60)
        )
        send(qtbot, window, text)
        assert "prefill" in shots
    finally:
        window.shutdown()
    wide = open_window(qtbot, tmp_path / "wide", size=(1920, 1080))
    try:
        send(qtbot, wide, "What is a KV cache?")
        wide.instruments.redraw()
        wide.grab().save(str(out / "side-by-side.png"))
    finally:
        wide.shutdown()


def test_an_int8_kv_cache_chosen_in_the_controls_keeps_the_weights(window, qtbot):
    """The KV dtype beside the cache window: choosing int8 gives the model a pool of int8 rows
    once no reply runs, on the same weights (no reload); the metrics count its bytes, replies
    go on, and the choice is what settings.ini keeps for the next start."""
    model = window.worker.engine.model
    float_block = window.worker.engine.metrics().kv_block_bytes
    combo = window.controls.kv_dtype_combo
    combo.setCurrentIndex(combo.findData("int8"))
    combo.activated.emit(combo.currentIndex())
    engine = lambda: window.worker.engine  # noqa: E731

    def swapped() -> bool:  # read from this thread while the worker swaps pools: None between
        kv = getattr(engine(), "kv", None)
        return kv is not None and kv.format.name == "int8"

    qtbot.waitUntil(swapped, timeout=LONG_WAIT_MS)
    assert engine().model is model  # the weights were not loaded again
    snapshot = engine().metrics()
    assert snapshot.kv_dtype == "int8" and snapshot.kv_block_bytes < float_block / 3
    window.controls.max_new_tokens.set_value(4)
    send(qtbot, window, "Hello there.")
    assert window.chat.last.view.text.strip()
    assert window.controls.state()["kv_dtype"] == "int8"


def test_a_kv_dtype_this_device_refuses_is_named_and_the_control_goes_back(window, qtbot):
    """fp8 on a CPU: refused with the reason, the pool and the weights as they were, and the
    control back on what the pool holds (so settings.ini never keeps a refused choice)."""
    engine = window.worker.engine
    combo = window.controls.kv_dtype_combo
    combo.setCurrentIndex(combo.findData("fp8"))
    combo.activated.emit(combo.currentIndex())
    qtbot.waitUntil(lambda: window.controls.kv_dtype() == "auto", timeout=LONG_WAIT_MS)
    assert window.worker.engine is engine
    assert "sm_89" in window.chat.notice.text()
    assert window.controls.state()["kv_dtype"] == "auto"
