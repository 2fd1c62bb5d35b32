"""The controls dock: model and precision, sampling, replies per prompt, prefix cache, cache
window, scheduler limits and speculative decoding. Each control says in its tooltip what it
does to memory and speed.

Numbers are typed into number fields (:class:`~widgets.number_field.NumberField`), which
refuse a value out of range with a message, so the panel always holds settings that the
engine accepts. This module holds the panel and its model, KV cache and scheduler, and serve
groups; the sampling group is :mod:`widgets.sampling_controls`, speculative decoding's
:mod:`widgets.speculation_controls`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
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
    QPlainTextEdit,
    QPushButton,
    QScrollArea,
    QVBoxLayout,
    QWidget,
)

from widgets.number_field import NumberField, add_field
from widgets.sampling_controls import SamplingGroup
from widgets.speculation_controls import SpeculationGroup

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
    "w8a8",
    "w8a8-sq",
    "mixed:attn=int8,mlp=int4-g32,head=int8",
)


#: The KV caches on offer, as (label, ``--kv-dtype``)
KV_DTYPES = [("model's float dtype", "auto"), ("int8", "int8"), ("fp8 (sm_89+)", "fp8")]


class ControlsPanel(QScrollArea):
    model_requested = Signal(str)  # "default", a folder or a .gguf file
    browse_requested = Signal()  # open the model picker (models already on this machine)
    precision_requested = Signal(str)
    device_requested = Signal(str)
    tensor_parallel_requested = Signal(int)  # the model split over this many processes
    reload_requested = Signal()  # a load-time setting changed
    kv_pool_requested = Signal(float)  # a KV pool of this many MiB (no reload of the weights)
    kv_dtype_requested = Signal(str)  # what the KV pool holds: auto, int8 … (no reload either)
    sampling_changed = Signal()
    sampling_shown = Signal()  # the sampling on show changed, by the user or the app
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
        # narrower than its content (a dock dragged small): scrolled, never cut off
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAsNeeded)
        body = QWidget()
        layout = QVBoxLayout(body)
        layout.addWidget(self._model_group())
        self.sampling_group = SamplingGroup()
        self.sampling_group.changed.connect(self.sampling_changed)
        self.sampling_group.shown.connect(self.sampling_shown)
        self.sampling_group.invalid_input.connect(self.invalid_input)
        layout.addWidget(self.sampling_group)
        layout.addWidget(self._batching_group())
        self.speculation_group = SpeculationGroup()
        self.speculation_group.changed.connect(self.speculation_changed)
        layout.addWidget(self.speculation_group)
        layout.addWidget(self._serve_group())
        layout.addStretch(1)
        self.setWidget(body)
        # the groups' widgets, under the panel's names (what the app and the tests read)
        g, sp = self.sampling_group, self.speculation_group
        self.temperature, self.top_k, self.top_p = g.temperature, g.top_k, g.top_p
        self.min_p, self.repetition_penalty, self.seed = g.min_p, g.repetition_penalty, g.seed
        self.max_new_tokens, self.candidates = g.max_new_tokens, g.candidates
        self.stop_strings, self.sampling_source = g.stop_strings, g.sampling_source
        self.reset_sampling_button = g.reset_sampling_button
        self.spec_method, self.spec_precision = sp.spec_method, sp.spec_precision
        self.spec_folder, self.spec_browse = sp.spec_folder, sp.spec_browse
        self.spec_k, self.spec_label = sp.spec_k, sp.spec_label

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
        self.ranks_combo = QComboBox()
        self.set_rank_choices(2)
        self.ranks_combo.setToolTip(
            "Tensor parallelism: the model split over this many processes, one a GPU on CUDA "
            "(NCCL), sharing the cores on a CPU (gloo). For a model larger than one device; "
            "on one CPU it is slower than one process (docs/tensor-parallel.md). Changing it "
            "reloads the model; the memory plot then shows each rank's memory"
        )
        self.ranks_combo.activated.connect(
            lambda _: self.tensor_parallel_requested.emit(self.tensor_parallel())
        )
        form.addRow("Processes", self.ranks_combo)
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
        self.kv_dtype_combo = QComboBox()
        for label, value in KV_DTYPES:
            self.kv_dtype_combo.addItem(label, value)
        self.kv_dtype_combo.setToolTip(
            "What the KV cache holds. int8 keeps each token's K and V rows with a scale of "
            "their own: about half a 16-bit cache's bytes, so twice the context in the same "
            "pool, for a little accuracy (the A/B lab measures how much). fp8 needs a GPU with "
            "native FP8 (sm_89+). Changing it gives the model a new pool once the replies in "
            "progress end; the weights are not reloaded"
        )
        self.kv_dtype_combo.activated.connect(
            lambda _: self.kv_dtype_requested.emit(self.kv_dtype())
        )
        form.addRow("KV dtype", self.kv_dtype_combo)
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

    def _field(
        self,
        form: QFormLayout,
        label: str,
        name: str,
        value: float | None,
        *,
        on_change: Callable[[], None],
        **kwargs: Any,
    ) -> NumberField:
        return add_field(
            form, label, name, value, invalid=self.invalid_input, on_change=on_change, **kwargs
        )

    # -- reading -----------------------------------------------------------------------------
    def sampling(self) -> dict[str, Any]:
        """Keyword arguments for the engine's ``SamplingParams``."""
        return self.sampling_group.sampling()

    def kv_memory_mib(self) -> float:
        return float(self.kv_memory.value() or 512)

    def num_candidates(self) -> int:
        return self.sampling_group.num_candidates()

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
        return self.speculation_group.speculation()

    def show_speculation(self, text: str, k: int, error: str = "") -> None:
        """The worker's answer: the speculation in force (``text`` "" when off) and, when the
        change asked for failed, why; the controls then go back to what runs."""
        self.speculation_group.show_speculation(text, k, error)

    def show_speculation_stats(
        self, acceptance_rate: float | None, mean_acceptance_length: float | None
    ) -> None:
        """From a metrics snapshot: the share of draft tokens accepted and the tokens a
        verifying step yields (None: nothing drafted yet)."""
        self.speculation_group.show_stats(acceptance_rate, mean_acceptance_length)

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

    def tensor_parallel(self) -> int:
        """The processes the model is split over (1: not split)."""
        return int(self.ranks_combo.currentData() or 1)

    def set_rank_choices(self, most: int) -> None:
        """Offer 1 … ``most`` processes (a GPU each on CUDA), keeping the choice made."""
        current = self.tensor_parallel() if self.ranks_combo.count() else 1
        self.ranks_combo.clear()
        for n in range(1, max(most, current, 1) + 1):
            self.ranks_combo.addItem("1 (not split)" if n == 1 else f"{n} (tensor parallel)", n)
        self.ranks_combo.setCurrentIndex(self.ranks_combo.findData(current))

    def show_plan(self, line: str, detail: str, fits: bool) -> None:
        """The memory plan of the model loading: one line, the whole plan in its tooltip."""
        self.plan_label.setText(line if fits else f"⚠ {line}")
        self.plan_label.setToolTip(detail)

    def show_model(
        self, path: str, precision: str, device: str | None = None, resolved: str | None = None,
        tensor_parallel: int = 1,
    ) -> None:  # fmt: skip
        """The model in use; ``device`` as chosen, ``resolved`` where it runs (``auto`` then
        reads ``auto → cpu``); split over ``tensor_parallel`` processes."""
        if self.ranks_combo.findData(tensor_parallel) < 0:
            self.set_rank_choices(tensor_parallel)
        self.ranks_combo.setCurrentIndex(self.ranks_combo.findData(tensor_parallel))
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
    def set_model_defaults(self, model: str, defaults: dict[str, float]) -> None:
        """A model loaded, with its own sampling ``defaults`` (``SamplingParams`` keyword
        arguments); see :meth:`SamplingGroup.set_model_defaults`."""
        self.sampling_group.set_model_defaults(model, defaults)

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

    def kv_dtype(self) -> str:
        """What the KV cache should hold (``--kv-dtype``)."""
        return str(self.kv_dtype_combo.currentData() or "auto")

    def set_kv_dtype(self, name: str) -> None:
        """Show ``name`` as the KV dtype (quietly: nothing is requested)."""
        index = self.kv_dtype_combo.findData(name)
        self.kv_dtype_combo.setCurrentIndex(max(index, 0))

    def state(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: f.text() for k, f in self.fields().items()}
        out["kv_dtype"] = self.kv_dtype()
        out["stop_strings"] = self.stop_strings.text()
        out["window_on"] = self.window_on.isChecked()
        out["prefix_cache"] = self.prefix_cache()
        out["speculation"] = self.speculation_group.state()
        model_sampling = self.sampling_group.saved_defaults()
        if model_sampling is not None:  # so the user's own values survive a restart
            out["model_sampling"] = model_sampling
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
        if isinstance(state.get("kv_dtype"), str):
            self.set_kv_dtype(state["kv_dtype"])
        # on unless saved off: settings from before the prefix cache have no key
        self.prefix_cache_on.setChecked(state.get("prefix_cache") not in (False, "false"))
        self.speculation_group.restore(state.get("speculation"))
        self.sampling_group.restore_defaults(state.get("model_sampling"))
