"""The controls dock: model and precision, sampling, replies per prompt, prefix cache, cache
window, scheduler limits and speculative decoding. Each control says in its tooltip what it
does to memory and speed.

Numbers are typed into :class:`NumberField`s: a value out of range is refused with a message
(the ``invalid`` signal) and the field goes back to its last good value, so the panel always
holds settings that the engine accepts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QGuiApplication
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
    QPushButton,
    QScrollArea,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

PRECISIONS = (
    "fp32",
    "bf16",
    "fp16",
    "int8",
    "int8+head",
    "int4-g32",
    "int4-g32+head",
    "int4-g64",
    "int4-g128",
    "mixed:attn=int8,mlp=int4-g32,head=int8",
)

#: speculative decoding's drafters: (label, ``--speculative`` method; "" is off)
SPECULATION_METHODS = (
    ("Off", ""), ("Self-draft", "self"), ("Prompt lookup", "lookup"), ("Draft model", "model"),
)  # fmt: skip
#: the precisions a self-draft runs the model's own weights at, the cheapest first
SELF_DRAFT_PRECISIONS = ("int4-g32+head", "int8+head", "int4-g64")
DRAFT_K = (1, 16, 8)  # the most draft tokens a step: lowest, highest, default

#: sampling before a model says otherwise: greedy, every filter off (what a model without a
#: generation_config.json gets); a model's own defaults replace these when it loads
NEUTRAL_SAMPLING: dict[str, float] = {
    "temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
    "max_new_tokens": 512,
}  # fmt: skip


class NumberField(QLineEdit):
    """A number with bounds; refuses what is out of range and says why."""

    changed = Signal()  # the user entered a new value
    shown = Signal()  # the value shown changed: by the user or by set_value
    invalid = Signal(str)

    def __init__(
        self,
        name: str,
        value: float | None,
        *,
        lo: float,
        hi: float,
        integer: bool = False,
        lo_open: bool = False,
        optional: bool = False,
        tip: str = "",
    ) -> None:
        super().__init__()
        self.name, self.lo, self.hi = name, lo, hi
        self.integer, self.lo_open, self.optional = integer, lo_open, optional
        self._good = self._format(value)
        self.setText(self._good)
        self.setToolTip(tip)
        if optional:
            self.setPlaceholderText("off")
        self.editingFinished.connect(self._check)
        self.changed.connect(self.shown)

    def _format(self, value: float | None) -> str:
        if value is None:
            return ""
        return str(int(value)) if self.integer else f"{value:g}"

    def _range_text(self) -> str:
        left = "(" if self.lo_open else "["
        return f"{left}{self._format(self.lo)}, {self._format(self.hi)}]"

    def parse(self, text: str) -> float | None:
        """The value of ``text``; raises ValueError with a message for the user."""
        text = text.strip()
        if not text:
            if self.optional:
                return None
            raise ValueError(f"{self.name} needs a value in {self._range_text()}")
        try:
            value = int(text) if self.integer else float(text)
        except ValueError:
            kind = "a whole number" if self.integer else "a number"
            raise ValueError(f"{self.name} must be {kind}, not {text!r}") from None
        too_low = value <= self.lo if self.lo_open else value < self.lo
        if too_low or value > self.hi or value != value:
            raise ValueError(f"{self.name} must be in {self._range_text()}; {text} is out of range")
        return value

    def value(self) -> float | None:
        return self.parse(self._good)

    def set_value(self, value: float | None) -> None:
        self.parse(self._format(value))  # refuses a bad stored value
        self._good = self._format(value)
        self.setText(self._good)
        self.shown.emit()

    def holds(self, value: float | None) -> bool:
        """Whether the field shows ``value`` (as it would display it)."""
        return self._good == self._format(value)

    def _check(self) -> None:
        if self.text() == self._good:
            return
        try:
            value = self.parse(self.text())
        except ValueError as exc:
            self.setText(self._good)
            self.invalid.emit(f"{exc}; kept {self._good or 'off'}")
            return
        self._good = self._format(value)
        self.setText(self._good)
        self.changed.emit()


class ControlsPanel(QScrollArea):
    model_requested = Signal(str)  # "default", a folder or a .gguf file
    browse_requested = Signal()  # open the model picker (models already on this machine)
    precision_requested = Signal(str)
    device_requested = Signal(str)
    reload_requested = Signal()  # a load-time setting changed
    kv_pool_requested = Signal(float)  # a KV pool of this many MiB (no reload of the weights)
    sampling_changed = Signal()
    limits_changed = Signal(dict)
    window_changed = Signal(object)  # (sink, window) or None
    serve_toggled = Signal(bool)  # serve this engine on localhost (the port: serve_port)
    prefix_cache_toggled = Signal(bool)  # reuse cached prompt prefixes, or not
    prefix_cache_clear_requested = Signal()  # forget every cached prefix
    #: speculative decoding as ``--speculative`` takes it (``self:int4-g32+head``, ``lookup``,
    #: ``model:DIR``; "" off) and the most draft tokens a step
    speculation_changed = Signal(str, int)
    invalid_input = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWidgetResizable(True)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        body = QWidget()
        layout = QVBoxLayout(body)
        layout.addWidget(self._model_group())
        layout.addWidget(self._sampling_group())
        layout.addWidget(self._batching_group())
        layout.addWidget(self._speculation_group())
        layout.addWidget(self._serve_group())
        layout.addStretch(1)
        self.setWidget(body)

    # -- groups ------------------------------------------------------------------------------
    def _serve_group(self) -> QGroupBox:
        """Expose this engine as an OpenAI-compatible API on localhost (``infersight serve``'s
        routes, stepped by the app's own worker)."""
        box = QGroupBox("Serve")
        form = QFormLayout(box)
        self.serve_on = QCheckBox("Serve on localhost")
        self.serve_on.setToolTip(
            "Answer OpenAI-compatible requests (/v1/chat/completions, /v1/completions, /metrics) "
            "on 127.0.0.1 with this model, batched with your chat and shown in the instruments"
        )
        self.serve_port = NumberField("port", 8000, lo=1024, hi=65535, integer=True,
                                      tip="The port to listen on (loopback only)")  # fmt: skip
        self.serve_port.invalid.connect(self.invalid_input)
        form.addRow(self.serve_on, self.serve_port)
        self.serve_info = QPlainTextEdit()
        self.serve_info.setReadOnly(True)
        self.serve_info.setPlaceholderText("Off. Switch it on to see the address, key and examples")
        self.serve_info.setMaximumHeight(150)
        self.serve_copy = QPushButton("Copy example")
        self.serve_copy.setEnabled(False)
        self.serve_copy.clicked.connect(
            lambda: QGuiApplication.clipboard().setText(self.serve_info.toPlainText())
        )
        form.addRow(self.serve_info)
        form.addRow(self.serve_copy)
        self.serve_on.toggled.connect(lambda on: self.serve_toggled.emit(on))
        return box

    def show_serving(self, text: str | None) -> None:
        """What the server says while on (address, key, curl and Python examples), or
        ``None`` once it is off (or could not start)."""
        self.serve_info.setPlainText(text or "")
        self.serve_copy.setEnabled(bool(text))
        if text is None and self.serve_on.isChecked():
            self.serve_on.blockSignals(True)
            self.serve_on.setChecked(False)
            self.serve_on.blockSignals(False)

    def _model_group(self) -> QGroupBox:
        box = QGroupBox("Model")
        form = QFormLayout(box)
        self.model_combo = QComboBox()
        self.model_combo.setToolTip(
            "The model to chat with. Weights take memory once; the KV cache grows with context"
        )
        self.model_combo.addItem("SmolLM2-135M-Instruct (default)", "default")
        self.model_combo.activated.connect(
            lambda _: self.model_requested.emit(str(self.model_combo.currentData()))
        )
        open_folder = QPushButton("Folder…")
        open_folder.setToolTip("Load a Hugging Face model folder (config.json, *.safetensors)")
        open_folder.clicked.connect(self._pick_folder)
        open_gguf = QPushButton("GGUF…")
        open_gguf.setToolTip("Import a .gguf file once into the model store, then load it")
        open_gguf.clicked.connect(self._pick_gguf)
        browse = QPushButton("Browse models…")
        browse.setToolTip(
            "Models already on this machine: the model store, the Hugging Face cache, LM "
            "Studio and folders you add, each with whether it fits in memory"
        )
        browse.clicked.connect(self.browse_requested)
        row = QHBoxLayout()
        row.addWidget(open_folder)
        row.addWidget(open_gguf)
        row.addWidget(browse)
        self.precision_combo = QComboBox()
        self.precision_combo.addItems(PRECISIONS)
        self.precision_combo.setToolTip(
            "Weight precision. fp32: exact, 4 bytes a weight. bf16/fp16: half the memory. "
            "int8: a quarter, usually the fastest decode on CPU. int4: an eighth, most loss. "
            "'+head' quantizes the LM head too. Changing it reloads in the background; the "
            "current model answers until the new one is ready"
        )
        self.precision_combo.activated.connect(
            lambda _: self.precision_requested.emit(self.precision_combo.currentText())
        )
        self.device_combo = QComboBox()
        self.set_devices(["auto", "cpu"])
        self.device_combo.setToolTip(
            "Where the engine runs. auto: the GPU when torch sees one, else the CPU (the "
            "status bar shows which). On a GPU the weights and the KV pool live in its memory "
            "(see the memory plot); changing it reloads the model"
        )
        self.device_combo.activated.connect(lambda _: self.device_requested.emit(self.device()))
        form.addRow("Model", self.model_combo)
        form.addRow("", row)
        form.addRow("Precision", self.precision_combo)
        form.addRow("Device", self.device_combo)
        self.plan_label = QLabel("")
        self.plan_label.setWordWrap(True)
        self.plan_label.setObjectName("plan")
        form.addRow("Memory", self.plan_label)
        self.kv_memory = NumberField(
            "KV pool", 512, lo=16, hi=1_048_576, tip="Memory (MiB) set aside for the paged KV "
            "cache: it bounds how many tokens all replies together can hold. Changing it "
            "gives the model a new pool once the replies in progress end; the weights are "
            "not reloaded",
        )  # fmt: skip
        self.kv_memory.invalid.connect(self.invalid_input)
        self.kv_memory.changed.connect(lambda: self.kv_pool_requested.emit(self.kv_memory_mib()))
        form.addRow("KV pool (MiB)", self.kv_memory)
        return box

    def _sampling_group(self) -> QGroupBox:
        box = QGroupBox("Sampling")
        form = QFormLayout(box)
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
        self.stop_strings.editingFinished.connect(self.sampling_changed)
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
        return box

    def _batching_group(self) -> QGroupBox:
        box = QGroupBox("KV cache and scheduler")
        form = QFormLayout(box)
        self.prefix_cache_on = QCheckBox("Prefix cache")
        self.prefix_cache_on.setChecked(True)
        self.prefix_cache_on.setToolTip(
            "Reuses the KV of a prompt's prefix already computed (earlier turns of a chat, a "
            "shared system prompt, the n candidates of one prompt), so only the new tokens are "
            "prefilled. Turn it off to measure what it saves"
        )
        # toggled, not clicked: restore() reports a saved 'off' too, so the engine follows it
        self.prefix_cache_on.toggled.connect(self.prefix_cache_toggled)
        self.prefix_cache_on.toggled.connect(self._show_prefix_cache_state)
        self.clear_prefix_cache = QPushButton("Clear cache")
        self.clear_prefix_cache.setToolTip("Forget every cached prefix; blocks in use are kept")
        self.clear_prefix_cache.clicked.connect(self.prefix_cache_clear_requested)
        self.prefix_cache_label = QLabel()
        self.prefix_cache_label.setToolTip(
            "hits: the share of prompt tokens whose KV came from the cache; blocks cached: "
            "full KV blocks a later prompt can reuse (the pool takes them back when it needs)"
        )
        self._prefix_stats: tuple[float | None, int] = (None, 0)  # the last snapshot's
        self._show_prefix_cache_state()
        row = QHBoxLayout()
        row.addWidget(self.clear_prefix_cache)
        row.addWidget(self.prefix_cache_label, 1)
        form.addRow(self.prefix_cache_on, row)  # the switch as the row's label: compact
        self.window_on = QCheckBox("Keep only sinks + recent tokens")
        self.window_on.setToolTip(
            "A long chat then runs in bounded KV memory: blocks that fall out of the window go "
            "back to the pool. Older context is forgotten (except the first sink tokens)"
        )
        self.window_on.toggled.connect(self._window_edited)
        form.addRow("Cache window", self.window_on)
        self.window_tokens = self._field(
            form,
            "Window tokens",
            "window",
            256,
            lo=16,
            hi=131072,
            integer=True,
            tip="Recent tokens kept in the cache; memory per reply is bounded by this",
            on_change=self._window_edited,
        )
        self.sink_tokens = self._field(
            form,
            "Sink tokens",
            "sink tokens",
            4,
            lo=0,
            hi=1024,
            integer=True,
            tip="First tokens always kept (attention sinks keep long generations stable)",
            on_change=self._window_edited,
        )
        self.max_batch_size = self._field(
            form,
            "Max batch size",
            "max batch size",
            16,
            lo=1,
            hi=256,
            integer=True,
            tip="Sequences decoded together per step. Larger: more tokens/s overall, slower "
            "tokens for each, more KV in use",
            on_change=self._limits_edited,
        )
        self.max_tokens_per_step = self._field(
            form,
            "Max tokens / step",
            "max tokens per step",
            512,
            lo=1,
            hi=65536,
            integer=True,
            tip="Prefill is cut into chunks of this size so a long prompt does not stall "
            "everyone's decoding. Smaller: steadier TPOT, slower TTFT",
            on_change=self._limits_edited,
        )
        self.max_wait_ms = self._field(
            form, "Max wait (ms)", "max wait", 0, lo=0, hi=10000,
            tip="How long a lone request is held hoping for company to batch with (0 = never)",
            on_change=self._limits_edited,
        )  # fmt: skip
        return box

    def _speculation_group(self) -> QGroupBox:
        """A drafter proposes a few tokens, the model checks them all in one step: more
        tokens per step, the same text (greedy) or the same distribution (sampled)."""
        box = QGroupBox("Speculative decoding")
        form = QFormLayout(box)
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
        return box

    def _field(
        self,
        form: QFormLayout,
        label: str,
        name: str,
        value: float | None,
        *,
        on_change: Callable[[], None] | None = None,
        **kwargs: Any,
    ) -> NumberField:
        field = NumberField(name, value, **kwargs)
        field.invalid.connect(self.invalid_input)
        field.changed.connect(on_change or self.sampling_changed.emit)
        form.addRow(label, field)
        return field

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

    def kv_memory_mib(self) -> float:
        return float(self.kv_memory.value() or 512)

    def num_candidates(self) -> int:
        return int(self.candidates.value() or 1)

    def limits(self) -> dict[str, float]:
        return {
            "max_batch_size": int(self.max_batch_size.value() or 1),
            "max_tokens_per_step": int(self.max_tokens_per_step.value() or 1),
            "max_wait_ms": float(self.max_wait_ms.value() or 0.0),
        }

    def cache_window(self) -> tuple[int, int] | None:
        if not self.window_on.isChecked():
            return None
        return int(self.sink_tokens.value() or 0), int(self.window_tokens.value() or 1)

    def prefix_cache(self) -> bool:
        return self.prefix_cache_on.isChecked()

    def show_prefix_cache(self, hit_rate: float | None, cached_blocks: int) -> None:
        """The engine's prefix cache, from a metrics snapshot: ``hit_rate`` the share of
        prompt tokens found cached (None before any prompt), ``cached_blocks`` the full
        blocks held for reuse."""
        self._prefix_stats = (hit_rate, cached_blocks)
        self._show_prefix_cache_state()

    def _show_prefix_cache_state(self, *_: object) -> None:
        on = self.prefix_cache()
        self.clear_prefix_cache.setEnabled(on)
        hit_rate, blocks = self._prefix_stats
        if not on:
            text = "off"
        elif hit_rate is None:
            text = "no prompts yet"
        else:
            text = f"hits {hit_rate:.0%} · {blocks} block{'' if blocks == 1 else 's'} cached"
        self.prefix_cache_label.setText(text)

    # -- speculative decoding ------------------------------------------------------------------
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

    def show_speculation_stats(
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
            self.speculation_changed.emit(*value)
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

    def _limits_edited(self) -> None:
        self.limits_changed.emit(self.limits())

    def _window_edited(self, *_: object) -> None:
        self.window_changed.emit(self.cache_window())

    # -- model list ----------------------------------------------------------------------------
    def add_model(self, label: str, path: str) -> None:
        if self.model_combo.findData(path) < 0:
            self.model_combo.addItem(label, path)

    def device(self) -> str:
        """The device chosen (``auto``, ``cpu``, ``cuda:0`` …), whatever its label says."""
        return str(self.device_combo.currentData() or self.device_combo.currentText())

    def set_devices(self, devices: list[str]) -> None:
        """The devices to offer, ``auto`` first (the item's data is the device's name)."""
        current = self.device() if self.device_combo.count() else "auto"
        self.device_combo.clear()
        for name in devices:
            self.device_combo.addItem(name, name)
        index = self.device_combo.findData(current)
        self.device_combo.setCurrentIndex(max(index, 0))

    def show_plan(self, line: str, detail: str, fits: bool) -> None:
        """The memory plan of the model loading: one line, the whole plan in its tooltip."""
        self.plan_label.setText(line if fits else f"⚠ {line}")
        self.plan_label.setToolTip(detail)

    def show_model(
        self, path: str, precision: str, device: str | None = None, resolved: str | None = None
    ) -> None:
        """The model in use; ``device`` as chosen, ``resolved`` where it runs (``auto`` then
        reads ``auto → cpu``)."""
        index = self.model_combo.findData(path)
        if index >= 0:
            self.model_combo.setCurrentIndex(index)
        if self.precision_combo.findText(precision) < 0:
            self.precision_combo.addItem(precision)
        self.precision_combo.setCurrentText(precision)
        if device is not None:
            if self.device_combo.findData(device) < 0:
                self.device_combo.addItem(device, device)
            self.device_combo.setCurrentIndex(self.device_combo.findData(device))
            auto = self.device_combo.findData("auto")
            if auto >= 0 and device == "auto" and resolved:
                self.device_combo.setItemText(auto, f"auto → {resolved}")

    def _pick_folder(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Model folder")
        if path:
            self.model_requested.emit(path)

    def _pick_gguf(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "GGUF file", filter="GGUF (*.gguf)")
        if path:
            self.model_requested.emit(path)

    # -- the model's default sampling -----------------------------------------------------------
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
            self.sampling_changed.emit()

    def _show_sampling_source(self) -> None:
        if self._defaults_model is None:
            return
        summary = _describe_sampling(self._defaults)
        mine = not self.is_model_default()
        self.sampling_source.setText("your own values" if mine else "model default")
        self.sampling_source.setToolTip(f"The model's default sampling: {summary}")
        self.reset_sampling_button.setEnabled(mine)
        self.reset_sampling_button.setToolTip(f"Back to the model's default: {summary}")

    # -- settings ------------------------------------------------------------------------------
    def fields(self) -> dict[str, NumberField]:
        return {
            "temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
            "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
            "seed": self.seed, "max_new_tokens": self.max_new_tokens,
            "candidates": self.candidates, "window_tokens": self.window_tokens,
            "sink_tokens": self.sink_tokens, "kv_memory": self.kv_memory,
            "max_batch_size": self.max_batch_size,
            "max_tokens_per_step": self.max_tokens_per_step, "max_wait_ms": self.max_wait_ms,
        }  # fmt: skip

    def state(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: f.text() for k, f in self.fields().items()}
        out["stop_strings"] = self.stop_strings.text()
        out["window_on"] = self.window_on.isChecked()
        out["prefix_cache"] = self.prefix_cache()
        out["speculation"] = {
            "method": self.spec_method.currentData(),
            "precision": self.spec_precision.currentText(),
            "folder": self.spec_folder.text(),
            "k": self.spec_k.value(),
        }
        if self._defaults_model is not None:  # so the user's own values survive a restart
            out["model_sampling"] = {"model": self._defaults_model, "defaults": self._defaults}
        return out

    def restore(self, state: dict[str, Any]) -> None:
        """Apply saved settings; anything unreadable keeps its default."""
        for key, f in self.fields().items():
            text = state.get(key)
            if isinstance(text, str):
                with contextlib.suppress(ValueError):
                    f.set_value(f.parse(text))
        if isinstance(state.get("stop_strings"), str):
            self.stop_strings.setText(state["stop_strings"])
        self.window_on.setChecked(state.get("window_on") in (True, "true"))
        # on unless saved off: settings from before the prefix cache have no key
        self.prefix_cache_on.setChecked(state.get("prefix_cache") not in (False, "false"))
        self._restore_speculation(state.get("speculation"))
        saved = state.get("model_sampling")
        if isinstance(saved, dict) and isinstance(saved.get("model"), str):
            defaults = saved.get("defaults")
            fields = self._sampling_fields()
            if isinstance(defaults, dict) and set(defaults) == set(fields):
                with contextlib.suppress(TypeError, ValueError):
                    self._defaults = {k: float(v) for k, v in defaults.items()}
                    self._defaults_model = saved["model"]
            self._show_sampling_source()

    def _restore_speculation(self, saved: object) -> None:
        """Saved speculation (off when absent or unreadable); a change reaches the engine
        through ``speculation_changed``, as the prefix cache switch does."""
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
