"""The main window: wires the chat pane, controls and instruments to the engine worker and the
conversation store. With its chat half (:class:`app.gui.chat_window.ChatWindow`: conversations
and the streaming reply) the only place that knows both the widgets and the engine's data."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from PySide6.QtCore import QCoreApplication, QEvent, QSettings, Qt, QThread
from PySide6.QtGui import QCloseEvent, QIcon, QShowEvent
from PySide6.QtWidgets import (
    QFrame,
    QLabel,
    QProgressBar,
    QProgressDialog,
    QScrollArea,
    QTabWidget,
    QWidget,
)

from app.conversations import ChatStore
from app.gui import docks, gc_guard, menus, status
from app.gui.chat_window import ActiveReply, ChatWindow
from app.gui.commands import (
    Configure,
    EngineView,
    Load,
    ModelInfo,
    ReplyStats,
    Resize,
    Speculate,
    Stop,
    TuneStatus,
)
from app.gui.hub_calls import hub_calls
from app.gui.instrument_frames import frame_of
from app.gui.lab import LabController
from app.gui.remote_chat import CALLS, REMOTE_NOTE, RemoteChat
from app.gui.status import model_label, settings_label
from app.gui.tune_router import TuneRouter
from app.gui.worker import LOAD_JOIN_S, EngineWorker, Loader
from app.loading import LoadSpec, available_devices, gpu_count, load_engine, scan_models
from engine.kv_cache.window import CacheWindow
from engine.store.catalog import Discovery
from widgets.ab_view import ABView
from widgets.chat_pane import ChatPane
from widgets.controls import ControlsPanel
from widgets.instruments import InstrumentsPanel
from widgets.model_picker import ModelPicker
from widgets.tuner import TunerView

if TYPE_CHECKING:
    from app.endpoints.client import Endpoint
    from app.gui.serve_host import ServeHost
    from engine.loader.memory_plan import MemoryPlan

log = logging.getLogger(__name__)

RESOURCES = Path(__file__).resolve().parents[2] / "resources"
#: engine threads that outlived their window (see ``MainWindow.shutdown``), kept referenced
_STRAY_THREADS: list[tuple[QThread, EngineWorker]] = []


def style_sheet() -> str:
    path = RESOURCES / "style.qss"
    return path.read_text(encoding="utf-8") if path.is_file() else ""


class MainWindow(ChatWindow):
    # the status bar's, made by app.gui.status.build_status_bar
    status_model: QLabel
    status_settings: QLabel
    status_load: QProgressBar
    load_progress: status.LoadProgress

    def __init__(
        self,
        data_dir: Path,
        *,
        spec: LoadSpec | None = None,
        overrides: Mapping[str, Any] | None = None,
        loader: Loader = load_engine,
    ) -> None:
        super().__init__()
        self.data_dir = data_dir
        self.setWindowTitle("Infersight")
        self.setStyleSheet(style_sheet())
        icon = RESOURCES / "infersight.svg"
        if icon.is_file():
            self.setWindowIcon(QIcon(str(icon)))
        self.store = ChatStore(data_dir / "chats.sqlite3")
        self.settings = QSettings(str(data_dir / "settings.ini"), QSettings.Format.IniFormat)
        self.model: ModelInfo | None = None
        self.recovery = None
        self.loading: LoadSpec | None = None
        self.active: ActiveReply | None = None
        self.conversation_id: int | None = None
        self.last_stats: ReplyStats | None = None
        self._tags = 0
        self._closed = False
        self.picker: ModelPicker | None = None  # made when first opened
        self.serve_host: ServeHost | None = None  # serving this engine on localhost
        self._lab_known: dict[str, str] = {}  # model path → name, for the lab's model lists
        self._lab_set = False

        self.chat = ChatPane()
        self.ab_view = ABView()
        self.tabs = QTabWidget()
        self.tabs.setObjectName("centralTabs")
        self.tabs.addTab(self.chat, "Chat")
        self.tuner = TunerView()
        #: the pages wider than a 1280 px window leaves them scroll, so that they never hold
        #: the side panels narrower than their content
        self.pages: dict[QWidget, QScrollArea] = {}
        for page, title in ((self.ab_view, "A/B lab"), (self.tuner, "Batching tuner")):
            area = self.pages[page] = QScrollArea()
            area.setWidget(page)
            area.setWidgetResizable(True)
            area.setFrameShape(QFrame.Shape.NoFrame)
            self.tabs.addTab(area, title)
        self.setCentralWidget(self.tabs)
        self.controls = ControlsPanel()
        self.instruments = InstrumentsPanel()
        self._docks_arranged = False
        self.controls_dock = docks.make_dock(self, "Controls", self.controls, "controlsDock")
        self.instruments_dock = docks.make_dock(
            self, "Instruments", self.instruments, "instrumentsDock"
        )
        status.build_status_bar(self)
        self.menus = menus.build(self)

        self.worker = EngineWorker(loader)
        self.engine_thread = QThread(self)
        self.engine_thread.setObjectName("infersight-engine")
        self.worker.moveToThread(self.engine_thread)
        self.engine_thread.started.connect(self.worker.run)
        self.worker.stopped.connect(self.engine_thread.quit, Qt.ConnectionType.DirectConnection)
        self._connect()
        self.worker.loaded.connect(self._settle_garbage)
        self.controls.set_devices(available_devices())
        self.controls.set_rank_choices(max(2, gpu_count()))
        self._restore_settings()
        # the restored limits and window; the worker applies them to every engine it loads
        self.worker.post(
            Configure(limits=self.controls.limits(), prefix_caching=self.controls.prefix_cache())
        )
        self._on_window(self.controls.cache_window())
        self._show_settings()
        self.engine_thread.start()
        # the A/B lab: engines of its own on a thread of its own (app/gui/lab_worker.py)
        self.lab = LabController(self.ab_view, self._lab_messages, parent=self)
        self.tabs.currentChanged.connect(self._on_tab)
        self._open_conversations()
        self.load(spec or self._saved_spec(**(overrides or {})))

    def _show_settings(self) -> None:
        c = self.controls
        self.status_settings.setText(
            settings_label(c.sampling(), c.cache_window(), c.prefix_cache())
        )

    def _connect(self) -> None:
        w, chat, controls = self.worker, self.chat, self.controls
        w.deltas.connect(self._on_deltas)
        w.prefill_progress.connect(self._on_prefill)
        w.reply_stats.connect(self._on_stats)
        self.remote = RemoteChat(self.settings, self)  # a server's replies, the same way in
        self.remote.deltas.connect(self._on_deltas)
        self.remote.reply_stats.connect(self._on_stats)
        self.remote.changed.connect(self._on_remote)
        w.loading.connect(lambda _spec: self.remote.use(None))  # a local model: the chat's again
        w.metrics.connect(self._on_metrics)
        w.loading.connect(self._on_loading)
        w.load_progress.connect(self._on_load_progress)
        w.loaded.connect(self._on_loaded)
        w.load_failed.connect(self._on_load_failed)
        # Worker signals go to methods of this window only: a bound QObject method runs in
        # the receiver's (UI) thread, while a plain lambda would run in the worker's.
        w.error.connect(self._on_worker_error)
        w.ranks_failed.connect(self._on_ranks_failed)
        w.notice.connect(self._on_worker_notice)
        w.unloaded.connect(self._on_unloaded)
        w.planned.connect(self._on_planned)
        w.speculation_applied.connect(self._on_speculation)
        w.kv_dtype_applied.connect(self._on_kv_dtype_applied)
        chat.send_requested.connect(self.send)
        chat.stop_requested.connect(self.stop)
        chat.regenerate_requested.connect(self.regenerate)
        chat.edit_requested.connect(self.edit_last)
        chat.new_conversation_requested.connect(self.new_conversation)
        chat.conversation_selected.connect(self.select_conversation)
        chat.system_prompt_edited.connect(self._on_system_prompt)
        chat.rename_requested.connect(self.rename_conversation)
        chat.delete_requested.connect(self.delete_conversation)
        controls.model_requested.connect(lambda path: self.load(self._spec(model=path)))
        controls.browse_requested.connect(self.browse_models)
        controls.precision_requested.connect(lambda p: self.load(self._spec(precision=p)))
        controls.device_requested.connect(lambda d: self.load(self._spec(device=d)))
        controls.tensor_parallel_requested.connect(
            lambda n: self.load(self._spec(tensor_parallel=n))
        )
        controls.reload_requested.connect(lambda: self.load(self._spec()))
        controls.kv_pool_requested.connect(self._on_kv_pool)
        controls.kv_dtype_requested.connect(self._on_kv_dtype)
        controls.limits_changed.connect(lambda limits: self.worker.post(Configure(limits=limits)))
        controls.window_changed.connect(self._on_window)
        controls.serve_toggled.connect(self._on_serve)
        controls.prefix_cache_toggled.connect(
            lambda on: self.worker.post(Configure(prefix_caching=on))
        )
        controls.prefix_cache_clear_requested.connect(
            lambda: self.worker.post(Configure(clear_prefix_cache=True))
        )
        for changed in (controls.sampling_shown, controls.window_changed,
                        controls.prefix_cache_toggled):  # fmt: skip
            changed.connect(lambda *_: self._show_settings())
        controls.speculation_changed.connect(lambda text, k: self.worker.post(Speculate(text, k)))
        controls.invalid_input.connect(lambda text: self.chat.show_notice(text, "warning"))
        self.instruments.layer_timing_toggled.connect(
            lambda on: self.worker.post(Configure(layer_timing=on))
        )
        tuner = self.tuner
        w.tune_status.connect(self._on_tune_status)
        tuner.limits_changed.connect(self._set_limits)
        tuner.apply_limits.connect(self._set_limits)
        # the load, to the engine or to a server the tuner's target names
        self.tune_router = TuneRouter(tuner, self.worker.post, self)

    # -- the batching tuner ------------------------------------------------------------------
    def _set_limits(self, limits: dict[str, float]) -> None:
        """Limits from the tuner (a slider, or a sweep's best setting): the engine takes them
        at its next step, and the controls panel shows the same values."""
        for key, value in limits.items():
            field = getattr(self.controls, key, None)
            if field is not None:
                field.set_value(value)
        self.worker.post(Configure(limits=dict(limits)))

    def _on_tune_status(self, status: TuneStatus) -> None:
        self.tuner.set_status(status.running, status.load, status.sweep, status.message)

    # -- model -------------------------------------------------------------------------------
    def _model_path(self) -> str:
        return (
            self.loading.model if self.loading else (self.model.path if self.model else "default")
        )

    def _precision(self) -> str:
        return self.model.precision if self.model else self.controls.precision_combo.currentText()

    def _device(self) -> str:
        """The device as the user chose it (``auto`` stays ``auto``)."""
        return self.model.requested_device if self.model else self.controls.device()

    def _spec(
        self, *, model: str | None = None, precision: str | None = None,
        device: str | None = None, tensor_parallel: int | None = None,
    ) -> LoadSpec:  # fmt: skip
        if tensor_parallel is None:  # the model's split, else the control's
            tensor_parallel = (
                self.model.tensor_parallel if self.model else self.controls.tensor_parallel()
            )
        return LoadSpec(
            model or self._model_path(),
            precision or self._precision(),
            device or self._device(),
            self._kv_memory_mib(device or self._device()),
            tensor_parallel=tensor_parallel,
            kv_dtype=self.controls.kv_dtype(),
        )

    def _kv_memory_mib(self, device: str) -> float | None:
        """The KV pool of the control; on a GPU None until the user sets one: the load
        profiles the pool, and the control then shows the size it chose."""
        import torch

        gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
        if gpu and self.settings.value("kv_pool_chosen") not in (True, "true"):
            return None
        return self.controls.kv_memory_mib()

    def browse_models(self) -> None:
        """Show the model picker and scan (in the background) for the current precision and
        device; folders added there are kept in the store."""
        if self.picker is None:
            hub = hub_calls(lambda: (self._precision(), self._device()))
            self.picker = ModelPicker(self._scan_models, self.store.model_folders(), self, hub=hub,
                                      endpoints=CALLS)  # fmt: skip
            self.remote.attach(self.picker)
            self.picker.model_requested.connect(lambda path: self.load(self._spec(model=path)))
            self.picker.folder_added.connect(self.store.add_model_folder)
        self.picker.set_target(self._precision(), self._device())
        self.picker.show()
        self.picker.raise_()
        self.picker.refresh()

    def _on_remote(self, endpoint: Endpoint | None) -> None:
        """The chat talks to a server now (or to the local model again)."""
        if endpoint is not None:
            self.status_model.setText(f"{endpoint.name} · served")
            self.status_model.setToolTip("The chat's replies come from this server")
            self.chat.show_notice(REMOTE_NOTE.format(name=endpoint.name), "info")
        elif self.model is not None:
            self.status_model.setText(model_label(self.model))

    def _scan_models(self, folders: list[Path], precision: str, device: str) -> Discovery:
        """(The picker's scan thread.) :func:`scan_models` with what the model loaded now
        would give back: its weights and KV pool."""
        model = self.model
        held = 0 if model is None else model.weights_bytes + int(model.kv_memory_mib * 2**20)
        return scan_models(folders, precision, device, held)

    def load(self, spec: LoadSpec) -> None:
        if self.loading is not None:
            self.chat.show_notice(
                f"{self.loading.model} ({self.loading.precision}) is still loading; "
                "try again when it is ready",
                "warning",
            )
            self.controls.show_model(self._model_path(), self._precision())
            return
        self.loading = spec
        self.worker.post(Load(spec))

    def _on_worker_notice(self, text: str) -> None:
        self.chat.show_notice(text, "info")

    def _on_planned(self, plan: MemoryPlan) -> None:
        """The memory plan of the load starting, beside the model controls."""
        self.controls.show_plan(plan.one_line(), "\n".join(plan.lines()), plan.fits)

    def _on_unloaded(self, text: str) -> None:
        """The model went first, so that the one loading fits; the conversation stays."""
        self.model = None
        self.status_model.setText("no model (loading the next)")
        self.chat.show_notice(text, "info")

    def _on_kv_pool(self, mib: float) -> None:
        self.settings.setValue("kv_pool_chosen", True)  # the user's size from now on
        if self.model is None:  # nothing to resize: the next load takes the new size
            return
        self.worker.post(Resize(mib, self.controls.kv_dtype()))

    def _on_kv_dtype_applied(self, name: str) -> None:
        """What the pool holds after a change asked for: a refused one goes back."""
        self.controls.set_kv_dtype(name)

    def _on_kv_dtype(self, name: str) -> None:
        """A new pool of what the control says, for the current model (the weights stay); the
        next load takes it too."""
        if self.model is None:
            return
        self.worker.post(Resize(self.controls.kv_memory_mib(), name))

    def _on_worker_error(self, text: str) -> None:
        self.chat.show_notice(text)

    def _on_ranks_failed(self, text: str) -> None:
        """A rank of the split model failed: its engine is stopped, the chat stays; offer the
        same model in one process."""
        self.status_model.setText("model stopped: a tensor-parallel rank failed")
        self.recovery = (
            "Reload without tensor parallelism",
            lambda: self.load(self._spec(tensor_parallel=1)),
        )
        self.chat.show_notice(f"{text}. The conversation is kept.", action=self.recovery)

    def _on_speculation(self, text: str, k: int, error: str) -> None:
        """What the engine speculates with now ("" off), after a change or a new engine;
        ``error``: why the change asked for failed (the chat shows it too)."""
        self.controls.show_speculation(text, k, error)

    def _on_loading(self, spec: LoadSpec) -> None:
        name = "the default model" if spec.model == "default" else Path(spec.model).name
        old = (
            f"; {self.model.name} ({self.model.precision}) answers meanwhile" if self.model else ""
        )
        self.status_model.setText(f"loading {name} ({spec.precision})…{old}")

    def _on_load_progress(self, stage: str, done: int, total: int) -> None:
        spec = self.loading
        what = "the default model" if spec is None or spec.model == "default" else spec.model
        self.load_progress.report(stage, done, total, what)

    def _close_progress(self) -> None:
        self.load_progress.close()

    @property
    def progress(self) -> QProgressDialog | None:
        """The pull's dialog while one is shown."""
        return self.load_progress.dialog

    def _on_loaded(self, info: ModelInfo) -> None:
        self.loading = None
        self.recovery = None
        self._close_progress()
        self.model = info
        self.tuner.set_engine(
            {**self.controls.limits(), "kv_blocks": info.kv_blocks}, info.kv_blocks,
            info.block_size,
        )  # fmt: skip
        self.tuner.capacity.set_model(info.path, info.precision)
        self.controls.add_model(info.name, info.path)
        self._lab_models(info)
        self.controls.show_model(
            info.path, info.precision, info.requested_device, info.device, info.tensor_parallel
        )
        self.controls.set_model_defaults(info.path, info.default_sampling)
        with contextlib.suppress(ValueError):  # a profiled pool under the control's minimum
            self.controls.kv_memory.set_value(info.kv_memory_mib)
        self.status_model.setText(model_label(info))
        self.status_model.setToolTip("\n".join(("Model · precision · device", *info.paths)))
        self.settings.setValue("model", info.path)
        self.settings.setValue("precision", info.precision)
        self.settings.setValue("device", info.requested_device)  # "auto" stays "auto"

    def _lab_models(self, info: ModelInfo) -> None:
        """The lab offers the models the chat knows; its A and B start at the first model
        loaded (A fp32, B int8) and are the user's to change from then on."""
        self._lab_known[info.path] = info.name
        self.ab_view.set_models([(name, path) for path, name in self._lab_known.items()])
        if not self._lab_set:
            self._lab_set = True
            self.ab_view.set_current(info.path, info.precision)

    def _on_tab(self, index: int) -> None:
        """Leaving the lab gives its engines back (the chat's model may need the memory); the
        next run there loads them again."""
        if self.tabs.widget(index) is not self.pages[self.ab_view]:
            self.lab.release()

    def _lab_messages(self) -> list[dict[str, str]]:
        """The current conversation as the engine sees it (for "continue the conversation")."""
        return self._engine_messages() if self.conversation_id is not None else []

    def _settle_garbage(self, _info: ModelInfo) -> None:
        """A load leaves many young objects that each later collection would traverse, in the
        middle of a reply: collect once now and freeze the survivors (``app.gc_guard``)."""
        gc_guard.settle()

    def _on_load_failed(self, message: str) -> None:
        spec, self.loading = self.loading, None
        self._close_progress()
        if self.model is not None:
            keep = f" Still using {self.model.name} ({self.model.precision})."
            self.status_model.setText(model_label(self.model))
            self.controls.show_model(
                self.model.path, self.model.precision, self.model.requested_device,
                tensor_parallel=self.model.tensor_parallel,
            )  # fmt: skip
        else:
            keep = " No model is loaded: pick another model or precision in Controls."
            self.status_model.setText("no model")
        what = spec.model if spec else "the model"
        self.chat.show_notice(f"Could not load {what}: {message}.{keep}")

    def _saved_spec(
        self, *, model: str | None = None, precision: str | None = None,
        device: str | None = None, tensor_parallel: int = 1,
    ) -> LoadSpec:  # fmt: skip
        """What the user last loaded (settings.ini) and the KV pool they left, but for what
        the command line gave (``model``, ``precision``, ``device``, ``tensor_parallel``)."""
        model = model or str(self.settings.value("model", "default"))
        precision = precision or str(self.settings.value("precision", "fp32"))
        if device is None:
            device = str(self.settings.value("device", "auto"))
            if device not in available_devices():
                device = "auto"
        return LoadSpec(
            model, precision, device, self._kv_memory_mib(device), tensor_parallel=tensor_parallel,
            kv_dtype=self.controls.kv_dtype(),
        )  # fmt: skip

    def _on_serve(self, on: bool) -> None:
        """Serve this engine on localhost (OpenAI-compatible), or stop serving."""
        if not on:
            self._stop_serving()
            return
        from app.gui.serve_host import ServeHost

        try:
            host = ServeHost(self.worker, int(self.controls.serve_port.value() or 8000))
            host.start()
        except (OSError, RuntimeError) as exc:
            self.chat.show_notice(f"Could not start serving: {exc}", "warning")
            self.controls.show_serving(None)
            return
        self.serve_host = host
        ex = host.examples()
        self.controls.show_serving(f"{host.url}\nkey: {host.key}\n\n{ex['curl']}\n\n{ex['python']}")

    def _stop_serving(self) -> None:
        host, self.serve_host = self.serve_host, None
        if host is not None:
            host.stop()
            self.controls.show_serving(None)

    def _on_window(self, window: tuple[int, int] | None) -> None:
        value: CacheWindow | bool = False if window is None else CacheWindow(*window)
        self.worker.post(Configure(window=value))

    # -- instruments -------------------------------------------------------------------------
    def _on_metrics(self, view: EngineView) -> None:
        s = view.snapshot
        self.tuner.add_snapshot(s)
        self.controls.show_prefix_cache(
            s.prefix_cache_hit_rate if s.prefix_caching else None, s.kv_blocks_cached
        )
        self.controls.show_speculation_stats(
            s.spec_decode_acceptance_rate, s.spec_decode_mean_acceptance_length
        )
        self.instruments.add_frame(frame_of(s))

    # -- settings and shutdown ---------------------------------------------------------------
    def _restore_settings(self) -> None:
        raw = self.settings.value("controls")
        if isinstance(raw, str):
            try:
                self.controls.restore(json.loads(raw))
            except ValueError:
                log.warning("ignoring unreadable saved controls")
        self.chat.mark_speculation.setChecked(
            self.settings.value("mark_speculation") in (True, "true")
        )
        precision = self.settings.value("precision")
        if isinstance(precision, str):
            self.controls.show_model(str(self.settings.value("model", "default")), precision)
        geometry = self.settings.value("geometry")
        if geometry is not None:
            self.restoreGeometry(geometry)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the worker (cancelling what runs) and close the store; idempotent.

        The reply being streamed is kept, every character the worker sent, marked stopped.
        The worker stops after the step in flight, or once a load in flight has noticed its
        cancellation (at most ``LOAD_JOIN_S``); this waits for that, because a ``QThread``
        destroyed while it runs takes the process down with it.
        """
        if self._closed:
            return
        self._closed = True
        self._stop_serving()  # before the worker: its requests end while it still steps
        if self.picker is not None:
            self.picker.shutdown()
        self.lab.request_stop()  # both threads wind down together; the lab is waited for below
        self.tune_router.shutdown(timeout_s)
        self.remote.shutdown()
        if self.engine_thread.isRunning():
            self.worker.post(Stop())
            deadline = time.monotonic() + LOAD_JOIN_S + timeout_s
            while self.engine_thread.isRunning() and time.monotonic() < deadline:
                self.engine_thread.wait(50)
            if self.engine_thread.isRunning():  # a load that never reports progress
                log.warning("the engine thread is still busy; leaving it to the process exit")
                self.engine_thread.setParent(None)  # not destroyed with this window
                _STRAY_THREADS.append((self.engine_thread, self.worker))
            # the text it sent while we waited is still queued for this window: take it
            QCoreApplication.sendPostedEvents(self, QEvent.Type.MetaCall)
        if self.active is not None:  # keep what was streamed
            reply, self.active = self.active, None
            selected, meta = self._reply_record(reply)
            self.store.update_message(
                reply.message_id, content=reply.candidates[selected], status="stopped", meta=meta
            )
        self.lab.shutdown()
        self.settings.setValue("controls", json.dumps(self.controls.state()))
        docks.save(self, self.settings)
        self.settings.setValue("mark_speculation", self.chat.mark_speculation.isChecked())
        self.settings.setValue("geometry", self.saveGeometry())
        self.settings.sync()
        self.store.close()

    def show_page(self, page: QWidget) -> None:
        """Bring the chat, the A/B lab or the tuner to the front."""
        self.tabs.setCurrentWidget(self.pages.get(page, page))

    def showEvent(self, event: QShowEvent) -> None:
        super().showEvent(event)
        if not self._docks_arranged:  # at its first show, when its size is known
            self._docks_arranged = True
            docks.arrange(self, self.controls_dock, self.instruments_dock, self.settings)

    def closeEvent(self, event: QCloseEvent) -> None:
        self.shutdown()
        super().closeEvent(event)
