"""The model picker's "Get models" page: search the Hugging Face Hub by name, see a repo's
weight files with their sizes and, for each precision, whether it fits this machine (from its
config alone, before a byte of weights is downloaded), then download with progress and cancel,
and load. A gated or private repo's token goes in the token field (kept in the system
keyring). The work itself is the app's (:class:`HubCalls`, run in a thread of this page's)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import QTimer, Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QListWidget,
    QProgressBar,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from engine.units import format_size

POLL_MS = 50
Progress = Callable[[str, int, int], None]


@dataclass(frozen=True, slots=True)
class RepoView:
    """What the page shows of a repo: its weight files (path, bytes or None), each
    precision's verdict (precision, text, fits) and whether it is gated."""

    repo_id: str
    files: list[tuple[str, int | None]]
    verdicts: list[tuple[str, str, bool]]
    gated: bool


@dataclass(frozen=True, slots=True)
class HubCalls:
    """The app's side: each runs in the page's thread and raises with a message to show."""

    search: Callable[[str], list[str]]
    inspect: Callable[[str], RepoView]
    pull: Callable[[str, str | None, Progress], str]  # repo, weights file or None → folder
    save_token: Callable[[str], None]


class Stop(Exception):
    """Raised in a download's progress when the user cancels it."""


def size_text(nbytes: int | None) -> str:
    return "-" if nbytes is None else format_size(nbytes)


