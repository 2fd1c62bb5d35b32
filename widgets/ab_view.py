"""The A/B lab: two configurations answer the same prompt side by side, and afterwards every
token is coloured by how much they disagree there. It answers "what does INT4 (or another
model) cost me here, and where?".

A thin view, like the rest of ``widgets/``: the app hands it plain JSON-like dicts and it emits
what the user asked for. It imports neither torch nor the engine, so a saved comparison opens,
and the view is tested, without a model.

A *report* (what :meth:`ABView.show_report` takes; a saved file holds
``{"format": "infersight-ab/1", "comparisons": [report, ...]}``)::

    {"prompt": str, "prompt_tokens": int,
     "a": {"model", "precision", "device", "sampling": dict, "window": [sink, window] | None,
           "text", "token_ids": [int], "pieces": [str] (one per token, joined == text),
           "finish_reason", "ttft_s": float | None, "tokens_per_s": float | None,
           "weights_bytes": int, "kv_bytes": int},
     "b": {same keys},
     "columns": {"a": {"kl": [float], "p_a": [float], "p_b": [float],
                       "noise_kl": [float] | None, "top_a": [[[str, float], ...], ...],
                       "top_b": [...]},        # along A's tokens, teacher-forced
                 "b": {same keys}},            # along B's tokens
     "divergence": {"index": int | None, "top_n": 5, "a_token", "b_token",
                    "a_in_b_top": bool | None, "b_in_a_top": bool | None},
     "summary": {"tokens", "kl_mean", "kl_p99", "kl_max", "rms_dp", "top1_agreement", "flips",
                 "noise_kl_mean", "noise_kl_p99",
                 "speculative": {"greedy_acceptance", "sampling_acceptance", "mode",
                                 # measured with B drafting for A; neither: not attempted
                                 "measured": {"k", "mode", "token_acceptance",
                                              "acceptance_rate", "mean_acceptance_length",
                                              "predicted_mean_acceptance_length",
                                              "acceptance_per_pos", "draft_tokens",
                                              "accepted_tokens", "matches_a",
                                              "first_difference", ...},
                                 "not_measured": str}},   # why it could not be measured
     "memory": {"mode": "side by side" | "one after the other", "message": str}}

A *scan* (:meth:`ABView.show_scan`) gives, per layer and block (attention, MLP), the KL when
only that block is at the low precision; a *plan* (:meth:`ABView.show_plan`) is the mixed
precision spec that fits a memory budget.
"""

from __future__ import annotations

import bisect
import html
import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QEvent, QPoint, QRect, Qt, QTimer, Signal
from PySide6.QtGui import QColor, QFont, QHelpEvent, QTextCharFormat, QTextCursor
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QSizePolicy,
    QSlider,
    QSpinBox,
    QSplitter,
    QTabWidget,
    QTextBrowser,
    QToolTip,
    QVBoxLayout,
    QWidget,
)

from widgets.controls import PRECISIONS

SIDES = ("a", "b")
RUNNING = "Running…"
COLOUR_BY = ("KL(A‖B)", "A's probability of this token", "none")
#: KL is coloured on a log scale between these (nats): below the low end a token is left
#: plain, so the eye goes to the few tokens that matter rather than to rounding noise.
KL_LOW, KL_HIGH = 1e-4, 1.0
#: The log-scale KL plot cannot show 0 (identical distributions); such points sit here.
KL_PLOT_FLOOR = 1e-8
MARKER = "▶"  # put before the first divergence in both columns (not part of either text)
BUDGET_STEPS = 1000  # slider positions between the smallest and the largest plan
BUDGET_DEBOUNCE_MS = 250  # a plan is asked for once the slider rests this long
MIB = 1024 * 1024
BAR_COLOURS = {"attn": "#4e9af1", "mlp": "#f1a04e"}
UPGRADED_COLOURS = {"attn": "#a9cdfa", "mlp": "#f8cf9f"}
ACCENT = "#4e9af1"
YELLOW, RED = (250, 210, 60), (230, 50, 40)


# -- plain helpers ------------------------------------------------------------------------------
def visible(piece: str) -> str:
    """A token's text with whitespace made visible, so ``' the'`` and ``'the'`` differ in a
    tooltip: spaces as ``·``, newlines as ``⏎``, tabs as ``⇥``, other control characters
    escaped; an empty piece (part of a character still to come) as ``∅``."""
    if not piece:
        return "∅"
    marks = {" ": "·", "\n": "⏎", "\t": "⇥", "\r": "␍"}
    return "".join(
        marks.get(ch, ch if ch.isprintable() else ch.encode("unicode_escape").decode())
        for ch in piece
    )


def format_kl(value: float | None) -> str:
    """KL in nats to 3 significant digits (``0.0123``, ``3.1e-07``); ``–`` when unknown
    (``None``, or NaN: a figure over no tokens)."""
    if value is None or math.isnan(value):
        return "–"
    return "0" if value == 0 else f"{value:.3g}"


def format_pct(value: float | None) -> str:
    """A probability or a rate as a percentage; small ones keep two significant digits."""
    if value is None or math.isnan(value):
        return "–"
    pct = 100.0 * value
    return f"{pct:.1f}%" if pct == 0 or abs(pct) >= 0.1 else f"{pct:.2g}%"


def format_mib(nbytes: float | None) -> str:
    return "–" if nbytes is None else f"{nbytes / MIB:.1f} MiB"


def kl_level(kl: float | None) -> float:
    """0…1 on a log scale from :data:`KL_LOW` to :data:`KL_HIGH` nats (0 below, 1 above)."""
    if kl is None or not kl > KL_LOW:
        return 0.0
    return min(1.0, math.log(kl / KL_LOW) / math.log(KL_HIGH / KL_LOW))


def probability_level(p: float | None) -> float:
    """0…1, linear: a token A was sure of (p = 1) is plain, an unlikely one (p → 0) red."""
    if p is None:
        return 0.0
    return min(1.0, max(0.0, 1.0 - p))


def heat_colour(level: float) -> QColor | None:
    """The background for a level in 0…1: none at 0, then a faint yellow that thickens and
    turns red. Lightness falls steadily along the ramp, so it reads in order in greyscale
    too; ``None`` means no colour at all (most tokens, most of the time)."""
    if not level > 0:
        return None
    level = min(level, 1.0)
    if level <= 0.5:
        return QColor(*YELLOW, int(40 + 170 * level / 0.5))
    t = (level - 0.5) / 0.5
    r, g, b = (round(y + (r_ - y) * t) for y, r_ in zip(YELLOW, RED, strict=True))
    return QColor(r, g, b, 210)


