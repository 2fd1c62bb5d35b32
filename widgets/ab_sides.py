"""The two sides of the A/B lab: each one's form (model, precision, temperature, cache
window) and its output column, whose :class:`TokenView` shows the text token by token (each
with its format and tooltip) and marks the first divergence."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from PySide6.QtCore import QEvent, QPoint, QRect, Qt
from PySide6.QtGui import QHelpEvent, QTextCharFormat, QTextCursor
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QSizePolicy,
    QSpinBox,
    QTextBrowser,
    QToolTip,
    QVBoxLayout,
    QWidget,
)

from widgets.ab_format import _escape
from widgets.controls import PRECISIONS
from widgets.endpoint_text import parse_endpoint

MARKER = "▶"  # put before the first divergence in both columns (not part of either text)


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


class Column(QWidget):
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


#: The low-bit kernel choices a side offers, as (label, mode); None: INFERSIGHT_LOWBIT's
LOWBIT_CHOICES = (
    ("auto (faster per shape)", None),
    ("ours: int8 activations", "ours"),
    ("torch's: float activations", "torch"),
)


#: The KV caches a side may hold, as (label, ``--kv-dtype``)
KV_DTYPES = [("model's float dtype", "auto"), ("int8", "int8"), ("fp8 (sm_89+)", "fp8")]

#: How a column's header names the kernels its side ran on
LOWBIT_TITLES = {"ours": "our low-bit kernels", "torch": "torch's low-bit kernels"}


class SideForm(QGroupBox):
    """Model, precision, KV cache, temperature and cache window of one side."""

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
        self.model.setToolTip(
            "A model folder (pick one, or type a path), or an OpenAI-compatible server: its "
            "URL, then a space and a model id (none: the first it lists), e.g. "
            "http://127.0.0.1:8000 Qwen/Qwen2.5-0.5B-Instruct. Its API key is the one kept "
            "for that server in the keyring"
        )
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
        self.lowbit = QComboBox()
        for label, mode in LOWBIT_CHOICES:
            self.lowbit.addItem(label, mode)
        self.lowbit.setToolTip(
            "INT4/INT8 layers on a CPU: our kernels quantize the activations to int8 per block "
            "of 32, torch's keep them in float. The same precision on both sides, one with "
            "each, shows what quantizing the activations costs"
        )
        self.kv_dtype = QComboBox()
        for label, value in KV_DTYPES:
            self.kv_dtype.addItem(label, value)
        self.kv_dtype.setToolTip(
            "What the side's KV cache holds: the model's float dtype, or int8 (each token's K "
            "and V rows with a scale of their own: half a 16-bit cache's bytes). The same "
            "precision on both sides with two caches shows what the cache alone costs, on one "
            "copy of the weights"
        )
        form.addRow("Model", self.model)
        form.addRow("Precision", self.precision)
        form.addRow("KV cache", self.kv_dtype)
        form.addRow("CPU kernels", self.lowbit)
        form.addRow("Temperature", self.temperature)
        form.addRow(self.window_on, window_row)  # the switch as the row's label: compact
        # a server answers as it was started: these are its own, not the lab's to choose
        self.model.currentTextChanged.connect(self._on_model_text)

    def endpoint(self) -> tuple[str, str] | None:
        """The server's URL and model id where the side names one (None: a local model)."""
        return parse_endpoint(self.model_path())

    def _on_model_text(self, _text: str) -> None:
        local = self.endpoint() is None
        for widget in (self.precision, self.kv_dtype, self.lowbit, self.window_on):
            widget.setEnabled(local)
        for spin in (self.sinks, self.recent):
            spin.setEnabled(local and self.window_on.isChecked())

    def model_path(self) -> str:
        """The chosen item's path, or the text typed in the box."""
        text = self.model.currentText().strip()
        index = self.model.findText(text)
        data = self.model.itemData(index) if index >= 0 else None
        return str(data) if data else text

    def set_models(self, models: Sequence[tuple[str, str]]) -> None:
        """The models to offer, as (name, path), keeping the choice (quietly)."""
        current = self.model_path()
        self.model.blockSignals(True)
        self.model.clear()
        for name, path in models:
            self.model.addItem(name, path)
        if current:
            self.set_model(current)
        self.model.blockSignals(False)

    def set_model(self, path: str) -> None:
        index = self.model.findData(path)
        if index < 0:
            self.model.addItem(Path(path).name or path, path)
            index = self.model.count() - 1
        self.model.setCurrentIndex(index)

    def values(self) -> dict[str, Any]:
        window = [self.sinks.value(), self.recent.value()] if self.window_on.isChecked() else None
        endpoint = self.endpoint()
        if endpoint is not None:
            url, model = endpoint
            return {"model": "", "endpoint": url, "endpoint_model": model,
                    "temperature": self.temperature.value()}  # fmt: skip
        return {
            "model": self.model_path(),
            "precision": self.precision.currentText().strip(),
            "lowbit": self.lowbit.currentData(),
            "kv_dtype": self.kv_dtype.currentData(),
            "temperature": self.temperature.value(),
            "window": window,
        }
