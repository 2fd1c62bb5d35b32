"""The model picker (offscreen, pytest-qt): a background scan, the table, the filter, Load and
Add folder; and its wiring into the controls, the store and the main window."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest
from PySide6.QtWidgets import QPushButton

from app.conversations import ChatStore
from engine.errors import ModelLoadError
from engine.store.catalog import DiscoveredModel, Discovery, PlannedModel
from engine.store.planning import discover_and_plan
from engine.units import format_size
from tests.conftest import build_tiny_hf
from tests.gguf_factory import write_gguf
from tests.test_discovery import add_to_hf_cache, folder_files
from widgets.controls import ControlsPanel
from widgets.model_picker import PLAN_COLUMN, ModelPicker, format_parameters

pytestmark = pytest.mark.usefixtures("gui_gc")

WAIT_MS = 20_000


@dataclass(frozen=True)
class FakePlan:
    fits: bool
    text: str

    def one_line(self) -> str:
        return self.text


def planned(name: str, path: str, *, fits: bool | None, parameters: int = 1_500_000_000):
    model = DiscoveredModel(name, Path(path), "hf-cache", "safetensors", "qwen2", parameters, 2**30)
    if fits is None:
        return PlannedModel(model, None, "no config to plan from")
    return PlannedModel(model, FakePlan(fits, f"plan of {name}"))  # type: ignore[arg-type]


ROWS = [
    planned("Qwen/Qwen2.5-1.5B", "/models/qwen", fits=True),
    planned("big/Llama-70B", "/models/big.gguf", fits=False, parameters=70_000_000_000),
    planned("odd/model", "/models/odd", fits=None, parameters=135_000_000),
]


class Scanner:
    """A scan that records its calls and, when told to, waits for a go-ahead."""

    def __init__(self, rows: list[PlannedModel], *, hold: bool = False) -> None:
        self.rows = rows
        self.calls: list[tuple[list[Path], str, str]] = []
        self.release = threading.Event()
        if not hold:
            self.release.set()

    def __call__(self, folders: list[Path], precision: str, device: str) -> Discovery:
        self.calls.append((folders, precision, device))
        assert self.release.wait(WAIT_MS / 1000)
        return Discovery(list(self.rows), precision, "cpu" if device == "auto" else device)


def open_picker(qtbot: Any, scan: Callable[..., Discovery], **kwargs: Any) -> ModelPicker:
    picker = ModelPicker(scan, **kwargs)
    qtbot.addWidget(picker)
    picker.show()
    return picker


def scan_now(qtbot: Any, picker: ModelPicker) -> None:
    with qtbot.waitSignal(picker.scanned, timeout=WAIT_MS):
        picker.refresh()


def cells(picker: ModelPicker, row: int) -> list[str]:
    table = picker.table
    return [table.item(row, c).text() for c in range(table.columnCount())]


def test_the_scan_runs_off_the_ui_thread_and_the_table_shows_each_model(qtbot: Any) -> None:
    scanner = Scanner(ROWS, hold=True)
    picker = open_picker(qtbot, scanner, precision="int8", device="auto")
    picker.refresh()  # returns at once: the scan waits in its own thread
    assert picker.scanning() and picker.status.text() == "Looking for models…"
    qtbot.wait(100)  # the UI thread keeps turning while the scan is held
    assert picker.table.rowCount() == 0
    with qtbot.waitSignal(picker.scanned, timeout=WAIT_MS):
        scanner.release.set()
    assert not picker.scanning() and scanner.calls == [([], "int8", "auto")]
    header = picker.table.horizontalHeaderItem(PLAN_COLUMN).text()
    assert header == "Plan on cpu at int8"
    assert cells(picker, 0) == [
        "Qwen/Qwen2.5-1.5B",
        "hf-cache",
        "qwen2",
        "1.5B",
        "1.00 GiB",
        "fits",
    ]
    assert cells(picker, 1)[3:] == ["70B", "1.00 GiB", "does not fit"]
    assert cells(picker, 2)[3:] == ["135M", "1.00 GiB", "–"]
    assert picker.table.item(1, PLAN_COLUMN).toolTip() == "plan of big/Llama-70B"
    assert picker.table.item(2, PLAN_COLUMN).toolTip() == "no config to plan from"
    assert picker.status.text() == "3 model(s) found"


def test_the_filter_hides_what_does_not_match(qtbot: Any) -> None:
    picker = open_picker(qtbot, Scanner(ROWS))
    scan_now(qtbot, picker)
    picker.filter.setText("LLAMA")
    assert picker.visible_names() == ["big/Llama-70B"]
    picker.filter.setText("/models/")  # paths match too
    assert len(picker.visible_names()) == 3
    picker.filter.setText("")
    assert len(picker.visible_names()) == 3


def test_load_and_double_click_emit_the_models_path(qtbot: Any) -> None:
    picker = open_picker(qtbot, Scanner(ROWS))
    scan_now(qtbot, picker)
    requested: list[str] = []
    picker.model_requested.connect(requested.append)
    assert not picker.load_button.isEnabled()  # nothing selected yet
    picker.select("big/Llama-70B")
    assert picker.load_button.isEnabled() and "plan of big/Llama-70B" in picker.detail.text()
    picker.load_button.click()
    assert requested == ["/models/big.gguf"] and not picker.isVisible()
    picker.show()
    picker.table.cellDoubleClicked.emit(0, 2)
    assert requested == ["/models/big.gguf", "/models/qwen"]


def test_an_added_folder_is_announced_once_and_scanned(qtbot: Any, tmp_path: Path) -> None:
    scanner = Scanner(ROWS)
    picker = open_picker(qtbot, scanner, folders=["/old"])
    added: list[str] = []
    picker.folder_added.connect(added.append)
    for _ in range(2):
        with qtbot.waitSignal(picker.scanned, timeout=WAIT_MS):
            picker.add_folder(str(tmp_path))
    assert added == [str(tmp_path)]
    assert scanner.calls[-1][0] == [Path("/old"), tmp_path]


def test_a_failed_scan_says_so(qtbot: Any) -> None:
    def broken(folders: list[Path], precision: str, device: str) -> Discovery:
        raise ModelLoadError("the disk went away")

    picker = open_picker(qtbot, broken)
    scan_now(qtbot, picker)
    assert picker.status.text() == "Could not look for models: the disk went away"


def test_formatting() -> None:
    assert [format_parameters(n) for n in (0, 950, 135_000_000, 1_540_000_000)] == [
        "–", "950", "135M", "1.5B",
    ]  # fmt: skip
    assert format_size(3 * 2**20) == "3.0 MiB" and format_size(5 * 2**30) == "5.00 GiB"


# -- on real discovery -------------------------------------------------------------------------


def test_the_picker_lists_the_hub_cache_and_lm_studio_and_loads_either(
    qtbot: Any, user_home: Path, tmp_path: Path, tiny_model_dir: Any
) -> None:
    folder, _ = tiny_model_dir("llama", False)
    from engine.store.discovery import hf_cache_dir

    snapshot = add_to_hf_cache(hf_cache_dir(), "tester/tiny-llama", folder_files(folder))
    lms = user_home / ".lmstudio" / "models" / "tester" / "tiny-GGUF"
    lms.mkdir(parents=True)
    gguf = write_gguf(build_tiny_hf("llama", tied=True), lms / "tiny.gguf", arch="llama")

    def scan(folders: list[Path], precision: str, device: str) -> Discovery:
        return discover_and_plan(folders, precision, device, memory=2**30)

    picker = open_picker(qtbot, scan, device="cpu")
    scan_now(qtbot, picker)
    assert [cells(picker, i)[:3] for i in range(picker.table.rowCount())] == [
        ["tester/tiny-llama", "hf-cache", "llama"],
        ["tiny", "lmstudio", "llama"],
    ]
    assert [cells(picker, i)[PLAN_COLUMN] for i in range(2)] == ["fits", "fits"]
    requested: list[str] = []
    picker.model_requested.connect(requested.append)
    for name in ("tester/tiny-llama", "tiny"):
        picker.show()
        picker.select(name)
        picker.load_selected()
    assert requested == [str(snapshot), str(gguf)]


# -- wiring --------------------------------------------------------------------------------------


def test_browse_models_in_the_controls_asks_for_the_picker(qtbot: Any) -> None:
    controls = ControlsPanel()
    qtbot.addWidget(controls)
    (button,) = [b for b in controls.findChildren(QPushButton) if b.text() == "Browse models…"]
    with qtbot.waitSignal(controls.browse_requested, timeout=1000):
        button.click()


def test_added_folders_are_kept_in_the_store(tmp_path: Path) -> None:
    store = ChatStore(tmp_path / "chats.sqlite3")
    store.add_model_folder("/b")
    store.add_model_folder("/a")
    store.add_model_folder("/b")
    store.close()
    store = ChatStore(tmp_path / "chats.sqlite3")
    assert store.model_folders() == ["/b", "/a"]
    store.remove_model_folder("/b")
    assert store.model_folders() == ["/a"]
    store.close()


def test_the_window_opens_the_picker_keeps_its_folders_and_loads_its_choice(
    qtbot: Any, user_home: Path, tmp_path: Path
) -> None:
    from app.gui.main_window import MainWindow
    from app.loading import LoadSpec

    asked: list[str] = []

    def refuse(spec: LoadSpec, progress: Any) -> Any:
        asked.append(spec.model)
        raise ModelLoadError("not in this test")

    lms = user_home / ".lmstudio" / "models" / "p" / "r"
    lms.mkdir(parents=True)
    gguf = write_gguf(build_tiny_hf("llama", tied=True), lms / "tiny.gguf", arch="llama")
    window = MainWindow(tmp_path / "data", spec=LoadSpec("default", "fp32", "cpu"), loader=refuse)
    qtbot.addWidget(window)
    try:
        qtbot.waitUntil(lambda: asked == ["default"] and window.loading is None, timeout=WAIT_MS)
        (browse,) = [b for b in window.controls.findChildren(QPushButton)
                     if b.text() == "Browse models…"]  # fmt: skip
        assert window.picker is None
        with qtbot.waitSignal(window.controls.browse_requested, timeout=1000):
            browse.click()  # as the user asks: the controls' button, then the window's answer
        picker = window.picker
        assert picker is not None and picker.isVisible()
        qtbot.waitUntil(lambda: picker.table.rowCount() == 1, timeout=WAIT_MS)
        mine = tmp_path / "mine"
        mine.mkdir()
        shutil.copy(gguf, mine / "copy.gguf")
        with qtbot.waitSignal(picker.scanned, timeout=WAIT_MS):
            picker.add_folder(str(mine))
        assert window.store.model_folders() == [str(mine)]
        assert picker.table.rowCount() == 2
        picker.select("copy")
        picker.load_selected()
        qtbot.waitUntil(lambda: asked[-1:] == [str(mine / "copy.gguf")], timeout=WAIT_MS)
    finally:
        window.shutdown()
