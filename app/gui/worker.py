"""The engine's thread.

:class:`EngineWorker` is a ``QObject`` that lives in its own ``QThread`` and owns the engine.
The UI talks to it only through :meth:`EngineWorker.post` (a thread-safe command queue) and
listens to its signals, which carry plain data (no tensors). Its loop drains the queue, runs
``engine.step()`` while there is work, coalesces token text to at most one signal per frame
and sends a metrics view a few times a second.

Loading runs on a third, short-lived thread so the current model keeps answering; when the new
one is ready it takes new requests and the old one finishes what it was doing, then is dropped.
A failed load leaves the current model in place. An exception inside ``step()`` ends that
engine's replies with an error and the worker carries on.

Two workers can run side by side (one engine each), which is what an A/B view needs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from PySide6.QtCore import QObject, Signal

from app.loading import LoadSpec as LoadSpec  # re-exported: the UI and tests use it
from app.loading import load_engine as load_engine
from app.loading import needs_download, plan_load
from engine.bench.loadgen import SLO, Driver, LoadGenerator, LoadResult
from engine.bench.loadgen import LoadSpec as LoadGen
from engine.bench.tuning import Setting, Sweep, SweepProgress
from engine.core.engine import LLMEngine
from engine.core.metrics import MetricsSnapshot, RequestMetrics
from engine.core.sampling import SamplingParams
from engine.errors import CancelledError, InfersightError
from engine.kv_cache.paged import CacheWindow
from engine.speculative.speculator import SpeculativeConfig, parse_speculative

log = logging.getLogger(__name__)

FRAME_S = 1 / 60  # token text is flushed at most this often
METRICS_S = 0.25  # metrics while working
IDLE_METRICS_S = 1.0  # metrics while idle
ENGINE_NICENESS = 5  # how much lower than the UI the engine thread (and its helpers) runs
LOAD_JOIN_S = 120.0  # a stopping worker waits this long for a load to notice its cancel
LIVE_RESULT_S = 1.0  # a running live load's figures are recomputed at most this often

# -- what crosses the thread boundary (plain data) ---------------------------------------------


# LoadSpec (what to load) is defined with the one loader every front end uses, app.loading


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    path: str
    precision: str
    device: str  # where it runs: "auto" resolved ("cpu", "cuda" …)
    context_length: int
    num_parameters: int
    weights_bytes: int
    kv_blocks: int
    block_size: int
    kv_memory_mib: float
    requested_device: str = "auto"  # as the user chose it ("auto", "cpu", "cuda:1" …)
    #: the model's own sampling (``SamplingParams`` keyword arguments, generation_config.json)
    default_sampling: dict[str, Any] = field(default_factory=dict, hash=False)
    #: the CPU paths probed and each kind of weight's format and kernel (the load report)
    paths: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Delta:
    """New text of one candidate of one reply; ``finish`` is set on its last delta.

    With speculative decoding ``pieces`` splits ``text`` by how each token came:
    ``(text, kind)`` with ``kind`` one of ``accepted`` (a draft the model accepted),
    ``corrected`` (the model's own token where it rejected a draft), ``bonus`` (its token
    after accepting every draft) or ``""`` (a step without drafts). Their texts joined are
    ``text``; empty when no token of the delta came from a speculative step."""

    tag: str
    candidate: int
    text: str
    finish: str | None = None  # stop | length | cancelled | timeout | error
    error: str | None = None
    pieces: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class ReplyStats:
    """The engine's own figures for one finished candidate."""

    tag: str
    candidate: int
    request_id: str
    model: str
    precision: str
    metrics: RequestMetrics

    @property
    def tokens_per_s(self) -> float | None:
        tpot = self.metrics.time_per_output_token_seconds
        return 1.0 / tpot if tpot else None


@dataclass(frozen=True, slots=True)
class EngineView:
    """One metrics snapshot plus what the app needs to label it."""

    model: ModelInfo
    snapshot: MetricsSnapshot


# -- commands (UI → worker) ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Send:
    tag: str
    messages: list[dict[str, str]]
    sampling: dict[str, Any]
    candidates: int = 1


@dataclass(frozen=True, slots=True)
class Cancel:
    tag: str


@dataclass(frozen=True, slots=True)
class Load:
    spec: LoadSpec


@dataclass(frozen=True, slots=True)
class Configure:
    """Live settings; ``None`` leaves a setting as it is. ``window=False`` turns it off.
    ``clear_prefix_cache`` forgets the current engine's cached prefixes (once)."""

    limits: dict[str, float] | None = None
    window: CacheWindow | bool | None = None
    layer_timing: bool | None = None
    prefix_caching: bool | None = None
    clear_prefix_cache: bool = False


@dataclass(frozen=True, slots=True)
class Speculate:
    """Speculative decoding on the current engine and every engine loaded after it:
    ``text`` as ``--speculative`` takes it (``self:int4-g32+head``, ``lookup``,
    ``model:DIR``; empty: off) with at most ``k`` draft tokens a step. A change that fails
    leaves the speculation in force as it was; either way ``speculation_applied`` says what
    runs."""

    text: str
    k: int = 8


