"""Every page usable at 1280×800 and 1920×1080 (issue 46, finding 3 and 4): each visible label
and button's text fits its width, wraps whole, or is elided with the whole text in its
tooltip; the side panels are side by side on a wide window and wide enough for their
content."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from PySide6.QtGui import QTextDocument
from PySide6.QtWidgets import QAbstractButton, QAbstractScrollArea, QLabel, QLineEdit, QWidget

from app.gui.main_window import MainWindow
from tests.app_window import open_window

pytestmark = [pytest.mark.real_model, pytest.mark.usefixtures("gui_gc")]


def plain(text: str) -> str:
    if "<" in text and ">" in text:  # rich text: its shown characters
        doc = QTextDocument()
        doc.setHtml(text)
        return doc.toPlainText()
    return text


def cut_by_panel(widget: QWidget) -> str | None:
    """Why ``widget`` is cut off sideways by what holds it (a panel narrower than its content,
    with no scroll bar to reach the rest), or None."""
    seen = widget.visibleRegion().boundingRect().width()
    if seen >= widget.width() - 1:
        return None
    parent = widget.parentWidget()
    while parent is not None:
        if isinstance(parent, QAbstractScrollArea) and parent.horizontalScrollBar().isVisible():
            return None  # scrolled out of view: the scroll bar reaches it
        parent = parent.parentWidget()
    return f"only {seen} of its {widget.width()} px in view"


def cut_text(widget: QWidget) -> str | None:
    """Why ``widget``'s text does not show whole (None where it does)."""
    if cut_by_panel(widget):
        return cut_by_panel(widget)
    if isinstance(widget, QLabel):
        text = plain(widget.text())
        if not text.strip() or not widget.pixmap().isNull():
            return None
        if widget.wordWrap():
            if widget.heightForWidth(widget.width()) <= widget.height() + 1:
                return None
            return f"wraps to {widget.heightForWidth(widget.width())} px in {widget.height()}"
        need = max(widget.fontMetrics().horizontalAdvance(line) for line in text.split("\n"))
        have = widget.contentsRect().width() - 2 * widget.margin() - 2 * widget.indent()
        if need <= have + 1 or widget.toolTip() == widget.text():  # elided, whole in its tip
            return None
        return f"needs {need} px, has {have}"
    if isinstance(widget, QLineEdit) and widget.placeholderText() and not widget.text():
        hint = widget.placeholderText()
        need = widget.fontMetrics().horizontalAdvance(hint) + 8  # the frame's margins
        have = widget.contentsRect().width()
        if need <= have or widget.toolTip():
            return None
        return f"placeholder needs {need} px, has {have}"
    if isinstance(widget, QAbstractButton) and widget.text():
        need, have = widget.sizeHint().width(), widget.width()
        if need <= have + 1 or widget.toolTip() == widget.text():
            return None
        return f"needs {need} px, has {have}"
    return None


def shown(window: MainWindow) -> Iterator[QWidget]:
    """The labels and buttons a user sees now."""
    for widget in window.findChildren(QWidget):
        if (
            isinstance(widget, (QLabel, QAbstractButton, QLineEdit))
            and widget.isVisible()
            and not widget.visibleRegion().isEmpty()
        ):
            yield widget


def views(window: MainWindow) -> Iterator[str]:
    """Each page with each side panel in front (each instruments tab in turn)."""
    for page in (window.chat, window.ab_view, window.tuner):
        window.show_page(page)
        window.controls_dock.raise_()
        yield f"{type(page).__name__} + Controls"
        window.instruments_dock.raise_()
        for index in range(window.instruments.tabs.count()):
            window.instruments.tabs.setCurrentIndex(index)
            yield f"{type(page).__name__} + {window.instruments.tabs.tabText(index)}"


#: 1280×800; 1920×1080; 1920×1080 at 150% scaling (its fonts on 1280×720 of room)
SIZES = [(1280, 800), (1920, 1080), (1280, 720)]


@pytest.mark.parametrize("size", SIZES)
def test_no_text_is_cut_off(qtbot, tmp_path, default_model, size):
    window = open_window(qtbot, tmp_path / "data", size=size)
    try:
        found: list[str] = []
        for view in views(window):
            qtbot.wait(30)
            for widget in shown(window):
                why = cut_text(widget)
                if why:
                    text = widget.text() or getattr(widget, "placeholderText", str)()
                    found.append(f"{view}: {type(widget).__name__} {text!r}: {why}")
        assert not found, "\n".join(sorted(set(found)))
    finally:
        window.shutdown()


def test_the_side_panels_sit_side_by_side_on_a_wide_window(qtbot, tmp_path, default_model):
    wide = open_window(qtbot, tmp_path / "wide", size=(1920, 1080))
    try:
        assert not wide.tabifiedDockWidgets(wide.controls_dock)
        assert wide.controls_dock.isVisible() and wide.instruments_dock.isVisible()
        controls = wide.controls.widget()
        assert wide.controls.viewport().width() >= controls.minimumSizeHint().width()
    finally:
        wide.shutdown()
    narrow = open_window(qtbot, tmp_path / "narrow", size=(1280, 800))
    try:  # tabbed, and wide enough that Controls do not scroll sideways
        assert narrow.tabifiedDockWidgets(narrow.controls_dock) == [narrow.instruments_dock]
        narrow.controls_dock.raise_()
        qtbot.wait(30)
        controls = narrow.controls.widget()
        assert narrow.controls.viewport().width() >= controls.minimumSizeHint().width()
    finally:
        narrow.shutdown()


def test_a_tuner_status_does_not_narrow_the_side_panels(qtbot, tmp_path, default_model):
    """Finding 4: the tuner's status text appearing widened its page and narrowed the dock,
    cutting the Controls off again."""
    window = open_window(qtbot, tmp_path / "data")
    try:
        window.show_page(window.tuner)
        window.controls_dock.raise_()
        qtbot.wait(30)
        before = window.controls_dock.width()
        window.tuner.status_label.setText("a sweep point: " + "batch 8 · 512 tokens · " * 12)
        qtbot.wait(30)
        assert window.controls_dock.width() == before
        assert not any(cut_text(w) for w in shown(window) if w is not window.tuner.status_label)
    finally:
        window.shutdown()
