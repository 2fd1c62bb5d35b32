"""A message's text as rendered Markdown, as tall as its text (the conversation scrolls, not
each message), or as plain text marked by how each streamed piece came (speculative decoding:
accepted drafts, the model's corrections, bonus tokens)."""

from __future__ import annotations

import html

from PySide6.QtCore import Qt
from PySide6.QtGui import QResizeEvent, QTextOption
from PySide6.QtWidgets import QFrame, QSizePolicy, QTextBrowser, QWidget

#: how a streamed piece came (``Delta.pieces`` kinds) → its background and its legend
SPECULATION_MARKS = {
    "accepted": ("#2f5a3a", "accepted draft"),
    "corrected": ("#6b4a1e", "model's correction"),
    "bonus": ("#2d4a7a", "bonus token"),
}


def marked_html(pieces: list[tuple[str, str]]) -> str:
    """The pieces as plain text (whitespace kept), each of a speculation kind on its
    colour."""
    parts = []
    for text, kind in pieces:
        body = html.escape(text).replace("\n", "<br>")
        mark = SPECULATION_MARKS.get(kind)
        parts.append(f'<span style="background-color:{mark[0]}">{body}</span>' if mark else body)
    return f'<p style="white-space:pre-wrap">{"".join(parts)}</p>'


class MarkdownView(QTextBrowser):
    """Rendered Markdown that is exactly as tall as its text at the pane's width (the
    conversation scrolls, not each message). Long code lines wrap rather than clip."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._source = ""
        self._marked = False
        self.setOpenExternalLinks(True)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setWordWrapMode(QTextOption.WrapMode.WrapAtWordBoundaryOrAnywhere)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.document().setDocumentMargin(2)

    def set_text(self, text: str) -> None:
        if text != self._source or self._marked:
            self._source, self._marked = text, False
            self.setMarkdown(text)
            self._fit()

    def set_marked(self, pieces: list[tuple[str, str]]) -> None:
        """Show ``pieces`` (text, speculation kind) as plain text, each kind on its colour."""
        text = "".join(t for t, _ in pieces)
        if text != self._source or not self._marked:
            self._source, self._marked = text, True
            self.setHtml(marked_html(pieces))
            self._fit()

    def text(self) -> str:
        """The source shown (Markdown, or the marked pieces' text)."""
        return self._source

    @property
    def marked(self) -> bool:
        return self._marked

    def _fit(self) -> None:
        doc = self.document()
        doc.setTextWidth(max(1, self.viewport().width()))
        self.setFixedHeight(int(doc.size().height()) + 2)

    def resizeEvent(self, event: QResizeEvent) -> None:
        super().resizeEvent(event)
        self._fit()