@dataclass(frozen=True, slots=True)
class Pause:
    paused: bool


@dataclass(frozen=True, slots=True)
class Stop:
    pass


@dataclass(frozen=True, slots=True)
class Tune:
    """Start the tuner's load on the current engine: one :class:`LoadGen` spec (live tuning,
    limits moved by :class:`Configure` as it runs) or a sweep over ``settings``. A tune
    already running is stopped first."""

    load: LoadGen | None = None
    settings: tuple[Setting, ...] = ()
    slo: SLO | None = None


@dataclass(frozen=True, slots=True)
class StopTune:
    """Cancel every request of the running tune; its blocks go back at once."""


@dataclass(frozen=True, slots=True)
class TuneStatus:
    """The tuner's progress, a few times a second and once at the end (``running`` False).
    ``load`` is the live load's figures so far; ``sweep`` a sweep's points and position."""

    running: bool
    load: LoadResult | None = None
    sweep: SweepProgress | None = None
    sent: int = 0
    outstanding: int = 0
    message: str = ""


@dataclass(frozen=True, slots=True)
class Resize:
    """A KV pool of ``kv_memory_mib`` for the current model: the same weights behind a new
    pool (no reload), once the replies in progress have finished."""

    kv_memory_mib: float


@dataclass(frozen=True, slots=True)
class _Loaded:
    """A loaded engine; the loader thread has already tried to start ``speculation`` on it
    (the setting when the load began), and ``speculation_error`` says why that failed."""

    engine: LLMEngine
    info: ModelInfo
    spec: LoadSpec
    speculation: tuple[str, int] = ("", 8)
    speculation_error: str = ""


@dataclass(frozen=True, slots=True)
class _Unload:
    """The loader thread asks for the current model to go before it loads ``spec``: the plan
    says both do not fit at once. ``done`` is set once it is gone."""

    spec: LoadSpec
    why: str
    done: threading.Event


@dataclass(frozen=True, slots=True)
class _LoadFailed:
    spec: LoadSpec
    message: str


