"""The chat with a model another server runs, in the real window: the model picker's endpoint
page lists ``infersight serve``'s models (the openai SDK's listing is the oracle) and the chat
streams its greedy reply (the SDK's reply to the same conversation is the oracle), Regenerate
keeps both versions, Stop ends a reply mid-stream with its text kept, and a server that drops
the stream, refuses the key or is not there is one line each, the conversation kept."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest

from app.endpoints.client import Endpoint
from app.gui.main_window import MainWindow
from tests.app_window import LONG_WAIT_MS, open_window, send, stored
from tests.misbehaving import RIGHT
from tests.served import KEY

pytestmark = [pytest.mark.real_model, pytest.mark.usefixtures("gui_gc")]
PROMPT = "Name three colours."
TOKENS = 8


@pytest.fixture
def window(qtbot: object, tmp_path: Path, default_model: Path) -> Iterator[MainWindow]:
    w = open_window(qtbot, tmp_path / "data")
    w.controls.max_new_tokens.set_value(TOKENS)
    yield w
    w.shutdown()


def choose_server(qtbot, window: MainWindow, url: str, key: str) -> None:
    """The picker's endpoint page, as a user fills it in."""
    window.browse_models()
    assert window.picker is not None and window.picker.endpoint_page is not None
    page = window.picker.endpoint_page
    page.url.setEditText(url)
    page.key.setText(key)
    page.remember.setChecked(False)  # this machine's keyring is not the test's
    with qtbot.waitSignal(page.listed, timeout=LONG_WAIT_MS):
        page.list_button.click()


def test_the_chat_streams_a_servers_reply_and_regenerates_it(qtbot, window, server, client):
    choose_server(qtbot, window, server, KEY)
    page = window.picker.endpoint_page
    listed = [page.models.itemText(i) for i in range(page.models.count())]
    assert listed == [m.id for m in client.models.list().data]
    page.use_button.click()
    assert window.remote.active and "served" in window.status_model.text()
    assert "not visible remotely" in window.chat.notice.text()
    send(qtbot, window, PROMPT)
    oracle = client.chat.completions.create(
        model=listed[0], messages=[{"role": "user", "content": PROMPT}], max_tokens=TOKENS,
        temperature=0.0,
    )  # fmt: skip
    text = oracle.choices[0].message.content
    assert stored(window) == [("user", PROMPT, "done"), ("assistant", text, "done")]
    header = window.store.messages(window.conversation_id)[-1].meta["stats"]
    assert header.startswith(f"{window.remote.endpoint.name} · served") and "TTFT" in header
    assert f"{TOKENS} tokens" in header and "cut at the token limit" in header
    assert re.search(r"at the server \d+ running, \d+ waiting", header)  # its /metrics
    assert window.status_ttft.text().startswith("TTFT ") and "tok/s" in window.status_speed.text()
    window.regenerate()
    qtbot.waitUntil(lambda: window.active is None, timeout=LONG_WAIT_MS)
    last = window.store.messages(window.conversation_id)[-1]
    assert last.meta["candidates"] == [text, text]  # greedy: the same reply, both kept
    assert window.settings.value("endpoints/recent")[0] == server


def test_stop_ends_a_servers_reply_with_its_text_kept(qtbot, window, misbehaving):
    window.remote.use(Endpoint(misbehaving, "long", RIGHT))  # a word every half second
    window.chat.input.setPlainText(PROMPT)
    window.chat._submit()
    qtbot.waitUntil(lambda: "la" in window.chat.last.view.text, timeout=LONG_WAIT_MS)
    window.stop()
    qtbot.waitUntil(lambda: window.active is None, timeout=5000)
    (_, (role, content, status)) = stored(window)
    assert (role, status) == ("assistant", "stopped") and content.startswith("la ")


def test_stop_ends_a_reply_still_waiting_for_its_first_byte(qtbot, window, misbehaving):
    window.remote.use(Endpoint(misbehaving, "slow", RIGHT))  # two seconds before a byte
    window.chat.input.setPlainText(PROMPT)
    window.chat._submit()
    qtbot.wait(200)
    began = time.perf_counter()
    window.stop()
    qtbot.waitUntil(lambda: window.active is None, timeout=1500)
    assert time.perf_counter() - began < 1.5
    assert stored(window)[-1] == ("assistant", "", "stopped")


def test_a_server_that_fails_is_one_line_and_the_chat_is_kept(qtbot, window, misbehaving):
    window.remote.use(Endpoint(misbehaving, "drop", RIGHT))  # two words, then it hangs up
    send(qtbot, window, PROMPT)
    assert stored(window) == [("user", PROMPT, "done"), ("assistant", "Red green", "error")]
    notice = window.chat.notice.text()
    assert "ended the stream" in notice and "The chat is kept" in notice
    window.remote.use(Endpoint(misbehaving, "busy", RIGHT))  # 429, Retry-After: 3
    send(qtbot, window, PROMPT)
    assert stored(window)[2:] == [("user", PROMPT, "done"), ("assistant", "", "error")]
    assert "retry after 3 s" in window.chat.notice.text()
    choose_server(qtbot, window, misbehaving, "wrong-key")
    page = window.picker.endpoint_page
    assert "refused the API key" in page.status.text() and not page.use_button.isEnabled()
    choose_server(qtbot, window, "http://127.0.0.1:9", "")
    assert "is unreachable" in page.status.text() and "is the server running" in page.status.text()
    assert "\n" not in page.status.text()
