"""The desktop app's models on the real default model, offscreen (pytest-qt): a GGUF imported,
precision switched while the old model answers, bad folders refused, closing mid-load and
mid-reply, serving the app's engine beside the chat.

Each test opens a real :class:`MainWindow` on a fresh data folder; the engine runs in the
window's worker thread exactly as it does for a user.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest
import torch

from app.conversations import ChatStore
from app.gui.commands import ReplyStats
from app.gui.main_window import MainWindow
from app.loading import LoadSpec
from engine.core.engine import LLMEngine
from engine.core.sampling import SamplingParams
from engine.loader import memory_plan
from tests.app_window import (
    LONG_WAIT_MS,
    SPEC,
    GatedLoader,
    Recorder,
    open_window,
    send,
    start_long_reply,
    stored,
)

pytestmark = [pytest.mark.real_model, pytest.mark.usefixtures("gui_gc")]
SHORT = 4  # tokens of a reply that only has to come (its status, its model are what is checked)


def test_a_gguf_is_imported_with_a_progress_dialog_then_chatted_with(
    qtbot: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.conftest import build_tiny_hf
    from tests.gguf_factory import write_gguf

    monkeypatch.setenv("INFERSIGHT_HOME", str(tmp_path / "home"))
    sizes = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4)
    gguf = write_gguf(
        build_tiny_hf("llama", tied=True, **sizes), tmp_path / "tiny.gguf", arch="llama"
    )
    loader = GatedLoader("fp32")  # held until the recorder below is connected
    window = MainWindow(
        tmp_path / "data", spec=LoadSpec(str(gguf), "fp32", "cpu", 16), loader=loader
    )
    qtbot.addWidget(window)  # type: ignore[attr-defined]
    progress: list[int] = []
    recorder = Recorder(
        lambda _: progress.append(window.progress.value() if window.progress else -1)
    )
    window.worker.load_progress.connect(recorder.record)
    loader.release()
    try:
        qtbot.waitUntil(lambda: window.model is not None, timeout=LONG_WAIT_MS)  # type: ignore[attr-defined]
        assert 100 in progress and window.progress is None  # shown, then closed
        assert window.model is not None and window.model.name == "tiny"
        assert (tmp_path / "home" / "models" / "tiny" / "config.json").is_file()
        window.controls.max_new_tokens.set_value(5)
        send(qtbot, window, "t1 t2")
        assert window.chat.last is not None and window.chat.last.view.status == "done"
    finally:
        window.shutdown()


def test_switching_precision_keeps_the_chat_and_the_old_model_answers_meanwhile(
    qtbot: object, tmp_path: Path, default_model: Path
) -> None:
    loader = GatedLoader("int8")
    window = open_window(qtbot, tmp_path / "data", loader=loader)
    recorder = Recorder()
    window.worker.reply_stats.connect(recorder.record)
    stats: list[ReplyStats] = recorder.values  # type: ignore[assignment]
    window.controls.max_new_tokens.set_value(SHORT)
    try:
        send(qtbot, window, "Hi!")
        window.controls.precision_requested.emit("int8")
        assert loader.waiting.wait(30)
        send(qtbot, window, "How are you?")  # while int8 loads
        assert [s.precision for s in stats] == ["fp32", "fp32"]
        assert window.model is not None and window.model.precision == "fp32"
        assert "loading" in window.status_model.text()
        loader.release()
        qtbot.waitUntil(lambda: window.model.precision == "int8", timeout=LONG_WAIT_MS)  # type: ignore[union-attr, attr-defined]
        send(qtbot, window, "Thanks.")
        assert [s.precision for s in stats] == ["fp32", "fp32", "int8"]
        plan = window.controls.plan_label  # the plan of the int8 load, shown as it started
        assert plan.text().startswith("int8: ") and "fits" in plan.text()
        assert "Memory plan: SmolLM2-135M-Instruct at int8 on cpu" in plan.toolTip()
        assert [r for r, _, _ in stored(window)] == ["user", "assistant"] * 3
        assert len(window.chat.bubbles) == 6
    finally:
        loader.release()
        window.shutdown()


def test_bad_model_folder_and_gguf_keep_the_current_model(
    qtbot: object, window: MainWindow, tmp_path: Path
) -> None:
    before = window.model
    for bad, says in (
        (tmp_path / "missing-model", "does not exist"),
        (tmp_path / "broken.gguf", "not a readable GGUF"),
    ):
        if bad.suffix == ".gguf":
            bad.write_bytes(b"GGUF but not really")
        window.controls.model_requested.emit(str(bad))
        qtbot.waitUntil(lambda: window.loading is None, timeout=LONG_WAIT_MS)  # type: ignore[attr-defined]
        assert window.chat.notice.isVisible()
        assert says in window.chat.notice.text() and "Still using" in window.chat.notice.text()
        assert window.model == before
    if not torch.cuda.is_available():  # a device that is not there: the same story
        window.controls.device_requested.emit("cuda:0")
        qtbot.waitUntil(lambda: window.loading is None, timeout=LONG_WAIT_MS)  # type: ignore[attr-defined]
        assert "Still using" in window.chat.notice.text() and window.model == before
        assert window.controls.device_combo.currentText() == "cpu"
    with pytest.MonkeyPatch.context() as mp:  # a load the plan says cannot fit: refused
        mp.setattr(memory_plan, "free_memory", lambda device: float(2**20))
        mp.setattr(window.worker, "_reclaimable", lambda: 0)  # not even once the old one goes
        window.controls.precision_requested.emit("bf16")
        qtbot.waitUntil(lambda: window.loading is None, timeout=LONG_WAIT_MS)  # type: ignore[attr-defined]
    text = window.chat.notice.text()
    assert "does not fit on cpu" in text and "MiB" in text and "Still using" in text
    assert window.model == before and "⚠ bf16" in window.controls.plan_label.text()
    window.controls.max_new_tokens.set_value(SHORT)
    send(qtbot, window, "Still there?")
    assert window.chat.last is not None and window.chat.last.view.status == "done"


def test_sending_while_the_first_model_loads_is_explained(
    qtbot: object, tmp_path: Path, default_model: Path
) -> None:
    loader = GatedLoader("fp32")
    window = open_window(qtbot, tmp_path / "data", loader=loader, wait=False)
    try:
        assert loader.waiting.wait(30)
        window.chat.input.setPlainText("Hello?")
        window.chat._submit()
        assert "still loading" in window.chat.notice.text()
        assert window.chat.input.toPlainText() == "Hello?"
        assert stored(window) == [] and window.active is None
        loader.release()
        qtbot.waitUntil(lambda: window.model is not None, timeout=LONG_WAIT_MS)  # type: ignore[attr-defined]
        window.controls.max_new_tokens.set_value(SHORT)
        send(qtbot, window, "Hello?")
        assert window.chat.last is not None and window.chat.last.view.status == "done"
    finally:
        loader.release()
        window.shutdown()


def test_closing_mid_load_cancels_the_load_and_leaves_no_thread(
    qtbot: object, tmp_path: Path
) -> None:
    from tests.test_worker import SlowLoader, loader_threads

    loader = SlowLoader()  # a long conversion, reporting progress until cancelled
    window = MainWindow(tmp_path / "data", spec=SPEC, loader=loader)
    qtbot.addWidget(window)  # type: ignore[attr-defined]
    assert loader.started.wait(30)
    window.close()
    assert not window.engine_thread.isRunning()
    assert loader.cancelled.is_set() and not loader_threads()


def test_closing_mid_reply_keeps_it_and_stops_the_engine_thread(
    qtbot: object, window: MainWindow
) -> None:
    start_long_reply(qtbot, window)
    shown = window.chat.last.view.text  # type: ignore[union-attr]
    conversation = window.conversation_id
    assert conversation is not None
    window.close()
    assert not window.engine_thread.isRunning()
    store = ChatStore(window.data_dir / "chats.sqlite3")
    try:
        *_, reply = store.messages(conversation)
        assert reply.status == "stopped" and reply.content.startswith(shown)
    finally:
        store.close()


def test_serving_the_apps_engine_streams_beside_the_chat(
    qtbot: object, window: MainWindow, oracle: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An openai SDK client streams from the app's own engine while the chat streams its own
    reply: both are batched by the one worker, both equal what the engine gives alone."""
    import socket

    import openai

    from app.gui import serve_host
    from app.gui.worker import EngineWorker
    from app.server.routes import bind

    sock = bind("127.0.0.1", 0)  # held from here on: no other process can take the port
    port = int(sock.getsockname()[1])
    asked: list[int] = []
    real_host = serve_host.ServeHost

    def host_on_sock(
        worker: EngineWorker, port: int, key: str | None = None
    ) -> serve_host.ServeHost:
        asked.append(port)  # the panel's port, given to the host that serves on the socket
        return real_host(worker, port, key, sock=sock)

    monkeypatch.setattr(serve_host, "ServeHost", host_on_sock)
    engine = window.worker.engine
    assert engine is not None
    engine.collector.window_s = float("inf")  # keep every step's batch size
    window.controls.serve_port.set_value(port)
    window.controls.serve_on.setChecked(True)
    host = window.serve_host
    assert host is not None and asked == [port] and host.port == port
    shown = window.controls.serve_info.toPlainText()
    assert host.url in shown and host.key in shown and "from openai import OpenAI" in shown

    question, result = "Name a large city in Asia.", {}

    def call() -> None:
        client = openai.OpenAI(base_url=host.url, api_key=host.key, max_retries=0, timeout=120)
        stream = client.chat.completions.create(
            model=host.server.name, messages=[{"role": "user", "content": question}],
            max_tokens=24, temperature=0, stream=True,
        )  # fmt: skip
        result["text"] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    owners: set[str] = set()  # who held KV blocks, as the instruments were told
    recorder = Recorder(lambda view: owners.update(  # type: ignore[attr-defined]
        o for held in view.snapshot.kv_block_owners for o in held))  # fmt: skip
    window.worker.metrics.connect(recorder.record)
    caller = threading.Thread(target=call)
    caller.start()
    send(qtbot, window, "Name three colours of the sea.")
    qtbot.waitUntil(lambda: not caller.is_alive(), timeout=LONG_WAIT_MS)  # type: ignore[attr-defined]

    def alone(content: str) -> str:
        gen = oracle.generate(
            oracle.chat_prompt_ids([{"role": "user", "content": content}]),
            SamplingParams(max_new_tokens=24),
        )
        for _ in gen:
            pass
        return gen.result.text

    assert result["text"] == alone(question)
    assert window.chat.last is not None
    assert window.chat.last.view.text == alone("Name three colours of the sea.")
    assert max(s.batch_size for s in engine.collector.steps) >= 2  # batched together
    assert any("@127.0.0.1:" in o for o in owners), owners  # the API's request, by client
    window.controls.serve_on.setChecked(False)
    assert window.serve_host is None and not window.controls.serve_info.toPlainText()
    assert sock.fileno() == -1  # the host closed it
    with socket.socket() as s:  # the port is free again
        s.bind(("127.0.0.1", port))