@dataclass(frozen=True, slots=True)
class Serve:
    """A request from outside (the app's OpenAI-compatible server): queued on the current
    engine beside the chat's, its events handed to ``sink`` on this thread (an error, too)."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    timeout_s: float
    sink: Callable[[Any], None]
    priority: int = 0


@dataclass(frozen=True, slots=True)
class CancelServe:
    request_id: str


Command = (
    Send | Cancel | Load | Configure | Speculate | Pause | Stop | Tune | StopTune | Resize
    | Serve | CancelServe | _Loaded | _LoadFailed | _Unload
)  # fmt: skip

#: ``loader(spec, progress)`` → a loaded engine. ``progress(stage, done, total)``.
Loader = Callable[[LoadSpec, Callable[[str, int, int], None]], LLMEngine]
#: ``planner(spec, reclaimable=N)`` → the memory plan (:func:`app.loading.plan_load`)
Planner = Callable[..., Any]


@dataclass(slots=True)
class _Reply:
    tag: str
    candidate: int
    engine: LLMEngine
    info: ModelInfo


@dataclass(slots=True)
class _Settings:
    limits: dict[str, float] = field(default_factory=dict)
    window: CacheWindow | None = None
    layer_timing: bool = False
    prefix_caching: bool = True
    #: speculative decoding: ``--speculative`` text ("" off) and the most draft tokens a step
    speculation: str = ""
    draft_k: int = 8


class EngineWorker(QObject):
    """Owns one engine at a time (plus, briefly, the one it replaces)."""

    deltas = Signal(list)  # list[Delta], at most once per frame
    reply_stats = Signal(object)  # ReplyStats
    metrics = Signal(object)  # EngineView
    loading = Signal(object)  # LoadSpec
    load_progress = Signal(str, int, int)  # stage, done, total
    loaded = Signal(object)  # ModelInfo
    load_failed = Signal(str)
    unloaded = Signal(str)  # the model went before a load that needs its memory; why
    planned = Signal(object)  # the memory plan of the load starting (engine.loading.MemoryPlan)
    notice = Signal(str)  # something the user should know that is not an error
    error = Signal(str)  # a command that could not be done; the worker goes on
    paused = Signal(bool)
    tune_status = Signal(object)  # TuneStatus
    #: the speculation in force after a Speculate or a new engine: its text ("" off), k, and
    #: why the change asked for failed ("" when it did not)
    speculation_applied = Signal(str, int, str)
    stopped = Signal()

    def __init__(self, loader: Loader = load_engine, planner: Planner = plan_load) -> None:
        super().__init__()
        self._loader = loader
        self._planner = planner
        self._spec: LoadSpec | None = None  # what the current engine was loaded from
        self._unloaded_for: LoadSpec | None = None  # the spec of a model unloaded for a load
        self._resize_to: float | None = None  # a KV pool (MiB) waiting for the replies to end
        self._commands: queue.Queue[Command] = queue.Queue()
        self.engine: LLMEngine | None = None
        self.info: ModelInfo | None = None
        self._retiring: list[LLMEngine] = []
        self._replies: dict[str, _Reply] = {}  # request id → reply
        self._served: dict[str, tuple[LLMEngine, Callable[[Any], None]]] = {}  # from outside
        self._pending: list[Delta] = []
        self._settings = _Settings()
        self._loading: LoadSpec | None = None
        self._load_thread: threading.Thread | None = None
        self._load_cancel = threading.Event()
        self._paused = False
        self._running = False
        self._last_flush = 0.0
        self._last_metrics = 0.0
        self._streams = OwnStreams()  # this worker's CUDA stream on each device it uses
        self._tune: Driver | None = None  # the tuner's load on the current engine
        self._tune_engine: LLMEngine | None = None
        self._live_result: LoadResult | None = None
        self._live_result_at = 0.0

    # -- any thread ------------------------------------------------------------------------
    def post(self, command: Command) -> None:
        self._commands.put(command)

    # -- worker thread ---------------------------------------------------------------------
    def run(self) -> None:
        """The loop; connect it to ``QThread.started``. Returns after a :class:`Stop`."""
        self._running = True
        yield_to_the_ui()
        with self._device_stream():
            while self._running:
                self._drain(wait=not self._has_work())
                if self._running and not self._paused:
                    self._step_all()
                self._flush()
                self._maybe_emit_metrics()
        self._wait_for_loader()
        self._drop_engines()
        self.stopped.emit()

    @contextlib.contextmanager
    def _device_stream(self) -> Iterator[None]:
        """The loop's span. Engine work on CUDA runs on the worker's own stream of each device
        (made current by :meth:`_use_device_stream` as an engine comes in); leaving puts the
        default streams back. Nothing here touches CUDA for a CPU model."""
        try:
            yield
        finally:
            self._streams.restore()

    def _use_device_stream(self, engine: LLMEngine) -> None:
        self._streams.use(str(engine.device))

    def _has_work(self) -> bool:
        if self._paused:
            return False
        return any(e.has_work() for e in self._engines())

    def _idle_wait(self) -> float:
        """How long the loop may wait for a command: until the tuner's next arrival."""
        wait = IDLE_METRICS_S / 4
        if self._tune is not None and not self._paused:
            due = self._tune.next_arrival_in(time.perf_counter())
            if due is not None:
                wait = min(wait, due)
        return wait

    def _engines(self) -> list[LLMEngine]:
        return ([self.engine] if self.engine is not None else []) + self._retiring

    def _drain(self, *, wait: bool) -> None:
        timeout = self._idle_wait() if wait else None
        while True:
            try:
                command = (
                    self._commands.get(timeout=timeout) if wait else self._commands.get_nowait()
                )
            except queue.Empty:
                return
            wait = False
            try:
                self._handle(command)
            except InfersightError as exc:
                self.error.emit(str(exc))
            except Exception as exc:  # a bug: say it, keep the worker alive
                log.exception("command %s failed", type(command).__name__)
                self.error.emit(f"internal error: {type(exc).__name__}: {exc}")

    def _handle(self, command: Command) -> None:
        if isinstance(command, Send):
            self._send(command)
        elif isinstance(command, Cancel):
            self._cancel(command.tag)
        elif isinstance(command, Load):
            self._start_load(command.spec)
        elif isinstance(command, Configure):
            self._configure(command)
        elif isinstance(command, Speculate):
            self._speculate(command)
        elif isinstance(command, Pause):
            if command.paused:  # a paused engine would stretch every figure of the load
                self._end_tune("stopped: the engine was paused")
            self._paused = command.paused
            self._emit_metrics()
            self.paused.emit(command.paused)
        elif isinstance(command, Tune):
            self._start_tune(command)
        elif isinstance(command, StopTune):
            self._end_tune("stopped")
        elif isinstance(command, Stop):
            self._end_tune("the engine stopped")
            for rid in list(self._replies):
                self._replies[rid].engine.cancel(rid)
            self._cancel_served()
            self._running = False
        elif isinstance(command, Resize):
            self._resize_to = command.kv_memory_mib
            self._maybe_resize()
        elif isinstance(command, _Loaded):
            self._spec = command.spec
            self._unloaded_for = None
            tried = (command.speculation, command.speculation_error)
            self._swap_in(command.engine, command.info, tried)
        elif isinstance(command, _LoadFailed):
            self._load_failed(command)
        elif isinstance(command, _Unload):
            self._unload(command)
        elif isinstance(command, Serve):
            self._serve(command)
        elif isinstance(command, CancelServe):
            served = self._served.get(command.request_id)
            if served is not None:
                served[0].cancel(command.request_id)

    def _send(self, command: Send) -> None:
        """Queue every candidate of a reply, or none: a refusal ends the reply with an error."""
        added: list[str] = []
        try:
            engine, info = self.engine, self.info
            if engine is None or info is None:
                raise InfersightError("no model is loaded yet; wait until loading has finished")
            prompt = engine.chat_prompt_ids(command.messages)
            for candidate in range(command.candidates):
                params = dict(command.sampling)
                if params.get("seed") is not None:
                    params["seed"] = int(params["seed"]) + candidate
                rid = engine.add_request(prompt, SamplingParams(**params))
                added.append(rid)
                self._replies[rid] = _Reply(command.tag, candidate, engine, info)
        except InfersightError as exc:
            for rid in added:
                self._replies.pop(rid).engine.cancel(rid)
            for candidate in range(command.candidates):
                self._pending.append(Delta(command.tag, candidate, "", "error", str(exc)))
            raise

    @property
    def running(self) -> bool:
        """Its loop runs (between ``started`` and a :class:`Stop`)."""
        return self._running

    def _serve(self, command: Serve) -> None:
        engine = self.engine
        try:
            if engine is None:
                raise InfersightError("no model is loaded yet; try again once it has loaded")
            engine.add_request(
                command.prompt, command.params, request_id=command.request_id,
                timeout_s=command.timeout_s, priority=command.priority,
            )  # fmt: skip
        except Exception as exc:  # refused: that request fails, nothing else
            command.sink(exc)
            return
        self._served[command.request_id] = (engine, command.sink)

    def _cancel_served(self) -> None:
        for rid, (engine, _) in list(self._served.items()):
            engine.cancel(rid)

    def _cancel(self, tag: str) -> None:
        for rid, reply in list(self._replies.items()):
            if reply.tag == tag:
                reply.engine.cancel(rid)  # its event arrives with that engine's next step

    def _configure(self, command: Configure) -> None:
        """Apply live settings; they are kept (for the next engine too) only if the engine
        took them. While a sweep runs, its settings own the limits: limits asked for then
        are kept and applied when it ends."""
        s = self._settings
        new = _Settings(dict(s.limits), s.window, s.layer_timing, s.prefix_caching)
        if command.limits is not None:
            new.limits.update(command.limits)
        if command.window is not None:
            new.window = command.window if isinstance(command.window, CacheWindow) else None
        if command.layer_timing is not None:
            new.layer_timing = command.layer_timing
        if command.prefix_caching is not None:
            new.prefix_caching = command.prefix_caching
        if self.engine is not None:
            self._apply_settings(self.engine, new, limits=not self._sweeping())
            if command.clear_prefix_cache:
                self.engine.clear_prefix_cache()
        self._settings = new
        self._emit_metrics()

    def _speculate(self, command: Speculate) -> None:
        """Start, change or stop speculative decoding on the current engine (a self-draft or
        draft model loads its weights here, in seconds); kept for the engines loaded later.
        A failure leaves the engine's speculation and the setting as they were."""
        s = self._settings
        try:
            config = speculative_config(command.text, command.k)
            if self.engine is not None:
                self.engine.set_speculation(config)
        except Exception as exc:
            message = _speculation_error(command.text, exc)
            self.speculation_applied.emit(s.speculation, s.draft_k, message)
            self.error.emit(f"{message}; speculative decoding stays {s.speculation or 'off'}")
            return
        s.speculation, s.draft_k = command.text.strip(), command.k
        self.speculation_applied.emit(s.speculation, s.draft_k, "")
        self._emit_metrics()

    def _reapply_speculation(self, engine: LLMEngine, tried: tuple[tuple[str, int], str]) -> None:
        """Give a new engine (a load, a new KV pool) the speculation in force. ``tried``: what
        the loader thread started on it and why that failed. A drafter this engine cannot
        take (a draft model with another tokenizer, say) switches speculation off, never the
        model."""
        s = self._settings
        want = (s.speculation, s.draft_k)
        (attempted, failed) = tried
        error = failed if failed and attempted == want else ""
        if not error and (s.speculation or getattr(engine, "speculator", None) is not None):
            try:  # instant when the loader (or the old engine's pool) has this drafter
                engine.set_speculation(speculative_config(*want))
            except Exception as exc:
                error = _speculation_error(s.speculation, exc)
        if error:
            with contextlib.suppress(Exception):
                engine.set_speculation(None)
            self.error.emit(f"{error}; speculative decoding is off for {engine.name}")
            s.speculation = ""
        self.speculation_applied.emit(s.speculation, s.draft_k, error)

    def _sweeping(self) -> bool:
        return isinstance(self._tune, Sweep) and self._tune_engine is self.engine

    # -- the tuner -------------------------------------------------------------------------
    def _start_tune(self, command: Tune) -> None:
        engine = self.engine
        if engine is None:
            raise InfersightError("no model is loaded yet; wait until loading has finished")
        self._end_tune("replaced by a new run")
        driver: Driver
        if command.settings:
            driver = Sweep(engine, command.settings, slo=command.slo)
        elif command.load is not None:
            driver = LoadGenerator(engine, command.load, slo=command.slo, id_prefix="tune")
        else:
            raise InfersightError("a tune needs a load or sweep settings")
        self._tune, self._tune_engine = driver, engine
        self._emit_tune()

    def _end_tune(self, why: str) -> None:
        """Stop the tune (every request it sent is cancelled) and say so."""
        driver = self._tune
        if driver is None:
            return
        driver.stop()
        self._emit_tune(message=why)
        self._tune_done()

    def _tune_done(self) -> None:
        """The tune is over: a sweep has put its limits back; the user's own apply again."""
        engine, sweep = self._tune_engine, self._sweeping()
        self._tune = self._tune_engine = None
        self._live_result = None
        if sweep and engine is not None:
            try:
                self._apply_settings(engine)
            except InfersightError as exc:
                self.error.emit(f"{exc}; the engine keeps the limits it had before the sweep")

    def _tune_step(self, action: Callable[[Driver], None]) -> None:
        """Run one of the tune's calls; an error ends the tune with its message, never the
        worker."""
        driver = self._tune
        if driver is None:
            return
        try:
            action(driver)
        except Exception as exc:
            log.exception("the tuner's load failed")
            self._end_tune(f"the load stopped: {type(exc).__name__}: {exc}")
            return
        if driver.finished:
            self._emit_tune()
            self._tune_done()

    def _emit_tune(self, message: str = "") -> None:
        driver = self._tune
        if driver is None:
            return
        now = time.perf_counter()
        running = not driver.finished and not message
        if isinstance(driver, Sweep):
            status = TuneStatus(running, sweep=driver.progress(), message=message)
        else:
            assert isinstance(driver, LoadGenerator)
            # A live load's figures cover everything it has done so far: recomputed at most
            # once a second while it runs (its records only grow), always at the end.
            result = self._live_result
            if driver.started is not None and (
                not running or result is None or now - self._live_result_at >= LIVE_RESULT_S
            ):
                result = self._live_result = driver.result(now)
                self._live_result_at = now
            status = TuneStatus(
                running, load=result, sent=driver.sent, outstanding=driver.outstanding,
                message=message,
            )  # fmt: skip
        self.tune_status.emit(status)

    def _apply_settings(
        self, engine: LLMEngine, settings: _Settings | None = None, *, limits: bool = True
    ) -> None:
        s = settings or self._settings
        if s.limits and limits:
            engine.update_limits(**s.limits)  # raises on an invalid limit; nothing changes
        engine.set_window(s.window)
        engine.enable_layer_timing(s.layer_timing)
        engine.set_prefix_caching(s.prefix_caching)

    # -- loading -----------------------------------------------------------------------------
    def _start_load(self, spec: LoadSpec) -> None:
        if self._loading is not None:
            raise InfersightError(
                f"{self._loading.model} ({self._loading.precision}) is still loading; "
                "wait for it to finish before loading another model"
            )
        self._loading = spec
        self.loading.emit(spec)
        self._load_cancel = threading.Event()
        speculation = (self._settings.speculation, self._settings.draft_k)
        self._load_thread = threading.Thread(
            target=self._load_in_background,
            args=(spec, self._reclaimable(), speculation),
            name="infersight-load",
            daemon=True,
        )
        self._load_thread.start()

    def _report_progress(self, stage: str, done: int, total: int) -> None:
        """The loader's progress callback (loader thread); where a Stop cancels the load."""
        if self._load_cancel.is_set():
            raise CancelledError("the load was cancelled because the engine is stopping")
        self.load_progress.emit(stage, done, total)

    def _wait_for_loader(self) -> None:
        """On Stop: cancel a load in flight and wait for its thread, so that nothing of this
        worker runs on after it has stopped (its signals could reach deleted objects)."""
        thread = self._load_thread
        if thread is None:
            return
        self._load_cancel.set()
        thread.join(LOAD_JOIN_S)
        if thread.is_alive():
            log.warning("the model loader did not stop within %.0f s", LOAD_JOIN_S)

    def _reclaimable(self) -> int:
        """Bytes that unloading the current model (and any retiring one) would give back."""
        return sum(e.weights_bytes + e.kv.nbytes for e in self._engines())

    def _load_in_background(
        self, spec: LoadSpec, reclaimable: int = 0, speculation: tuple[str, int] = ("", 8)
    ) -> None:
        try:
            self._plan_and_make_room(spec, reclaimable)
            engine = self._loader(spec, self._report_progress)
            spec_error = _start_speculation(engine, *speculation)
            _finish_loader_work(engine)
            info = model_info(engine, spec)
        except InfersightError as exc:
            self.post(_LoadFailed(spec, str(exc)))
        except Exception as exc:
            log.exception("loading %s failed", spec.model)
            self.post(
                _LoadFailed(spec, f"could not load {spec.model}: {type(exc).__name__}: {exc}")
            )
        else:
            self.post(_Loaded(engine, info, spec, speculation, spec_error))

    def _plan_and_make_room(self, spec: LoadSpec, reclaimable: int) -> None:
        """(Loader thread.) Plan the load and show the plan. When it says the new model fits
        only once the current one is gone, have the worker unload it first, and wait for
        that. A model that would not fit either way is left running: the loader refuses the
        load with the plan's numbers. A model still to be downloaded is planned by the loader
        once it is here (the download reports its own progress)."""
        if needs_download(spec.model):
            return
        try:
            now = self._planner(spec, self._report_progress)
            later = self._planner(spec, reclaimable=reclaimable) if reclaimable else now
        except CancelledError:
            raise
        except InfersightError:  # the loader says what is wrong with this spec
            return
        self.planned.emit(later if not now.fits and later.fits else now)
        if now.fits or not later.fits:
            return
        done = threading.Event()
        self.post(_Unload(spec, now.refusal() or "", done))
        while not done.wait(0.05):
            if self._load_cancel.is_set():
                raise CancelledError("the load was cancelled because the engine is stopping")

    def _unload(self, command: _Unload) -> None:
        """Let the current model go so that ``command.spec`` can load; its replies end
        (cancelled), the conversation stays in the window."""
        info = self.info
        if info is not None:
            self._unloaded_for = self._spec
            for rid in list(self._replies):
                self._replies[rid].engine.cancel(rid)
            self._cancel_served()
            self._step_all()  # the cancellations reach their replies before the engine goes
            self._flush()
            self._end_tune("the model was unloaded")
            self.engine, self.info, self._retiring = None, None, []
            self._free_memory()
            self.unloaded.emit(
                f"Unloaded {info.name} ({info.precision}) first: it and "
                f"{command.spec.model} ({command.spec.precision}) do not fit in memory "
                "together. The conversation is kept."
            )
        command.done.set()

    def _load_failed(self, command: _LoadFailed) -> None:
        """A failed load leaves the previous model running; if it was unloaded for this one,
        it is loaded again."""
        self._loading = None
        self.load_failed.emit(command.message)
        previous, self._unloaded_for = self._unloaded_for, None
        if previous is not None and self.engine is None:
            self.notice.emit(f"Loading {previous.model} ({previous.precision}) again")
            self._start_load(previous)

    def _maybe_resize(self) -> None:
        """Give the current model a KV pool of the size asked for, once it has no replies in
        progress: the same weights behind a new pool; nothing is loaded again."""
        engine, mib = self.engine, self._resize_to
        busy = self._tune is not None or self._retiring  # a tune owns the engine until it ends
        if engine is None or mib is None or engine.has_work() or busy:
            return
        self._resize_to = None
        try:
            resized = engine.with_pool(kv_memory=mib * 2**20)
        except InfersightError as exc:
            self.error.emit(f"{exc}; the KV pool stays as it was")
            return
        except Exception as exc:  # torch out of memory, say: the engine keeps its pool
            log.exception("resizing the KV pool failed")
            self.error.emit(f"could not resize the KV pool ({exc}); it stays as it was")
            return
        self._spec = _with_pool_size(self._spec, mib)
        spec = self._spec or LoadSpec(engine.name, engine.precision.text, str(engine.device), mib)
        del engine
        self.engine = None
        self._free_memory()
        self._settings.limits.pop("kv_blocks", None)
        self._swap_in(resized, model_info(resized, spec))  # it kept the old pool's drafter
        self.notice.emit(
            f"KV pool resized to {resized.kv.nbytes / 2**20:.0f} MiB "
            f"({resized.kv.manager.num_blocks} blocks); the weights were not reloaded"
        )

    def _swap_in(
        self, engine: LLMEngine, info: ModelInfo, tried: tuple[tuple[str, int], str] = (("", 8), "")
    ) -> None:
        self._loading = None
        self._resize_to = None  # a resize asked for the old model: the new one has its pool
        self._end_tune("a new model was loaded")
        self._settings.limits.pop("kv_blocks", None)  # a cap on the old pool; the new has its own
        try:
            self._apply_settings(engine)
        except InfersightError as exc:
            self.error.emit(f"{exc}; the new model runs with default limits")
        self._reapply_speculation(engine, tried)
        if self.engine is not None and self.engine.has_work():
            self._retiring.append(self.engine)  # finishes its replies, then goes
        self._use_device_stream(engine)
        self.engine, self.info = engine, info
        self._free_memory()
        self.loaded.emit(info)
        self._emit_metrics()

    def _drop_engines(self) -> None:
        self.engine, self.info, self._retiring = None, None, []
        while not self._commands.empty():  # e.g. a _Loaded engine that arrived after Stop
            self._commands.get_nowait()
        self._free_memory()

    @staticmethod
    def _free_memory() -> None:
        # No gc.collect() here: a collection in this thread could finalise Qt objects that
        # belong to the UI thread. A dropped engine goes with its last reference; on CUDA the
        # allocator's cached blocks are handed back to the driver.
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # -- stepping ----------------------------------------------------------------------------
    def _step_all(self) -> None:
        if self._tune is not None and self._tune_engine is self.engine:
            self._tune_step(lambda d: d.tick(time.perf_counter()))
        tune = self._tune
        for engine in self._engines():
            if not engine.has_work():
                continue
            try:
                events = engine.step()
            except Exception as exc:
                log.exception("engine step failed")
                self._fail_engine(engine, exc)
                continue
            if tune is not None and engine is self._tune_engine:
                self._tune_step(lambda d: d.observe(events))  # noqa: B023 (called at once)
            for event in events:
                reply = self._replies.get(event.request_id)
                if reply is None:
                    served = self._served.get(event.request_id)
                    if served is not None:
                        if event.finish_reason is not None:
                            del self._served[event.request_id]
                        served[1](event)
                    continue
                kind = event.speculation
                pieces = ((event.text, kind),) if kind and event.text else ()
                self._pending.append(
                    Delta(
                        reply.tag, reply.candidate, event.text, event.finish_reason, pieces=pieces
                    )
                )
                if event.finish_reason is not None:
                    self._finished(event.request_id, reply)
        idle = [e for e in self._retiring if not e.has_work()]
        if idle:
            self._retiring = [e for e in self._retiring if e not in idle]
            self._free_memory()
        if self._resize_to is not None:
            self._maybe_resize()

    def _finished(self, request_id: str, reply: _Reply) -> None:
        del self._replies[request_id]
        metrics = reply.engine.request_metrics(request_id)
        if metrics is not None:
            self.reply_stats.emit(
                ReplyStats(
                    reply.tag, reply.candidate, request_id, reply.info.name,
                    reply.info.precision, metrics,
                )
            )  # fmt: skip

    def _fail_engine(self, engine: LLMEngine, exc: Exception) -> None:
        """End every reply of ``engine`` with an error; its blocks go back to the pool."""
        message = f"the engine failed: {type(exc).__name__}: {exc}"
        if engine is self._tune_engine:
            self._end_tune(message)
        for rid, reply in list(self._replies.items()):
            if reply.engine is engine:
                with contextlib.suppress(Exception):
                    engine.cancel(rid)
                del self._replies[rid]
                self._pending.append(Delta(reply.tag, reply.candidate, "", "error", message))
        for rid, (served_by, sink) in list(self._served.items()):
            if served_by is engine:
                with contextlib.suppress(Exception):
                    engine.cancel(rid)
                del self._served[rid]
                sink(exc)
        with contextlib.suppress(Exception):
            engine.step()  # collect the cancellations so the engine is idle and clean
        self.error.emit(message)

    def _flush(self) -> None:
        now = time.perf_counter()
        if not self._pending:
            return
        if now - self._last_flush < FRAME_S and not any(d.finish for d in self._pending):
            return
        pending, self._pending = self._pending, []
        self._last_flush = now
        self.deltas.emit(_coalesce(pending))

    def _maybe_emit_metrics(self) -> None:
        if self._paused:
            return
        busy = self._has_work()
        if time.perf_counter() - self._last_metrics >= (METRICS_S if busy else IDLE_METRICS_S):
            self._emit_metrics()

    def _emit_metrics(self) -> None:
        self._last_metrics = time.perf_counter()
        if self.engine is None or self.info is None:
            return
        self.metrics.emit(EngineView(self.info, self.engine.metrics()))
        self._emit_tune()


