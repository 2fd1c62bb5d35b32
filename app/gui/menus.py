"""The window's menu bar: File, Model, View and Help, each command with its shortcut, and the
About, documentation and shortcuts of Help."""

from __future__ import annotations

import platform
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from PySide6.QtCore import QUrl
from PySide6.QtGui import QAction, QDesktopServices, QKeySequence
from PySide6.QtWidgets import QMenu, QMessageBox

if TYPE_CHECKING:
    from app.gui.main_window import MainWindow

DOCS = Path(__file__).resolve().parents[2] / "docs"


def version() -> str:
    try:
        return metadata.version("infersight")
    except metadata.PackageNotFoundError:
        return "(not installed)"


def build(window: MainWindow) -> dict[str, QMenu]:
    """The menus, by title; every action also reachable by its shortcut."""
    bar = window.menuBar()
    menus: dict[str, QMenu] = {}

    def menu(title: str) -> QMenu:
        menus[title.replace("&", "")] = m = bar.addMenu(title)
        return m

    def act(
        m: QMenu, text: str, slot: object, keys: str | QKeySequence.StandardKey = ""
    ) -> QAction:
        action = m.addAction(text)
        if keys:
            action.setShortcut(QKeySequence(keys))
        action.triggered.connect(slot)
        return action

    f = menu("&File")
    act(f, "&New chat", window.new_conversation, "Ctrl+N")
    f.addSeparator()
    act(f, "&Quit", window.close, QKeySequence.StandardKey.Quit)
    m = menu("&Model")
    act(m, "&Open a model on this machine…", window.browse_models, "Ctrl+O")
    act(m, "&Get models from the Hub…", lambda: get_models(window), "Ctrl+G")
    act(m, "&Reload", lambda: window.load(window._spec()), "Ctrl+R")
    v = menu("&View")
    for keys, (page, title) in enumerate(
        ((window.chat, "&Chat"), (window.ab_view, "&A/B lab"), (window.tuner, "Batching &tuner")),
        start=1,
    ):
        act(v, title, lambda _=False, p=page: window.show_page(p), f"Ctrl+{keys}")
    v.addSeparator()
    for dock in (window.controls_dock, window.instruments_dock):
        v.addAction(dock.toggleViewAction())  # shows or hides the panel
    h = menu("&Help")
    act(h, "&Documentation", lambda: open_docs(window), QKeySequence.StandardKey.HelpContents)
    act(h, "&Keyboard shortcuts", lambda: shortcuts_box(window, menus).exec())
    act(h, "&About Infersight", lambda: about_box(window).exec())
    return menus


def get_models(window: MainWindow) -> None:
    """The model picker on its Hub page."""
    window.browse_models()
    picker = window.picker
    if picker is not None and picker.hub_page is not None:
        picker.pages.setCurrentWidget(picker.hub_page)
        picker.hub_page.query.setFocus()


def open_docs(window: MainWindow) -> bool:
    """The documentation: the README beside the docs/ folder of this checkout, in the
    desktop's viewer; where there is none (an installed package), where to find it."""
    readme = DOCS.parent / "README.md"
    if readme.exists() and QDesktopServices.openUrl(QUrl.fromLocalFile(str(readme))):
        return True
    window.chat.show_notice(
        f"The documentation is README.md and docs/ in Infersight's source ({DOCS.parent})",
        "info",
    )
    return False


def shortcuts_text(menus: dict[str, QMenu]) -> str:
    rows = ["Enter: send · Shift+Enter: a new line"]
    for title, m in menus.items():
        for action in m.actions():
            keys = action.shortcut().toString(QKeySequence.SequenceFormat.NativeText)
            if keys:
                rows.append(f"{keys}: {title} → {action.text().replace('&', '')}")
    return "\n".join(rows)


def shortcuts_box(window: MainWindow, menus: dict[str, QMenu]) -> QMessageBox:
    box = QMessageBox(QMessageBox.Icon.NoIcon, "Keyboard shortcuts", shortcuts_text(menus),
                      parent=window)  # fmt: skip
    return box


def about_text(window: MainWindow) -> str:
    import torch

    model = window.model
    loaded = f"{model.name} · {model.precision} · {model.device}" if model else "no model"
    return (
        f"Infersight {version()}\n"
        "A workbench for running and seeing inside local LLM inference: its engine is written "
        "from scratch in PyTorch.\n\n"
        f"Model: {loaded}\n"
        f"Python {platform.python_version()} · torch {torch.__version__}"
        f" · {'CUDA ' + str(torch.version.cuda) if torch.cuda.is_available() else 'CPU'}\n"
        "Apache-2.0"
    )


def about_box(window: MainWindow) -> QMessageBox:
    return QMessageBox(QMessageBox.Icon.Information, "About Infersight", about_text(window),
                       parent=window)  # fmt: skip
