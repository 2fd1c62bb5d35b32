"""The batching tuner's load against an OpenAI-compatible server: the requests a
:class:`~engine.bench.load_spec.LoadSpec` describes (closed loop: ``users`` each sending the
next as the last ends; open loop: arrivals at ``rate``), drawn as text from the tuner's prompt
set (the server tokenizes them), streamed, and timed by the client's clock. The figures are a
:class:`~engine.bench.load_spec.LoadResult`, as an engine's run gives them, less what only the
engine can see (its queue, batch sizes and preemptions: NaN and 0 here); a failed request is
counted by how it failed, with the server's first line of each kind.

Requests run to their drawn length (``ignore_eos``, the benchmark convention, which vLLM,
llama.cpp's server and ours take; ``ignore_eos=False`` leaves it out for a server that refuses
fields it does not know).
"""

from __future__ import annotations

import itertools
import math
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import httpx2

from app.endpoints.client import Endpoint, EndpointError, Streamed, session, stream_chat
from engine.bench.load_spec import SLO, LoadResult, LoadSpec, draw_request, prompt_set, stats_ms

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


@dataclass(slots=True)
class EndpointRun:
    """A run's figures, its requests, and its failures by kind (with each kind's first
    message, as the tuner marks where the server failed)."""

    result: LoadResult
    records: list[Record]
    failures: Counter[str]
    first_failure: dict[str, str]


def run_load(
    endpoint: Endpoint, spec: LoadSpec, slo: SLO | None = None, *,
    stop: threading.Event | None = None, ignore_eos: bool = True,
) -> EndpointRun:  # fmt: skip
    """Send ``spec``'s load to ``endpoint`` until its requests are sent (or its duration is
    over, or ``stop`` is set), wait for the ones in flight, and give the figures."""
    stop = stop or threading.Event()
    # one client for the run, its connections kept alive between a user's requests
    with session(endpoint, spec.users if spec.mode == "closed" else 256) as client:
        return _load(endpoint, spec, slo, stop, ignore_eos, client)


def _load(
    endpoint: Endpoint, spec: LoadSpec, slo: SLO | None, stop: threading.Event,
    ignore_eos: bool, client: httpx2.Client,
) -> EndpointRun:  # fmt: skip
    rng = random.Random(spec.seed)
    texts = prompt_set()
    lock = threading.Lock()
    records: list[Record] = []
    messages: dict[str, str] = {}
    sent = [0]
    started = time.perf_counter()
    deadline = None if spec.duration_s is None else started + spec.duration_s

    def next_request() -> tuple[str, list[dict[str, str]], int] | None:
        with lock:
            over = spec.requests is not None and sent[0] >= spec.requests
            if stop.is_set() or over or (deadline is not None and time.perf_counter() > deadline):
                return None
            sent[0] += 1
            return draw_request(rng, spec.mix, texts, tokens_of, ROOM)

    def send(kind: str, chat: list[dict[str, str]], out: int) -> Record:
        reply = Streamed(time.perf_counter())
        extra = {"ignore_eos": True} if ignore_eos else None
        try:
            stream = stream_chat(endpoint, chat, max_tokens=out, extra=extra, reply=reply,
                                 session=client)  # fmt: skip
            for _ in stream:
                if stop.is_set():  # a stop ends the requests in flight too
                    stream.close()
                    break
        except EndpointError as exc:
            return failed(kind, reply, exc.kind, str(exc), exc.retry_after)
        except Exception as exc:  # a user thread must end in a record
            return failed(kind, reply, "protocol", f"{endpoint.name}: {exc!r}", None)
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
            itl_s=[b - a for a, b in itertools.pairwise(timed)],
        )  # fmt: skip

    def failed(kind: str, reply: Streamed, how: str, message: str, wait: float | None) -> Record:
        with lock:
            messages.setdefault(how, message)
        if how in FATAL:  # no wait heals it: the run ends
            stop.set()
        return Record(kind, time.perf_counter() - reply.started, reply.started, failure=how,
                      retry_after=wait)  # fmt: skip

    def keep(record: Record) -> None:
        with lock:
            records.append(record)

    if spec.mode == "closed":

        def user() -> None:
            while (request := next_request()) is not None:
                record = send(*request)
                keep(record)
                if record.failure is not None:  # wait as the server asked, or a little
                    wait = BACKOFF_S if record.retry_after is None else record.retry_after
                    stop.wait(min(wait, MAX_BACKOFF_S))

        threads = [threading.Thread(target=user, daemon=True) for _ in range(spec.users)]
        for t in threads:
            t.start()
    else:
        threads = []
        gaps = random.Random(spec.seed + 1)
        due = started
        while (request := next_request()) is not None:
            if stop.wait(max(0.0, due - time.perf_counter())):
                break
            if deadline is not None and due > deadline:  # due after the run's end
                break
            t = threading.Thread(target=lambda r=request: keep(send(*r)), daemon=True)
            t.start()
            threads.append(t)
            mean = 1.0 / spec.rate
            shape = spec.burstiness
            due += mean if spec.mode == "constant" else gaps.gammavariate(shape, mean / shape)
    stopped = True
    try:
        for t in threads:
            t.join()
        stopped = stop.is_set()  # a stop, or a failure no wait heals, ended it early
    finally:  # an interrupt (Ctrl-C) stops the users and the streams in flight too
        stop.set()
    ended = time.perf_counter()
    return _run(endpoint, spec, slo, records, messages, ended - started, stopped)


def _run(
    endpoint: Endpoint, spec: LoadSpec, slo: SLO | None, records: list[Record],
    messages: dict[str, str], duration: float, stopped: bool,
) -> EndpointRun:  # fmt: skip
    done = [r for r in records if r.failure is None]
    failures = Counter(r.failure for r in records if r.failure is not None)
    duration = max(duration, 1e-9)
    ttft = [r.time_to_first_token_seconds for r in done if r.time_to_first_token_seconds]
    tpot = [r.time_per_output_token_seconds for r in done if r.time_per_output_token_seconds]
    inputs = sum(r.input_tokens for r in done)
    outputs = sum(r.output_tokens for r in done)
    good = attained = None
    if slo is not None:
        met = sum(1 for r in done if slo.met_by(cast("RequestMetrics", r)))  # the same fields
        good, attained = met / duration, (met / len(done) if done else 0.0)
    result = LoadResult(
        setting={"endpoint": endpoint.name}, load=spec.describe(), completed=len(done),
        failed=sum(failures.values()), duration=duration, total_input_tokens=inputs,
        total_output_tokens=outputs, request_throughput=len(done) / duration,
        output_throughput=outputs / duration, total_token_throughput=(inputs + outputs) / duration,
        ttft_ms=stats_ms(ttft), tpot_ms=stats_ms(tpot),
        itl_ms=stats_ms([g for r in done for g in r.itl_s]),
        e2el_ms=stats_ms([r.e2e_s for r in done]), queue_ms=stats_ms([]), preemptions=0,
        mean_batch_size=math.nan,
        mean_tokens_per_request=(inputs + outputs) / len(done) if done else 0.0,
        slo=slo.describe() if slo else "", request_goodput=good, slo_attainment=attained,
        stopped=stopped, refused=failures.get("rate_limited", 0),
    )  # fmt: skip
    return EndpointRun(result, records, Counter(failures), dict(messages))
