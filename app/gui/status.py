"""The status bar's texts: the model as it runs (precision, device, processes) and the
settings every reply is made under now (sampling, the cache window, the prefix cache)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from PySide6.QtWidgets import QProgressBar

from app.gui.commands import ModelInfo
from engine.core.sampling import SamplingParams

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
