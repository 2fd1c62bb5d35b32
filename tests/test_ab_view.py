"""The A/B lab view on its own (no model): a synthetic report and scan go in, and what the
user sees (text, colours, tooltips, plots) and asks for (signals) is checked."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest
from PySide6.QtCore import QEvent, QPoint, Qt
from PySide6.QtGui import QFont, QHelpEvent, QImage, QTextCursor
from PySide6.QtWidgets import QToolTip

from widgets.ab_format import (
    format_kl,
    format_pct,
    heat_colour,
    kl_level,
    probability_level,
    quant_format,
    visible,
)
from widgets.ab_sides import MARKER
from widgets.ab_view import BUDGET_STEPS, ABView

pytestmark = pytest.mark.usefixtures("gui_gc")

PIECES_A = ["The", " café", " is", " open", ".\n", "Come", " in", " é", "!", " Bye"]
PIECES_B = ["The", " café", " is", " closed", ".\n", "Sorry", " é", "t", "é", "!"]
LOW_KL, HIGH_KL = 1e-6, 0.5  # token 0 and token 3 of each column


def _top(pieces: list[str], i: int, first: float) -> list[list[Any]]:
    """A top-5 list led by the column's own token."""
    others = [" the", "\n", " a", " é"]
    return [[pieces[i], first], *[[t, (1 - first) / 5] for t in others]]


def _column(pieces: list[str], noise: bool) -> dict[str, Any]:
    n = len(pieces)
    kl = [LOW_KL if i == 0 else HIGH_KL if i == 3 else 0.001 * (i + 1) for i in range(n)]
    p_a = [0.99 if i == 0 else 0.05 if i == 3 else 0.8 for i in range(n)]
    return {
        "kl": kl,
        "p_a": p_a,
        "p_b": [0.7] * n,
        "noise_kl": [1e-7 * (i + 1) for i in range(n)] if noise else None,
        "top_a": [_top(pieces, i, p_a[i]) for i in range(n)],
        "top_b": [_top(pieces, i, 0.7) for i in range(n)],
    }


def _side(pieces: list[str], precision: str) -> dict[str, Any]:
    return {
        "model": "/models/smollm2-135m",
        "precision": precision,
        "device": "cpu",
        "sampling": {"temperature": 0.0},
        "window": None,
        "text": "".join(pieces),
        "token_ids": list(range(len(pieces))),
        "pieces": pieces,
        "finish_reason": "length",
        "ttft_s": 0.123,
        "tokens_per_s": 45.6,
        "weights_bytes": 512 * 1024 * 1024,
        "kv_bytes": 3 * 1024 * 1024,
    }


def make_report(noise: bool = True) -> dict[str, Any]:
    """A consistent report of 10 tokens a side that part at token 3 (' open' / ' closed')."""
    return {
        "prompt": "Is the café open?",
        "prompt_tokens": 7,
        "a": _side(PIECES_A, "fp32"),
        "b": _side(PIECES_B, "int4-g32"),
        "columns": {"a": _column(PIECES_A, noise), "b": _column(PIECES_B, noise)},
        "divergence": {
            "index": 3,
            "top_n": 5,
            "a_token": " open",
            "b_token": " closed",
            "a_in_b_top": True,
            "b_in_a_top": False,
        },
        "summary": {
            "tokens": 10,
            "kl_mean": 0.0123,
            "kl_p99": 0.456,
            "kl_max": 0.5,
            "rms_dp": 0.0234,
            "top1_agreement": 0.9,
            "flips": True,
            "noise_kl_mean": 3.1e-07,
            "noise_kl_p99": 9e-07,
            "speculative": {
                "greedy_acceptance": 0.9,
                "sampling_acceptance": 0.952,
                "mode": "greedy",
            },
        },
        "memory": {"mode": "side by side", "message": "A and B fit side by side (1.0 GiB)."},
    }


