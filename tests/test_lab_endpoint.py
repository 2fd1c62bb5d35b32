"""The A/B lab's window with a server on a side: the URL typed into B's model box of a real
view, ``infersight serve`` in a child process (tests/served.py) answering, the local side on
the lab's thread; what the window shows is the report's (bounded figures marked as such), and
a server that cannot be reached is one line in the window, the lab going on."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.probed import needs_int4
from tests.served import KEY
from tests.test_lab import LONG_WAIT_MS, Lab

pytestmark = pytest.mark.usefixtures("gui_gc")

PROMPT = "Name three colours."


@pytest.fixture
def served_key(monkeypatch):
    monkeypatch.setenv("INFERSIGHT_ENDPOINT_KEY", KEY)  # the keyring's stand-in


def ask(lab: Lab, a_precision: str, b_model: str, tokens: int = 10) -> None:
    view = lab.view
    view.forms["a"].set_model("default")
    view.forms["a"].precision.setCurrentText(a_precision)
    view.forms["b"].model.setEditText(b_model)
    assert not view.forms["b"].precision.isEnabled()  # a server's precision is its own
    view.prompt.setPlainText(PROMPT)
    view.max_new_tokens.setValue(tokens)
    view.run_button.click()
    lab.qtbot.waitUntil(lambda: lab.controller.busy, timeout=5000)
    lab.qtbot.waitUntil(lambda: not lab.controller.busy, timeout=LONG_WAIT_MS)


@needs_int4
def test_the_lab_compares_a_local_int4_model_with_a_served_fp32_one(qtbot, server, served_key):
    lab = Lab(qtbot)
    try:
        ask(lab, "int4-g32", server)
        report = lab.view.report()
        assert report is not None, lab.notices
    finally:
        lab.close()
    assert report["b"]["remote"] and report["bounds"]["k"] == 20
    assert len(report["b"]["token_ids"]) == 10 and lab.appends["b"]  # streamed from the server
    for side in "ab":
        assert lab.view.column_text(side) == report[side]["text"]
    shown = lab.view.summary_text()
    assert "mean KLD ≥" in shown and "outside the top-k" in shown, shown
    assert "B is a server" in lab.view.notice.text()
    assert "server" in lab.view.columns["b"].header.text()
    assert "client clock" in lab.view.columns["b"].stats.text()
    tip = lab.view.tooltip_for("a", 0)
    assert "KL(A‖B) ≥" in tip and "rank in B" in tip, tip


def test_the_lab_compares_two_servers_with_no_local_model(qtbot, server, served_key):
    lab = Lab(qtbot)
    view = lab.view
    try:
        view.forms["a"].model.setEditText(server)
        view.forms["b"].model.setEditText(server)
        view.forms["b"].temperature.setValue(1.0)  # B sampled: their answers part
        view.prompt.setPlainText(PROMPT)
        view.max_new_tokens.setValue(12)
        view.run_button.click()
        lab.qtbot.waitUntil(lambda: lab.controller.busy, timeout=5000)
        lab.qtbot.waitUntil(lambda: not lab.controller.busy, timeout=LONG_WAIT_MS)
        report = view.report()
        assert report is not None, lab.notices
    finally:
        lab.close()
    assert (
        report["a"]["remote"] and report["b"]["remote"] and not report["summary"].get("text_only")
    )
    assert "no local model" in view.notice.text()
    assert lab.appends["a"] and lab.appends["b"]  # both streamed as they came
    for side in "ab":
        assert view.column_text(side) == report[side]["text"]


def test_a_server_that_cannot_be_reached_is_one_line_and_the_lab_goes_on(qtbot, served_key):
    lab = Lab(qtbot)
    try:
        ask(lab, "fp32", "http://127.0.0.1:9")
        assert lab.view.report() is None
        (line,) = lab.notices
        assert "unreachable" in line and "\n" not in line
        assert not lab.controller.busy and lab.view.run_button.isEnabled()
    finally:
        lab.close()


@pytest.mark.skipif(
    not os.environ.get("INFERSIGHT_SCREENSHOTS"), reason="renders for the docs (make screenshots)"
)
@needs_int4
def test_lab_endpoint_screenshot(qtbot, server, served_key):
    """The lab at 1280×800: local INT4 (A) against ``infersight serve`` at fp32 (B)."""
    out = Path(os.environ["INFERSIGHT_SCREENSHOTS"])
    lab = Lab(qtbot)
    try:
        lab.view.resize(1280, 800)
        lab.view.show()
        ask(lab, "int4-g32", server, tokens=48)
        assert lab.view.report() is not None, lab.notices
        lab.view.grab().save(str(out / "ab-lab-endpoint.png"))
    finally:
        lab.close()
    assert (out / "ab-lab-endpoint.png").stat().st_size > 10_000