def quant_format(precision: str) -> str | None:
    """The weight format a layer scan quantizes blocks to, from a precision: ``int4-g32+head``
    → ``int4-g32``, ``int8`` → ``int8``; ``None`` for one that is not a single quantized
    format (``fp32``, ``bf16``, a mixed spec)."""
    match = re.fullmatch(r"(int8|int4-g\d+)(\+head)?", precision.strip())
    return match.group(1) if match else None


def _escape(text: str) -> str:
    """Text for a rich-text tooltip (quotes stay quotes: they are not inside a tag)."""
    return html.escape(text, quote=False)


def _at(values: Sequence[Any] | None, index: int) -> Any:
    """``values[index]``, or ``None`` where the list is missing or short (a report cut off by
    a cancel may lack the last token's figures)."""
    return values[index] if values is not None and 0 <= index < len(values) else None


def _side_stats(side: dict[str, Any]) -> str:
    parts = []
    if side.get("ttft_s") is not None:
        parts.append(f"TTFT {1000 * side['ttft_s']:.0f} ms")
    if side.get("tokens_per_s") is not None:
        parts.append(f"{side['tokens_per_s']:.1f} tok/s")
    parts.append(f"weights {format_mib(side.get('weights_bytes'))}")
    parts.append(f"KV {format_mib(side.get('kv_bytes'))}")
    if side.get("finish_reason"):
        parts.append(f"finish: {side['finish_reason']}")
    return " · ".join(parts)


def divergence_text(divergence: dict[str, Any]) -> str:
    """What the first divergence means under vLLM's rule (its ``check_logprobs_close``: where
    two outputs first differ, each model's token must be in the other's top-N, or the models
    really behave differently; after that point the texts are not compared any more)."""
    index = divergence.get("index")
    if index is None:
        return "A and B chose the same token at every position both reached."
    n = divergence.get("top_n", 5)

    def said(flag: bool | None) -> str:
        return "unknown" if flag is None else ("yes" if flag else "no")

    def chose(name: str, token: str | None) -> str:
        return f"{name} had stopped" if token is None else f"{name} chose '{visible(token)}'"

    a_in_b, b_in_a = divergence.get("a_in_b_top"), divergence.get("b_in_a_top")
    lines = [
        f"First divergence at token {index}: {chose('A', divergence.get('a_token'))}, "
        f"{chose('B', divergence.get('b_token'))}.",
        f"A's token in B's top-{n}: {said(a_in_b)}; B's token in A's top-{n}: {said(b_in_a)}.",
    ]
    if a_in_b and b_in_a:
        lines.append(
            "vLLM's rule passes: each choice is among the other's top candidates, a near tie "
            "that sent the texts apart rather than a real change in behaviour."
        )
    elif a_in_b is None or b_in_a is None:
        lines.append("vLLM's rule cannot be checked here (top candidates missing).")
    else:
        lines.append(
            "vLLM's rule fails: one model's choice is outside the other's top candidates, a real "
            "difference in behaviour."
        )
    return "\n".join(lines)


SUMMARY_TIP = (
    "KLD: KL(A‖B) of the next-token distributions, in nats. RMS Δp: root mean square of "
    "p_A − p_B for the tokens of the text. Top-1 agreement: how often both would pick the "
    "same next token. Noise floor: A against a second run of A, what counts as no "
    "difference. Acceptance: how often B's drafts pass A's check in speculative decoding"
)
SPECULATION_TIP = (
    "Acceptance, predicted: from the two models' next-token distributions along A's answer: "
    "for greedy A, how often B's likeliest token is A's (top-1 agreement); for sampling, "
    "Σ min(p_A, p_B) = 1 − TV(p_A, p_B), the chance that rejection sampling keeps B's "
    "draft.\nMeasured: A answered once more, same prompt, sampling and seed, by "
    "speculative decoding with B's model drafting k tokens at every step: accepted drafts "
    "over accepted drafts plus rejections, the same figure as the prediction (vLLM's "
    "acceptance rate, accepted over drafted tokens, also counts the drafts a rejection "
    "leaves unchecked). Mean acceptance length: tokens per verified step, A's own included; "
    "predicted: what the predicted acceptance gives for the same drafts."
)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None


def _length(value: Any) -> str:
    number = _number(value)
    return "–" if number is None else f"{number:.2f}"


def measured_text(spec: dict[str, Any]) -> str:
    """The measured acceptance, for beside the predicted one (empty when not attempted)."""
    measured = spec.get("measured")
    if not isinstance(measured, dict):
        reason = spec.get("not_measured")
        return f"not measured: {reason}" if reason else ""
    mode = measured.get("mode", "?")
    text = (
        f"measured {format_pct(_number(measured.get('token_acceptance')))} ({mode}, "
        f"k={measured.get('k', '?')}: mean acceptance length "
        f"{_length(measured.get('mean_acceptance_length'))}, predicted "
        f"{_length(measured.get('predicted_mean_acceptance_length'))})"
    )
    if mode == "greedy" and measured.get("matches_a") is False:
        text += f", output differs from A's at token {measured.get('first_difference')}"
    return text


def speculation_tip(spec: dict[str, Any]) -> str:
    """:data:`SPECULATION_TIP` and this run's measured details (or why there are none)."""
    measured = spec.get("measured")
    if not isinstance(measured, dict):
        reason = spec.get("not_measured")
        return f"{SPECULATION_TIP}\n\nNot measured: {reason}" if reason else SPECULATION_TIP
    per_pos = measured.get("acceptance_per_pos")
    positions = (
        ", ".join(format_pct(_number(v)) for v in per_pos) if isinstance(per_pos, list) else "–"
    )
    matches = measured.get("matches_a")
    lines = [
        f"This run: {measured.get('accepted_tokens', '?')} of "
        f"{measured.get('draft_tokens', '?')} drafted tokens accepted "
        f"({format_pct(_number(measured.get('acceptance_rate')))}, vLLM's acceptance rate); "
        f"by draft position: {positions}.",
        "Output equals A's: " + ("unknown" if matches is None else "yes" if matches else "no")
        + (" (sampling: the same distribution, other draws)"
           if matches is False and measured.get("mode") == "sampling" else ""),
    ]  # fmt: skip
    return f"{SPECULATION_TIP}\n\n" + "\n".join(lines)