def make_scan(layers: int = 4) -> dict[str, Any]:
    blocks = [
        {"layer": i, "part": part, "kl": 0.01 * (i + 1) * (2 if part == "mlp" else 1),
         "bytes_low": 1_000_000, "bytes_high": 4_000_000}
        for i in range(layers)
        for part in ("attn", "mlp")
    ]  # fmt: skip
    return {
        "model": "/models/smollm2-135m",
        "low": "int4-g32",
        "high": "fp32",
        "text_tokens": 512,
        "all_low_kl": 0.0789,
        "fixed_bytes": 50_000_000,
        "min_bytes": 58_000_000,
        "max_bytes": 82_000_000,
        "blocks": blocks,
    }


@pytest.fixture
def view(qtbot: Any) -> ABView:
    v = ABView()
    qtbot.addWidget(v)
    v.resize(1280, 800)
    return v


def test_plain_helpers() -> None:
    assert visible(" a\nb\tc") == "·a⏎b⇥c" and visible("") == "∅" and visible("\x00") == "\\x00"
    assert format_kl(0.0123) == "0.0123" and format_kl(3.1e-07) == "3.1e-07"
    assert format_kl(None) == "–" and format_kl(0.0) == "0" and format_kl(float("nan")) == "–"
    assert format_pct(0.952) == "95.2%" and format_pct(0.00012) == "0.012%"
    assert quant_format("int4-g32+head") == "int4-g32" and quant_format("int8") == "int8"
    assert quant_format("fp32") is None and quant_format("mixed:attn=int8") is None
    assert quant_format("w8a8") == "w8a8" and quant_format("w8a8-sq") is None
    assert kl_level(1e-5) == 0 and kl_level(1e-2) == pytest.approx(0.5) and kl_level(5) == 1
    assert probability_level(1.0) == 0 and probability_level(0.0) == 1
    assert heat_colour(0) is None
    faint, strong = heat_colour(0.1), heat_colour(1.0)
    assert faint is not None and strong is not None and faint.alpha() < strong.alpha()
    assert strong.red() > strong.green()  # the high end is red


def test_streamed_text_shows_in_the_columns(view: ABView) -> None:
    view.begin_run("A · fp32 · cpu", "B · int4-g32 · cpu")
    assert view.cancel_button.isEnabled() and not view.run_button.isEnabled()
    for piece in PIECES_A[:4]:
        view.append("a", piece)
    view.append("b", "The café")
    assert view.column_text("a") == "The café is open"
    assert view.column_text("b") == "The café"
    assert view.columns["a"].header.text() == "A · fp32 · cpu"
    view.set_side_stats("b", "TTFT 120 ms")
    assert view.columns["b"].stats.text() == "TTFT 120 ms"
    view.show_report(make_report())
    view.begin_run("A", "B")  # a new run starts from empty columns, the old report gone
    assert view.column_text("a") == "" and view.column_text("b") == ""
    assert view.report() is None and view.summary_text() == "Running…"
    view.append("a", "New")
    view.colour_by.setCurrentIndex(2)  # recolouring mid-run leaves the streamed text alone
    assert view.column_text("a") == "New"
    view.set_status("generating…")
    assert view.status.text() == "generating…"
    assert not view.scan_button.isEnabled()  # one job at a time
    view.set_busy(False)
    assert view.run_button.isEnabled() and not view.cancel_button.isEnabled()


def test_a_report_renders_each_column_token_by_token(view: ABView) -> None:
    view.begin_run("A", "B")
    view.append("a", "The caf")  # half-streamed text is replaced by the report's tokens
    report = make_report()
    view.show_report(report)
    assert view.report() is report
    assert view.column_text("a") == report["a"]["text"]
    assert view.column_text("b") == report["b"]["text"]
    assert view.columns["a"].text.spans[0] == (0, 3)
    assert view.columns["b"].header.text() == "B · int4-g32 · cpu"
    stats = view.columns["a"].stats.text()
    assert "TTFT 123 ms" in stats and "45.6 tok/s" in stats and "weights 512.0 MiB" in stats
    assert view.notice.text() == report["memory"]["message"] and not view.notice.isHidden()


