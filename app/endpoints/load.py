"""The batching tuner's load against an OpenAI-compatible server: the requests a
:class:`~engine.bench.load_spec.LoadSpec` describes (closed loop: ``users`` each sending the
next as the last ends; open loop: arrivals at ``rate``), drawn as text from the tuner's prompt
set (the server tokenizes them), streamed, and timed by the client's clock. The figures are a
:class:`~engine.bench.load_spec.LoadResult`, as an engine's run gives them, less what only the
engine can see (its queue, batch sizes and preemptions: NaN and 0 here); a failed request is
counted by how it failed, with the server's first line of each kind, and when.

An :class:`EndpointLoad` runs in threads of its own: :meth:`~EndpointLoad.retarget` turns the
users or the rate while it runs (the tuner's sliders), :meth:`~EndpointLoad.live` reads the
last seconds' figures for the live plots. :func:`run_load` runs one to its end.

Requests run to their drawn length (``ignore_eos``, the benchmark convention, which vLLM,
llama.cpp's server and ours take; ``ignore_eos=False`` leaves it out for a server that refuses
fields it does not know). The spec's :class:`~engine.bench.load_spec.Traffic` sends some as
text completions, unstreamed or sampled, and injects faults (:mod:`app.endpoints.traffic`);
each record says how it ended (:attr:`Record.outcome`), what the soak checks. The latency
figures are those of the requests without a fault (a slow reader's pauses are its own).
"""

from __future__ import annotations

import itertools
import math
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, cast

import httpx2

from app.endpoints import traffic
from app.endpoints.client import Endpoint, EndpointError, Streamed, session
from app.endpoints.server_metrics import ServerGauges, scrape
from engine.bench.load_spec import (
    SLO,
    LoadResult,
    LoadSpec,
    Shape,
    draw_request,
    draw_shape,
    prompt_set,
    quantile,
    stats_ms,
)

if TYPE_CHECKING:
    from engine.core.metrics import RequestMetrics

#: a remote server's context is not known here: requests are drawn as if it were this large
ROOM = 1 << 20
#: the longest a closed-loop user waits on a rate limit before its next request
MAX_BACKOFF_S = 30.0
#: how long a closed-loop user waits after a failure the server gave no wait for
BACKOFF_S = 0.5
#: failures that no wait heals: the run ends at the first
FATAL = frozenset({"unreachable", "auth", "model"})
#: the most users (and connections) a run takes, however the sliders move
MAX_USERS = 256
#: the live figures' latency percentiles read the requests finished in this many seconds
LIVE_WINDOW_S = 10.0
#: how often a run reads the server's /metrics
SCRAPE_S = 1.0
#: how long a stop waits for the requests in flight to see it before recording them as cut
GRACE_S = 0.5
#: how a request ended, as the client saw it (:attr:`Record.outcome`)
OUTCOMES = ("whole", "error_event", "refused", "cut", "lost")
#: failures that are a server's refusal (a 4xx), not its failing
REFUSALS = frozenset({"refused", "rate_limited", "auth", "model"})


