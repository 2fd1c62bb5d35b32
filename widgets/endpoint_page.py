"""The model picker's *OpenAI-compatible endpoint* page: a server's base URL (the ones used
before offered first), its API key (kept in the OS keyring where asked, else for this run
only), the models its ``/v1/models`` lists, and *Use in chat*. The page runs no HTTP itself:
the window gives it :class:`EndpointCalls`, which it runs on a thread of its own (a server
may take seconds to answer, or never); a timer in the UI thread picks the answer up."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from PySide6.QtCore import QTimer, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from widgets.endpoint_text import PLACEHOLDER

POLL_MS = 50


@dataclass(frozen=True, slots=True)
class EndpointCalls:
    """What the page asks of the app: the models a server lists (URL, key or None; raises
    with a line to show), and keeping a key in the keyring (URL, key; raises where the
    machine has none)."""

    list_models: Callable[[str, str | None], list[str]]
    save_key: Callable[[str, str], None]


class EndpointPage(QWidget):
    #: URL, model id, key ("": the keyring's, or none): chat with that server's model
    endpoint_requested = Signal(str, str, str)
    listed = Signal()  # a listing ended (its models or its failure shown)

    def __init__(self, calls: EndpointCalls, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.calls = calls
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="infersight-endpoint")
        self._pending: Future[list[str]] | None = None
        self._listing = ""  # the URL whose models are being listed
        self._poll = QTimer(self, interval=POLL_MS)
        self._poll.timeout.connect(self._collect)
        layout = QVBoxLayout(self)
        intro = QLabel(
            "Chat with a model another server runs — vLLM, SGLang, llama.cpp's server, Ollama, "
            "LM Studio, or infersight serve on another machine. Its replies stream into the "
            "chat; the instruments show what this client measures (TTFT, TPOT, tokens/s) and "
            "the server's queue where its /metrics says it. Its layers and KV cache are not "
            "visible from here."
        )
        intro.setWordWrap(True)
        layout.addWidget(intro)
        form = QFormLayout()
        self.url = QComboBox()
        self.url.setEditable(True)
        self.url.setToolTip("The server's base URL, with or without /v1")
        line = self.url.lineEdit()
        assert line is not None
        line.setPlaceholderText(PLACEHOLDER.split(" ")[0])
        self.key = QLineEdit()
        self.key.setEchoMode(QLineEdit.EchoMode.Password)
        self.key.setPlaceholderText("API key (empty: the one kept for this server, or none)")
        self.remember = QCheckBox("Keep the key in the system keyring")
        self.remember.setChecked(True)
        list_row = QHBoxLayout()
        self.models = QComboBox()
        self.models.setToolTip("The models the server lists (GET /v1/models)")
        self.list_button = QPushButton("List models")
        self.list_button.clicked.connect(self.list_models)
        list_row.addWidget(self.models, 1)
        list_row.addWidget(self.list_button)
        form.addRow("Server", self.url)
        form.addRow("API key", self.key)
        form.addRow("", self.remember)
        form.addRow("Model", list_row)
        layout.addLayout(form)
        self.status = QLabel()
        self.status.setWordWrap(True)
        layout.addWidget(self.status)
        layout.addStretch(1)
        buttons = QHBoxLayout()
        self.use_button = QPushButton("Use in chat")
        self.use_button.setEnabled(False)
        self.use_button.clicked.connect(self.use)
        buttons.addStretch(1)
        buttons.addWidget(self.use_button)
        layout.addLayout(buttons)
        self.url.currentTextChanged.connect(self._url_changed)

    def set_recent(self, urls: Sequence[str]) -> None:
        """The servers used before, latest first (the first one shown)."""
        self.url.blockSignals(True)
        self.url.clear()
        self.url.addItems(list(urls))
        self.url.blockSignals(False)

    @property
    def busy(self) -> bool:
        return self._pending is not None

    def _url_changed(self, _text: str) -> None:
        self.models.clear()
        self.use_button.setEnabled(False)

    def list_models(self) -> None:
        """Ask the server for its models (in the background)."""
        url = self.url.currentText().strip()
        if not url.startswith(("http://", "https://")):
            self.status.setText(f"Give the server's URL, like {PLACEHOLDER.split(' ')[0]}")
            return
        if self.busy:
            return
        self.status.setText(f"asking {url} for its models…")
        self.list_button.setEnabled(False)
        self._pending = self._executor.submit(self.calls.list_models, url, self._key() or None)
        self._listing = url
        self._poll.start()

    def _collect(self) -> None:
        pending = self._pending
        if pending is None or not pending.done():
            return
        self._poll.stop()
        self._pending = None
        self.list_button.setEnabled(True)
        if self._listing != self.url.currentText().strip():  # the URL changed meanwhile
            self.status.setText("the server's URL changed: List models again")
            self.listed.emit()
            return
        try:
            ids = pending.result()
        except Exception as exc:  # the call's line: unreachable, a key refused …
            self.models.clear()
            self.use_button.setEnabled(False)
            self.status.setText(str(exc))
        else:
            self.models.clear()
            self.models.addItems(ids)
            self.use_button.setEnabled(bool(ids))
            self.status.setText(
                f"{len(ids)} model{'' if len(ids) == 1 else 's'} listed" if ids
                else "the server lists no model"
            )  # fmt: skip
        self.listed.emit()

    def _key(self) -> str:
        return self.key.text().strip()

    def use(self) -> None:
        """Chat with the chosen model: the key kept first where asked."""
        url, model, key = self.url.currentText().strip(), self.models.currentText(), self._key()
        if not model:
            return
        if key and self.remember.isChecked():
            try:
                self.calls.save_key(url, key)
            except Exception as exc:  # no keyring here: the key serves this run only
                self.status.setText(f"{exc}; the key is used for this run only")
        self.endpoint_requested.emit(url, model, key)

    def shutdown(self) -> None:
        self._poll.stop()
        self._executor.shutdown(wait=False, cancel_futures=True)