class OwnStreams:
    """A thread's own CUDA stream on each device it works on (the engine worker's, the lab's).

    torch keeps a current stream per device and thread, so once :meth:`use` has run for a
    device everything this thread runs there (steps, a new request's tensors, layer-timing
    events) goes to that stream, whichever engine launches it; engines on one device share
    it. It is created only for a CUDA device: a CPU model creates no CUDA context, and
    ``cuda:1`` work never lands on cuda:1's default stream. The current device is left as it
    was (``set_stream`` alone would change it). Call from the thread itself.
    """

    def __init__(self) -> None:
        self._streams: dict[int, Any] = {}  # CUDA device index → the stream there

    @property
    def by_device(self) -> dict[int, Any]:
        """CUDA device index → this thread's stream there."""
        return dict(self._streams)

    def use(self, device: str) -> None:
        if not device.startswith("cuda"):
            return
        import torch

        index = torch.device(device).index
        index = torch.cuda.current_device() if index is None else index
        if index in self._streams:
            return
        stream = torch.cuda.Stream(device=index)  # type: ignore[no-untyped-call]
        self._streams[index] = stream
        with torch.cuda.device(index):
            torch.cuda.set_stream(stream)

    def restore(self) -> None:
        """Put each device's default stream back (the thread is ending)."""
        if not self._streams:
            return
        import torch

        for index in self._streams:
            with torch.cuda.device(index):
                torch.cuda.set_stream(torch.cuda.default_stream(index))
        self._streams.clear()