def tokens_of(text: str) -> int:
    """A text's tokens, estimated (a remote server tokenizes; about four characters each)."""
    return max(1, len(text) // 4)


@dataclass(slots=True)
class Record:
    """One request's outcome: its times (seconds), its tokens, or how it failed."""

    kind: str
    e2e_s: float
    sent: float = 0.0  # time.perf_counter() when it was sent
    input_tokens: int = 0
    output_tokens: int = 0
    time_to_first_token_seconds: float | None = None
    time_per_output_token_seconds: float | None = None
    itl_s: list[float] = field(default_factory=list)
    failure: str | None = None  # an EndpointError's kind
    retry_after: float | None = None  # a rate limit's wait, as the server asked
    max_tokens: int = 0  # the output length asked for
    due: float | None = None  # open loop: when it was meant to be sent (time.perf_counter())
    cut: bool = False  # the client ended it: a stop, or its fault (a disconnect, a cancel)
    shape: Shape = field(default_factory=Shape)  # how it was sent, and its fault
    finish_reason: str | None = None
    status: int = 0  # the HTTP status of a failure (200: an error event in a stream)
    shaped: bool = False  # a failure's body was an OpenAI error

    @property
    def outcome(self) -> str:
        """How it ended (one of :data:`OUTCOMES`): ``whole`` (finished: stop or length),
        ``error_event`` (the server took it and ended it with an error event naming why),
        ``refused`` (a 4xx with OpenAI's error shape), ``cut`` (the client hung up), or
        ``lost``: anything else — a 5xx, a stream dropped or ended without its finish, a
        4xx without the shape, no answer. ``lost`` must never happen."""
        if self.failure is None:
            if self.cut:
                return "cut"
            return "whole" if self.finish_reason in ("stop", "length") else "lost"
        if self.failure == "server" and self.status == 200:
            return "error_event"
        if self.failure in REFUSALS and 400 <= self.status < 500 and self.shaped:
            return "refused"
        return "lost"


@dataclass(slots=True)
class EndpointRun:
    """A run's figures, its requests, and its failures by kind (with each kind's first
    message, as the tuner marks where the server failed)."""

    result: LoadResult
    records: list[Record]
    failures: Counter[str]
    first_failure: dict[str, str]
    started: float = 0.0  # time.perf_counter() at its start
    spec: LoadSpec | None = None  # its load, at the level it ended at
    users: list[tuple[float, float]] = field(default_factory=list)  # (s, load) as turned


def failure_counts(run: EndpointRun) -> str:
    """``4 rate_limited, 1 dropped — <the server's first line>`` ("" where none failed)."""
    if not run.failures:
        return ""
    counts = ", ".join(f"{n} {kind}" for kind, n in sorted(run.failures.items()))
    return f"{counts} — {next(iter(run.first_failure.values()), '')}"


def outcome_counts(run: EndpointRun) -> dict[str, int]:
    """How its requests ended, by fault: ``{"none/whole": 40, "cancel/cut": 3, …}``."""
    ended = Counter((r.shape.fault or "none", r.outcome) for r in run.records)
    return {f"{fault}/{outcome}": n for (fault, outcome), n in sorted(ended.items())}


@dataclass(frozen=True, slots=True)
class LiveFigures:
    """A running load's last seconds, for the live plots: seconds since its start, output
    tokens/s since the last reading (chunks with text, as streamed), TTFT and TPOT p50/p95
    (ms) of the requests finished in :data:`LIVE_WINDOW_S`, requests in flight, done and
    failed so far, and the failures since the last reading (seconds, kind)."""

    time: float
    output_tps: float
    ttft_ms: tuple[float, float]
    tpot_ms: tuple[float, float]
    in_flight: int
    completed: int
    failed: int
    failures: tuple[tuple[float, str], ...]
    load: float  # users or requests/s now
    server: ServerGauges | None = None  # the server's own, where its /metrics says them


class EndpointLoad:
    """``spec``'s load on ``endpoint`` (see the module docstring): :meth:`start` it, turn it
    with :meth:`retarget`, read it with :meth:`live` and :meth:`run`, end it with
    :meth:`stop`."""

    def __init__(
        self, endpoint: Endpoint, spec: LoadSpec, slo: SLO | None = None, *,
        ignore_eos: bool = True, stop: threading.Event | None = None,
    ) -> None:  # fmt: skip
        self.endpoint, self.spec, self.slo, self.ignore_eos = endpoint, spec, slo, ignore_eos
        self._stop = stop or threading.Event()
        self._turn = threading.Condition()  # the users and the rate; woken when they change
        self.users, self.rate = spec.users, spec.rate
        self._rng = random.Random(spec.seed)
        self._shapes = random.Random(f"{spec.seed}/shapes")  # apart from prompts and arrivals
        self._texts = prompt_set()
        self._records: list[Record] = []
        self._messages: dict[str, str] = {}
        self._failed_at: list[tuple[float, str]] = []
        self._loads: list[tuple[float, float]] = []
        self._sent = self._streamed = self._done = 0
        #: the requests in flight, by number: what a stop records as cut if they do not end
        self._flying: dict[int, tuple[str, Streamed, int, float | None, Shape]] = {}
        self._keys = 0
        self._read = (0.0, 0, 0)  # the last live reading: its time, chunks and failures
        self._threads: list[threading.Thread] = []
        self._driver: threading.Thread | None = None
        self._client: httpx2.Client | None = None
        self.started = self.ended = 0.0
        self.server: ServerGauges | None = None  # the server's own figures, last read
        self._stopped = False

    # -- control ----------------------------------------------------------------------------
    def start(self) -> EndpointLoad:
        """Start sending in threads of its own; returns at once."""
        self.started = time.perf_counter()
        self._loads.append((0.0, self.spec.load))
        self._client = session(self.endpoint, MAX_USERS)
        self._driver = threading.Thread(target=self._drive, daemon=True, name="infersight-load")
        self._driver.start()
        threading.Thread(target=self._watch, daemon=True, name="infersight-metrics").start()
        return self

    def retarget(self, users: int | None = None, rate: float | None = None) -> None:
        """Turn the load while it runs: closed loop, ``users`` (more start at once, fewer
        stop as their requests end); open loop, the ``rate`` from the next arrival."""
        with self._turn:
            if users is not None:
                self.users = max(1, min(MAX_USERS, int(users)))
            if rate is not None and rate > 0 and math.isfinite(rate):
                self.rate = float(rate)
            closed = self.spec.mode == "closed"
            now = self.users if closed else self.rate
            if self.started and not self.ended:
                self._loads.append((time.perf_counter() - self.started, float(now)))
            self._turn.notify_all()
        if closed and self.started and not self._stop.is_set():
            self._add_users()

    def stop(self) -> None:
        """Send no more and end the requests in flight (their connections close: a cancel)."""
        self._stop.set()
        with self._turn:
            self._turn.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the run to end (True: it has)."""
        if self._driver is not None:
            self._driver.join(timeout)
        return bool(self.ended)

    @property
    def finished(self) -> bool:
        return bool(self.ended)

    # -- readings ---------------------------------------------------------------------------
    def live(self) -> LiveFigures:
        """The figures since the last call (see :class:`LiveFigures`)."""
        now = time.perf_counter()
        with self._turn:
            last_t, last_chunks, last_failed = self._read
            self._read = (now, self._streamed, len(self._failed_at))
            chunks = self._streamed - last_chunks
            recent = []  # records are kept in the order they ended: read back to the window
            for r in reversed(self._records):
                if r.sent + r.e2e_s < now - LIVE_WINDOW_S:
                    break
                if r.failure is None and not r.shape.fault:  # (a slow reader's own pauses)
                    recent.append(r)
            done, failed = self._done, len(self._failed_at)
            fresh = tuple(self._failed_at[last_failed:])
            in_flight, load = (
                len(self._flying),
                self.users if self.spec.mode == "closed" else self.rate,
            )
        since = now - (last_t or self.started)
        ttft = sorted(r.time_to_first_token_seconds for r in recent
                      if r.time_to_first_token_seconds is not None)  # fmt: skip
        tpot = sorted(r.time_per_output_token_seconds for r in recent
                      if r.time_per_output_token_seconds is not None)  # fmt: skip
        return LiveFigures(
            now - self.started, chunks / since if since > 0 else 0.0,
            (_pct(ttft, 0.5), _pct(ttft, 0.95)), (_pct(tpot, 0.5), _pct(tpot, 0.95)),
            in_flight, done, failed, fresh, float(load), self.server,
        )  # fmt: skip

    def ended_since(self, since: float) -> list[Record]:
        """The requests that ended at or after ``since`` (``time.perf_counter()``), in the
        order they ended."""
        with self._turn:
            i = len(self._records)
            while i and self._records[i - 1].sent + self._records[i - 1].e2e_s >= since:
                i -= 1
            return self._records[i:]

    def run(self) -> EndpointRun:
        """The figures of the requests ended so far (all of them once it has ended)."""
        with self._turn:
            records, messages = list(self._records), dict(self._messages)
            loads = list(self._loads)
        end = self.ended or time.perf_counter()
        spec = replace(self.spec, users=self.users, rate=self.rate)  # as turned, if it was
        run = _run(self.endpoint, spec, self.slo, records, messages, end - self.started,
                   self._stopped)  # fmt: skip
        run.started, run.users, run.spec = self.started, loads, spec
        return run

    # -- the threads ------------------------------------------------------------------------
    def _watch(self) -> None:
        """Read the server's /metrics every :data:`SCRAPE_S` while the run lasts (not at all
        where its first page has none of the figures)."""
        with session(self.endpoint, 1) as client:
            while not self.ended:
                read = scrape(self.endpoint, client)
                if read is None and self.server is None:
                    return  # no such figures on its page
                self.server = read or self.server  # a read that failed keeps the last one
                if self._stop.wait(SCRAPE_S):
                    return

    def _over(self) -> bool:
        """No request is to be sent any more: stopped, or every one sent, or past the run's
        duration (under the lock)."""
        spec = self.spec
        over = spec.requests is not None and self._sent >= spec.requests
        end = None if spec.duration_s is None else self.started + spec.duration_s
        return self._stop.is_set() or over or (end is not None and time.perf_counter() > end)

    def _next_request(self) -> tuple[str, list[dict[str, str]], int, Shape] | None:
        with self._turn:
            if self._over():
                return None
            self._sent += 1
            kind, messages, out = draw_request(self._rng, self.spec.mix, self._texts,
                                               tokens_of, ROOM)  # fmt: skip
            return kind, messages, out, draw_shape(self._shapes, self.spec.traffic)

    def _drive(self) -> None:
        try:
            if self.spec.mode == "closed":
                self._add_users()
            else:
                self._arrivals()
            stopped_at = None
            while True:  # users may be added while the first ones run
                with self._turn:
                    pending = [t for t in self._threads if t.is_alive()]
                if not pending:
                    break
                pending[0].join(0.1)
                if not self._stop.is_set():
                    continue
                if stopped_at is None:  # a stop ends the requests in flight: each at its
                    stopped_at = time.perf_counter()  # next chunk, its connection closed
                elif time.perf_counter() - stopped_at > GRACE_S:
                    self._give_up()  # still waiting for a byte: cut where they are
                    break
            self._stopped = self._stop.is_set()  # a stop, or a failure no wait heals
        finally:
            self.ended = time.perf_counter()
            self._stop.set()  # an interrupt stops the users and the streams in flight too
            if self._client is not None:
                self._client.close()

    def _give_up(self) -> None:
        """Record the requests still in flight as cut where they are (a server still
        preparing its first byte): the run ends now; their threads, left to end when the
        server sends (a stop makes them close the connection then), record nothing more."""
        with self._turn:
            for kind, reply, out, due, shape in self._flying.values():
                record = self._record(kind, reply, out, shape, cut=True)
                record.max_tokens, record.due = out, due
                self._records.append(record)
            self._flying.clear()

    def _add_users(self) -> None:
        with self._turn:
            while len(self._threads) < self.users and not self._stop.is_set():
                t = threading.Thread(target=self._user, args=(len(self._threads),), daemon=True)
                self._threads.append(t)
                t.start()

    def _user(self, index: int) -> None:
        while True:
            with self._turn:  # a user beyond the count waits until it is needed again
                while index >= self.users and not self._over():
                    self._turn.wait(0.1)  # a duration runs out without a notify
            if (request := self._next_request()) is None:
                return
            record = self._send(*request)
            asked = record.shape.fault and record.outcome == "refused"  # the fault's refusal
            if record.failure is not None and not asked:  # wait as the server asked, or a bit
                wait = BACKOFF_S if record.retry_after is None else record.retry_after
                self._stop.wait(min(wait, MAX_BACKOFF_S))

    def _arrivals(self) -> None:
        gaps = random.Random(self.spec.seed + 1)
        shape, last, unit = self.spec.burstiness, self.started, 0.0  # the first at the start
        while (request := self._next_request()) is not None:
            with self._turn:  # the gap is a unit one over the rate in force, which may turn
                while not self._stop.is_set():
                    due = last + unit / self.rate
                    if (left := due - time.perf_counter()) <= 0:
                        break
                    self._turn.wait(min(left, 0.1))
                if self._stop.is_set():
                    return
                deadline = self.spec.duration_s
                if deadline is not None and due > self.started + deadline:  # after its end
                    return
                t = threading.Thread(target=self._send, args=(*request, due), daemon=True)
                self._threads.append(t)
            t.start()
            last = due
            unit = 1.0 if self.spec.mode == "constant" else gaps.gammavariate(shape, 1 / shape)

    def _send(
        self, kind: str, chat: list[dict[str, str]], out: int, shape: Shape,
        due: float | None = None,
    ) -> Record:  # fmt: skip
        reply = Streamed(time.perf_counter())
        with self._turn:
            self._keys += 1
            key = self._keys
            self._flying[key] = (kind, reply, out, due, shape)
        record = self._request(kind, chat, out, shape, reply)
        record.max_tokens, record.due = out, due
        with self._turn:
            if self._flying.pop(key, None) is None:  # a stop recorded it already, cut
                return record
            self._records.append(record)
            self._done += record.failure is None and not record.cut
            if not shape.stream and record.failure is None:  # its tokens came at once
                self._streamed += record.output_tokens
            if record.failure is not None:
                self._failed_at.append((record.sent + record.e2e_s - self.started,
                                        record.failure))  # fmt: skip
        return record

    def _chunk(self) -> bool:
        """A streamed chunk came: counted; False where a stop ends the requests in flight."""
        with self._turn:
            self._streamed += 1
        return not self._stop.is_set()

    def _request(
        self, kind: str, chat: list[dict[str, str]], out: int, shape: Shape, reply: Streamed
    ) -> Record:
        endpoint, client = self.endpoint, self._client
        assert client is not None  # started
        try:
            cut = traffic.send(endpoint, client, chat, out, shape, reply,
                               temperature=self.spec.traffic.temperature,
                               ignore_eos=self.ignore_eos, on_chunk=self._chunk)  # fmt: skip
        except Exception as exc:  # a user thread must end in a record
            answered = isinstance(exc, EndpointError) and exc.status  # the server's own words
            if self._stop.is_set() and not answered:  # its connection closed by a stop: cut
                return self._record(kind, reply, out, shape, cut=True)
            if not isinstance(exc, EndpointError):
                exc = EndpointError("protocol", f"{endpoint.name}: {exc!r}")
            return self._failed(kind, reply, shape, exc)
        return self._record(kind, reply, out, shape, cut=cut)

    def _record(self, kind: str, reply: Streamed, out: int, shape: Shape, *, cut: bool) -> Record:
        """A reply's record, whole or as far as a stop let it come."""
        timed = [c.at for c in reply.chunks if c.text]
        usage = reply.usage or {}
        # the server's count; without one, the drawn length where the reply ran to it (a
        # server may stream several tokens a chunk), else the chunks'
        tokens = reply.tokens
        if not isinstance(usage.get("completion_tokens"), int) and reply.finish_reason == "length":
            tokens = out
        tpot = (timed[-1] - timed[0]) / (tokens - 1) if len(timed) > 1 and tokens > 1 else None
        return Record(
            kind, time.perf_counter() - reply.started, reply.started,
            input_tokens=int(usage.get("prompt_tokens") or 0), output_tokens=tokens,
            time_to_first_token_seconds=reply.ttft_s, time_per_output_token_seconds=tpot,
            itl_s=[b - a for a, b in itertools.pairwise(timed)], cut=cut, shape=shape,
            finish_reason=reply.finish_reason,
        )  # fmt: skip

    def _failed(self, kind: str, reply: Streamed, shape: Shape, exc: EndpointError) -> Record:
        how = exc.kind
        with self._turn:
            self._messages.setdefault(how, str(exc))
        if how in FATAL:  # no wait heals it: the run ends
            self.stop()
        return Record(kind, time.perf_counter() - reply.started, reply.started, failure=how,
                      retry_after=exc.retry_after, shape=shape, status=exc.status,
                      shaped=exc.shaped)  # fmt: skip


