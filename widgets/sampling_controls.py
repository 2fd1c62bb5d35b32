"""The controls dock's sampling group: temperature, top-k, top-p, min-p, repetition penalty,
seed, max new tokens, stop strings and replies per prompt, and the model's own default
sampling (which the fields show once it loads, and Reset puts back)."""

from __future__ import annotations

import contextlib
from typing import Any

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QFormLayout, QGroupBox, QLabel, QLineEdit, QPushButton

from widgets.number_field import NumberField, add_field

#: sampling before a model says otherwise: greedy, every filter off (what a model without a
#: generation_config.json gets); a model's own defaults replace these when it loads
NEUTRAL_SAMPLING: dict[str, float] = {
    "temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
    "max_new_tokens": 512,
}  # fmt: skip


class SamplingGroup(QGroupBox):
    """The sampling fields; ``changed`` when the user changes one (or Reset changes them)."""

    changed = Signal()  # the user changed a value
    shown = Signal()  # a value on show changed, the user's or set by the app (a model's defaults)
    invalid_input = Signal(str)

    def __init__(self) -> None:
        super().__init__("Sampling")
        form = QFormLayout(self)
        self.sampling_source = QLabel("no model loaded yet")
        self.sampling_source.setWordWrap(True)
        self.reset_sampling_button = QPushButton("Reset to model default")
        self.reset_sampling_button.setToolTip(
            "Put back the sampling the model's authors recommend (its generation_config.json)"
        )
        self.reset_sampling_button.setEnabled(False)
        self.reset_sampling_button.clicked.connect(self.reset_sampling)
        form.addRow(self.sampling_source, self.reset_sampling_button)
        self.temperature = self._field(
            form,
            "Temperature",
            "temperature",
            NEUTRAL_SAMPLING["temperature"],
            lo=0,
            hi=5,
            tip="0 = greedy (always the likeliest token). Higher = more varied. No cost",
        )
        self.top_k = self._field(
            form,
            "Top-k",
            "top-k",
            NEUTRAL_SAMPLING["top_k"],
            lo=0,
            hi=1_000_000,
            integer=True,
            tip="Keep only the k likeliest tokens (0 = off). Costs a partial sort per token",
        )
        self.top_p = self._field(
            form,
            "Top-p",
            "top-p",
            NEUTRAL_SAMPLING["top_p"],
            lo=0,
            hi=1,
            lo_open=True,
            tip="Keep the likeliest tokens that make up this probability (1 = off). "
            "Costs a full sort of the vocabulary per token",
        )
        self.min_p = self._field(
            form,
            "Min-p",
            "min-p",
            NEUTRAL_SAMPLING["min_p"],
            lo=0,
            hi=0.99,
            tip="Drop tokens less likely than min-p × the top token's probability (0 = off)",
        )
        self.repetition_penalty = self._field(
            form,
            "Repetition penalty",
            "repetition penalty",
            NEUTRAL_SAMPLING["repetition_penalty"],
            lo=0.01,
            hi=10,
            tip="Above 1 makes tokens already in the context less likely (1 = off)",
        )
        self.seed = self._field(
            form,
            "Seed",
            "seed",
            None,
            lo=0,
            hi=2**63 - 1,
            integer=True,
            optional=True,
            tip="Fixes the random choices so a reply can be reproduced (empty = random)",
        )
        self.max_new_tokens = self._field(
            form,
            "Max new tokens",
            "max new tokens",
            NEUTRAL_SAMPLING["max_new_tokens"],
            lo=1,
            hi=32768,
            integer=True,
            tip="Longest reply. Each token adds to the KV cache (see the block map)",
        )
        self.stop_strings = QLineEdit()
        self.stop_strings.setPlaceholderText("comma-separated, e.g. ###, User:")
        self.stop_strings.setToolTip("The reply ends before any of these strings appears")
        self.stop_strings.editingFinished.connect(self.changed)
        form.addRow("Stop strings", self.stop_strings)
        self.candidates = self._field(
            form, "Replies per prompt", "replies per prompt", 1, lo=1, hi=8, integer=True,
            tip="Several candidate replies to one prompt, shown as tabs. The engine batches "
            "them: n replies cost far less than n times one, and n× the KV cache",
        )  # fmt: skip
        self._defaults_model: str | None = None  # whose defaults these are
        self._defaults: dict[str, float] = {}
        for f in self._sampling_fields().values():
            f.shown.connect(self._show_sampling_source)
            f.shown.connect(self.shown)

    def _field(
        self, form: QFormLayout, label: str, name: str, value: float | None, **kwargs: Any
    ) -> NumberField:
        return add_field(
            form, label, name, value, invalid=self.invalid_input, on_change=self.changed.emit,
            **kwargs,
        )  # fmt: skip

    # -- reading -----------------------------------------------------------------------------
    def sampling(self) -> dict[str, Any]:
        """Keyword arguments for the engine's ``SamplingParams``."""
        seed = self.seed.value()
        stops = tuple(s.strip() for s in self.stop_strings.text().split(",") if s.strip())
        return {
            "temperature": self.temperature.value(),
            "top_k": int(self.top_k.value() or 0),
            "top_p": self.top_p.value(),
            "min_p": self.min_p.value(),
            "repetition_penalty": self.repetition_penalty.value(),
            "seed": None if seed is None else int(seed),
            "max_new_tokens": int(self.max_new_tokens.value() or 1),
            "stop": stops,
        }

    def num_candidates(self) -> int:
        return int(self.candidates.value() or 1)

    def _sampling_fields(self) -> dict[str, NumberField]:
        return {
            "temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
            "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
            "max_new_tokens": self.max_new_tokens,
        }  # fmt: skip

    def set_model_defaults(self, model: str, defaults: dict[str, float]) -> None:
        """A model loaded, with its own sampling ``defaults`` (``SamplingParams`` keyword
        arguments; keys it lacks are :data:`NEUTRAL_SAMPLING`'s). The fields show them, unless
        they hold the user's own values for this same model (say, reloaded in another
        precision): those are kept, and Reset puts the model's back."""
        fields = self._sampling_fields()
        keep = model == self._defaults_model and not self.is_model_default()
        self._defaults_model = model
        self._defaults = {
            k: float(v) for k, v in {**NEUTRAL_SAMPLING, **defaults}.items() if k in fields
        }
        if keep:
            self._show_sampling_source()
        else:
            self.reset_sampling()

    def model_defaults(self) -> dict[str, float]:
        return dict(self._defaults)

    def is_model_default(self) -> bool:
        """Whether the sampling fields hold the model's defaults (True before any model)."""
        fields = self._sampling_fields()
        return all(fields[k].holds(v) for k, v in self._defaults.items())

    def reset_sampling(self) -> None:
        """Put the model's default sampling back into the fields."""
        fields = self._sampling_fields()
        changed = not self.is_model_default()
        for key, value in self._defaults.items():
            fields[key].set_value(value)
        self._show_sampling_source()
        if changed:
            self.changed.emit()

    def _show_sampling_source(self) -> None:
        if self._defaults_model is None:
            return
        summary = _describe_sampling(self._defaults)
        mine = not self.is_model_default()
        self.sampling_source.setText("your own values" if mine else "model default")
        self.sampling_source.setToolTip(f"The model's default sampling: {summary}")
        self.reset_sampling_button.setEnabled(mine)
        self.reset_sampling_button.setToolTip(f"Back to the model's default: {summary}")

    def saved_defaults(self) -> dict[str, Any] | None:
        """The model's defaults as :meth:`restore_defaults` takes them (None before a model),
        so the user's own values survive a restart."""
        if self._defaults_model is None:
            return None
        return {"model": self._defaults_model, "defaults": self._defaults}

    def restore_defaults(self, saved: object) -> None:
        """Saved :meth:`saved_defaults`; anything unreadable is left as it is."""
        if isinstance(saved, dict) and isinstance(saved.get("model"), str):
            defaults = saved.get("defaults")
            fields = self._sampling_fields()
            if isinstance(defaults, dict) and set(defaults) == set(fields):
                with contextlib.suppress(TypeError, ValueError):
                    self._defaults = {k: float(v) for k, v in defaults.items()}
                    self._defaults_model = saved["model"]
            self._show_sampling_source()


def _describe_sampling(v: dict[str, float]) -> str:
    """``greedy`` or ``temperature 0.2, top-k 50, top-p 0.9`` (only what is on)."""
    greedy = v.get("temperature", 0) == 0
    parts = ["greedy"] if greedy else [f"temperature {v['temperature']:g}"]
    if not greedy:
        parts += [f"top-k {v['top_k']:g}"] if v.get("top_k", 0) > 0 else []
        parts += [f"top-p {v['top_p']:g}"] if v.get("top_p", 1) < 1 else []
        parts += [f"min-p {v['min_p']:g}"] if v.get("min_p", 0) > 0 else []
    if v.get("repetition_penalty", 1) != 1:
        parts.append(f"repetition penalty {v['repetition_penalty']:g}")
    if "max_new_tokens" in v:
        parts.append(f"at most {v['max_new_tokens']:g} new tokens")
    return ", ".join(parts)
