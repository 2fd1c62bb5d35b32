"""The engine worker's loop (:class:`WorkerLoop`): the commands it takes, the replies and
served requests it steps, the tuner's load, and the text and metrics it sends to the UI.
:class:`app.gui.worker.EngineWorker` builds on it with which engine runs: loading, unloading
for room, resizing the KV pool and speculative decoding."""

from __future__ import annotations

import contextlib
import logging
import queue
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from PySide6.QtCore import QObject, Signal

from app.gui.commands import (
    Cancel,
    CancelServe,
    Command,
    Configure,
    Delta,
    EngineView,
    ModelInfo,
    Pause,
    ReplyStats,
    Retune,
    Send,
    Serve,
    Stop,
    StopTune,
    Tune,
    TuneStatus,
)
from app.gui.threads import FRAME_S, OwnStreams, yield_to_the_ui
from engine.bench.load_spec import LoadResult
from engine.bench.loadgen import Driver, LoadGenerator
from engine.bench.tuning import Sweep
from engine.core.engine import LLMEngine
from engine.core.recovery import Stepped, StepRecovery
from engine.core.sampling import SamplingParams
from engine.errors import InfersightError
from engine.kv_cache.window import CacheWindow
from engine.parallel.executor import RankFailed

log = logging.getLogger(__name__)

#: prompts from this many tokens get a progress bar while they are read (shorter ones take
#: about a step)
PREFILL_SHOWN_FROM = 256

METRICS_S = 0.25  # metrics while working
IDLE_METRICS_S = 1.0  # metrics while idle
LIVE_RESULT_S = 1.0  # a running live load's figures are recomputed at most this often
#: GPU memory the worker holds back while idle and lets go when a step runs out of memory, so
#: that recovering has room (the same as ``infersight serve``'s default ``--oom-margin-mib``)
OOM_MARGIN_MIB = 256


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