def summary_line(summary: dict[str, Any], divergence: dict[str, Any] | None = None) -> str:
    """The comparison in one line (KL in nats)."""
    spec = summary.get("speculative")
    spec = spec if isinstance(spec, dict) else {}
    measured = measured_text(spec)
    noise = summary.get("noise_kl_mean")
    parts = [
        f"{summary.get('tokens', 0)} tokens: mean KLD {format_kl(summary.get('kl_mean'))} nats",
        f"p99 KLD {format_kl(summary.get('kl_p99'))}",
        f"RMS Δp {format_pct(summary.get('rms_dp'))}",
        f"top-1 agreement {format_pct(summary.get('top1_agreement'))}",
        f"flips (answers differ): {'yes' if summary.get('flips') else 'no'}",
        f"noise floor (A vs A′) {format_kl(noise) if noise is not None else 'n/a'}",
        f"B drafting for A would be accepted {format_pct(spec.get('greedy_acceptance'))} "
        f"(greedy) / {format_pct(spec.get('sampling_acceptance'))} (sampling)"
        + (f", {measured}" if measured else ""),
    ]
    if divergence is not None and divergence.get("index") is not None:
        parts.append(f"first divergence at token {divergence['index']}")
    return " · ".join(parts)


# -- the token column ---------------------------------------------------------------------------
class TokenView(QTextBrowser):
    """A column's text, token by token. It keeps each token's character span, so a point
    under the mouse maps to a token (its tooltip) and a test can read a token's format."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setOpenLinks(False)
        self.document().setUndoRedoEnabled(False)  # streamed text needs no undo history
        self.spans: list[tuple[int, int]] = []  # [start, end) of each token, in the document
        self._starts: list[int] = []
        self.marker_pos: int | None = None
        self.marker_tip = ""
        self.tooltip_provider: Callable[[int], str] | None = None

    def clear_tokens(self) -> None:
        self.clear()
        self.spans, self._starts, self.marker_pos = [], [], None

    def append_text(self, text: str) -> None:
        """Streamed text, inserted at the end (no re-render); the view follows the end unless
        the user scrolled up."""
        bar = self.verticalScrollBar()
        following = bar.value() >= bar.maximum() - 4
        cursor = QTextCursor(self.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        cursor.insertText(text, QTextCharFormat())
        if following:
            bar.setValue(bar.maximum())

    def set_tokens(
        self,
        pieces: Sequence[str],
        formats: Sequence[QTextCharFormat],
        marker_at: int | None = None,
        marker_format: QTextCharFormat | None = None,
        marker_tip: str = "",
    ) -> None:
        """Render the tokens, each with its format, and :data:`MARKER` before token
        ``marker_at`` (at the end when the column is shorter than that)."""
        self.clear_tokens()
        self.marker_tip = marker_tip
        cursor = QTextCursor(self.document())
        cursor.beginEditBlock()

        def marker() -> None:
            self.marker_pos = cursor.position()
            cursor.insertText(MARKER, marker_format or QTextCharFormat())

        for i, (piece, fmt) in enumerate(zip(pieces, formats, strict=True)):
            if i == marker_at:
                marker()
            start = cursor.position()
            cursor.insertText(piece, fmt)
            self.spans.append((start, cursor.position()))
        if marker_at is not None and marker_at >= len(pieces):
            marker()
        cursor.endEditBlock()
        self._starts = [s for s, _ in self.spans]

    def token_at(self, char_pos: int) -> int | None:
        """The token holding the character at ``char_pos`` (a document position), or
        ``None`` (the marker, or past the end)."""
        i = bisect.bisect_right(self._starts, char_pos) - 1
        if i >= 0 and self.spans[i][0] <= char_pos < self.spans[i][1]:
            return i
        return None

    def char_at(self, point: QPoint) -> int | None:
        """The character under ``point`` (viewport coordinates), or ``None`` off the text.
        ``cursorForPosition`` gives the nearest gap between characters; the point's side of
        that gap says which character it is over."""
        layout = self.document().documentLayout()
        content = point + QPoint(
            self.horizontalScrollBar().value(), self.verticalScrollBar().value()
        )
        if layout.hitTest(content.toPointF(), Qt.HitTestAccuracy.ExactHit) < 0:
            return None
        cursor = self.cursorForPosition(point)
        pos = cursor.position()
        if point.x() < self.cursorRect(cursor).x() and pos > 0:
            pos -= 1
        return pos

    def token_at_point(self, point: QPoint) -> int | None:
        pos = self.char_at(point)
        return None if pos is None else self.token_at(pos)

    def format_at(self, index: int) -> QTextCharFormat:
        """The character format of token ``index`` (of its first character)."""
        start, end = self.spans[index]
        if start == end:
            return QTextCharFormat()
        cursor = QTextCursor(self.document())
        cursor.setPosition(start + 1)  # charFormat is the format of the character before
        return cursor.charFormat()

    def plain_text(self) -> str:
        """The column's text, without the divergence marker."""
        text = self.toPlainText()
        if self.marker_pos is None:
            return text
        # document positions count UTF-16 units (an emoji is two), Python's str code points
        units = text.encode("utf-16-le")
        at = 2 * self.marker_pos
        return (units[:at] + units[at + 2 * len(MARKER) :]).decode("utf-16-le")

    def viewportEvent(self, event: QEvent) -> bool:
        if event.type() == QEvent.Type.ToolTip and isinstance(event, QHelpEvent):
            tip, area = self._tip_at(event.pos())
            if tip:  # shown until the mouse leaves the token, then the next one's
                QToolTip.showText(event.globalPos(), tip, self.viewport(), area)
            else:
                QToolTip.hideText()
                event.ignore()
            return True
        return super().viewportEvent(event)

    def _tip_at(self, point: QPoint) -> tuple[str, QRect]:
        pos = self.char_at(point)
        if pos is None:
            return "", QRect()
        if pos == self.marker_pos:
            tip = _escape(self.marker_tip).replace("\n", "<br>")
            return tip, self._span_rect(pos, pos + len(MARKER))
        index = self.token_at(pos)
        if index is None or self.tooltip_provider is None:
            return "", QRect()
        start, end = self.spans[index]
        area = self._span_rect(start, end)
        return self.tooltip_provider(index), area if area.contains(point) else QRect()

    def _span_rect(self, start: int, end: int) -> QRect:
        """Where characters ``start`` … ``end`` are drawn (viewport coordinates), when they
        sit on one line; else an empty rect (the tooltip then simply follows the mouse)."""
        first, last = QTextCursor(self.document()), QTextCursor(self.document())
        first.setPosition(start)
        last.setPosition(end)
        a, b = self.cursorRect(first), self.cursorRect(last)
        if a.top() != b.top():
            return QRect()
        return QRect(a.topLeft(), b.bottomRight())