def test_token_at_maps_every_character_to_its_token(view: ABView) -> None:
    report = make_report()
    view.show_report(report)
    divergence = report["divergence"]["index"]
    for side in ("a", "b"):
        pos = 0
        for index, piece in enumerate(report[side]["pieces"]):
            if index == divergence:
                assert view.token_at(side, pos) is None  # the marker is no token
                pos += len(MARKER)
            for _ in piece:  # every character of the piece (é is one; \n one too)
                assert view.token_at(side, pos) == index
                pos += 1
        assert view.token_at(side, pos) is None  # past the end
    newline = PIECES_A.index(".\n")
    after = view.columns["a"].text.spans[newline + 1][0]  # "Come", on the second line
    assert view.token_at("a", after) == newline + 1
    assert view.token_at("a", after + 3) == newline + 1


def test_hovering_a_token_shows_its_tooltip(view: ABView, qtbot: Any) -> None:
    view.show_report(make_report())
    view.show()
    qtbot.waitExposed(view)
    text = view.columns["b"].text
    start, _ = text.spans[5]  # "Sorry"
    cursor = QTextCursor(text.document())
    cursor.setPosition(start)
    point = text.cursorRect(cursor).center() + QPoint(3, 0)
    assert text.token_at_point(point) == 5
    assert text.token_at_point(QPoint(text.viewport().width() - 2, 2)) is None  # off the text
    event = QHelpEvent(QEvent.Type.ToolTip, point, text.viewport().mapToGlobal(point))
    text.viewportEvent(event)
    assert "token 5" in QToolTip.text() and "Sorry" in QToolTip.text()
    cursor.setPosition(text.marker_pos)  # type: ignore[arg-type]
    point = text.cursorRect(cursor).center() + QPoint(3, 0)
    event = QHelpEvent(QEvent.Type.ToolTip, point, text.viewport().mapToGlobal(point))
    text.viewportEvent(event)
    assert "vLLM's rule" in QToolTip.text()


def test_tooltip_lists_both_top_fives_and_the_kl(view: ABView) -> None:
    report = make_report()
    view.show_report(report)
    tip = view.tooltip_for("b", 1)
    assert "'·café'" in tip and "KL(A‖B) 0.002 nats" in tip
    assert "p_A 80.0%" in tip and "p_B 70.0%" in tip
    assert "A top-5 (fp32)" in tip and "B top-5 (int4-g32)" in tip
    for text, p in report["columns"]["b"]["top_a"][1] + report["columns"]["b"]["top_b"][1]:
        assert f"'{visible(text)}'" in tip and format_pct(p) in tip
    assert "'⏎'" in tip  # a newline candidate is shown, not swallowed
    assert "vLLM" not in tip
    assert "vLLM" in view.tooltip_for("a", 3)  # the divergence explains vLLM's rule


def test_the_first_divergence_is_marked_in_both_columns(view: ABView) -> None:
    view.show_report(make_report())
    for side in ("a", "b"):
        text = view.columns[side].text
        fmt = view.token_format(side, 3)
        assert fmt.fontWeight() == QFont.Weight.Bold and fmt.fontUnderline()
        assert not view.token_format(side, 2).fontUnderline()
        assert text.toPlainText()[text.marker_pos] == MARKER
        assert text.marker_pos == text.spans[3][0] - len(MARKER)
        assert "B's token in A's top-5: no" in text.marker_tip
        assert "vLLM's rule fails" in text.marker_tip
    report = make_report()
    report["divergence"] = {"index": None, "top_n": 5}
    view.show_report(report)
    assert view.columns["a"].text.marker_pos is None
    assert MARKER not in view.columns["a"].text.toPlainText()
    report["a"]["pieces"] = PIECES_A[:3]  # A stopped where B went on: the marker ends A
    report["a"]["text"] = "".join(PIECES_A[:3])
    report["divergence"] = {"index": 3, "top_n": 5, "a_token": None, "b_token": " closed",
                            "a_in_b_top": None, "b_in_a_top": None}  # fmt: skip
    view.show_report(report)
    a = view.columns["a"].text
    assert a.toPlainText().endswith(MARKER) and view.column_text("a") == "The café is"
    assert "A had stopped, B chose '·closed'" in a.marker_tip


