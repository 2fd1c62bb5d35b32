"""A load run (or a sweep's runs) as GuideLLM's report, ``benchmarks.json`` (schema version 2,
as GuideLLM 0.8 writes it): one benchmark per run, each with its requests (their times, tokens
and errors) and the metrics GuideLLM computes from them (:mod:`engine.bench.guidellm_stats`),
so that ``guidellm export``, its console, CSV and HTML outputs and any tool that reads its
JSON read a run from here as one of its own. Closed-loop users are GuideLLM's ``concurrent``
strategy (streams), open-loop arrivals its ``constant`` or ``poisson`` (rate).

The requests come as :class:`TimedRequest`: wall-clock (Unix) seconds, as GuideLLM keeps
them. Plain Python, no torch."""

from __future__ import annotations

import json
import platform
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.bench.guidellm_stats import (
    STATUSES,
    by_status,
    concurrency,
    distribution,
    rate,
)
from engine.bench.load_spec import PROMPT_SET

SCHEMA_VERSION = 2
#: what a run's status reads as in GuideLLM's breakdown
STATUS = {"completed": "successful", "errored": "errored", "cancelled": "incomplete"}
#: the modality figures GuideLLM's report lists, none measured here but text tokens
UNMEASURED = {"image": ("tokens", "images", "pixels", "bytes"),
              "video": ("tokens", "frames", "seconds", "bytes"),
              "audio": ("tokens", "samples", "seconds", "bytes"),
              "tool_call": ("tokens", "mixed_tokens", "count")}  # fmt: skip
SUMMARY_KEYS = ("input", "input_per_second", "input_concurrency", "output", "output_per_second",
                "output_concurrency", "total", "total_per_second", "total_concurrency")  # fmt: skip


@dataclass(frozen=True, slots=True)
class TimedRequest:
    """One request of a run, by the client's clock in Unix seconds: sent (``start``), its
    first and last streamed token, answered (``end``); its streamed chunks with text
    (``iterations``), its tokens, and how it ended (``completed``, ``errored``, or
    ``cancelled``: a stop cut it). ``targeted_start``: when an open loop meant to send it."""

    request_id: str
    status: str
    start: float
    end: float
    first_token: float | None
    last_token: float | None
    iterations: int
    prompt_tokens: int | None
    output_tokens: int | None
    targeted_start: float | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Run:
    """One benchmark: its load (``closed``, ``constant``, ``poisson``) and level (users or
    requests/s), and its requests."""

    mode: str
    load: float
    requests: tuple[TimedRequest, ...]
    label: str = ""
    #: what bounded it, as GuideLLM names constraints (none: a live run, until stopped)
    constraints: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: what else was true of it (a load turned while it ran, a burstiness)
    environment: dict[str, Any] = field(default_factory=dict)


def _derived(r: TimedRequest) -> dict[str, Any]:
    """A request's figures, as GuideLLM computes them from its times and tokens."""
    s, e, ft, lt, n = r.start, r.end, r.first_token, r.last_token, r.iterations
    pt, ot = r.prompt_tokens, r.output_tokens if r.output_tokens is not None else (n or None)
    latency = e - s
    total = None if pt is None and ot is None else (pt or 0) + (ot or 0)
    d: dict[str, Any] = {
        "request_start_time": s, "request_end_time": e, "request_latency": latency,
        "prompt_tokens": pt, "output_tokens": ot, "total_tokens": total,
        "time_to_first_token_ms": None if ft is None else 1e3 * (ft - s),
        "time_to_first_output_token_ms": None if ft is None else 1e3 * (ft - s),
        "time_per_output_token_ms": 1e3 * ((lt or e) - s) / ot if ot else None,
        "inter_token_latency_ms": (1e3 * (lt - ft) / (ot - 1)
                                   if ft is not None and lt is not None and ot and ot > 1
                                   else None),
        "iter_tokens_per_iteration": (ot - 1.0) / (n - 1.0) if ot and ot > 1 and n > 1 else None,
        "output_tokens_per_iteration": ot / n if ot is not None and n >= 1 else None,
        "time_to_last_round_trip_ms": None, "avg_round_trip_time_ms": None,
        "request_dispatch_delay": None if r.targeted_start is None else s - r.targeted_start,
        "request_scheduled_latency": None if r.targeted_start is None else e - r.targeted_start,
        "tokens_per_second": total / latency if latency and total is not None else None,
        "output_tokens_per_second": ot / latency if latency and ot is not None else None,
    }  # fmt: skip
    # when its tokens count towards the per-second rates: the prompt at the first token, the
    # first output token then, the others spread evenly over the iterations after it
    d["_n"] = n
    d["_prompt"] = (ft if ft is not None else e, float(pt or 0))
    if ft is None or lt is None or n <= 1:
        d["_iters"] = []
        d["_outs"] = [(lt if lt is not None else e, float(ot or 0))]
    else:
        per, step = d["iter_tokens_per_iteration"], (lt - ft) / (n - 1)
        d["_iters"] = (
            [] if per is None else [(lt if i == n - 1 else ft + i * step, per) for i in range(1, n)]
        )
        d["_outs"] = [(ft, 1.0 * bool(ot)), *d["_iters"]]  # fmt: skip
    return d