class _Column(QWidget):
    """One side's output: a title, its speed and memory, and the tokens."""

    def __init__(self, side: str) -> None:
        super().__init__()
        self.side = side
        self.header = QLabel(side.upper())
        self.header.setObjectName("roleLabel")
        self.stats = QLabel()
        self.stats.setObjectName("statusLabel")
        self.stats.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.text = TokenView()
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.header)
        layout.addWidget(self.stats)
        layout.addWidget(self.text, 1)


class _SideForm(QGroupBox):
    """Model, precision, temperature and cache window of one side."""

    def __init__(self, title: str) -> None:
        super().__init__(title)
        form = QFormLayout(self)
        self.model = QComboBox()
        self.model.setEditable(True)
        self.model.setInsertPolicy(QComboBox.InsertPolicy.NoInsert)
        self.model.setSizeAdjustPolicy(
            QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon
        )
        self.model.setMinimumContentsLength(10)
        self.model.setToolTip("A model folder (pick one, or type a path)")
        self.precision = QComboBox()
        self.precision.setEditable(True)
        self.precision.setInsertPolicy(QComboBox.InsertPolicy.NoInsert)
        self.precision.addItems(PRECISIONS)
        # long mixed specs must not widen the form (the tab fits a 1280-pixel window)
        self.precision.setSizeAdjustPolicy(
            QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon
        )
        self.precision.setMinimumContentsLength(10)
        self.precision.setToolTip(
            "Weights' precision; '+head' quantizes the LM head too. A mixed spec "
            "(from the layer sensitivity tab) can be typed here"
        )
        self.temperature = QDoubleSpinBox()
        self.temperature.setRange(0.0, 5.0)
        self.temperature.setDecimals(2)
        self.temperature.setSingleStep(0.1)
        self.temperature.setSpecialValueText("0 (greedy)")
        self.temperature.setToolTip("0 = greedy: differences then come from the weights alone")
        self.window_on = QCheckBox("Window")
        self.window_on.setToolTip("Keep only the first sink tokens and the most recent ones")
        self.sinks = QSpinBox()
        self.sinks.setRange(0, 999)
        self.sinks.setValue(4)
        self.sinks.setToolTip("Sink tokens: the first tokens, always kept")
        self.recent = QSpinBox()
        self.recent.setRange(16, 99999)
        self.recent.setValue(256)
        self.recent.setToolTip("Recent tokens kept in the cache")
        for spin in (self.sinks, self.recent):
            spin.setEnabled(False)
            self.window_on.toggled.connect(spin.setEnabled)
        self.sinks.setPrefix("sink ")
        self.recent.setPrefix("last ")
        window_row = QHBoxLayout()
        window_row.addWidget(self.sinks)
        window_row.addWidget(self.recent)
        form.addRow("Model", self.model)
        form.addRow("Precision", self.precision)
        form.addRow("Temperature", self.temperature)
        form.addRow(self.window_on, window_row)  # the switch as the row's label: compact

    def model_path(self) -> str:
        """The chosen item's path, or the text typed in the box."""
        text = self.model.currentText().strip()
        index = self.model.findText(text)
        data = self.model.itemData(index) if index >= 0 else None
        return str(data) if data else text

    def set_model(self, path: str) -> None:
        index = self.model.findData(path)
        if index < 0:
            self.model.addItem(Path(path).name or path, path)
            index = self.model.count() - 1
        self.model.setCurrentIndex(index)

    def values(self) -> dict[str, Any]:
        window = [self.sinks.value(), self.recent.value()] if self.window_on.isChecked() else None
        return {
            "model": self.model_path(),
            "precision": self.precision.currentText().strip(),
            "temperature": self.temperature.value(),
            "window": window,
        }


def _plot(title: str, left: str, bottom: str) -> pg.PlotWidget:
    w = pg.PlotWidget(background="#1e2127")
    w.setTitle(title, color="#d0d4da", size="10pt")
    w.setLabel("left", left)
    w.setLabel("bottom", bottom)
    for axis in ("left", "bottom"):
        w.getAxis(axis).enableAutoSIPrefix(False)
    w.showGrid(x=True, y=True, alpha=0.2)
    w.setMinimumHeight(120)
    return w