def test_colour_by_kl_probability_or_nothing(view: ABView) -> None:
    view.show_report(make_report())

    def background(side: str, index: int) -> tuple[Qt.BrushStyle, int]:
        brush = view.token_format(side, index).background()
        return brush.style(), brush.color().alpha()

    view.colour_by.setCurrentIndex(0)  # KL(A‖B)
    assert background("b", 0)[0] == Qt.BrushStyle.NoBrush  # KL 1e-6: below the ramp
    style, alpha = background("b", 3)
    assert style == Qt.BrushStyle.SolidPattern and alpha > 150
    high = view.token_format("b", 3).background().color()
    mid = view.token_format("b", 1).background().color()  # KL 0.002: faint yellow
    assert mid.alpha() < high.alpha()
    view.colour_by.setCurrentIndex(1)  # A's probability
    assert background("b", 0)[1] < background("b", 3)[1]  # p 0.99 vs 0.05
    assert view.token_format("b", 3).background().color() != high
    view.colour_by.setCurrentIndex(2)  # none
    assert all(background("b", i)[0] == Qt.BrushStyle.NoBrush for i in range(len(PIECES_B)))
    assert view.column_text("b") == "".join(PIECES_B)  # recolouring keeps the text


def test_summary_line_formats_the_figures(view: ABView) -> None:
    view.show_report(make_report())
    s = view.summary_text()
    for part in (
        "mean KLD 0.0123 nats",
        "p99 KLD 0.456",
        "RMS Δp 2.3%",
        "top-1 agreement 90.0%",
        "flips (answers differ): yes",
        "noise floor (A vs A′) 3.1e-07",
        "B drafting for A would be accepted 90.0% (greedy) / 95.2% (sampling)",
        "first divergence at token 3",
    ):
        assert part in s, part
    report = make_report(noise=False)
    report["summary"]["noise_kl_mean"] = None
    view.show_report(report)
    assert "noise floor (A vs A′) n/a" in view.summary_text()


MEASURED = {
    "k": 4,
    "mode": "greedy",
    "tokens": 10,
    "drafts": 3,
    "draft_tokens": 9,
    "accepted_tokens": 8,
    "token_acceptance": 8 / 9,
    "acceptance_rate": 8 / 9,
    "mean_acceptance_length": 11 / 3,
    "acceptance_per_pos": [1.0, 1.0, 1.0, 0.5],
    "draft_tokens_per_pos": [3, 2, 2, 2],
    "matches_a": True,
    "first_difference": None,
    "tokens_per_s": 120.0,
    "predicted_mean_acceptance_length": 3.461,
}


def test_measured_acceptance_shows_beside_the_predicted_one(view: ABView) -> None:
    report = make_report()
    spec = report["summary"]["speculative"]
    spec["measured"] = dict(MEASURED)
    view.show_report(report)
    assert (
        "B drafting for A would be accepted 90.0% (greedy) / 95.2% (sampling), measured 88.9% "
        "(greedy, k=4: mean acceptance length 3.67, predicted 3.46)"
    ) in view.summary_text()
    tip = view.summary.toolTip()
    for part in (
        "top-1 agreement",
        "1 − TV",
        "B's model drafting k tokens",
        "8 of 9 drafted tokens accepted (88.9%, vLLM's acceptance rate)",
        "by draft position: 100.0%, 100.0%, 100.0%, 50.0%",
        "Output equals A's: yes",
    ):
        assert part in tip, part
    # greedy speculative decoding must give A's answer: where it did not, the line says so
    spec["measured"].update(matches_a=False, first_difference=5)
    view.show_report(report)
    assert "output differs from A's at token 5" in view.summary_text()
    # a pair that cannot draft for each other: the reason, in the line and the tooltip
    del spec["measured"]
    spec["not_measured"] = "the draft model is on cpu and the target on cuda"
    view.show_report(report)
    assert (
        "(sampling), not measured: the draft model is on cpu and the target on cuda"
        in view.summary_text()
    )
    assert "Not measured: the draft model is on cpu" in view.summary.toolTip()
    # a report from before measuring (no key): the prediction alone, the plain tooltip
    view.show_report(make_report())
    assert "measured" not in view.summary_text().split("(sampling)")[1]
    assert "This run" not in view.summary.toolTip()


