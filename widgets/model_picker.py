"""The model picker: the models already on this machine (the model store, the Hugging Face
cache, LM Studio, folders the user added), each with whether it fits in memory on the device
at the precision chosen in Controls.

A thin view over :func:`engine.store.planning.discover_and_plan`: the window gives it a ``scan``
callable and the picker runs it on a thread of its own (a scan reads many headers and can take
seconds); a timer in the UI thread picks the result up, so the UI thread never waits. Loading
a model (double-click, or Load) emits ``model_requested`` with what the controls' model signal
carries: a model folder, or a ``.gguf`` file that the loader imports into the store once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QDialog,
    QFileDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from engine.store.catalog import Discovery, PlannedModel
from engine.units import format_size
from widgets.endpoint_page import EndpointCalls, EndpointPage
from widgets.hub_page import HubCalls, HubPage

#: ``scan(folders, precision, device)``; runs off the UI thread
Scan = Callable[[list[Path], str, str], Discovery]

COLUMNS = ("Name", "Source", "Architecture", "Parameters", "Size on disk", "Plan")
PLAN_COLUMN = COLUMNS.index("Plan")
POLL_MS = 50  # how often the UI thread looks whether a scan finished


def format_parameters(n: int) -> str:
    """``135M``, ``1.5B``; ``–`` when unknown."""
    if n <= 0:
        return "–"
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            value = n / scale
            return f"{value:.1f}{suffix}" if value < 10 else f"{value:.0f}{suffix}"
    return str(n)


def plan_text(row: PlannedModel) -> tuple[str, str]:
    """The plan cell's text and tooltip: fits or not, and the one-line plan (or why none)."""
    if row.plan is None:
        return "–", row.plan_error or "no plan"
    return ("fits" if row.plan.fits else "does not fit"), row.plan.one_line()