class WorkerLoop(QObject):
    """The loop of an engine worker and what it does with the engine it has (the subclass
    :class:`~app.gui.worker.EngineWorker` loads it)."""

    deltas = Signal(list)  # list[Delta], at most once per frame
    #: a reply's prompt being read, before its first token: (tag, tokens read, of all)
    prefill_progress = Signal(str, int, int)
    reply_stats = Signal(object)  # ReplyStats
    metrics = Signal(object)  # EngineView
    error = Signal(str)  # a command that could not be done; the worker goes on
    #: a rank of the tensor-parallel model failed: the engine is stopped, the chat kept (why)
    ranks_failed = Signal(str)
    notice = Signal(str)  # something the user should know that is not an error
    paused = Signal(bool)
    tune_status = Signal(object)  # TuneStatus
    stopped = Signal()

    def __init__(self) -> None:
        super().__init__()
        self._commands: queue.Queue[Command] = queue.Queue()
        self.engine: LLMEngine | None = None
        self.info: ModelInfo | None = None
        self._retiring: list[LLMEngine] = []
        self._replies: dict[str, _Reply] = {}  # request id → reply
        self._prefill_shown: dict[str, int] = {}  # request id → prompt tokens last shown read
        self._served: dict[str, tuple[LLMEngine, Callable[[Any], None]]] = {}  # from outside
        self._pending: list[Delta] = []
        self._settings = _Settings()
        self._paused = False
        self._running = False
        self._last_flush = 0.0
        self._last_metrics = 0.0
        self._streams = OwnStreams()  # this worker's CUDA stream on each device it uses
        self._tune: Driver | None = None  # the tuner's load on the current engine
        self._tune_engine: LLMEngine | None = None
        self._live_result: LoadResult | None = None
        self._live_result_at = 0.0
        #: steps the engines, recovering from a step that runs out of memory as the server
        #: does (:mod:`engine.core.recovery`); its margin is set for a CUDA engine
        self.recovery = StepRecovery()

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
        elif isinstance(command, Configure):
            self._configure(command)
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
        elif isinstance(command, Retune) and isinstance(self._tune, LoadGenerator):
            self._tune.retarget(command.users, command.rate)  # the next tick sends by it
        elif isinstance(command, Stop):
            self._end_tune("the engine stopped")
            for rid in list(self._replies):
                self._replies[rid].engine.cancel(rid)
            self._cancel_served()
            self._running = False
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

    def _wait_for_loader(self) -> None:
        """On Stop, before the engines go: wait for a load in flight (the subclass loads)."""

    def _drop_engines(self) -> None:
        self.engine, self.info, self._retiring = None, None, []
        while not self._commands.empty():  # e.g. a _Loaded engine that arrived after Stop
            self._commands.get_nowait()
        self.recovery.release()
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
    def _report_prefill(self) -> None:
        """For each reply still reading its prompt, how far it got (its chunks read, the
        prefix cache's tokens counted as read); once a step, and only when it moved."""
        for rid, reply in self._replies.items():
            try:
                seq = reply.engine.sequence(rid)
            except KeyError:
                continue
            total = len(seq.prompt_ids)
            if seq.output_ids or total < PREFILL_SHOWN_FROM:
                continue
            done = min(seq.num_computed, total)
            if self._prefill_shown.get(rid) != done:
                self._prefill_shown[rid] = done
                self.prefill_progress.emit(reply.tag, done, total)
        for rid in [r for r in self._prefill_shown if r not in self._replies]:
            del self._prefill_shown[rid]

    def _step_all(self) -> None:
        if self._tune is not None and self._tune_engine is self.engine:
            self._tune_step(lambda d: d.tick(time.perf_counter()))
        tune = self._tune
        for engine in self._engines():
            if not engine.has_work():
                continue
            try:
                stepped = self.recovery.step(engine)
            except Exception as exc:
                log.exception("engine step failed")
                self._fail_engine(engine, exc)
                continue
            if stepped.out_of_memory:
                self._recovered(engine, stepped)
            events = stepped.events
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
        self._report_prefill()
        idle = [e for e in self._retiring if not e.has_work()]
        if idle:
            self._retiring = [e for e in self._retiring if e not in idle]
            self._free_memory()
        current = self.engine
        if current is not None and self._margin_wanted() and not self._has_work():
            self.recovery.reserve(current.device)  # taken again once the engines are idle

    def _margin_wanted(self) -> bool:
        """Whether the out-of-memory margin may be held now (not while a load needs room)."""
        return True

    def _recovered(self, engine: LLMEngine, stepped: Stepped) -> None:
        """A step ran out of memory and went on: the replies it had to end get a message
        saying why and what to do, served requests their error; a lowered prefill chunk is
        told in the chat. A tune's figures would measure the recovery: it stops."""
        if engine is self._tune_engine:
            self._end_tune("stopped: the engine ran out of memory during the load")
        where = "GPU" if engine.device.type == "cuda" else str(engine.device)
        for rid, exc in stepped.failed.items():
            reply = self._replies.pop(rid, None)
            if reply is not None:
                seq = stepped.ended.get(rid)
                size = f" ({seq.num_tokens} tokens)" if seq is not None else ""
                message = (
                    f"{where} memory ran out for this reply{size}, with nothing smaller left to "
                    "try; shorten the conversation (a new chat, or delete earlier messages), "
                    "ask for fewer new tokens, or load the model with a smaller KV pool"
                )
                self._pending.append(Delta(reply.tag, reply.candidate, "", "error", message))
            served = self._served.pop(rid, None)
            if served is not None:
                served[1](exc)
        if stepped.chunk is not None:
            was, now = stepped.chunk
            self.notice.emit(
                f"{engine.name} ran out of memory computing a prompt {was} tokens a step; it "
                f"now computes prompts {now} tokens a step, which needs less memory, and the "
                "reply went on"
            )

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
        if isinstance(exc, RankFailed):  # the ranks are gone: a reload is the way on
            with contextlib.suppress(Exception):
                engine.parallel.close()  # its process group, so that a new split can start
            self.ranks_failed.emit(str(exc))
        else:
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