def _finish_loader_work(engine: LLMEngine) -> None:
    """Wait, in the loader thread, until its copies to the GPU have landed.

    They ran on the loader thread's current stream of the engine's device; the worker runs the
    engine on a stream of its own, which does not wait for that one, so without this its first
    step could read weights or a KV pool still being written.
    """
    if engine.device.type == "cuda":
        import torch

        torch.cuda.current_stream(engine.device).synchronize()


def yield_to_the_ui() -> None:
    """Lower the calling thread's CPU priority (Linux), so that the UI thread runs first.

    The engine keeps every core busy (torch's intra-op threads, which this thread's first
    parallel region creates and which inherit its priority, as Linux threads do). At equal
    priority the UI thread got under half a core while a reply streamed on a 2-core CPU, and a
    20 ms repaint took 50–60 ms. The UI needs a few percent of one core, so a lower engine
    priority costs the engine almost nothing. Linux only: elsewhere the call would change the
    whole process, so it does nothing there.
    """
    if not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)  # on Linux: this thread alone
        os.setpriority(os.PRIO_PROCESS, tid, min(current + ENGINE_NICENESS, 19))
    except OSError as exc:  # a sandbox that forbids it: run at the same priority
        log.debug("could not lower the engine thread's priority: %s", exc)


def _coalesce(deltas: list[Delta]) -> list[Delta]:
    """One delta per candidate: its texts joined, its finish (always its last event) kept,
    its speculation pieces joined (neighbours of one kind merged)."""
    merged: dict[tuple[str, int], Delta] = {}
    for d in deltas:
        key = (d.tag, d.candidate)
        prev = merged.get(key)
        if prev is not None:
            pieces = _join_pieces(prev, d) if prev.pieces or d.pieces else ()
            d = Delta(d.tag, d.candidate, prev.text + d.text, d.finish, d.error, pieces)
        merged[key] = d
    return list(merged.values())