# -- the view -----------------------------------------------------------------------------------
class ABView(QWidget):
    """The A/B lab tab. Plain data in (:meth:`show_report`, :meth:`show_scan`,
    :meth:`show_plan`), signals out; the app runs the engine."""

    run_requested = Signal(dict)
    cancel_requested = Signal()
    scan_requested = Signal(dict)
    scan_cancel_requested = Signal()
    budget_changed = Signal(object)  # bytes (an int; Qt's int signal stops at 2 GiB)
    use_spec_requested = Signal(str)
    open_requested = Signal(str)
    save_json_requested = Signal(str)
    save_png_requested = Signal(str)  # the app calls grab_png(path) and says how it went

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._report: dict[str, Any] | None = None
        self._scan: dict[str, Any] | None = None
        self._upgraded: set[tuple[int, str]] = set()
        self._busy = False

        # configuration
        self.forms = {"a": _SideForm("A (reference)"), "b": _SideForm("B")}
        self.forms["b"].precision.setCurrentText("int8")
        self.seed = QSpinBox()
        self.seed.setRange(0, 2**31 - 1)
        self.seed.setToolTip("Both sides sample with this seed, so only the weights differ")
        self.max_new_tokens = QSpinBox()
        self.max_new_tokens.setRange(1, 32768)
        self.max_new_tokens.setValue(64)
        self.continue_conversation = QCheckBox("Continue the chat")
        self.continue_conversation.setToolTip(
            "Continue the current conversation: send its messages before the prompt (both "
            "sides get the same)"
        )
        self.run_button = QPushButton("Run")
        self.run_button.setDefault(True)
        self.run_button.clicked.connect(self._request_run)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.clicked.connect(self.cancel_requested)
        self.open_button = QPushButton("Open…")
        self.open_button.setToolTip("Open a saved A/B comparison (JSON)")
        self.open_button.clicked.connect(self._ask_open)
        self.save_json_button = QPushButton("Save…")
        self.save_json_button.setToolTip(
            "Save the comparison as JSON, every figure included (the format of "
            "`infersight eval compare --json`)"
        )
        self.save_json_button.clicked.connect(self._ask_save_json)
        self.save_png_button = QPushButton("PNG…")
        self.save_png_button.setToolTip("Save a picture of this tab")
        self.save_png_button.clicked.connect(self._ask_save_png)
        run_box = QGroupBox("Both")
        run_form = QFormLayout(run_box)
        run_form.addRow("Seed", self.seed)
        run_form.addRow("Max new tokens", self.max_new_tokens)
        run_form.addRow(self.continue_conversation)
        run_row = QHBoxLayout()
        run_row.addWidget(self.run_button)
        run_row.addWidget(self.cancel_button)
        run_form.addRow(run_row)
        self.status = QLabel()
        self.status.setObjectName("statusLabel")
        self.status.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        run_form.addRow(self.status)
        self.prompt = QPlainTextEdit()
        self.prompt.setPlaceholderText("The prompt both A and B answer")
        self.prompt.setFixedHeight(60)
        config = QHBoxLayout()
        config.addWidget(self.forms["a"], 1)
        config.addWidget(self.forms["b"], 1)
        config.addWidget(run_box)

        self.notice = QLabel()
        self.notice.setObjectName("notice")
        self.notice.setWordWrap(True)
        self.notice.setVisible(False)
        self.notice.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)

        self.tabs = QTabWidget()
        self.tabs.addTab(self._tokens_tab(), "Tokens")
        self.tabs.addTab(self._sensitivity_tab(), "Layer sensitivity")

        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addLayout(config)
        layout.addWidget(self.prompt)
        layout.addWidget(self.notice)
        layout.addWidget(self.tabs, 1)
        self.set_busy(False)

    def _tokens_tab(self) -> QWidget:
        self.colour_by = QComboBox()
        self.colour_by.addItems(COLOUR_BY)
        self.colour_by.setToolTip(
            "KL(A‖B): how far B's next-token distribution is from A's there (log scale, "
            f"{KL_LOW:g} … {KL_HIGH:g} nats). A's probability: how likely A found the token "
            "the column shows (in B's column: where A would not have said it)"
        )
        self.colour_by.currentIndexChanged.connect(self._render_columns)
        self.plot_column = QComboBox()
        self.plot_column.addItem("A's text", "a")
        self.plot_column.addItem("B's text", "b")
        self.plot_column.setCurrentIndex(1)
        self.plot_column.currentIndexChanged.connect(self._draw_kl)
        row = QHBoxLayout()
        row.addWidget(QLabel("Colour by"))
        row.addWidget(self.colour_by)
        row.addSpacing(16)
        row.addWidget(QLabel("Plot column"))
        row.addWidget(self.plot_column)
        row.addStretch(1)
        for button in (self.open_button, self.save_json_button, self.save_png_button):
            row.addWidget(button)  # here rather than above: the tab must fit a 1280-px window

        self.columns = {side: _Column(side) for side in SIDES}
        for side, column in self.columns.items():
            column.text.tooltip_provider = lambda i, s=side: self.tooltip_for(s, i)
        columns = QSplitter(Qt.Orientation.Horizontal)
        for column in self.columns.values():
            columns.addWidget(column)

        self.summary = QLabel("Run a comparison, or open a saved one")
        self.summary.setWordWrap(True)
        # two lines always: a one-line label was cut where the columns took the height
        self.summary.setMinimumHeight(2 * self.summary.fontMetrics().lineSpacing() + 4)
        self.summary.setTextFormat(Qt.TextFormat.PlainText)
        self.summary.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.summary.setToolTip(SUMMARY_TIP + "\n\n" + SPECULATION_TIP)
        self.kl_plot = _plot("KL(A‖B) per token", "KL (nats)", "token")
        self.kl_plot.setLogMode(y=True)
        self.kl_plot.getAxis("left").setWidth(64)  # room for 10⁻⁶-style ticks and the label
        # bottom right: the curve runs along the top, the floor band along the bottom left
        self.kl_plot.getPlotItem().addLegend(offset=(-6, -24), labelTextSize="8pt")
        floor_pen = pg.mkPen(0, 0, 0, 0)
        self.noise_bottom = pg.PlotDataItem(pen=floor_pen)
        self.noise_top = pg.PlotDataItem(pen=pg.mkPen(150, 160, 175, 90))
        self.kl_plot.addItem(self.noise_bottom, ignoreBounds=True)
        self.kl_plot.addItem(self.noise_top)
        self.noise_band = pg.FillBetweenItem(
            self.noise_bottom, self.noise_top, brush=pg.mkBrush(150, 160, 175, 50)
        )
        self.kl_plot.addItem(self.noise_band)
        self.kl_curve = self.kl_plot.plot(
            name="KL(A‖B)",
            pen=pg.mkPen(BAR_COLOURS["mlp"], width=1.5),
            symbol="o",
            symbolSize=4,
            symbolBrush=BAR_COLOURS["mlp"],
            symbolPen=None,
        )
        legend = self.kl_plot.getPlotItem().legend
        # the band's edge stands for it: a legend sample of a FillBetweenItem crashed Qt
        # (pyqtgraph 0.14, a segfault in the plot's paintEvent)
        legend.addItem(self.noise_top, "noise floor (A vs A′)")
        self.divergence_line = pg.InfiniteLine(
            angle=90,
            movable=False,
            pen=pg.mkPen(ACCENT, style=Qt.PenStyle.DashLine),
            label="first divergence",
            labelOpts={"color": ACCENT, "position": 0.9},
        )
        self.divergence_line.setVisible(False)
        self.kl_plot.addItem(self.divergence_line)
        self.noise_band.setVisible(False)

        below = QWidget()
        below_layout = QVBoxLayout(below)
        below_layout.setContentsMargins(0, 0, 0, 0)
        below_layout.addWidget(self.summary)
        below_layout.addWidget(self.kl_plot, 1)
        split = QSplitter(Qt.Orientation.Vertical)
        split.addWidget(columns)
        split.addWidget(below)
        split.setStretchFactor(0, 3)
        split.setStretchFactor(1, 2)
        tab = QWidget()
        layout = QVBoxLayout(tab)
        layout.addLayout(row)
        layout.addWidget(split, 1)
        return tab

    def _sensitivity_tab(self) -> QWidget:
        self.scan_button = QPushButton("Scan layers")
        self.scan_button.setToolTip(
            "Quantize one block at a time (each layer's attention, then its MLP) to B's "
            "format and measure the KL against A's model on a text: the blocks that hurt most "
            "are the ones worth keeping at high precision"
        )
        self.scan_button.clicked.connect(self._request_scan)
        self.scan_cancel_button = QPushButton("Cancel scan")
        self.scan_cancel_button.clicked.connect(self.scan_cancel_requested)
        self.scan_progress = QProgressBar()
        self.scan_progress.setRange(0, 1)
        self.scan_progress.setValue(0)
        self.scan_progress.setFormat("")
        row = QHBoxLayout()
        row.addWidget(self.scan_button)
        row.addWidget(self.scan_cancel_button)
        row.addWidget(self.scan_progress, 1)
        self.scan_label = QLabel("No scan yet")
        self.scan_label.setWordWrap(True)
        self.scan_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)

        self.scan_plot = _plot("KL with only this block quantized", "KL (nats)", "layer")
        # top right: the first layers' bars are often the tallest
        self.scan_plot.getPlotItem().addLegend(offset=(-6, 6), labelTextSize="8pt")
        self.attn_bars = pg.BarGraphItem(x=[], height=[], width=0.4, brush=BAR_COLOURS["attn"])
        self.mlp_bars = pg.BarGraphItem(x=[], height=[], width=0.4, brush=BAR_COLOURS["mlp"])
        self.scan_plot.addItem(self.attn_bars)
        self.scan_plot.addItem(self.mlp_bars)
        legend = self.scan_plot.getPlotItem().legend
        legend.addItem(self.attn_bars, "attention")
        legend.addItem(self.mlp_bars, "MLP")

        self.budget = QSlider(Qt.Orientation.Horizontal)
        self.budget.setRange(0, BUDGET_STEPS)
        self.budget.setEnabled(False)
        self.budget.setToolTip("Weight memory the mixed precision plan may use")
        self.budget.valueChanged.connect(self._budget_moved)
        self.budget_label = QLabel("budget –")
        self._budget_timer = QTimer(self, singleShot=True, interval=BUDGET_DEBOUNCE_MS)
        self._budget_timer.timeout.connect(lambda: self.budget_changed.emit(self.budget_bytes()))
        budget_row = QHBoxLayout()
        budget_row.addWidget(QLabel("Budget"))
        budget_row.addWidget(self.budget, 1)
        budget_row.addWidget(self.budget_label)
        self.spec_line = QLineEdit()
        self.spec_line.setReadOnly(True)
        self.spec_line.setPlaceholderText("the plan's precision spec")
        self.use_button = QPushButton("Use as B")
        self.use_button.setToolTip("Put this spec in B's precision, to compare it with A")
        self.use_button.setEnabled(False)
        self.use_button.clicked.connect(self._use_spec)
        spec_row = QHBoxLayout()
        spec_row.addWidget(self.spec_line, 1)
        spec_row.addWidget(self.use_button)
        self.plan_label = QLabel()
        self.plan_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)

        tab = QWidget()
        layout = QVBoxLayout(tab)
        layout.addLayout(row)
        layout.addWidget(self.scan_label)
        layout.addWidget(self.scan_plot, 1)
        layout.addLayout(budget_row)
        layout.addLayout(spec_row)
        layout.addWidget(self.plan_label)
        return tab

    # -- configuration ----------------------------------------------------------------------
    def set_models(self, models: Sequence[tuple[str, str]]) -> None:
        """The models to offer, as (name, path); each side keeps its choice."""
        for form in self.forms.values():
            current = form.model_path()
            form.model.blockSignals(True)
            form.model.clear()
            for name, path in models:
                form.model.addItem(name, path)
            if current:
                form.set_model(current)
            form.model.blockSignals(False)

    def set_current(self, model_path: str, precision: str) -> None:
        """The chat's model: A is it at fp32 (the reference), B the same model at the chat's
        precision when that is a quantized one, else at int8."""
        for form in self.forms.values():
            form.set_model(model_path)
        self.forms["a"].precision.setCurrentText("fp32")
        quantized = precision not in ("fp32", "bf16", "fp16") and bool(precision)
        self.forms["b"].precision.setCurrentText(precision if quantized else "int8")

    def form(self) -> dict[str, Any]:
        """What :attr:`run_requested` carries."""
        return {
            "a": self.forms["a"].values(),
            "b": self.forms["b"].values(),
            "seed": self.seed.value(),
            "max_new_tokens": self.max_new_tokens.value(),
            "prompt": self.prompt.toPlainText(),
            "continue_conversation": self.continue_conversation.isChecked(),
        }

    def _request_run(self) -> None:
        request = self.form()
        if not request["prompt"].strip() and not request["continue_conversation"]:
            self.set_notice("Type a prompt for A and B first.", "warning")
            return
        missing = [
            s.upper() for s in SIDES if not request[s]["model"] or not request[s]["precision"]
        ]
        if missing:
            self.set_notice(
                f"Choose a model and a precision for {' and '.join(missing)}.", "warning"
            )
            return
        self.run_requested.emit(request)

    def set_busy(self, busy: bool) -> None:
        """While the lab works (a run or a scan: one at a time), nothing new can start and
        either Cancel stops it."""
        self._busy = busy
        for button in (self.run_button, self.scan_button, self.open_button):
            button.setEnabled(not busy)
        self.cancel_button.setEnabled(busy)
        self.scan_cancel_button.setEnabled(busy)
        self.save_json_button.setEnabled(not busy and self._report is not None)
        if not busy and self._report is None and self.summary.text() == RUNNING:
            self.summary.setText("No comparison: the run was cancelled or failed (see above)")

    def set_status(self, text: str) -> None:
        """What the lab is doing now (loading B…, generating…, done)."""
        self.status.setText(text)
        self.status.setToolTip(text)

    def set_notice(self, text: str, level: str = "info") -> None:
        """A message above the columns (how A and B share memory, what went wrong); empty
        text hides it."""
        self.notice.setProperty("level", level)
        self.notice.style().unpolish(self.notice)
        self.notice.style().polish(self.notice)
        self.notice.setText(text)
        self.notice.setVisible(bool(text))

    # -- streaming ----------------------------------------------------------------------------
    def begin_run(self, a_title: str, b_title: str) -> None:
        """A run starts: empty columns, and the last report's figures go (they belong to
        other text; :meth:`report` is ``None`` until the new one arrives)."""
        self._report = None
        self.summary.setText(RUNNING)
        self.summary.setToolTip(SUMMARY_TIP + "\n\n" + SPECULATION_TIP)
        self.kl_curve.setData([], [])
        self.noise_top.setData([], [])
        self.noise_bottom.setData([], [])
        self.noise_band.setVisible(False)
        self.divergence_line.setVisible(False)
        for side, title in zip(SIDES, (a_title, b_title), strict=True):
            column = self.columns[side]
            column.header.setText(title)
            column.stats.setText("")
            column.text.clear_tokens()
        self.set_busy(True)

    def append(self, side: str, text: str) -> None:
        if self._report is None:  # a shown report's columns are rendered from its pieces
            self.columns[side].text.append_text(text)

    def set_side_stats(self, side: str, text: str) -> None:
        self.columns[side].stats.setText(text)
        self.columns[side].stats.setToolTip(text)

    # -- the report ---------------------------------------------------------------------------
    def show_report(self, report: dict[str, Any]) -> None:
        """A finished comparison (or one opened from a file): the columns are rendered again
        token by token and coloured, the summary and the plot filled in."""
        self._report = report
        models = {report[s].get("model") for s in SIDES}
        for side in SIDES:
            info = report[side]
            parts = [side.upper(), info.get("precision", "?"), info.get("device", "?")]
            if len(models) > 1:
                parts.append(Path(str(info.get("model", ""))).name)
            self.columns[side].header.setText(" · ".join(parts))
            self.columns[side].header.setToolTip(str(info.get("model", "")))
            self.set_side_stats(side, _side_stats(info))
        self._render_columns()
        summary = report.get("summary", {})
        self.summary.setText(summary_line(summary, report.get("divergence")))
        spec = summary.get("speculative")
        self.summary.setToolTip(
            SUMMARY_TIP + "\n\n" + speculation_tip(spec if isinstance(spec, dict) else {})
        )
        self._draw_kl()
        message = (report.get("memory") or {}).get("message")
        if message:
            self.set_notice(message, "info")
        self.set_busy(self._busy)

    def report(self) -> dict[str, Any] | None:
        return self._report

    def column_text(self, side: str) -> str:
        return self.columns[side].text.plain_text()

    def summary_text(self) -> str:
        return self.summary.text()

    def token_at(self, side: str, char_pos: int) -> int | None:
        """The token of ``side``'s column at a character position (see :class:`TokenView`)."""
        return self.columns[side].text.token_at(char_pos)

    def token_format(self, side: str, index: int) -> QTextCharFormat:
        return self.columns[side].text.format_at(index)

    def _level(self, figures: dict[str, Any], index: int) -> float:
        mode = self.colour_by.currentIndex()
        if mode == 0:
            return kl_level(_at(figures.get("kl"), index))
        if mode == 1:
            return probability_level(_at(figures.get("p_a"), index))
        return 0.0

    def _render_columns(self) -> None:
        if self._report is None:
            return
        divergence = self._report.get("divergence") or {}
        at = divergence.get("index")
        marker_format = QTextCharFormat()
        marker_format.setForeground(QColor(ACCENT))
        marker_format.setFontWeight(QFont.Weight.Bold)
        for side in SIDES:
            pieces = list(self._report[side].get("pieces", []))
            figures = self._report.get("columns", {}).get(side, {})
            formats = []
            for i in range(len(pieces)):
                fmt = QTextCharFormat()
                level = self._level(figures, i)
                colour = heat_colour(level)
                if colour is not None:
                    fmt.setBackground(colour)
                    if level > 0.3:  # light text on a strong yellow or red does not read
                        fmt.setForeground(QColor(20, 20, 24))
                if i == at:
                    fmt.setFontWeight(QFont.Weight.Bold)
                    fmt.setFontUnderline(True)
                    fmt.setUnderlineColor(QColor(ACCENT))
                formats.append(fmt)
            self.columns[side].text.set_tokens(
                pieces, formats, at, marker_format, divergence_text(divergence)
            )

    def tooltip_for(self, column: str, index: int) -> str:
        """Token ``index`` of ``column``'s text: its KL, both models' probability of it, and
        both models' top-5 next tokens there (rich text)."""
        if self._report is None:
            return ""
        pieces = self._report[column].get("pieces", [])
        figures = self._report.get("columns", {}).get(column, {})
        piece = _at(pieces, index)
        lines = [
            f"<b>{column.upper()}'s token {index}</b> '{_escape(visible(piece or ''))}'",
            f"KL(A‖B) {format_kl(_at(figures.get('kl'), index))} nats · "
            f"p_A {format_pct(_at(figures.get('p_a'), index))} · "
            f"p_B {format_pct(_at(figures.get('p_b'), index))}",
        ]
        noise = _at(figures.get("noise_kl"), index)
        if noise is not None:
            lines.append(f"noise floor (A vs A′) {format_kl(noise)} nats")
        top_a = _at(figures.get("top_a"), index) or []
        top_b = _at(figures.get("top_b"), index) or []
        rows = []
        for i in range(max(len(top_a), len(top_b))):
            cells = []
            for top in (top_a, top_b):
                if i < len(top):
                    text, p = top[i]
                    cells.append(f"'{_escape(visible(text))}'</td><td align=right>{format_pct(p)}")
                else:
                    cells.append("</td><td>")
            rows.append("<tr><td>" + "</td><td>&nbsp;&nbsp;</td><td>".join(cells) + "</td></tr>")
        names = [self._report[s].get("precision", s.upper()) for s in SIDES]
        head = (
            f"<tr><th colspan=2 align=left>A top-{len(top_a)} ({_escape(names[0])})</th>"
            f"<th></th><th colspan=2 align=left>B top-{len(top_b)} ({_escape(names[1])})"
            "</th></tr>"
        )
        table = f"<table cellspacing=0 cellpadding=1>{head}{''.join(rows)}</table>"
        out = "<br>".join(lines) + table
        divergence = self._report.get("divergence") or {}
        if divergence.get("index") == index:
            out += "<hr>" + _escape(divergence_text(divergence)).replace("\n", "<br>")
        return out

    def _draw_kl(self) -> None:
        if self._report is None:
            return
        side = str(self.plot_column.currentData())
        figures = self._report.get("columns", {}).get(side, {})
        kl = np.asarray(figures.get("kl") or [], dtype=float)
        self.kl_curve.setData(np.arange(len(kl)), np.maximum(kl, KL_PLOT_FLOOR))
        noise = figures.get("noise_kl")
        if noise:
            values = np.maximum(np.asarray(noise, dtype=float), KL_PLOT_FLOOR)
            x = np.arange(len(values))
            self.noise_bottom.setData(x, np.full(len(values), KL_PLOT_FLOOR))
            self.noise_top.setData(x, values)
        else:
            self.noise_bottom.setData([], [])
            self.noise_top.setData([], [])
        self.noise_band.setVisible(bool(noise))
        self.noise_top.setVisible(bool(noise))
        index = (self._report.get("divergence") or {}).get("index")
        self.divergence_line.setVisible(index is not None)
        if index is not None:
            self.divergence_line.setValue(index)
        self.kl_plot.setTitle(
            f"KL(A‖B) per token, along {side.upper()}'s text", color="#d0d4da", size="10pt"
        )

    # -- layer sensitivity -------------------------------------------------------------------
    def _request_scan(self) -> None:
        precision = self.forms["b"].precision.currentText()
        low = quant_format(precision)
        if low is None:
            self.set_notice(
                f"A layer scan quantizes one block at a time to B's format; B's precision "
                f"{precision!r} is not one (choose int8 or int4-g32, say).",
                "warning",
            )
            return
        self.scan_requested.emit({"model": self.forms["a"].model_path(), "low": low})

    def set_scan_progress(self, done: int, total: int) -> None:
        self.scan_progress.setRange(0, max(1, total))
        self.scan_progress.setValue(min(done, max(1, total)))
        self.scan_progress.setFormat(f"{done} / {total} blocks")

    def show_scan(self, scan: dict[str, Any]) -> None:
        """A finished scan: bars per layer, and the budget slider spans its plans. The slider
        starts half-way, so a plan is asked for at once."""
        self._scan = scan
        self._upgraded = set()
        self._draw_bars()
        low, high = scan.get("low", "?"), scan.get("high", "?")
        self.scan_plot.setTitle(
            f"KL with only this block at {low} (the rest at fp32)", color="#d0d4da", size="10pt"
        )
        self.scan_label.setText(
            f"{Path(str(scan.get('model', ''))).name}: every block at {low}: KL "
            f"{format_kl(scan.get('all_low_kl'))} nats over {scan.get('text_tokens', '?')} "
            f"tokens · weights {format_mib(scan.get('min_bytes'))} (all {low}) … "
            f"{format_mib(scan.get('max_bytes'))} (all {high}), of which "
            f"{format_mib(scan.get('fixed_bytes'))} not scanned (embeddings, norms)"
        )
        self.budget.setEnabled(scan.get("max_bytes", 0) > scan.get("min_bytes", 0))
        self.budget.blockSignals(True)
        self.budget.setValue(BUDGET_STEPS // 2)
        self.budget.blockSignals(False)
        self._budget_moved()

    def _draw_bars(self) -> None:
        blocks = (self._scan or {}).get("blocks", [])
        for part, bars, shift in (("attn", self.attn_bars, -0.2), ("mlp", self.mlp_bars, 0.2)):
            mine = [b for b in blocks if b.get("part") == part]
            upgraded = [(b["layer"], part) in self._upgraded for b in mine]
            bars.setOpts(
                x=np.array([b["layer"] for b in mine], dtype=float) + shift,
                height=np.array([b["kl"] for b in mine], dtype=float),
                width=0.4,
                brushes=[UPGRADED_COLOURS[part] if u else BAR_COLOURS[part] for u in upgraded],
                pens=[pg.mkPen("w", width=2) if u else pg.mkPen(None) for u in upgraded],
            )

    def budget_bytes(self) -> int:
        """The budget the slider stands at, in bytes."""
        scan = self._scan or {}
        lo, hi = int(scan.get("min_bytes", 0)), int(scan.get("max_bytes", 0))
        return lo + round((hi - lo) * self.budget.value() / BUDGET_STEPS)

    def _budget_moved(self, *_: object) -> None:
        if self._scan is None:
            return
        self.budget_label.setText(format_mib(self.budget_bytes()))
        self._budget_timer.start()

    def show_plan(self, plan: dict[str, Any]) -> None:
        """The plan for the current budget: its spec, and its upgraded blocks in the chart.
        ``upgraded`` holds ``[layer, part]`` pairs or ``{"layer", "part"}`` dicts, the budget
        is ``budget`` or ``budget_bytes`` (``engine.sensitivity.Plan.to_dict``)."""
        self.spec_line.setText(plan.get("spec", ""))
        self.spec_line.setCursorPosition(0)
        self._upgraded = {
            (int(u["layer"]), str(u["part"])) if isinstance(u, dict) else (int(u[0]), str(u[1]))
            for u in plan.get("upgraded", [])
        }
        budget = plan.get("budget", plan.get("budget_bytes"))
        self.use_button.setEnabled(bool(plan.get("spec")))
        self.plan_label.setText(
            f"plan: {format_mib(plan.get('bytes'))} of a {format_mib(budget)} budget"
            f" · {len(self._upgraded)} blocks kept at "
            f"{(self._scan or {}).get('high', 'high precision')} (outlined) · predicted KL "
            f"{format_kl(plan.get('predicted_kl'))} nats"
        )
        self._draw_bars()

    def _use_spec(self) -> None:
        spec = self.spec_line.text()
        if spec:
            self.forms["b"].precision.setCurrentText(spec)
            self.use_spec_requested.emit(spec)

    # -- files --------------------------------------------------------------------------------
    def grab_png(self, path: str | Path) -> bool:
        """Save a picture of the whole view; False when the file could not be written."""
        return bool(self.grab().save(str(path), "PNG"))

    def open_path(self, path: str) -> None:
        self.open_requested.emit(path)

    def save_json_to(self, path: str) -> None:
        self.save_json_requested.emit(path)

    def save_png_to(self, path: str) -> None:
        self.save_png_requested.emit(path)

    def _ask_open(self) -> None:
        path, _ = QFileDialog.getOpenFileName(
            self, "Open A/B comparison", filter="A/B comparison (*.json)"
        )
        if path:
            self.open_path(path)

    def _ask_save_json(self) -> None:
        path, _ = QFileDialog.getSaveFileName(
            self, "Save A/B comparison", "ab.json", "A/B comparison (*.json)"
        )
        if path:
            self.save_json_to(path)

    def _ask_save_png(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Save picture", "ab.png", "PNG (*.png)")
        if path:
            self.save_png_to(path)
