"""The engine's thread behind ``infersight serve``: :class:`EngineLoop` owns one engine and
steps it while it has work, handing each request's events to its sink; :class:`EngineFront`,
what the routes need of it (or of the app's worker); and the self-test's fixed prompt and the
record of its answers (:class:`SelfTest`)."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from app.server.logs import log, log_event
from app.server.metrics import ServerMetrics
from engine.core.engine import LLMEngine
from engine.core.metrics import RequestMetrics
from engine.core.output import TokenEvent
from engine.core.recovery import StepRecovery
from engine.core.sampling import SamplingParams
from engine.core.sequence import Sequence as Seq

# -- health -------------------------------------------------------------------------------------

SELF_TEST_PROMPT = [{"role": "user", "content": "What is 2 + 2? Answer with one number."}]
SELF_TEST_TOKENS = 8
SELF_TEST_ID = "selftest-"
SELF_TEST_PRIORITY = 100  # ahead of every client request in the queue


@dataclass(slots=True)
class SelfTest:
    """The known answer (the first run's) and how the last run compared."""

    answer: str | None = None
    ok: bool | None = None
    runs: int = 0
    error: str | None = None
    skipped: int = 0  # runs that found the server too busy to answer in time

    def record(self, text: str, error: str | None) -> None:
        self.runs += 1
        if error is None and not text:
            error = "the answer was empty"
        if error is None and self.answer is not None and text != self.answer:
            error = f"answered {text!r}, not {self.answer!r}"
        if error is None and self.answer is None:
            self.answer = text
        self.ok, self.error = error is None, error


# -- the engine's thread ------------------------------------------------------------------------


def _figures(m: RequestMetrics) -> dict[str, Any]:
    """What a finished request's ``end`` line says: its counts and times, not its text."""

    def r(x: float | None) -> float | None:
        return None if x is None else round(x, 4)

    return {
        "request_id": m.request_id, "finish_reason": m.finish_reason,
        "prompt_tokens": m.prompt_tokens, "cached_prompt_tokens": m.cached_prompt_tokens,
        "output_tokens": m.output_tokens, "queue_s": r(m.request_queue_time_seconds),
        "ttft_s": r(m.time_to_first_token_seconds), "tpot_s": r(m.time_per_output_token_seconds),
        "e2e_s": r(m.e2e_request_latency_seconds), "preemptions": m.preemptions,
    }  # fmt: skip


Sink = Callable[[TokenEvent | BaseException], None]


class EngineLoop:
    """Steps one engine on a thread of its own. ``submit`` and ``cancel`` may be called from
    any thread; each request's events go to its sink (called on this thread), and an engine
    error goes to the sink of every request it ended."""

    SNAPSHOT_S = 0.25

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, margin_bytes: int = 0) -> None:
        self.engine = engine
        self.metrics = metrics
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._started: set[str] = set()  # requests that have their first token
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="infersight-engine", daemon=True)
        self._last_snapshot = 0.0
        #: steps the engine, and recovers from a step that runs out of memory the same way as
        #: the app's worker (:mod:`engine.core.recovery`); ``margin_bytes`` is held back from
        #: the allocator and let go then, so that recovering has room (taken again when idle)
        self.recovery = StepRecovery(margin_bytes)
        self._reserve()

    @property
    def margin_bytes(self) -> int:
        return self.recovery.margin_bytes

    @property
    def out_of_memory(self) -> int:
        """Steps that ran out of memory."""
        return self.recovery.out_of_memory

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def submit(
        self, request_id: str, prompt: list[int], params: SamplingParams, timeout_s: float,
        sink: Sink, priority: int = 0,
    ) -> None:  # fmt: skip
        self._commands.put(("add", (request_id, prompt, params, timeout_s, sink, priority)))

    def cancel(self, request_id: str) -> None:
        self._commands.put(("cancel", request_id))

    def stop(self, timeout_s: float = 30.0) -> None:
        """Cancel what runs, let the loop send the cancellations, and end it."""
        self._commands.put(("stop", None))
        self._thread.join(timeout_s)

    def _run(self) -> None:
        engine = self.engine
        while True:
            try:
                kind, arg = self._commands.get(timeout=0.05 if not engine.has_work() else 0)
            except queue.Empty:
                kind, arg = "", None
            if kind == "stop":
                for rid in list(self._sinks):
                    engine.cancel(rid)
                self._step()
                self._snapshot(force=True)
                return
            try:
                if kind == "add":
                    self._add(*arg)
                    continue  # take every command waiting before the next step
                if kind == "cancel":
                    engine.cancel(arg)
                    continue
                if engine.has_work():
                    self._step()
                    if engine.hold_s > 0:
                        time.sleep(min(engine.hold_s, 0.01))
                elif not self.recovery.margin_held:
                    self._reserve()
                self._snapshot()
            except Exception:  # whatever it was, the loop goes on serving
                log.exception("the engine loop failed to %s", kind or "step")

    def _add(
        self, rid: str, prompt: list[int], params: SamplingParams, timeout_s: float, sink: Sink,
        priority: int,
    ) -> None:  # fmt: skip
        try:
            self.engine.add_request(
                prompt, params, request_id=rid, timeout_s=timeout_s, priority=priority
            )
        except Exception as exc:  # refused, or out of memory: this request fails, not the loop
            with contextlib.suppress(Exception):
                self.engine.cancel(rid)  # in case it got half in
            sink(exc)
            return
        self._sinks[rid] = sink

    def _step(self) -> None:
        try:
            stepped = self.recovery.step(self.engine)
        except Exception as exc:  # the step's requests end with the error; serving goes on
            log.exception("engine step failed")
            self.metrics.engine_errors.inc()
            self.metrics.request_errors.inc(len(self._sinks))
            for rid, failed in list(self._sinks.items()):
                self.metrics.forget(rid)
                log_event("error", logging.ERROR, **self._context(rid, exc))
                self.engine.cancel(rid)
                failed(exc)
            self._sinks.clear()
            with contextlib.suppress(Exception):
                self.engine.step()  # collect the cancellations: the engine is idle and clean
            return
        if stepped.failed:  # out of memory, with nothing smaller to try: those requests end
            self.metrics.engine_errors.inc()
            self.metrics.request_errors.inc(len(stepped.failed))
        for rid, error in stepped.failed.items():
            self.metrics.forget(rid)
            ended = self._sinks.pop(rid, None)
            self._started.discard(rid)
            if ended is not None:
                context = self._context(rid, error, stepped.ended.get(rid))
                log_event("error", logging.ERROR, **context)
                ended(error)
        for event in stepped.events:
            sink = self._sinks.get(event.request_id)
            if sink is None:
                continue
            if not event.request_id.startswith(SELF_TEST_ID):
                self.metrics.observe_event(event, self.engine)
            if event.token_id is not None and event.request_id not in self._started:
                self._started.add(event.request_id)
                self._log_start(event.request_id)
            if event.finish_reason is not None:
                self._started.discard(event.request_id)
                del self._sinks[event.request_id]
                finished = self.engine.request_metrics(event.request_id)
                if finished is not None and not event.request_id.startswith(SELF_TEST_ID):
                    self.metrics.observe_request(finished)
                    log_event("end", **_figures(finished))
            sink(event)

    def _log_start(self, rid: str) -> None:
        """A request's first token: how long it queued and how much of its prompt was cached."""
        with contextlib.suppress(KeyError):
            seq = self.engine.sequence(rid)
            t = seq.times
            log_event(
                "first_token", request_id=rid,
                queue_s=None if t.scheduled is None else round(t.scheduled - t.arrival, 4),
                ttft_s=None if t.first_token is None else round(t.first_token - t.arrival, 4),
                cached_prompt_tokens=seq.num_cached,
            )  # fmt: skip

    def _reserve(self) -> None:
        self.recovery.reserve(self.engine.device)

    @property
    def margin_held(self) -> bool:
        return self.recovery.margin_held

    def _context(self, rid: str, exc: BaseException, seq: Seq | None = None) -> dict[str, Any]:
        """A failed request's whole story for its log line: the error, its prompt and output
        so far (as token ids), where it was and how it was sampled. ``seq``: the request as it
        ended, where the engine has let it go already."""
        fields: dict[str, Any] = {"request_id": rid, "error": f"{type(exc).__name__}: {exc}"}
        with contextlib.suppress(KeyError):
            seq = seq or self.engine.sequence(rid)
            fields.update(
                prompt_ids=seq.prompt_ids, output_ids=seq.output_ids, status=seq.status.value,
                num_computed=seq.num_computed, params=repr(seq.params),
            )  # fmt: skip
        return fields

    def _snapshot(self, *, force: bool = False) -> None:
        now = time.perf_counter()
        if force or now - self._last_snapshot >= self.SNAPSHOT_S:
            self._last_snapshot = now
            self.metrics.observe_engine(self.engine.metrics())
            self.metrics.observe_gpu(self.engine.device)


class EngineFront(Protocol):
    """What the routes need of whoever steps the engine: :class:`EngineLoop` for
    ``infersight serve``, the app's worker when the app serves (:mod:`app.gui.serve_host`)."""

    @property
    def engine(self) -> LLMEngine | None: ...
    @property
    def alive(self) -> bool: ...
    @property
    def out_of_memory(self) -> int: ...
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def submit(
        self, request_id: str, prompt: list[int], params: SamplingParams, timeout_s: float,
        sink: Sink, priority: int = 0,
    ) -> None: ...  # fmt: skip
    def cancel(self, request_id: str) -> None: ...