def _join_pieces(a: Delta, b: Delta) -> tuple[tuple[str, str], ...]:
    """The pieces of ``a`` then ``b``; a delta without pieces is one plain piece."""
    out: list[tuple[str, str]] = []
    for d in (a, b):
        for text, kind in d.pieces or ((d.text, ""),):
            if not text:
                continue
            if out and out[-1][1] == kind:
                out[-1] = (out[-1][0] + text, kind)
            else:
                out.append((text, kind))
    return tuple(out)


def speculative_config(text: str, k: int) -> SpeculativeConfig | None:
    """The engine's config for ``--speculative`` text (``""``: off); raises
    ``InvalidRequestError`` with what to write instead."""
    return parse_speculative(text, k=k) if text.strip() else None


def _speculation_error(text: str, exc: Exception) -> str:
    if isinstance(exc, InfersightError):
        return f"speculative decoding with {text.strip()} could not start: {exc}"
    log.error("starting speculative decoding (%s) failed", text, exc_info=exc)
    return f"speculative decoding with {text.strip()} could not start: {type(exc).__name__}: {exc}"


def _start_speculation(engine: LLMEngine, text: str, k: int) -> str:
    """(Loader thread.) Start speculative decoding on a freshly loaded engine, before it
    serves, so a self-draft's or draft model's weights load while the old model still
    answers. Returns why it failed ("" when it did not); the model loads either way."""
    if not text.strip():
        return ""
    try:
        engine.set_speculation(speculative_config(text, k))
    except Exception as exc:
        return _speculation_error(text, exc)
    return ""