def test_the_kl_plot_follows_the_chosen_column(view: ABView) -> None:
    report = make_report()
    view.show_report(report)
    assert view.plot_column.currentData() == "b"  # B's text by default
    x, y = view.kl_curve.getOriginalDataset()
    assert list(x) == list(range(10)) and list(y) == report["columns"]["b"]["kl"]
    assert view.noise_band.isVisible()
    _, noise = view.noise_top.getOriginalDataset()
    assert list(noise) == report["columns"]["b"]["noise_kl"]
    assert view.divergence_line.isVisible() and view.divergence_line.value() == 3
    report["columns"]["a"]["kl"][5] = 0.25
    view.plot_column.setCurrentIndex(0)
    assert list(view.kl_curve.getOriginalDataset()[1]) == report["columns"]["a"]["kl"]
    view.show_report(make_report(noise=False))
    assert not view.noise_band.isVisible()


def test_a_scan_draws_bars_and_the_budget_slider_asks_for_plans(view: ABView, qtbot: Any) -> None:
    scan = make_scan()
    with qtbot.waitSignal(view.budget_changed, timeout=2000) as first:
        view.show_scan(scan)  # a plan at half the range is asked for at once
    assert first.args == [70_000_000]
    attn = [b["kl"] for b in scan["blocks"] if b["part"] == "attn"]
    mlp = [b["kl"] for b in scan["blocks"] if b["part"] == "mlp"]
    assert list(view.attn_bars.opts["height"]) == attn
    assert list(view.mlp_bars.opts["height"]) == mlp
    assert list(view.attn_bars.opts["x"]) == [-0.2, 0.8, 1.8, 2.8]
    assert "0.0789" in view.scan_label.text()
    with qtbot.waitSignal(view.budget_changed, timeout=2000) as moved:
        view.budget.setValue(BUDGET_STEPS)
    assert moved.args == [scan["max_bytes"]]
    assert view.budget_label.text() == f"{scan['max_bytes'] / 2**20:.1f} MiB"

    spec = "mixed:default=int4-g32,3.mlp=fp32"
    plan = {"spec": spec, "bytes": 61_000_000, "budget": 62_000_000,
            "upgraded": [[3, "mlp"]], "predicted_kl": 0.0456}  # fmt: skip
    view.show_plan(plan)
    assert view.spec_line.text() == spec and "0.0456" in view.plan_label.text()
    assert "of a 59.1 MiB budget" in view.plan_label.text()
    as_engine_writes = {**plan, "upgraded": [{"layer": 3, "part": "mlp"}]}
    del as_engine_writes["budget"]
    view.show_plan({**as_engine_writes, "budget_bytes": 62_000_000})  # Plan.to_dict's shape
    assert "of a 59.1 MiB budget" in view.plan_label.text()
    brushes = view.mlp_bars.opts["brushes"]  # only layer 3's MLP is kept high
    assert brushes[3] != brushes[0] and len(set(view.attn_bars.opts["brushes"])) == 1
    assert view.mlp_bars.opts["pens"][3] != view.mlp_bars.opts["pens"][0]
    with qtbot.waitSignal(view.use_spec_requested) as used:
        view.use_button.click()
    assert used.args == [spec] and view.forms["b"].precision.currentText() == spec


def test_scan_requests_b_format_or_says_why_not(view: ABView, qtbot: Any) -> None:
    view.set_current("/models/smollm2-135m", "int4-g32+head")
    with qtbot.waitSignal(view.scan_requested) as asked:
        view.scan_button.click()
    assert asked.args == [{"model": "/models/smollm2-135m", "low": "int4-g32"}]
    view.set_busy(True)  # as the app does when it starts the scan
    assert not view.scan_button.isEnabled() and view.scan_cancel_button.isEnabled()
    view.set_scan_progress(3, 8)
    assert view.scan_progress.value() == 3 and view.scan_progress.maximum() == 8
    with qtbot.waitSignal(view.scan_cancel_requested):
        view.scan_cancel_button.click()
    view.set_busy(False)
    assert view.scan_button.isEnabled() and not view.scan_cancel_button.isEnabled()
    view.forms["b"].precision.setCurrentText("bf16")
    with qtbot.assertNotEmitted(view.scan_requested):
        view.scan_button.click()
    assert "'bf16'" in view.notice.text() and not view.notice.isHidden()
    # W8A8 from B's list: scanned block by block unsmoothed; smoothed, it spans blocks
    combo = view.forms["b"].precision
    combo.setCurrentIndex(combo.findText("w8a8"))
    with qtbot.waitSignal(view.scan_requested) as asked:
        view.scan_button.click()
    assert asked.args[0]["low"] == "w8a8"
    combo.setCurrentIndex(combo.findText("w8a8-sq"))
    with qtbot.assertNotEmitted(view.scan_requested):
        view.scan_button.click()
    assert "'w8a8-sq'" in view.notice.text()


