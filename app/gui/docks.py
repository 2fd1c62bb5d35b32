"""The side panels, Controls and Instruments, as docks: side by side on a wide window, so the
plots stay in view while a setting changes, tabbed together on a narrower one (1280 px), and
wide enough for their content at first start; then as the user left them (settings.ini)."""

from __future__ import annotations

from PySide6.QtCore import QSettings, Qt
from PySide6.QtWidgets import QDockWidget, QMainWindow, QScrollArea, QWidget

#: a window at least this wide gets Controls and Instruments side by side at first start
SIDE_BY_SIDE_PX = 1600
#: the right-hand docks' share of a window at first start, and their floor (px)
DOCK_SHARE, DOCK_MIN_PX = 0.36, 440
STATE_KEY = "dock_state"


def make_dock(window: QMainWindow, title: str, widget: QWidget, name: str) -> QDockWidget:
    dock = QDockWidget(title, window)
    dock.setObjectName(name)
    dock.setWidget(widget)
    dock.setFeatures(  # closable: the View menu shows it again
        QDockWidget.DockWidgetFeature.DockWidgetMovable
        | QDockWidget.DockWidgetFeature.DockWidgetFloatable
        | QDockWidget.DockWidgetFeature.DockWidgetClosable
    )
    window.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, dock)
    return dock


def arrange(
    window: QMainWindow, controls: QDockWidget, instruments: QDockWidget, settings: QSettings
) -> None:
    """The docks as the user left them, or at first start by the window's width: side by
    side from :data:`SIDE_BY_SIDE_PX`, else tabbed with Instruments in front."""
    state = settings.value(STATE_KEY)
    if state is not None and window.restoreState(state):
        return
    width = window.width()
    room = max(DOCK_MIN_PX, int(DOCK_SHARE * width))
    if width >= SIDE_BY_SIDE_PX:
        window.splitDockWidget(controls, instruments, Qt.Orientation.Horizontal)
        controls.show()
        instruments.show()
        sizes = [needs(controls), max(needs(instruments), DOCK_MIN_PX, width // 4)]
        window.resizeDocks([controls, instruments], sizes, Qt.Orientation.Horizontal)
    else:
        window.tabifyDockWidget(controls, instruments)
        instruments.raise_()
        room = max(room, needs(controls), needs(instruments))
        window.resizeDocks([instruments], [room], Qt.Orientation.Horizontal)


def needs(dock: QDockWidget) -> int:
    """The width a dock's content asks for without scrolling sideways: a scroll area's
    content, its vertical scroll bar and frame beside it."""
    content = dock.widget()
    if content is None:
        return 0
    inner = content.widget() if isinstance(content, QScrollArea) else None
    if isinstance(content, QScrollArea) and inner is not None:
        bar = content.verticalScrollBar().sizeHint().width()
        return inner.minimumSizeHint().width() + bar + 2 * content.frameWidth() + 4
    return content.minimumSizeHint().width()


def save(window: QMainWindow, settings: QSettings) -> None:
    settings.setValue(STATE_KEY, window.saveState())