class HubPage(QWidget):
    model_requested = Signal(str)  # a downloaded model's folder, to load
    finished = Signal()  # a search, an inspection or a download ended (its result shown)

    def __init__(self, calls: HubCalls, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.calls = calls
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="infersight-hub")
        self._pending: Future[Any] | None = None
        self._then: Callable[[Any], None] = lambda _: None
        self._progress: tuple[int, int] = (0, 0)
        self._stop = threading.Event()
        self._poll = QTimer(self, interval=POLL_MS)
        self._poll.timeout.connect(self._collect)
        self.repo: RepoView | None = None
        self._build()

    def _build(self) -> None:
        layout = QVBoxLayout(self)
        row = QHBoxLayout()
        self.query = QLineEdit()
        self.query.setPlaceholderText("Search the Hugging Face Hub, e.g. SmolLM2, Qwen3")
        self.query.returnPressed.connect(self.search)
        self.search_button = QPushButton("Search")
        self.search_button.clicked.connect(self.search)
        row.addWidget(self.query, 1)
        row.addWidget(self.search_button)
        layout.addLayout(row)
        self.results = QListWidget()
        self.results.currentTextChanged.connect(self.inspect)
        layout.addWidget(self.results, 1)
        self.files = QTableWidget(0, 2)
        self.files.setHorizontalHeaderLabels(["weights file", "size"])
        self.files.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.files.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        header = self.files.horizontalHeader()
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)  # paths whole
        header.setSectionResizeMode(1, QHeaderView.ResizeMode.ResizeToContents)
        self.files.verticalHeader().setVisible(False)
        layout.addWidget(self.files, 1)
        self.verdict = QLabel()
        self.verdict.setWordWrap(True)
        layout.addWidget(self.verdict)
        token_row = QHBoxLayout()
        self.token = QLineEdit()
        self.token.setEchoMode(QLineEdit.EchoMode.Password)
        self.token.setPlaceholderText("Access token, for gated or private models (kept in "
                                      "the system keyring)")  # fmt: skip
        self.token_button = QPushButton("Save token")
        self.token_button.clicked.connect(self.save_token)
        token_row.addWidget(self.token, 1)
        token_row.addWidget(self.token_button)
        layout.addLayout(token_row)
        self.bar = QProgressBar()
        self.bar.hide()
        layout.addWidget(self.bar)
        self.status = QLabel()
        self.status.setWordWrap(True)
        layout.addWidget(self.status)
        buttons = QHBoxLayout()
        self.download_button = QPushButton("Download and load")
        self.download_button.setEnabled(False)
        self.download_button.clicked.connect(self.download)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setEnabled(False)
        self.cancel_button.clicked.connect(self._stop.set)
        buttons.addStretch(1)
        buttons.addWidget(self.download_button)
        buttons.addWidget(self.cancel_button)
        layout.addLayout(buttons)

    # -- the work, in the page's thread ------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self._pending is not None

    def _run(self, what: str, call: Callable[[], Any], then: Callable[[Any], None]) -> None:
        if self.busy:
            self.status.setText("One moment: the last request has not finished")
            return
        self.status.setText(what)
        self._then = then
        self._pending = self._executor.submit(call)
        self._poll.start()

    def _collect(self) -> None:
        done, total = self._progress
        if self.bar.isVisible() and total:
            self.bar.setRange(0, max(1, total // 1024))
            self.bar.setValue(done // 1024)
            self.bar.setFormat(f"{size_text(done)} of {size_text(total)}")
        future = self._pending
        if future is None or not future.done():
            return
        self._poll.stop()
        self._pending = None
        self.bar.hide()
        self.cancel_button.setEnabled(False)
        try:
            result = future.result()
        except Stop:
            self.status.setText("Download cancelled")
        except Exception as exc:  # the app's message (a 404, a gated repo, the network)
            self.status.setText(str(exc))
        else:
            self.status.setText("")
            self._then(result)
        self.download_button.setEnabled(self.repo is not None)
        self.finished.emit()

    def search(self) -> None:
        text = self.query.text().strip()
        if not text:
            self.status.setText("Type part of a model's name first")
            return
        self._run(f"Searching for {text!r}…", lambda: self.calls.search(text), self._show_results)

    def _show_results(self, found: list[str]) -> None:
        self.results.clear()
        self.results.addItems(found)
        if not found:
            self.status.setText("No model on the Hub matches that name")

    def inspect(self, repo_id: str) -> None:
        self.repo = None  # nothing to download until this one is read
        self.download_button.setEnabled(False)
        if repo_id:
            self._run(f"Reading {repo_id}…", lambda: self.calls.inspect(repo_id), self._show_repo)

    def _show_repo(self, repo: RepoView) -> None:
        self.repo = repo
        self.files.setRowCount(len(repo.files))
        for i, (path, size) in enumerate(repo.files):
            self.files.setItem(i, 0, QTableWidgetItem(path))
            self.files.setItem(i, 1, QTableWidgetItem(size_text(size)))
        lines = [f"{'✓' if fits else '✗'} {precision}: {text}" for precision, text, fits
                 in repo.verdicts]  # fmt: skip
        gated = "Gated: accept its terms on the Hub and save your token. " if repo.gated else ""
        fit = "On this machine: " + " · ".join(lines) if lines else "(what fits: once read)"
        self.verdict.setText(gated + fit)
        self.download_button.setEnabled(True)

    def download(self) -> None:
        repo = self.repo
        if repo is None:
            return
        item = self.files.item(self.files.currentRow(), 0)
        chosen = item.text() if item is not None else None
        weights = chosen if chosen and chosen.endswith(".gguf") else None
        self._stop.clear()
        self._progress = (0, 0)

        def progress(stage: str, done: int, total: int) -> None:
            self._progress = (done, total)
            if self._stop.is_set():
                raise Stop("cancelled")

        self.bar.show()
        self.cancel_button.setEnabled(True)
        self.download_button.setEnabled(False)
        self._run(
            f"Downloading {repo.repo_id}…",
            lambda: self.calls.pull(repo.repo_id, weights, progress),
            lambda folder: self.model_requested.emit(folder),
        )

    def save_token(self) -> None:
        value = self.token.text().strip()
        self._run("Saving the token…", lambda: self.calls.save_token(value),
                  lambda _: self.status.setText("Token saved in the system keyring"))  # fmt: skip
        self.token.clear()

    def shutdown(self) -> None:
        self._stop.set()
        self._poll.stop()
        self._executor.shutdown(wait=False, cancel_futures=True)
