"""The status bar's texts: the model as it runs (precision, device, processes) and the
settings every reply is made under now (sampling, the cache window, the prefix cache)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel, QMainWindow, QProgressBar, QProgressDialog, QWidget

from app.gui.commands import ModelInfo
from engine.core.sampling import SamplingParams
from engine.units import format_size

#: SamplingParams fields the status bar names where they differ from the engine's default
NAMED = {
    "top_k": "top-k",
    "top_p": "top-p",
    "min_p": "min-p",
    "repetition_penalty": "repetition penalty",
    "seed": "seed",
}
DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingParams)}


def model_label(info: ModelInfo) -> str:
    """Model · precision · device, and the processes it is split over (tensor parallel)."""
    text = f"{info.name} · {info.precision} · {info.device}"
    if info.tensor_parallel > 1:
        text += f" · {info.tensor_parallel} processes"
    return text


def settings_label(
    sampling: dict[str, Any], window: tuple[int, int] | None, prefix_cache: bool
) -> str:
    """The sampling that replies use now (greedy or the temperature, what differs from the
    defaults, the token limit), the cache window and a prefix cache turned off."""
    temperature = sampling.get("temperature", DEFAULTS["temperature"])
    parts = ["greedy" if not temperature else f"temperature {temperature:g}"]
    for key, name in NAMED.items():
        value = sampling.get(key, DEFAULTS[key])
        if value != DEFAULTS[key]:
            parts.append(f"{name} {value:g}" if isinstance(value, float) else f"{name} {value}")
    parts.append(f"≤ {sampling.get('max_new_tokens', DEFAULTS['max_new_tokens'])} tokens")
    if sampling.get("constraint") is not None:
        parts.append("JSON")  # held to a grammar (the chat's Reply as JSON)
    if window is not None:
        sink, size = window
        parts.append(f"window {sink} sinks + {size}")
    if not prefix_cache:
        parts.append("prefix cache off")
    return " · ".join(parts)


#: a load's own stages (engine.loader.load.load_model), as the status bar names them
LOAD_STAGES = {
    "read": "reading the weights",
    "quantize": "reading and quantizing the weights",
    "settle": "threads, kernels, KV pool",
}


def show_stage(bar: QProgressBar, stage: str, done: int, total: int) -> None:
    """A load's stage on the status bar's progress bar: tensors done of all, then settling."""
    bar.setRange(0, max(1, total))
    bar.setValue(min(done, total))
    bar.setFormat(f"{LOAD_STAGES[stage]}: %v / %m" if stage != "settle" else LOAD_STAGES[stage])
    bar.setToolTip(f"Loading: {LOAD_STAGES[stage]}")
    bar.show()


def time_left(since: float, done: int, total: int) -> str:
    """`` · 12 s, about 30 s left`` from a stage's start and how far it got."""
    spent = time.monotonic() - since
    if done <= 0 or spent < 1:
        return ""
    left = spent * (total - done) / done
    return f" · {spent:.0f} s, about {left:.0f} s left"


def pull_amount(stage: str, done: int, total: int, since: float) -> str:
    """How far a pull's stage got: bytes for a download (``: 40.0 MiB of 88.6 MiB · 3 s,
    about 4 s left``), tensors for a conversion; nothing for a stage that cannot say (a pip
    older than 24.1 tells no bytes: its download reports 0 of 1)."""
    if total <= 1:
        return "…"
    if stage == "download":
        amount = f"{format_size(done)} of {format_size(total)}"
    else:
        amount = f"{done} / {total}"
    return f": {amount}{time_left(since, done, total)}"


#: what a pull's stages mean to a user: a dialog, since they take a while, once
PULL_STAGES = {
    "download": "Downloading the model",
    "dequantize": "Converting tensors",
    "write": "Writing the converted model",
}


def build_status_bar(window: QMainWindow) -> None:
    """The window's status bar: the model, a load's progress, the settings replies are made
    with, and the last reply's speed, TTFT and context (``window.status_*``)."""
    bar = window.statusBar()
    w: Any = window
    w.status_model = QLabel("no model")
    w.status_speed = QLabel("– tok/s")
    w.status_ttft = QLabel("TTFT –")
    w.status_context = QLabel("context –")
    w.status_model.setToolTip("Model · precision · device")
    w.status_speed.setToolTip("Decode speed of the last reply (1 / mean TPOT)")
    w.status_ttft.setToolTip("Time to first token of the last reply")
    w.status_context.setToolTip("Tokens the last reply used of the model's context")
    w.status_load = QProgressBar()  # a load's stages, while it runs
    w.status_load.setMinimumWidth(320)  # its text whole: "reading and quantizing …"
    w.status_load.setMaximumWidth(420)
    w.status_load.hide()
    w.status_settings = QLabel()
    w.status_settings.setToolTip(
        "What replies are made with now: sampling, the cache window, the prefix cache (Controls)"
    )
    bar.addWidget(w.status_model, 1)
    bar.addWidget(w.status_load)
    bar.addWidget(w.status_settings, 1)
    for label in (w.status_speed, w.status_ttft, w.status_context):
        bar.addPermanentWidget(label)
    w.load_progress = LoadProgress(window, w.status_load)


class LoadProgress:
    """A load's progress: a pull's stages (download, conversion) in a non-modal dialog with
    the time spent and left; a load's own (reading, quantizing, settling) on the status bar."""

    def __init__(self, parent: QWidget, bar: QProgressBar) -> None:
        self.parent, self.bar = parent, bar
        self.dialog: QProgressDialog | None = None
        self.started: dict[str, float] = {}  # a pull's stages, when each began

    def report(self, stage: str, done: int, total: int, what: str) -> None:
        if stage in LOAD_STAGES:
            show_stage(self.bar, stage, done, total)
            return
        if stage not in PULL_STAGES or not total:
            return
        since = self.started.setdefault(stage, time.monotonic())
        if self.dialog is None:
            self.dialog = dialog = QProgressDialog(f"Preparing {what}…", "", 0, 100, self.parent)
            dialog.setCancelButton(None)
            dialog.setAutoReset(False)  # it moves from stage to stage; closed when loaded
            dialog.setAutoClose(False)
            dialog.setWindowTitle("Preparing the model")
            dialog.setMinimumDuration(0)
            dialog.setWindowModality(Qt.WindowModality.NonModal)
            dialog.show()
        self.dialog.setLabelText(f"{PULL_STAGES[stage]}{pull_amount(stage, done, total, since)}")
        self.dialog.setValue(int(100 * done / total))

    def close(self) -> None:
        self.bar.hide()
        self.started.clear()
        if self.dialog is not None:
            self.dialog.close()
            self.dialog = None
