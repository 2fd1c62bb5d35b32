"""The controls dock's speculative decoding group: the drafter (a self-draft at a lower
precision, prompt lookup or a draft model's folder), the most draft tokens a step, and what
the engine runs and accepts. A change is asked for with ``changed`` and the worker's answer
comes back through :meth:`SpeculationGroup.show_speculation`; a refused one puts the
controls back to what runs."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QComboBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
)

#: speculative decoding's drafters: (label, ``--speculative`` method; "" is off)
SPECULATION_METHODS = (
    ("Off", ""), ("Self-draft", "self"), ("Prompt lookup", "lookup"), ("Draft model", "model"),
)  # fmt: skip
#: the precisions a self-draft runs the model's own weights at, the cheapest first
SELF_DRAFT_PRECISIONS = ("int4-g32+head", "int8+head", "int4-g64")
DRAFT_K = (1, 16, 8)  # the most draft tokens a step: lowest, highest, default


class SpeculationGroup(QGroupBox):
    """A drafter proposes a few tokens, the model checks them all in one step: more
    tokens per step, the same text (greedy) or the same distribution (sampled)."""

    #: speculative decoding as ``--speculative`` takes it (``self:int4-g32+head``, ``lookup``,
    #: ``model:DIR``; "" off) and the most draft tokens a step
    changed = Signal(str, int)

    def __init__(self) -> None:
        super().__init__("Speculative decoding")
        form = QFormLayout(self)
        self.spec_method = QComboBox()
        for label, method in SPECULATION_METHODS:
            self.spec_method.addItem(label, method)
        self.spec_method.setToolTip(
            "A cheap drafter proposes up to k tokens; the model verifies them in one step and "
            "keeps exactly the tokens it would have produced itself, so the reply does not "
            "change. Self-draft: the model's own weights at a lower precision (loads them once "
            "more). Prompt lookup: copies what followed the last words earlier in the chat (no "
            "model, no memory; pays off when the reply repeats its input). Draft model: a "
            "smaller model with the same tokenizer"
        )
        self.spec_precision = QComboBox()
        self.spec_precision.addItems(SELF_DRAFT_PRECISIONS)
        self.spec_precision.setToolTip(
            "The self-draft's precision: lower is a faster drafter that agrees less often"
        )
        self.spec_folder = QLineEdit()
        self.spec_folder.setPlaceholderText("draft model folder (same tokenizer)")
        self.spec_folder.setToolTip(
            "A Hugging Face folder of a smaller model with this model's tokenizer; it loads at "
            "the model's precision beside it"
        )
        self.spec_browse = QPushButton("…")
        self.spec_browse.setToolTip("Choose the draft model's folder")
        self.spec_browse.clicked.connect(self._pick_draft_folder)
        self.spec_k = QSpinBox()
        self.spec_k.setRange(DRAFT_K[0], DRAFT_K[1])
        self.spec_k.setValue(DRAFT_K[2])
        self.spec_k.setToolTip(
            "The most tokens drafted per step; each sequence drafts fewer (or none) while its "
            "drafts are rarely accepted. Changing it keeps the drafter"
        )
        self.spec_label = QLabel()
        self.spec_label.setWordWrap(True)
        self.spec_label.setObjectName("speculation")
        row = QHBoxLayout()
        row.addWidget(self.spec_folder, 1)
        row.addWidget(self.spec_browse)
        form.addRow("Drafter", self.spec_method)
        form.addRow("Draft precision", self.spec_precision)
        form.addRow("Draft model", row)
        form.addRow("Draft tokens (k)", self.spec_k)
        form.addRow("State", self.spec_label)
        self._spec_sent: tuple[str, int] = ("", DRAFT_K[2])  # the last change asked for
        self._spec_active = ""  # what the engine runs, as the worker last said
        self._spec_pending = 0  # changes asked for and not answered yet
        self._spec_error = ""
        self._spec_stats: tuple[float | None, float | None] = (None, None)
        self.spec_method.currentIndexChanged.connect(self._speculation_edited)
        self.spec_precision.currentIndexChanged.connect(self._speculation_edited)
        self.spec_folder.editingFinished.connect(self._speculation_edited)
        self.spec_k.valueChanged.connect(self._speculation_edited)
        self._speculation_edited()

    def speculation(self) -> tuple[str, int] | None:
        """``(--speculative text, k)`` as chosen ("" is off); None while a draft model has no
        folder yet."""
        method, k = self.spec_method.currentData(), self.spec_k.value()
        if method == "self":
            return f"self:{self.spec_precision.currentText()}", k
        if method == "model":
            folder = self.spec_folder.text().strip()
            return (f"model:{folder}", k) if folder else None
        return ("lookup" if method == "lookup" else ""), k

    def show_speculation(self, text: str, k: int, error: str = "") -> None:
        """The worker's answer: the speculation in force (``text`` "" when off) and, when the
        change asked for failed, why; the controls then go back to what runs."""
        self._spec_pending = max(0, self._spec_pending - 1)
        self._spec_active, self._spec_error = text, error
        if error and not self._spec_pending:
            self._set_speculation(text, k)
            self._spec_sent = (text, k)
        self._show_speculation_state()

    def show_stats(
        self, acceptance_rate: float | None, mean_acceptance_length: float | None
    ) -> None:
        """From a metrics snapshot: the share of draft tokens accepted and the tokens a
        verifying step yields (None: nothing drafted yet)."""
        self._spec_stats = (acceptance_rate, mean_acceptance_length)
        self._show_speculation_state()

    def _speculation_edited(self, *_: object) -> None:
        self._enable_speculation_inputs()
        value = self.speculation()
        if value is not None and not _same_speculation(value, self._spec_sent):
            self._spec_error = ""
            self._spec_sent = value
            self._spec_pending += 1
            self.changed.emit(*value)
        self._show_speculation_state()

    def _show_speculation_state(self) -> None:
        active, (rate, length) = self._spec_active, self._spec_stats
        tip = ""
        if self._spec_error:
            text, tip = f"⚠ {self._spec_error}", self._spec_error
        elif self._spec_pending:
            loads = self._spec_sent[0].split(":")[0] in ("self", "model")
            text = "loading the drafter…" if loads else "applying…"
        elif self.speculation() is None:
            text = "choose the draft model's folder" + (
                f" ({_short_drafter(active)} runs meanwhile)" if active else ""
            )
        elif not active:
            text = "off"
        elif rate is None or length is None:
            text = f"{_short_drafter(active)} · no drafts yet"
            tip = active
        else:
            text = f"{_short_drafter(active)} · {rate:.0%} accepted · {length:.1f} tokens/step"
            tip = (
                f"{active}: {rate:.0%} of the draft tokens were accepted; a verifying step "
                f"yields {length:.2f} tokens on average (the model's own token included)"
            )
        self.spec_label.setText(text)
        self.spec_label.setToolTip(tip)

    def _set_speculation(self, text: str, k: int) -> None:
        """Show ``text`` (``--speculative`` form, "" off) and ``k`` without asking for them."""
        method, _, arg = text.strip().partition(":")
        self._show_speculation_choice(
            method, arg if method == "self" else None, arg if method == "model" else None, k
        )

    def _show_speculation_choice(
        self, method: object, precision: object, folder: object, k: object
    ) -> None:
        """Set the group's widgets (what is not a valid value is left alone), quietly."""
        widgets = (self.spec_method, self.spec_precision, self.spec_folder, self.spec_k)
        for w in widgets:
            w.blockSignals(True)
        try:
            index = self.spec_method.findData(method)
            self.spec_method.setCurrentIndex(index if index >= 0 else self.spec_method.findData(""))
            if isinstance(precision, str) and precision:
                if self.spec_precision.findText(precision) < 0:
                    self.spec_precision.addItem(precision)
                self.spec_precision.setCurrentText(precision)
            if isinstance(folder, str):
                self.spec_folder.setText(folder)
            with contextlib.suppress(TypeError, ValueError):
                self.spec_k.setValue(min(max(int(k), DRAFT_K[0]), DRAFT_K[1]))  # type: ignore[call-overload]
        finally:
            for w in widgets:
                w.blockSignals(False)
        self._enable_speculation_inputs()

    def _enable_speculation_inputs(self) -> None:
        """The draft precision for a self-draft only, the folder for a draft model only."""
        method = self.spec_method.currentData()
        self.spec_precision.setEnabled(method == "self")
        self.spec_folder.setEnabled(method == "model")
        self.spec_browse.setEnabled(method == "model")

    def _pick_draft_folder(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Draft model folder")
        if path:
            self.spec_folder.setText(path)
            self._speculation_edited()

    def state(self) -> dict[str, Any]:
        return {
            "method": self.spec_method.currentData(),
            "precision": self.spec_precision.currentText(),
            "folder": self.spec_folder.text(),
            "k": self.spec_k.value(),
        }

    def restore(self, saved: object) -> None:
        """Saved speculation (off when absent or unreadable); a change reaches the engine
        through ``changed``, as the prefix cache switch does."""
        saved = saved if isinstance(saved, dict) else {}
        self._show_speculation_choice(
            saved.get("method", ""), saved.get("precision"), saved.get("folder"),
            saved.get("k", DRAFT_K[2]),
        )  # fmt: skip
        self._speculation_edited()


def _same_speculation(a: tuple[str, int], b: tuple[str, int]) -> bool:
    """Whether two ``(text, k)`` ask for the same thing (k means nothing while off)."""
    return a[0] == b[0] and (not a[0] or a[1] == b[1])


def _short_drafter(text: str) -> str:
    """``model:/models/draft-135m`` → ``model:draft-135m``; other forms as they are."""
    method, _, arg = text.partition(":")
    if method == "model" and arg:
        return f"model:{Path(arg).name or arg}"
    return text