def _with_pool_size(spec: LoadSpec | None, mib: float) -> LoadSpec | None:
    return None if spec is None else dataclasses.replace(spec, kv_memory_mib=mib)


def model_info(engine: LLMEngine, spec: LoadSpec) -> ModelInfo:
    return ModelInfo(
        name=engine.name,
        path=spec.model,
        precision=engine.precision.text,
        device=str(engine.device),
        context_length=engine.context_length,
        num_parameters=engine.num_parameters,
        weights_bytes=engine.weights_bytes,
        kv_blocks=engine.kv.manager.num_blocks,
        block_size=engine.kv.block_size,
        kv_memory_mib=spec.kv_memory_mib,
        requested_device=spec.device,
        default_sampling=dict(engine.default_sampling),
        paths=compute_paths(engine),
    )


def compute_paths(engine: LLMEngine) -> tuple[str, ...]:
    """What the load report says about how the model computes: on a CPU which fast paths the
    probe found and the thread count, whether decode steps run compiled, then each kind of
    weight with its format and path."""
    from engine.hardware.cpu_paths import cpu_paths
    from engine.kernels import paged_decode

    head: tuple[str, ...] = ()
    if engine.device.type == "cpu":
        attention = f"decode attention: {paged_decode.status()}"
        head = (cpu_paths().summary(), engine.threads_report, attention)
    head += (engine.graph.summary(),)
    return head + tuple(f"{g.kind}: {g.form}" for g in engine.weight_groups)
