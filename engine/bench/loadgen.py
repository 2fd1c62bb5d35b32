"""Load for the batching tuner: requests arriving as users would send them, in the ways a
:class:`~engine.bench.load_spec.LoadSpec` describes (closed or open loop).

Prompts come from the chat-like set in ``resources/prompts/chat.json``: single questions, a
document with a question about it, and long conversations (earlier turns stitched from the
set to a sampled length), in shares a :class:`~engine.bench.load_spec.PromptMix` sets; output
lengths are drawn from a clipped log-normal around a mean. Everything is seeded, so a sweep's
settings see the same requests. Requests ignore EOS and run to their drawn length (benchmark
convention).

:class:`LoadGenerator` does not step the engine: its owner calls :meth:`~LoadGenerator.tick`
before each ``engine.step()`` (due requests join) and :meth:`~LoadGenerator.observe` with the
step's events (finished requests are recorded; a closed-loop user sends its next one). So the
CLI (:func:`drive`) and the app's engine thread run the same generator. :meth:`stop` cancels
every request it sent, which hands their blocks back at once.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Protocol

from engine.bench.load_spec import (
    SLO,
    LoadResult,
    LoadSpec,
    Traffic,
    draw_request,
    prompt_set,
    stats_ms,
)
from engine.core.engine import LLMEngine
from engine.core.metrics import RequestMetrics
from engine.core.output import TokenEvent
from engine.core.sampling import SamplingParams
from engine.errors import EngineBusyError, InfersightError, InvalidRequestError


@dataclass(frozen=True, slots=True)
class LoadRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    kind: str  # question | document | conversation


# -- the prompts ----------------------------------------------------------------------------


def request_stream(engine: LLMEngine, spec: LoadSpec) -> Iterator[LoadRequest]:
    """The seeded, endless sequence of requests ``spec`` sends to ``engine``: every request
    fits the model's context and the KV pool's usable blocks."""
    rng = random.Random(spec.seed)
    texts = prompt_set()
    mgr = engine.kv.manager

    def count(text: str) -> int:
        return len(engine.tokenizer.encode(text))

    while True:
        # the room as it is now: the KV cap can change while the load runs
        room = min(engine.context_length, mgr.capacity * mgr.block_size) - 1
        kind, messages, out = draw_request(rng, spec.mix, texts, count, room)
        ids = engine.chat_prompt_ids(messages)[: room - out]
        yield LoadRequest(ids, out, kind)


# -- the generator --------------------------------------------------------------------------


class Driver(Protocol):
    """What an engine loop runs alongside its own requests (:func:`drive`, the app worker)."""

    @property
    def finished(self) -> bool: ...

    def tick(self, now: float) -> None: ...

    def observe(self, events: list[TokenEvent]) -> None: ...

    def next_arrival_in(self, now: float) -> float | None: ...

    def stop(self) -> None: ...


class LoadGenerator:
    """Sends ``spec``'s requests to ``engine`` and records how each one went."""

    def __init__(
        self,
        engine: LLMEngine,
        spec: LoadSpec,
        *,
        slo: SLO | None = None,
        setting: dict[str, Any] | None = None,
        id_prefix: str = "load",
    ) -> None:
        if spec.traffic != Traffic():
            raise InvalidRequestError(
                f"the traffic {spec.traffic.describe()} (routes, streams, faults) is how "
                "requests go to a server: send it to one (tune --endpoint URL, e.g. infersight "
                "serve's), not to the engine in this process"
            )
        self.engine = engine
        self.spec = spec
        self.slo = slo
        self.setting = dict(setting or {})
        self._requests = request_stream(engine, spec)
        self._prefix = id_prefix
        self._rng = random.Random(spec.seed + 1)  # arrival gaps, apart from the prompts
        self._sent = 0
        self._outstanding: set[str] = set()
        self.records: list[RequestMetrics] = []
        self.failed = 0
        self.started: float | None = None
        self.ended: float | None = None
        self.stopped = False
        self._next_arrival: float | None = None
        self._last_arrival: float | None = None
        self._ready = 0  # closed loop: users free to send (below 0: users leaving)
        self._refused = 0  # closed loop: users whose request the full queue refused
        self._retry: LoadRequest | None = None  # the request a refused closed-loop user resends
        self.refused = 0  # times the full waiting queue turned a request away
        self._first_step = (0, 0)

    # -- the protocol ---------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.ended is not None

    @property
    def outstanding(self) -> int:
        return len(self._outstanding)

    @property
    def sent(self) -> int:
        return self._sent

    def _may_send(self, now: float) -> bool:
        spec = self.spec
        if self.stopped or (spec.requests is not None and self._sent >= spec.requests):
            return False
        assert self.started is not None
        return spec.duration_s is None or now - self.started < spec.duration_s

    def _start(self, now: float) -> None:
        self.started = now
        collector = self.engine.collector
        self._first_step = (collector.steps_recorded, collector.batch_size_total)
        if self.spec.mode == "closed":
            self._ready = self.spec.users
        else:
            self._next_arrival = now

    def tick(self, now: float) -> None:
        """Send what is due at ``now``."""
        if self.finished:
            return
        if self.started is None:
            self._start(now)
        if self.spec.mode == "closed":
            while self._ready > 0 and self._may_send(now):
                self._ready -= 1
                self._send(now)
        else:
            while self._next_arrival is not None and self._next_arrival <= now:
                if not self._may_send(self._next_arrival):
                    self._next_arrival = None
                    break
                self._send(self._next_arrival)
                self._last_arrival = self._next_arrival
                self._next_arrival += self._gap()
        self._check_done(now)

    def _gap(self) -> float:
        spec = self.spec
        if spec.mode == "constant":
            return 1.0 / spec.rate
        return self._rng.gammavariate(spec.burstiness, 1.0 / (spec.rate * spec.burstiness))

    def _send(self, due: float) -> None:
        request = self._retry or next(self._requests)
        self._retry = None
        params = SamplingParams(max_new_tokens=request.max_new_tokens, ignore_eos=True)
        rid = f"{self._prefix}-{self._sent}"
        try:
            self.engine.add_request(request.prompt_ids, params, request_id=rid, arrival=due)
        except EngineBusyError:  # the waiting queue is full
            self.refused += 1
            if self.spec.mode == "closed":  # that user sends the same request after a step
                self._refused += 1
                self._retry = request
                return
            self._sent += 1  # open loop: the arrival happened, and it was turned away
            self.failed += 1
            return
        except InfersightError:  # it cannot run here (e.g. the KV cap was lowered under it)
            self._sent += 1
            self.failed += 1
            self._refused += self.spec.mode == "closed"
            return
        self._sent += 1
        self._outstanding.add(rid)

    def observe(self, events: list[TokenEvent]) -> None:
        """Record the requests that finished in a step (other requests' events are ignored)."""
        self._ready += self._refused
        self._refused = 0
        for event in events:
            if event.finish_reason is None or event.request_id not in self._outstanding:
                continue
            self._outstanding.discard(event.request_id)
            metrics = self.engine.request_metrics(event.request_id)
            if event.finish_reason in ("stop", "length") and metrics is not None:
                self.records.append(metrics)
            elif event.finish_reason != "cancelled":
                self.failed += 1
            self._ready += self.spec.mode == "closed"
        self._check_done(time.perf_counter())

    def _check_done(self, now: float) -> None:
        idle = self.ended is None and self.started is not None and not self._outstanding
        if idle and (self.stopped or not self._may_send(now)):
            self.ended = now

    def next_arrival_in(self, now: float) -> float | None:
        """Seconds until the next request is due: 0 before the start and while a closed-loop
        user is ready to send, the time to the next open-loop arrival, ``None`` when nothing
        is due (every user waits for an answer, or the load is over)."""
        if self.finished:
            return None
        if self.started is None or (self._ready + self._refused > 0 and self._may_send(now)):
            return 0.0
        if self._next_arrival is None:
            return None
        return max(0.0, self._next_arrival - now)

    def retarget(self, users: int | None = None, rate: float | None = None) -> None:
        """Turn the load while it runs (the tuner's sliders): closed loop, ``users`` (more
        send at once; fewer: users leave as their requests end); open loop, the ``rate``,
        the next arrival's gap scaled to it."""
        spec = self.spec
        if spec.mode == "closed" and users is not None and users >= 1:
            if self.started is not None:
                self._ready += users - spec.users
            self.spec = replace(spec, users=users)
        elif spec.mode != "closed" and rate is not None and rate > 0 and math.isfinite(rate):
            last, due = self._last_arrival, self._next_arrival
            if last is not None and due is not None:
                self._next_arrival = last + (due - last) * spec.rate / rate
            self.spec = replace(spec, rate=rate)

    def stop(self) -> None:
        """Cancel every request in flight (their blocks go back at once) and send no more."""
        self.stopped = True
        self._next_arrival = None
        for rid in list(self._outstanding):
            self.engine.cancel(rid)
        self._outstanding.clear()
        self._check_done(time.perf_counter())

    # -- figures --------------------------------------------------------------------------
    def result(self, now: float | None = None) -> LoadResult:
        """The figures so far (final once :attr:`finished`)."""
        end = self.ended or now or time.perf_counter()
        start = self.started if self.started is not None else end
        duration = max(end - start, 1e-9)
        done = self.records
        ttft = [m.time_to_first_token_seconds for m in done if m.time_to_first_token_seconds]
        tpot = [m.time_per_output_token_seconds for m in done if m.time_per_output_token_seconds]
        itl = [g for m in done for g in m.inter_token_latency_seconds]
        e2e = [m.e2e_request_latency_seconds for m in done]
        queue = [m.request_queue_time_seconds for m in done if m.request_queue_time_seconds]
        input_tokens = sum(m.prompt_tokens for m in done)
        output_tokens = sum(m.output_tokens for m in done)
        collector = self.engine.collector
        steps = collector.steps_recorded - self._first_step[0]
        batched = collector.batch_size_total - self._first_step[1]
        good: float | None = None
        attained: float | None = None
        if self.slo is not None:
            met = sum(1 for m in done if self.slo.met_by(m))
            good = met / duration
            attained = met / len(done) if done else 0.0
        return LoadResult(
            setting=self.setting, load=self.spec.describe(), completed=len(done),
            failed=self.failed, duration=duration, total_input_tokens=input_tokens,
            total_output_tokens=output_tokens, request_throughput=len(done) / duration,
            output_throughput=output_tokens / duration,
            total_token_throughput=(input_tokens + output_tokens) / duration,
            ttft_ms=stats_ms(ttft), tpot_ms=stats_ms(tpot), itl_ms=stats_ms(itl),
            e2el_ms=stats_ms(e2e), queue_ms=stats_ms(queue),
            preemptions=sum(m.preemptions for m in done),
            mean_batch_size=batched / steps if steps else 0.0,
            mean_tokens_per_request=(input_tokens + output_tokens) / len(done) if done else 0.0,
            slo=self.slo.describe() if self.slo else "", request_goodput=good,
            slo_attainment=attained, stopped=self.stopped, refused=self.refused,
        )  # fmt: skip


def drive(
    engine: LLMEngine,
    driver: Driver,
    *,
    should_stop: Callable[[], bool] = lambda: False,
    on_step: Callable[[], None] = lambda: None,
) -> None:
    """Step ``engine`` until ``driver`` is finished (or ``should_stop`` says so, which stops
    it): the command line's loop. Between arrivals with nothing to do it sleeps."""
    while not driver.finished:
        if should_stop():
            driver.stop()
            break
        now = time.perf_counter()
        driver.tick(now)
        if engine.has_work():
            driver.observe(engine.step())
            on_step()
            if engine.hold_s > 0 and not engine.scheduler.running:
                time.sleep(min(engine.hold_s, 0.01))
            continue
        wait = driver.next_arrival_in(time.perf_counter())
        if wait is not None and not driver.finished:
            time.sleep(min(wait, 0.05))
    engine.step()  # collect the cancellations a stop left, so the engine ends idle