class ModelPicker(QDialog):
    model_requested = Signal(str)  # a model folder or a .gguf file, as ControlsPanel sends
    folder_added = Signal(str)  # the window persists it
    scanned = Signal()  # a scan's result is shown (or its failure)

    def __init__(
        self,
        scan: Scan,
        folders: Sequence[str] = (),
        parent: QWidget | None = None,
        *,
        precision: str = "fp32",
        device: str = "auto",
        hub: HubCalls | None = None,
        endpoints: EndpointCalls | None = None,
    ) -> None:
        super().__init__(parent)
        self.setWindowTitle("Models")
        self.hub_calls = hub
        self.endpoint_calls = endpoints
        self.setModal(False)
        self.resize(900, 420)
        self._scan = scan
        self.folders = list(folders)
        self.precision, self.device = precision, device
        self.rows: list[PlannedModel] = []
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="infersight-discovery")
        self._pending: Future[Discovery] | None = None
        self._poll = QTimer(self, interval=POLL_MS)
        self._poll.timeout.connect(self._collect)
        self._build()

    def _build(self) -> None:
        """The models on this machine, and (given the app's calls) models to get from the
        Hugging Face Hub and a server's models to chat with."""
        outer = QVBoxLayout(self)
        self.pages = QTabWidget()
        outer.addWidget(self.pages)
        local = QWidget()
        self.pages.addTab(local, "On this machine")
        self.hub_page: HubPage | None = None
        if self.hub_calls is not None:
            self.hub_page = HubPage(self.hub_calls)
            self.hub_page.model_requested.connect(self.model_requested)
            self.pages.addTab(self.hub_page, "Get models")
        self.endpoint_page: EndpointPage | None = None
        if self.endpoint_calls is not None:
            self.endpoint_page = EndpointPage(self.endpoint_calls)
            self.pages.addTab(self.endpoint_page, "OpenAI-compatible endpoint")
        layout = QVBoxLayout(local)
        self.filter = QLineEdit()
        self.filter.setPlaceholderText("Filter: name, source, architecture, path")
        self.filter.textChanged.connect(self._apply_filter)
        layout.addWidget(self.filter)
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.verticalHeader().setVisible(False)
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        self.table.cellDoubleClicked.connect(lambda row, _col: self._load_row(row))
        self.table.itemSelectionChanged.connect(self._show_selected)
        layout.addWidget(self.table, 1)
        self.detail = QLabel()
        self.detail.setWordWrap(True)
        self.detail.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        layout.addWidget(self.detail)
        self.status = QLabel()
        layout.addWidget(self.status)
        buttons = QHBoxLayout()
        self.add_folder_button = QPushButton("Add folder…")
        self.add_folder_button.setToolTip("Also look for .gguf files and model folders here")
        self.add_folder_button.clicked.connect(lambda: self.add_folder())
        self.refresh_button = QPushButton("Refresh")
        self.refresh_button.clicked.connect(self.refresh)
        self.load_button = QPushButton("Load")
        self.load_button.setToolTip(
            "Load the selected model in the chat (a .gguf file is imported into the model "
            "store once, first)"
        )
        self.load_button.setEnabled(False)
        self.load_button.clicked.connect(self.load_selected)
        close = QPushButton("Close")
        close.clicked.connect(self.reject)
        for button in (self.add_folder_button, self.refresh_button):
            buttons.addWidget(button)
        buttons.addStretch(1)
        buttons.addWidget(self.load_button)
        buttons.addWidget(close)
        layout.addLayout(buttons)
        self._set_plan_header(self.device, self.precision)

    # -- scanning ----------------------------------------------------------------------------
    def set_target(self, precision: str, device: str) -> None:
        """The precision and device (as chosen: ``auto`` too) the plans are for."""
        self.precision, self.device = precision, device

    def refresh(self) -> None:
        """Scan again in the background; a scan still running is superseded (its result is
        dropped)."""
        if self._pending is not None:
            self._pending.cancel()  # if it has not started; a running one is left to finish
        folders = [Path(f) for f in self.folders]
        self._pending = self._executor.submit(self._scan, folders, self.precision, self.device)
        self.status.setText("Looking for models…")
        self._poll.start()

    def scanning(self) -> bool:
        return self._pending is not None

    def _collect(self) -> None:
        pending = self._pending
        if pending is None or not pending.done():
            return
        self._poll.stop()
        self._pending = None
        try:
            result = pending.result()
        except Exception as exc:  # the scan itself failed (not one entry: those are skipped)
            self.status.setText(f"Could not look for models: {exc}")
        else:
            self.show_result(result)
        self.scanned.emit()

    def show_result(self, result: Discovery) -> None:
        self.rows = list(result.models)
        self._set_plan_header(result.device, result.precision)
        self.table.setRowCount(len(self.rows))
        for i, row in enumerate(self.rows):
            self._fill_row(i, row)
        found = f"{len(self.rows)} model(s) found"
        self.status.setText(f"{found}; {result.note}" if result.note else found)
        self._apply_filter(self.filter.text())
        self._show_selected()

    def _set_plan_header(self, device: str, precision: str) -> None:
        item = QTableWidgetItem(f"Plan on {device} at {precision}")
        self.table.setHorizontalHeaderItem(PLAN_COLUMN, item)

    def _fill_row(self, index: int, row: PlannedModel) -> None:
        m = row.model
        plan, plan_tip = plan_text(row)
        cells = (
            m.name, m.source, m.architecture, format_parameters(m.parameters),
            format_size(m.disk_bytes), plan,
        )  # fmt: skip
        for column, text in enumerate(cells):
            item = QTableWidgetItem(text)
            item.setToolTip(plan_tip if column == PLAN_COLUMN else str(m.path))
            if column != 0:
                item.setTextAlignment(Qt.AlignmentFlag.AlignCenter)
            self.table.setItem(index, column, item)

    # -- filtering and choosing --------------------------------------------------------------
    def _apply_filter(self, text: str) -> None:
        needle = text.strip().lower()
        for i, row in enumerate(self.rows):
            m = row.model
            haystack = " ".join((m.name, m.source, m.architecture, m.format, str(m.path)))
            self.table.setRowHidden(i, bool(needle) and needle not in haystack.lower())

    def visible_names(self) -> list[str]:
        return [r.model.name for i, r in enumerate(self.rows) if not self.table.isRowHidden(i)]

    def _selected_row(self) -> PlannedModel | None:
        rows = self.table.selectionModel().selectedRows()
        if not rows or rows[0].row() >= len(self.rows):
            return None
        return self.rows[rows[0].row()]

    def _show_selected(self) -> None:
        row = self._selected_row()
        self.load_button.setEnabled(row is not None)
        if row is None:
            self.detail.setText("")
            return
        self.detail.setText(f"{row.model.path}\n{plan_text(row)[1]}")

    def select(self, name: str) -> None:
        """Select the first row showing the model ``name`` (tests, and a caller that knows it)."""
        for i, row in enumerate(self.rows):
            if row.model.name == name:
                self.table.selectRow(i)
                return

    def load_selected(self) -> None:
        row = self._selected_row()
        if row is not None:
            self._load(row)

    def _load_row(self, index: int) -> None:
        if 0 <= index < len(self.rows):
            self._load(self.rows[index])

    def _load(self, row: PlannedModel) -> None:
        self.model_requested.emit(str(row.model.path))
        self.accept()

    # -- folders -----------------------------------------------------------------------------
    def add_folder(self, path: str | None = None) -> None:
        """Add a folder to scan (asks for one when ``path`` is ``None``), then scan again."""
        if path is None:
            path = QFileDialog.getExistingDirectory(self, "A folder with models")
        if not path:
            return
        if path not in self.folders:
            self.folders.append(path)
            self.folder_added.emit(path)
        self.refresh()

    def shutdown(self) -> None:
        """Stop polling and let a running scan end on its own (no wait here)."""
        if self.hub_page is not None:
            self.hub_page.shutdown()
        if self.endpoint_page is not None:
            self.endpoint_page.shutdown()
        self._poll.stop()
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
        self._executor.shutdown(wait=False, cancel_futures=True)
