"""The A/B lab's glue to its view (:class:`LabController`): it turns the
:class:`~widgets.ab_view.ABView`'s requests into jobs for a :class:`~app.gui.lab_worker.LabWorker`
on a thread of its own, shows what the worker sends back, and opens and saves reports."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from PySide6.QtCore import QObject, Qt, QThread

from app.gui.lab_worker import (
    ABRequest,
    LabLoader,
    LabSide,
    LabWorker,
    MemoryProbe,
    ScanRequest,
    free_memory,
)
from app.loading import load_engine
from engine.errors import InfersightError
from widgets.ab_sides import LOWBIT_TITLES

if TYPE_CHECKING:
    from widgets.ab_view import ABView

log = logging.getLogger(__name__)


class LabController(QObject):
    """Connects the :class:`~widgets.ab_view.ABView` to a :class:`LabWorker` in its own thread;
    the main window gives it the current model and the conversation's messages."""

    def __init__(
        self,
        view: ABView,
        messages: Callable[[], list[dict[str, str]]],
        *,
        loader: LabLoader = load_engine,
        available: MemoryProbe = free_memory,
        parent: QObject | None = None,
    ) -> None:
        super().__init__(parent)
        self.view = view
        self._messages = messages
        self.scan: dict[str, Any] | None = None
        self.busy = False
        self.worker = LabWorker(loader, available)
        self.lab_thread = QThread(self)
        self.lab_thread.setObjectName("infersight-lab")
        self.worker.moveToThread(self.lab_thread)
        self.lab_thread.started.connect(self.worker.run)
        self.worker.stopped.connect(self.lab_thread.quit, Qt.ConnectionType.DirectConnection)
        w = self.worker
        w.status.connect(self._on_status)
        w.notice.connect(self._on_notice)
        w.deltas.connect(self._on_deltas)
        w.side_stats.connect(self._on_side_stats)
        w.report_ready.connect(self._on_report)
        w.scan_progress.connect(self._on_scan_progress)
        w.scan_ready.connect(self._on_scan)
        w.failed.connect(self._on_failed)
        w.finished.connect(self._on_finished)
        view.run_requested.connect(self.run)
        # not to the worker's own slot: a queued call would wait for its busy thread
        view.cancel_requested.connect(self.cancel)
        view.scan_requested.connect(self.start_scan)
        view.scan_cancel_requested.connect(self.cancel)
        view.budget_changed.connect(self.plan)
        view.open_requested.connect(self.open_file)
        view.save_json_requested.connect(self.save_json)
        view.save_png_requested.connect(self.save_png)
        self.lab_thread.start()

    # -- requests from the view ------------------------------------------------------------
    def cancel(self) -> None:
        """Cancel: the job stops at its next step, scoring pass or scanned block."""
        self.worker.cancel()

    def release(self) -> None:
        """Give the lab's engines back (the user left the tab); the next run loads again."""
        self.worker.release()

    def run(self, form: dict[str, Any]) -> None:
        if self.busy:
            self.view.set_notice("The lab is busy; cancel it or wait", "warning")
            return
        prompt = str(form.get("prompt", "")).strip()
        messages = list(self._messages()) if form.get("continue_conversation") else []
        if prompt:
            messages.append({"role": "user", "content": prompt})
        if not messages or messages[-1]["role"] != "user":
            self.view.set_notice(
                "Write a prompt (or continue a conversation whose last message is yours)",
                "warning",
            )
            return
        try:
            sides = [_lab_side(form[k]) for k in ("a", "b")]
        except (KeyError, TypeError, ValueError) as exc:
            self.view.set_notice(f"Cannot read the A/B settings: {exc}", "warning")
            return
        job = ABRequest(sides[0], sides[1], messages, messages[-1]["content"],
                        int(form.get("max_new_tokens", 64)), int(form.get("seed", 0)))  # fmt: skip
        self._start()
        self.view.begin_run(_title("A", sides[0]), _title("B", sides[1]))
        self.worker.post(job)

    def start_scan(self, form: dict[str, Any]) -> None:
        if self.busy:
            self.view.set_notice("The lab is busy; cancel it or wait", "warning")
            return
        self._start()
        self.view.set_scan_progress(0, 1)
        self.worker.post(ScanRequest(str(form["model"]), str(form["low"])))

    def plan(self, budget: int) -> None:
        from engine.evals.sensitivity import Scan, plan_mixed

        if self.scan is None:
            return
        try:
            self.view.show_plan(plan_mixed(Scan.from_dict(self.scan), int(budget)).to_dict())
        except InfersightError as exc:
            self.view.set_notice(str(exc), "warning")

    def open_file(self, path: str) -> None:
        from engine.evals.compare_file import read_document

        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            comparisons = read_document(data)
        except (OSError, ValueError, InfersightError) as exc:
            self.view.set_notice(f"Could not open {path}: {exc}", "warning")
            return
        shown = self.view.report()
        try:
            self.view.show_report(comparisons[0])
        except Exception as exc:  # a shape read_document let through: keep what was shown
            log.exception("showing %s failed", path)
            if shown is not None:
                self.view.show_report(shown)
            self.view.set_notice(f"Could not show {path}: {type(exc).__name__}: {exc}", "warning")
            return
        more = (
            f"; it holds {len(comparisons)} comparisons, this is the first"
            if len(comparisons) > 1
            else ""
        )
        self.view.set_notice(f"Opened {path}{more}", "info")

    def save_json(self, path: str) -> None:
        from engine.evals.compare_file import document

        report = self.view.report()
        if report is None:
            self.view.set_notice("Nothing to save yet: run an A/B first", "warning")
            return
        try:
            text = json.dumps(document([report]), indent=1, ensure_ascii=False)
            Path(path).write_text(text + "\n", encoding="utf-8")
        except OSError as exc:
            self.view.set_notice(f"Could not save {path}: {exc}", "warning")
            return
        self.view.set_notice(f"Saved {path}", "info")

    def save_png(self, path: str) -> None:
        if not self.view.grab_png(path):
            self.view.set_notice(f"Could not save {path}", "warning")

    # -- from the worker ---------------------------------------------------------------------
    def _start(self) -> None:
        self.busy = True
        self.view.set_busy(True)

    def _on_status(self, text: str) -> None:
        self.view.set_status(text)

    def _on_notice(self, text: str, level: str) -> None:
        self.view.set_notice(text, level)

    def _on_deltas(self, deltas: list[tuple[str, str]]) -> None:
        for side, text in deltas:
            self.view.append(side, text)

    def _on_side_stats(self, side: str, text: str) -> None:
        self.view.set_side_stats(side, text)

    def _on_report(self, report: dict[str, Any]) -> None:
        self.view.show_report(report)

    def _on_scan_progress(self, done: int, total: int) -> None:
        self.view.set_scan_progress(done, total)

    def _on_scan(self, scan: dict[str, Any]) -> None:
        self.scan = scan
        self.view.show_scan(scan)

    def _on_failed(self, text: str) -> None:
        self.view.set_notice(text, "warning")

    def _on_finished(self) -> None:
        self.busy = False
        self.view.set_busy(False)

    def request_stop(self) -> None:
        """Cancel what runs and ask the lab's thread to end (see :meth:`shutdown`)."""
        if self.lab_thread.isRunning():
            self.worker.stop()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Cancel what runs and wait for the lab's thread (the job stops at its next step)."""
        if not self.lab_thread.isRunning():
            return
        self.worker.stop()
        deadline = time.monotonic() + timeout_s
        while self.lab_thread.isRunning() and time.monotonic() < deadline:
            self.lab_thread.wait(50)
        if self.lab_thread.isRunning():
            log.warning("the lab's thread is still busy; leaving it to the process exit")
            self.lab_thread.setParent(None)
            _STRAY.append((self.lab_thread, self.worker))


_STRAY: list[tuple[QThread, LabWorker]] = []


def _lab_side(form: dict[str, Any]) -> LabSide:
    window = form.get("window")
    return LabSide(
        model=str(form.get("model") or "default"),
        precision=str(form.get("precision") or "fp32").strip(),
        device=str(form.get("device") or "auto"),
        temperature=float(form.get("temperature") or 0.0),
        window=None if not window else (int(window[0]), int(window[1])),
        lowbit=form.get("lowbit") or None,
        kv_dtype=str(form.get("kv_dtype") or "auto"),
        endpoint=str(form.get("endpoint") or ""),
        endpoint_model=str(form.get("endpoint_model") or ""),
    )


def _title(name: str, side: LabSide) -> str:
    if side.endpoint:
        return f"{name} · {side.endpoint_model or 'the first model'} @ {side.endpoint} · server"
    model = "default" if side.model == "default" else Path(side.model).name
    kernels = f" · {LOWBIT_TITLES[side.lowbit]}" if side.lowbit in LOWBIT_TITLES else ""
    kv = "" if side.kv_dtype == "auto" else f" · KV {side.kv_dtype}"
    return f"{name} · {model} · {side.precision}{kv}{kernels}"
