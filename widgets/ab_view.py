"""The A/B lab: two configurations answer the same prompt side by side, and afterwards every
token is coloured by how much they disagree there. It answers "what does INT4 (or another
model) cost me here, and where?".

A thin view, like the rest of ``widgets/``: the app hands it plain JSON-like dicts and it emits
what the user asked for. It imports neither torch nor the engine, so a saved comparison opens,
and the view is tested, without a model.

A *report* (what :meth:`ABView.show_report` takes; a saved file holds
``{"format": "infersight-ab/1", "comparisons": [report, ...]}``)::

    {"prompt": str, "prompt_tokens": int,
     "a": {"model", "precision", "device", "sampling": dict, "window": [sink, window] | None,
           "text", "token_ids": [int], "pieces": [str] (one per token, joined == text),
           "finish_reason", "ttft_s": float | None, "tokens_per_s": float | None,
           "weights_bytes": int, "kv_bytes": int},
     "b": {same keys},
     "columns": {"a": {"kl": [float], "p_a": [float], "p_b": [float],
                       "noise_kl": [float] | None, "top_a": [[[str, float], ...], ...],
                       "top_b": [...]},        # along A's tokens, teacher-forced
                 "b": {same keys}},            # along B's tokens
     "divergence": {"index": int | None, "top_n": 5, "a_token", "b_token",
                    "a_in_b_top": bool | None, "b_in_a_top": bool | None},
     "summary": {"tokens", "kl_mean", "kl_p99", "kl_max", "rms_dp", "top1_agreement", "flips",
                 "noise_kl_mean", "noise_kl_p99",
                 "speculative": {"greedy_acceptance", "sampling_acceptance", "mode",
                                 # measured with B drafting for A; neither: not attempted
                                 "measured": {"k", "mode", "token_acceptance",
                                              "acceptance_rate", "mean_acceptance_length",
                                              "predicted_mean_acceptance_length",
                                              "acceptance_per_pos", "draft_tokens",
                                              "accepted_tokens", "matches_a",
                                              "first_difference", ...},
                                 "not_measured": str}},   # why it could not be measured
     "memory": {"mode": "side by side" | "one after the other", "message": str}}

A *scan* (:meth:`ABView.show_scan`) gives, per layer and block (attention, MLP), the KL when
only that block is at the low precision; a *plan* (:meth:`ABView.show_plan`) is the mixed
precision spec that fits a memory budget.

This module holds the view; its parts are :mod:`widgets.ab_sides` (each side's form and token
column), :mod:`widgets.ab_plots` (the KL and scan plots) and :mod:`widgets.ab_format` (the
text, colours and tooltips made from a report).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QTextCharFormat
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QSizePolicy,
    QSlider,
    QSpinBox,
    QSplitter,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from widgets.ab_format import (
    COLOUR_BY,
    KL_HIGH,
    KL_LOW,
    SIDES,
    SPECULATION_TIP,
    SUMMARY_TIP,
    _side_stats,
    divergence_text,
    format_kl,
    format_mib,
    marker_format,
    quant_format,
    speculation_tip,
    summary_line,
    token_format,
    token_level,
    token_tooltip,
)
from widgets.ab_plots import KLPlot, ScanPlot
from widgets.ab_sides import LOWBIT_TITLES, Column, SideForm

RUNNING = "Running…"
BUDGET_STEPS = 1000  # slider positions between the smallest and the largest plan
BUDGET_DEBOUNCE_MS = 250  # a plan is asked for once the slider rests this long


# -- the view -----------------------------------------------------------------------------------
class ABView(QWidget):
    """The A/B lab tab. Plain data in (:meth:`show_report`, :meth:`show_scan`,
    :meth:`show_plan`), signals out; the app runs the engine."""

    run_requested = Signal(dict)
    cancel_requested = Signal()
    scan_requested = Signal(dict)
    scan_cancel_requested = Signal()
    budget_changed = Signal(object)  # bytes (an int; Qt's int signal stops at 2 GiB)
    use_spec_requested = Signal(str)
    open_requested = Signal(str)
    save_json_requested = Signal(str)
    save_png_requested = Signal(str)  # the app calls grab_png(path) and says how it went

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._report: dict[str, Any] | None = None
        self._scan: dict[str, Any] | None = None
        self._upgraded: set[tuple[int, str]] = set()
        self._busy = False

        # configuration
        self.forms = {"a": SideForm("A (reference)"), "b": SideForm("B")}
        self.forms["b"].precision.setCurrentText("int8")
        self.seed = QSpinBox()
        self.seed.setRange(0, 2**31 - 1)
        self.seed.setToolTip("Both sides sample with this seed, so only the weights differ")
        self.max_new_tokens = QSpinBox()
        self.max_new_tokens.setRange(1, 32768)
        self.max_new_tokens.setValue(64)
        self.continue_conversation = QCheckBox("Continue the chat")
        self.continue_conversation.setToolTip(
            "Continue the current conversation: send its messages before the prompt (both "
            "sides get the same)"
        )
        self.run_button = QPushButton("Run")
        self.run_button.setDefault(True)
        self.run_button.clicked.connect(self._request_run)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.clicked.connect(self.cancel_requested)
        self.open_button = QPushButton("Open…")
        self.open_button.setToolTip("Open a saved A/B comparison (JSON)")
        self.open_button.clicked.connect(self._ask_open)
        self.save_json_button = QPushButton("Save…")
        self.save_json_button.setToolTip(
            "Save the comparison as JSON, every figure included (the format of "
            "`infersight eval compare --json`)"
        )
        self.save_json_button.clicked.connect(self._ask_save_json)
        self.save_png_button = QPushButton("PNG…")
        self.save_png_button.setToolTip("Save a picture of this tab")
        self.save_png_button.clicked.connect(self._ask_save_png)
        run_box = QGroupBox("Both")
        run_form = QFormLayout(run_box)
        run_form.addRow("Seed", self.seed)
        run_form.addRow("Max new tokens", self.max_new_tokens)
        run_form.addRow(self.continue_conversation)
        run_row = QHBoxLayout()
        run_row.addWidget(self.run_button)
        run_row.addWidget(self.cancel_button)
        run_form.addRow(run_row)
        self.status = QLabel()
        self.status.setObjectName("statusLabel")
        self.status.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        run_form.addRow(self.status)
        self.prompt = QPlainTextEdit()
        self.prompt.setPlaceholderText("The prompt both A and B answer")
        self.prompt.setFixedHeight(60)
        config = QHBoxLayout()
        config.addWidget(self.forms["a"], 1)
        config.addWidget(self.forms["b"], 1)
        config.addWidget(run_box)

        self.notice = QLabel()
        self.notice.setObjectName("notice")
        self.notice.setWordWrap(True)
        self.notice.setVisible(False)
        self.notice.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)

        self.tabs = QTabWidget()
        self.tabs.addTab(self._tokens_tab(), "Tokens")
        self.tabs.addTab(self._sensitivity_tab(), "Layer sensitivity")

        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addLayout(config)
        layout.addWidget(self.prompt)
        layout.addWidget(self.notice)
        layout.addWidget(self.tabs, 1)
        self.set_busy(False)

    def _tokens_tab(self) -> QWidget:
        self.colour_by = QComboBox()
        self.colour_by.addItems(COLOUR_BY)
        self.colour_by.setToolTip(
            "KL(A‖B): how far B's next-token distribution is from A's there (log scale, "
            f"{KL_LOW:g} … {KL_HIGH:g} nats). A's probability: how likely A found the token "
            "the column shows (in B's column: where A would not have said it)"
        )
        self.colour_by.currentIndexChanged.connect(self._render_columns)
        self.plot_column = QComboBox()
        self.plot_column.addItem("A's text", "a")
        self.plot_column.addItem("B's text", "b")
        self.plot_column.setCurrentIndex(1)
        self.plot_column.currentIndexChanged.connect(self._draw_kl)
        row = QHBoxLayout()
        row.addWidget(QLabel("Colour by"))
        row.addWidget(self.colour_by)
        row.addSpacing(16)
        row.addWidget(QLabel("Plot column"))
        row.addWidget(self.plot_column)
        row.addStretch(1)
        for button in (self.open_button, self.save_json_button, self.save_png_button):
            row.addWidget(button)  # here rather than above: the tab must fit a 1280-px window

        self.columns = {side: Column(side) for side in SIDES}
        for side, column in self.columns.items():
            column.text.tooltip_provider = lambda i, s=side: self.tooltip_for(s, i)
        columns = QSplitter(Qt.Orientation.Horizontal)
        for column in self.columns.values():
            columns.addWidget(column)

        self.summary = QLabel("Run a comparison, or open a saved one")
        self.summary.setWordWrap(True)
        # two lines always: a one-line label was cut where the columns took the height
        self.summary.setMinimumHeight(2 * self.summary.fontMetrics().lineSpacing() + 4)
        self.summary.setTextFormat(Qt.TextFormat.PlainText)
        self.summary.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.summary.setToolTip(SUMMARY_TIP + "\n\n" + SPECULATION_TIP)
        self.kl = KLPlot()
        self.kl_plot = self.kl.widget
        # its items, under the view's names (what the tests read)
        self.kl_curve, self.noise_top = self.kl.curve, self.kl.noise_top
        self.noise_band, self.divergence_line = self.kl.noise_band, self.kl.divergence_line

        below = QWidget()
        below_layout = QVBoxLayout(below)
        below_layout.setContentsMargins(0, 0, 0, 0)
        below_layout.addWidget(self.summary)
        below_layout.addWidget(self.kl_plot, 1)
        split = QSplitter(Qt.Orientation.Vertical)
        split.addWidget(columns)
        split.addWidget(below)
        split.setStretchFactor(0, 3)
        split.setStretchFactor(1, 2)
        tab = QWidget()
        layout = QVBoxLayout(tab)
        layout.addLayout(row)
        layout.addWidget(split, 1)
        return tab

    def _sensitivity_tab(self) -> QWidget:
        self.scan_button = QPushButton("Scan layers")
        self.scan_button.setToolTip(
            "Quantize one block at a time (each layer's attention, then its MLP) to B's "
            "format and measure the KL against A's model on a text: the blocks that hurt most "
            "are the ones worth keeping at high precision"
        )
        self.scan_button.clicked.connect(self._request_scan)
        self.scan_cancel_button = QPushButton("Cancel scan")
        self.scan_cancel_button.clicked.connect(self.scan_cancel_requested)
        self.scan_progress = QProgressBar()
        self.scan_progress.setRange(0, 1)
        self.scan_progress.setValue(0)
        self.scan_progress.setFormat("")
        row = QHBoxLayout()
        row.addWidget(self.scan_button)
        row.addWidget(self.scan_cancel_button)
        row.addWidget(self.scan_progress, 1)
        self.scan_label = QLabel("No scan yet")
        self.scan_label.setWordWrap(True)
        self.scan_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)

        self.scan = ScanPlot()
        self.scan_plot = self.scan.widget
        self.attn_bars, self.mlp_bars = self.scan.attn_bars, self.scan.mlp_bars

        self.budget = QSlider(Qt.Orientation.Horizontal)
        self.budget.setRange(0, BUDGET_STEPS)
        self.budget.setEnabled(False)
        self.budget.setToolTip("Weight memory the mixed precision plan may use")
        self.budget.valueChanged.connect(self._budget_moved)
        self.budget_label = QLabel("budget –")
        self._budget_timer = QTimer(self, singleShot=True, interval=BUDGET_DEBOUNCE_MS)
        self._budget_timer.timeout.connect(lambda: self.budget_changed.emit(self.budget_bytes()))
        budget_row = QHBoxLayout()
        budget_row.addWidget(QLabel("Budget"))
        budget_row.addWidget(self.budget, 1)
        budget_row.addWidget(self.budget_label)
        self.spec_line = QLineEdit()
        self.spec_line.setReadOnly(True)
        self.spec_line.setPlaceholderText("the plan's precision spec")
        self.use_button = QPushButton("Use as B")
        self.use_button.setToolTip("Put this spec in B's precision, to compare it with A")
        self.use_button.setEnabled(False)
        self.use_button.clicked.connect(self._use_spec)
        spec_row = QHBoxLayout()
        spec_row.addWidget(self.spec_line, 1)
        spec_row.addWidget(self.use_button)
        self.plan_label = QLabel()
        self.plan_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)

        tab = QWidget()
        layout = QVBoxLayout(tab)
        layout.addLayout(row)
        layout.addWidget(self.scan_label)
        layout.addWidget(self.scan_plot, 1)
        layout.addLayout(budget_row)
        layout.addLayout(spec_row)
        layout.addWidget(self.plan_label)
        return tab

    # -- configuration ----------------------------------------------------------------------
    def set_models(self, models: Sequence[tuple[str, str]]) -> None:
        """The models to offer, as (name, path); each side keeps its choice."""
        for form in self.forms.values():
            form.set_models(models)

    def set_current(self, model_path: str, precision: str) -> None:
        """The chat's model: A is it at fp32 (the reference), B the same model at the chat's
        precision when that is a quantized one, else at int8."""
        for form in self.forms.values():
            form.set_model(model_path)
        self.forms["a"].precision.setCurrentText("fp32")
        quantized = precision not in ("fp32", "bf16", "fp16") and bool(precision)
        self.forms["b"].precision.setCurrentText(precision if quantized else "int8")

    def form(self) -> dict[str, Any]:
        """What :attr:`run_requested` carries."""
        return {
            "a": self.forms["a"].values(),
            "b": self.forms["b"].values(),
            "seed": self.seed.value(),
            "max_new_tokens": self.max_new_tokens.value(),
            "prompt": self.prompt.toPlainText(),
            "continue_conversation": self.continue_conversation.isChecked(),
        }

    def _request_run(self) -> None:
        request = self.form()
        if not request["prompt"].strip() and not request["continue_conversation"]:
            self.set_notice("Type a prompt for A and B first.", "warning")
            return
        missing = [s.upper() for s in SIDES if not request[s].get("endpoint") and (
            not request[s]["model"] or not request[s]["precision"])]  # fmt: skip
        if missing:
            self.set_notice(
                f"Choose a model and a precision for {' and '.join(missing)}.", "warning"
            )
            return
        self.run_requested.emit(request)

    def set_busy(self, busy: bool) -> None:
        """While the lab works (a run or a scan: one at a time), nothing new can start and
        either Cancel stops it."""
        self._busy = busy
        for button in (self.run_button, self.scan_button, self.open_button):
            button.setEnabled(not busy)
        self.cancel_button.setEnabled(busy)
        self.scan_cancel_button.setEnabled(busy)
        self.save_json_button.setEnabled(not busy and self._report is not None)
        if not busy and self._report is None and self.summary.text() == RUNNING:
            self.summary.setText("No comparison: the run was cancelled or failed (see above)")

    def set_status(self, text: str) -> None:
        """What the lab is doing now (loading B…, generating…, done)."""
        self.status.setText(text)
        self.status.setToolTip(text)

    def set_notice(self, text: str, level: str = "info") -> None:
        """A message above the columns (how A and B share memory, what went wrong); empty
        text hides it."""
        self.notice.setProperty("level", level)
        self.notice.style().unpolish(self.notice)
        self.notice.style().polish(self.notice)
        self.notice.setText(text)
        self.notice.setVisible(bool(text))

    # -- streaming ----------------------------------------------------------------------------
    def begin_run(self, a_title: str, b_title: str) -> None:
        """A run starts: empty columns, and the last report's figures go (they belong to
        other text; :meth:`report` is ``None`` until the new one arrives)."""
        self._report = None
        self.summary.setText(RUNNING)
        self.summary.setToolTip(SUMMARY_TIP + "\n\n" + SPECULATION_TIP)
        self.kl.clear()
        for side, title in zip(SIDES, (a_title, b_title), strict=True):
            column = self.columns[side]
            column.header.setText(title)
            column.stats.setText("")
            column.text.clear_tokens()
        self.set_busy(True)

    def append(self, side: str, text: str) -> None:
        if self._report is None:  # a shown report's columns are rendered from its pieces
            self.columns[side].text.append_text(text)

    def set_side_stats(self, side: str, text: str) -> None:
        self.columns[side].stats.setText(text)
        self.columns[side].stats.setToolTip(text)

    # -- the report ---------------------------------------------------------------------------
    def show_report(self, report: dict[str, Any]) -> None:
        """A finished comparison (or one opened from a file): the columns are rendered again
        token by token and coloured, the summary and the plot filled in."""
        self._report = report
        models = {report[s].get("model") for s in SIDES}
        caches = {report[s].get("kv_dtype") for s in SIDES}  # named where they differ
        for side in SIDES:
            info = report[side]
            parts = [side.upper(), info.get("precision", "?"), info.get("device", "?")]
            if len(caches) > 1 and not info.get("remote"):
                parts.append(f"KV {info.get('kv_dtype') or '?'}")
            if info.get("lowbit") in LOWBIT_TITLES:
                parts.append(LOWBIT_TITLES[info["lowbit"]])
            if info.get("remote"):  # "model @ server"
                parts.append(str(info.get("model", "")))
            elif len(models) > 1:
                parts.append(Path(str(info.get("model", ""))).name)
            self.columns[side].header.setText(" · ".join(parts))
            self.columns[side].header.setToolTip(str(info.get("model", "")))
            self.set_side_stats(side, _side_stats(info))
        self._render_columns()
        summary = report.get("summary", {})
        self.summary.setText(summary_line(summary, report.get("divergence")))
        spec = summary.get("speculative")
        self.summary.setToolTip(
            SUMMARY_TIP + "\n\n" + speculation_tip(spec if isinstance(spec, dict) else {})
        )
        self._draw_kl()
        message = (report.get("memory") or {}).get("message")
        bounds = report.get("bounds") or {}
        said = [str(t) for t in (bounds.get("text"), bounds.get("tokenizer")) if t]
        said += [str(n) for n in bounds.get("notes") or ()]
        if said:  # a server on a side: what is exact, what bounded, how the check went
            message = " ".join(f"{t.rstrip('.')}." for t in said)
        if message:
            self.set_notice(message, "info")
        self.set_busy(self._busy)

    def report(self) -> dict[str, Any] | None:
        return self._report

    def column_text(self, side: str) -> str:
        return self.columns[side].text.plain_text()

    def summary_text(self) -> str:
        return self.summary.text()

    def token_at(self, side: str, char_pos: int) -> int | None:
        """The token of ``side``'s column at a character position (see :class:`TokenView`)."""
        return self.columns[side].text.token_at(char_pos)

    def token_format(self, side: str, index: int) -> QTextCharFormat:
        return self.columns[side].text.format_at(index)

    def _render_columns(self) -> None:
        if self._report is None:
            return
        divergence = self._report.get("divergence") or {}
        at = divergence.get("index")
        for side in SIDES:
            pieces = list(self._report[side].get("pieces", []))
            figures = self._report.get("columns", {}).get(side, {})
            mode = self.colour_by.currentIndex()
            levels = (token_level(figures, i, mode) for i in range(len(pieces)))
            formats = [token_format(level, i == at) for i, level in enumerate(levels)]
            self.columns[side].text.set_tokens(
                pieces, formats, at, marker_format(), divergence_text(divergence)
            )

    def tooltip_for(self, column: str, index: int) -> str:
        """Token ``index`` of ``column``'s text: its KL, both models' probability of it, and
        both models' top-5 next tokens there (rich text)."""
        return "" if self._report is None else token_tooltip(self._report, column, index)

    def _draw_kl(self) -> None:
        if self._report is None:
            return
        side = str(self.plot_column.currentData())
        figures = self._report.get("columns", {}).get(side, {})
        self.kl.draw(side, figures, (self._report.get("divergence") or {}).get("index"))

    # -- layer sensitivity -------------------------------------------------------------------
    def _request_scan(self) -> None:
        precision = self.forms["b"].precision.currentText()
        low = quant_format(precision)
        if low is None:
            self.set_notice(
                f"A layer scan quantizes one block at a time to B's format; B's precision "
                f"{precision!r} is not one (choose int8, int4-g32 or w8a8, say).",
                "warning",
            )
            return
        self.scan_requested.emit({"model": self.forms["a"].model_path(), "low": low})

    def set_scan_progress(self, done: int, total: int) -> None:
        self.scan_progress.setRange(0, max(1, total))
        self.scan_progress.setValue(min(done, max(1, total)))
        self.scan_progress.setFormat(f"{done} / {total} blocks")

    def show_scan(self, scan: dict[str, Any]) -> None:
        """A finished scan: bars per layer, and the budget slider spans its plans. The slider
        starts half-way, so a plan is asked for at once."""
        self._scan = scan
        self._upgraded = set()
        self._draw_bars()
        low, high = scan.get("low", "?"), scan.get("high", "?")
        self.scan_plot.setTitle(
            f"KL with only this block at {low} (the rest at fp32)", color="#d0d4da", size="10pt"
        )
        self.scan_label.setText(
            f"{Path(str(scan.get('model', ''))).name}: every block at {low}: KL "
            f"{format_kl(scan.get('all_low_kl'))} nats over {scan.get('text_tokens', '?')} "
            f"tokens · weights {format_mib(scan.get('min_bytes'))} (all {low}) … "
            f"{format_mib(scan.get('max_bytes'))} (all {high}), of which "
            f"{format_mib(scan.get('fixed_bytes'))} not scanned (embeddings, norms)"
        )
        self.budget.setEnabled(scan.get("max_bytes", 0) > scan.get("min_bytes", 0))
        self.budget.blockSignals(True)
        self.budget.setValue(BUDGET_STEPS // 2)
        self.budget.blockSignals(False)
        self._budget_moved()

    def _draw_bars(self) -> None:
        self.scan.draw((self._scan or {}).get("blocks", []), self._upgraded)

    def budget_bytes(self) -> int:
        """The budget the slider stands at, in bytes."""
        scan = self._scan or {}
        lo, hi = int(scan.get("min_bytes", 0)), int(scan.get("max_bytes", 0))
        return lo + round((hi - lo) * self.budget.value() / BUDGET_STEPS)

    def _budget_moved(self, *_: object) -> None:
        if self._scan is None:
            return
        self.budget_label.setText(format_mib(self.budget_bytes()))
        self._budget_timer.start()

    def show_plan(self, plan: dict[str, Any]) -> None:
        """The plan for the current budget: its spec, and its upgraded blocks in the chart.
        ``upgraded`` holds ``[layer, part]`` pairs or ``{"layer", "part"}`` dicts, the budget
        is ``budget`` or ``budget_bytes`` (``engine.sensitivity.Plan.to_dict``)."""
        self.spec_line.setText(plan.get("spec", ""))
        self.spec_line.setCursorPosition(0)
        self._upgraded = {
            (int(u["layer"]), str(u["part"])) if isinstance(u, dict) else (int(u[0]), str(u[1]))
            for u in plan.get("upgraded", [])
        }
        budget = plan.get("budget", plan.get("budget_bytes"))
        self.use_button.setEnabled(bool(plan.get("spec")))
        self.plan_label.setText(
            f"plan: {format_mib(plan.get('bytes'))} of a {format_mib(budget)} budget"
            f" · {len(self._upgraded)} blocks kept at "
            f"{(self._scan or {}).get('high', 'high precision')} (outlined) · predicted KL "
            f"{format_kl(plan.get('predicted_kl'))} nats"
        )
        self._draw_bars()

    def _use_spec(self) -> None:
        spec = self.spec_line.text()
        if spec:
            self.forms["b"].precision.setCurrentText(spec)
            self.use_spec_requested.emit(spec)

    # -- files --------------------------------------------------------------------------------
    def grab_png(self, path: str | Path) -> bool:
        """Save a picture of the whole view; False when the file could not be written."""
        return bool(self.grab().save(str(path), "PNG"))

    def open_path(self, path: str) -> None:
        self.open_requested.emit(path)

    def save_json_to(self, path: str) -> None:
        self.save_json_requested.emit(path)

    def save_png_to(self, path: str) -> None:
        self.save_png_requested.emit(path)

    def _ask_open(self) -> None:
        path, _ = QFileDialog.getOpenFileName(
            self, "Open A/B comparison", filter="A/B comparison (*.json)"
        )
        if path:
            self.open_path(path)

    def _ask_save_json(self) -> None:
        path, _ = QFileDialog.getSaveFileName(
            self, "Save A/B comparison", "ab.json", "A/B comparison (*.json)"
        )
        if path:
            self.save_json_to(path)

    def _ask_save_png(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Save picture", "ab.png", "PNG (*.png)")
        if path:
            self.save_png_to(path)