def run_load(
    endpoint: Endpoint, spec: LoadSpec, slo: SLO | None = None, *,
    stop: threading.Event | None = None, ignore_eos: bool = True,
) -> EndpointRun:  # fmt: skip
    """Send ``spec``'s load to ``endpoint`` until its requests are sent (or its duration is
    over, or ``stop`` is set), wait for the ones in flight, and give the figures."""
    load = EndpointLoad(endpoint, spec, slo, ignore_eos=ignore_eos, stop=stop).start()
    try:
        load.wait()
    finally:  # an interrupt (Ctrl-C) stops the users and the streams in flight too
        load.stop()
        load.wait()
    return load.run()


def _pct(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of sorted seconds, in ms (NaN: none)."""
    return 1e3 * quantile(ordered, q) if ordered else math.nan


def _run(
    endpoint: Endpoint, spec: LoadSpec, slo: SLO | None, records: list[Record],
    messages: dict[str, str], duration: float, stopped: bool,
) -> EndpointRun:  # fmt: skip
    # a request a stop cut is neither done nor failed (as a local engine's cancelled ones)
    done = [r for r in records if r.failure is None and not r.cut]
    failures = Counter(r.failure for r in records if r.failure is not None)
    duration = max(duration, 1e-9)
    timed = [r for r in done if not r.shape.fault]  # latency: not a slow reader's own pauses
    ttft = [r.time_to_first_token_seconds for r in timed if r.time_to_first_token_seconds]
    tpot = [r.time_per_output_token_seconds for r in timed if r.time_per_output_token_seconds]
    inputs = sum(r.input_tokens for r in done)
    outputs = sum(r.output_tokens for r in done)
    good = attained = None
    if slo is not None:
        met = sum(1 for r in timed if slo.met_by(cast("RequestMetrics", r)))  # the same fields
        good, attained = met / duration, (met / len(timed) if timed else 0.0)
    result = LoadResult(
        setting={"endpoint": endpoint.name}, load=spec.describe(), completed=len(done),
        failed=sum(failures.values()), duration=duration, total_input_tokens=inputs,
        total_output_tokens=outputs, request_throughput=len(done) / duration,
        output_throughput=outputs / duration, total_token_throughput=(inputs + outputs) / duration,
        ttft_ms=stats_ms(ttft), tpot_ms=stats_ms(tpot),
        itl_ms=stats_ms([g for r in timed for g in r.itl_s]),
        e2el_ms=stats_ms([r.e2e_s for r in timed]), queue_ms=stats_ms([]), preemptions=0,
        mean_batch_size=math.nan,
        mean_tokens_per_request=(inputs + outputs) / len(done) if done else 0.0,
        slo=slo.describe() if slo else "", request_goodput=good, slo_attainment=attained,
        stopped=stopped, refused=failures.get("rate_limited", 0),
    )  # fmt: skip
    return EndpointRun(result, records, Counter(failures), dict(messages))