def test_run_requested_carries_the_form(view: ABView, qtbot: Any) -> None:
    view.set_models([("SmolLM2", "/models/smollm2-135m"), ("Qwen", "/models/qwen")])
    view.set_current("/models/smollm2-135m", "fp32")
    assert view.forms["a"].precision.currentText() == "fp32"
    assert view.forms["b"].precision.currentText() == "int8"  # fp32 chat: B defaults to int8
    view.forms["b"].model.setCurrentIndex(1)
    view.forms["b"].temperature.setValue(0.7)
    view.forms["b"].window_on.setChecked(True)
    view.forms["b"].lowbit.setCurrentIndex(view.forms["b"].lowbit.findData("ours"))
    view.forms["b"].kv_dtype.setCurrentIndex(view.forms["b"].kv_dtype.findData("int8"))
    view.seed.setValue(42)
    view.continue_conversation.setChecked(True)
    with qtbot.assertNotEmitted(view.run_requested):  # no prompt
        view.continue_conversation.setChecked(False)
        view.run_button.click()
    assert "prompt" in view.notice.text()
    view.prompt.setPlainText("Why is the sky blue?")
    with qtbot.waitSignal(view.run_requested) as run:
        view.run_button.click()
    assert run.args == [
        {
            "a": {"model": "/models/smollm2-135m", "precision": "fp32", "lowbit": None,
                  "kv_dtype": "auto", "temperature": 0.0, "window": None},
            "b": {"model": "/models/qwen", "precision": "int8", "lowbit": "ours",
                  "kv_dtype": "int8", "temperature": 0.7, "window": [4, 256]},
            "seed": 42,
            "max_new_tokens": 64,
            "prompt": "Why is the sky blue?",
            "continue_conversation": False,
        }
    ]  # fmt: skip
    view.forms["a"].model.setEditText("/somewhere/else")  # a typed path is taken as is
    assert view.form()["a"]["model"] == "/somewhere/else"
    view.set_models([("Qwen", "/models/qwen")])  # each side keeps its choice
    assert view.form()["b"]["model"] == "/models/qwen"


def test_file_buttons_emit_paths_and_png_is_written(
    view: ABView, qtbot: Any, tmp_path: Path
) -> None:
    view.show_report(make_report())
    path = str(tmp_path / "ab.png")
    view.save_png_requested.connect(view.grab_png)  # the app writes it so, and reports
    with qtbot.waitSignal(view.save_png_requested) as saved:
        view.save_png_to(path)
    assert saved.args == [path] and Path(path).stat().st_size > 1000
    assert not QImage(path).isNull()
    assert not view.grab_png(tmp_path / "no such folder" / "ab.png")
    with qtbot.waitSignal(view.save_json_requested) as asked:
        view.save_json_to(str(tmp_path / "ab.json"))
    assert asked.args == [str(tmp_path / "ab.json")]
    with qtbot.waitSignal(view.open_requested) as opened:
        view.open_path("/tmp/x.json")
    assert opened.args == ["/tmp/x.json"]


def test_the_whole_view_renders_at_1280x800(view: ABView, qtbot: Any, tmp_path: Path) -> None:
    view.show_report(make_report())
    view.show_scan(make_scan(layers=12))
    view.show()
    qtbot.waitExposed(view)
    path = tmp_path / "tokens.png"
    assert view.grab_png(path)
    assert QImage(str(path)).size().width() == 1280 and path.stat().st_size > 10_000
    view.tabs.setCurrentIndex(1)
    assert view.grab_png(tmp_path / "sensitivity.png")
    assert (tmp_path / "sensitivity.png").stat().st_size > 10_000