def _tokens_summary(groups: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """GuideLLM's text-token figures: prompt (input), output and both, as counts, per second
    and at once."""
    timed = {s: [(d["request_start_time"], d["request_end_time"], d["prompt_tokens"],
                  d["output_tokens"]) for d in ds
                 if d["request_start_time"] and d["request_end_time"]
                 and (d["prompt_tokens"] is not None or d["output_tokens"] is not None)]
             for s, ds in groups.items()}  # fmt: skip

    def three(i: int) -> tuple[Any, ...]:
        counts = {s: [float(m[i]) for m in ms if m[i] is not None] for s, ms in timed.items()}
        if not any(counts.values()):
            return None, None, None, counts, {}, {}
        rates = {s: [(m[1], float(m[i] or 0.0)) for m in ms] for s, ms in timed.items()}
        spans = {s: [(m[0], m[1], float(m[i] or 0.0)) for m in ms] for s, ms in timed.items()}
        return (
            _per(counts, distribution),
            _per(rates, _rate_all),
            _per(spans, _conc_all),
            counts,
            rates,
            spans,
        )

    iv, ir, ic, ivals, irates, ispans = three(2)
    ov, orate, oc, ovals, orates, ospans = three(3)
    both: tuple[Any, ...] = (None, None, None)
    if iv is not None and ov is not None:
        both = (_per({s: ivals[s] + ovals[s] for s in ivals}, distribution),
                _per({s: irates[s] + orates[s] for s in irates}, _rate_all),
                _per({s: ispans[s] + ospans[s] for s in ispans}, _conc_all))  # fmt: skip
    return dict(zip(SUMMARY_KEYS, (iv, ir, ic, ov, orate, oc, *both), strict=True))


def _rate_all(events: list[Any]) -> dict[str, Any]:
    return rate(events, None, None)


def _conc_all(spans: list[Any]) -> dict[str, Any]:
    return concurrency(spans, None, None)


def _per(per: dict[str, list[Any]], summarize: Any) -> dict[str, Any]:
    per = {**per, "total": per["successful"] + per["incomplete"] + per["errored"]}
    return {k: summarize(per[k]) for k in (*STATUSES, "total")}


def metrics(groups: dict[str, list[dict[str, Any]]], start: float, end: float,
            scheduled: bool) -> dict[str, Any]:  # fmt: skip
    """GenerativeMetrics of the requests' figures (``_derived``), by status, measured
    between ``start`` and ``end``; ``scheduled``: arrivals at a rate (their delays too)."""
    g = groups

    def field(name: str, default: float | None = 0.0) -> Any:
        return lambda d: d[name] if d[name] is not None else default

    def rates(value: Any) -> dict[str, Any]:
        return by_status(g, value, lambda v: rate(v, start, end))

    first = {s: [d for d in ds if d["time_to_first_token_ms"] is not None] for s, ds in g.items()}
    m: dict[str, Any] = {
        "request_totals": {**{s: len(g[s]) for s in STATUSES},
                           "total": sum(len(v) for v in g.values())},
        "requests_per_second": rates(lambda d: d["request_end_time"]),
        "request_concurrency": by_status(
            g, lambda d: (d["request_start_time"], d["request_end_time"]),
            lambda v: concurrency(v, start, end)),
        "request_latency": by_status(g, field("request_latency")),
        "request_streaming_iterations_count": by_status(g, lambda d: float(d["_n"])),
        "prompt_token_count": by_status(g, field("prompt_tokens")),
        "output_token_count": by_status(g, field("output_tokens")),
        "total_token_count": by_status(g, field("total_tokens")),
        "time_to_first_token_ms": by_status(first, field("time_to_first_token_ms")),
        "time_to_first_output_token_ms": by_status(first, field("time_to_first_output_token_ms")),
        "time_per_output_token_ms": by_status(
            g, lambda d: (d["time_per_output_token_ms"] or 0.0, float(d["output_tokens"] or 0))),
        "inter_token_latency_ms": by_status(
            g, lambda d: (d["inter_token_latency_ms"] or 0.0,
                          float((d["output_tokens"] or 1) - 1))),
        "time_to_last_round_trip_ms": by_status(g, field("time_to_last_round_trip_ms")),
        "avg_round_trip_time_ms": by_status(g, field("avg_round_trip_time_ms")),
        "prompt_tokens_per_second": rates(lambda d: d["_prompt"]),
        "output_tokens_per_second": rates(lambda d: d["_outs"]),
        "tokens_per_second": rates(lambda d: [d["_prompt"], *d["_outs"]]),
        "output_tokens_per_iteration": by_status(g, lambda d: [w for _, w in d["_outs"]]),
        "iter_tokens_per_iteration": by_status(g, lambda d: [w for _, w in d["_iters"]]),
        "text": {"tokens": _tokens_summary(g), "words": dict.fromkeys(SUMMARY_KEYS),
                 "characters": dict.fromkeys(SUMMARY_KEYS)},
        **{kind: {k: dict.fromkeys(SUMMARY_KEYS) for k in keys}
           for kind, keys in UNMEASURED.items()},
        "request_dispatch_delay": None, "request_scheduled_latency": None,
        "turn_predecessor_delay": None, "turn_scheduling_delay": None,
        "root_dispatch_delay": None, "turns": None,
        "slo_attainment": None, "slo_determined_requests": 0, "request_goodput": None,
    }  # fmt: skip
    if scheduled:  # arrivals at a rate: how late each was sent, and answered
        m["request_dispatch_delay"] = by_status(g, field("request_dispatch_delay", None))
        m["request_scheduled_latency"] = by_status(g, field("request_scheduled_latency", None))
        m["turn_predecessor_delay"] = by_status(
            g, lambda d: None if d["request_dispatch_delay"] is None else 0.0
        )
        m["turn_scheduling_delay"] = by_status(g, field("request_dispatch_delay", None))
        delays = [d["request_dispatch_delay"] for ds in g.values() for d in ds
                  if d["request_dispatch_delay"] is not None]  # fmt: skip
        m["root_dispatch_delay"] = distribution(delays) if delays else None
    return m


def _record(r: TimedRequest, d: dict[str, Any], index: int) -> dict[str, Any]:
    """A request as GuideLLM's GenerativeRequestStats, its figures beside it as GuideLLM
    writes them (read back from the times, not from these)."""
    first = r.start if r.iterations else None
    timings = {
        "targeted_start": r.targeted_start, "queued": r.start, "dequeued": r.start,
        "scheduled_at": r.start, "resolve_start": r.start, "request_start": r.start,
        "first_request_iteration": first, "first_token_iteration": r.first_token,
        "first_output_token_iteration": r.first_token, "last_token_iteration": r.last_token,
        "last_request_iteration": r.last_token, "request_iterations": r.iterations,
        "token_iterations": r.iterations, "request_end": r.end, "resolve_end": r.end,
        "finalized": r.end,
    }  # fmt: skip
    return {
        "type_": "generative_request_stats", "request_id": r.request_id, "response_id": None,
        "request_args": None, "output": None,
        "info": {"request_id": r.request_id, "status": r.status, "scheduler_node_id": 0,
                 "scheduler_process_id": 0, "scheduler_start_time": r.start,
                 "timings": timings, "error": r.error, "traceback": None},
        "input_metrics": {"text_tokens": r.prompt_tokens},
        "output_metrics": {"text_tokens": r.output_tokens},
        **{k: v for k, v in d.items() if not k.startswith("_")},
    }  # fmt: skip


def strategy(mode: str, load: float) -> dict[str, Any]:
    """GuideLLM's scheduling strategy for a load: closed-loop users are concurrent streams."""
    if mode == "closed":
        return {"type_": "concurrent", "streams": int(load)}
    return {"type_": mode, "rate": float(load)}


def profile(runs: list[Run]) -> dict[str, Any]:
    """GuideLLM's profile over a sweep's runs (one mode: the first run's)."""
    mode = runs[0].mode if runs else "closed"
    levels = [r.load for r in runs if r.mode == mode]
    if mode == "closed":
        return {"kind": "concurrent", "streams": [int(x) for x in levels]}
    return {"kind": mode, "rate": [float(x) for x in levels]}


def benchmark(run: Run, index: int, run_id: str, backend: dict[str, Any],
              source: str) -> dict[str, Any]:  # fmt: skip
    """One run as GuideLLM's GenerativeBenchmark."""
    if not run.requests:
        raise ValueError(f"run {run.label or index} has no requests to report")
    derived = [_derived(r) for r in run.requests]
    groups: dict[str, list[dict[str, Any]]] = {s: [] for s in STATUSES}
    records: dict[str, list[dict[str, Any]]] = {s: [] for s in STATUSES}
    for i, (r, d) in enumerate(zip(run.requests, derived, strict=True)):
        status = STATUS.get(r.status, "incomplete")
        groups[status].append(d)
        records[status].append(_record(r, d, i))
    start = min(r.start for r in run.requests)
    end = max(r.end for r in run.requests)
    made = {s: len(groups[s]) for s in STATUSES}
    spans = [r.end - r.start for r in run.requests]
    starts = [r.start - r.targeted_start for r in run.requests if r.targeted_start is not None]

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else -1.0  # GuideLLM's "unknown"

    return {
        "type_": "generative_benchmark",
        "config": {
            "id_": str(uuid.uuid4()), "run_id": run_id, "run_index": index,
            "strategy": strategy(run.mode, run.load),
            "constraints": run.constraints,
            "sample_size": None, "prefer_response_metrics": True, "slo": None,
            "warmup": {"percent": None, "value": None, "mode": "prefer_duration"},
            "cooldown": {"percent": None, "value": None, "mode": "prefer_duration"},
            "confidence": None, "profile": {}, "requests": {"source": source},
            "backend": backend,
            "environment": {"type": source, "label": run.label, **run.environment},
        },
        "scheduler_state": {
            "node_id": 0, "num_processes": 1, "start_time": start, "end_time": end,
            "start_requests_time": start, "end_requests_time": end, "end_queuing_time": end,
            "end_processing_time": end, "created_requests": len(run.requests),
            "queued_requests": 0, "pending_requests": 0, "processing_requests": 0,
            "processed_requests": len(run.requests), "successful_requests": made["successful"],
            "errored_requests": made["errored"], "cancelled_requests": made["incomplete"],
        },
        "scheduler_metrics": {
            "start_time": start, "request_start_time": start, "measure_start_time": start,
            "measure_end_time": end, "request_end_time": end, "end_time": end,
            "requests_made": {**made, "total": len(run.requests)},
            "queued_time_avg": 0.0, "resolve_start_delay_avg": 0.0,
            "resolve_targeted_start_delay_avg": mean(starts), "request_start_delay_avg": 0.0,
            "request_targeted_start_delay_avg": mean(starts), "request_time_avg": mean(spans),
            "resolve_end_delay_avg": 0.0, "resolve_time_avg": mean(spans),
            "finalized_delay_avg": 0.0, "processed_delay_avg": 0.0,
            "dataset_incomplete": False, "strategy_type": strategy(run.mode, run.load)["type_"],
        },
        "metrics": metrics(groups, start, end, scheduled=run.mode != "closed"),
        "requests": {**records, "total": None},
        "warnings": [],
        "start_time": start, "end_time": end, "duration": end - start,
        "warmup_duration": 0.0, "cooldown_duration": 0.0,
    }  # fmt: skip


def report(runs: list[Run], *, target: str, model: str, source: str = "infersight",
           version: str = "") -> dict[str, Any]:  # fmt: skip
    """The runs (a sweep's, or one) as GuideLLM's GenerativeBenchmarksReport."""
    backend = {"kind": "openai_http", "target": target, "model": model}
    prof = profile(runs)
    run_id = str(uuid.uuid4())
    benchmarks = [benchmark(r, i, run_id, backend, source) for i, r in enumerate(runs)]
    for b in benchmarks:
        b["config"]["profile"] = prof
    return {
        "metadata": {"version": SCHEMA_VERSION, "guidellm_version": f"{source} {version}".strip(),
                     "python_version": platform.python_version(),
                     "platform": platform.platform()},
        "config": {"metadata": {"labels": {"source": source}},
                   "spec": {"backend": backend, "profile": prof,
                            "data": [{"kind": "json_file", "path": str(PROMPT_SET)}]},
                   "benchmarks": [None] * len(benchmarks)},
        "benchmarks": benchmarks,
        "conclusions": [],
    }  # fmt: skip


def write_report(path: Path, runs: list[Run], **kw: Any) -> None:
    """:func:`report` as JSON at ``path``."""
    path.write_text(json.dumps(report(runs, **kw), indent=1), encoding="utf-8")
