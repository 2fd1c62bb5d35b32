"""GuideLLM's statistics, as its report (``benchmarks.json``, schema version 2, GuideLLM 0.8)
states them, so that a load run here exports figures GuideLLM's own tools read the same way:
a distribution's percentiles are the first value whose cumulative weight reaches them (no
interpolation), its variance the population's; rates and concurrency are weighted by the time
each value held; per-token latencies by their tokens. The tests check every figure against
GuideLLM's own ``GenerativeMetrics.compile`` on the same requests.

Plain Python, no torch: :mod:`engine.bench.guidellm_json` assembles the report from these."""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

#: GuideLLM's percentiles, by its names
PERCENTILES = {"p001": 0.001, "p01": 0.01, "p05": 0.05, "p10": 0.1, "p25": 0.25, "p50": 0.5,
               "p75": 0.75, "p90": 0.9, "p95": 0.95, "p99": 0.99, "p999": 0.999}  # fmt: skip
STATUSES = ("successful", "errored", "incomplete")
#: events closer than this (seconds) are one event in a rate or a concurrency
MERGE_S = 1e-4
TINY = 1e-6

Weighted = tuple[float, float]  # value, weight
Summary = dict[str, Any]


def empty(count: int = 0) -> Summary:
    """A distribution of nothing: zeros (GuideLLM's reading of no values)."""
    return {"mean": 0.0, "median": 0.0, "mode": 0.0, "variance": 0.0, "std_dev": 0.0,
            "min": 0.0, "max": 0.0, "count": count, "total_sum": 0.0,
            "percentiles": dict.fromkeys(PERCENTILES, 0.0),
            "pdf": None, "mean_ci": None, "percentile_cis": None}  # fmt: skip


def distribution(values: Iterable[float | Weighted], count: int | None = None) -> Summary:
    """A DistributionSummary of values, each of weight 1 or given as ``(value, weight)``;
    ``count`` is the sum of the weights unless given."""
    pairs = [(float(v[0]), float(v[1])) if isinstance(v, tuple) else (float(v), 1.0)
             for v in values]  # fmt: skip
    if not pairs:
        return empty(0)
    if count is None:
        count = round(sum(w for _, w in pairs))
    merged: dict[float, float] = {}
    for value, weight in pairs:
        merged[value] = merged.get(value, 0.0) + weight
    items = sorted((v, w) for v, w in merged.items() if w > 0)
    if not items:
        return empty(count)
    total = sum(w for _, w in items)
    if total <= TINY:  # weights too small to read: every value counts alike
        items, total = [(v, 1.0) for v, _ in items], float(len(items))
    values_ = [v for v, _ in items]
    probs = [w / total for _, w in items]
    cdf: list[float] = []
    running = 0.0
    for p in probs:
        running += p
        cdf.append(running)
    last = len(values_) - 1
    pct = {k: values_[min(bisect.bisect_left(cdf, q), last)] for k, q in PERCENTILES.items()}
    mean = sum(v * p for v, p in zip(values_, probs, strict=True))
    variance = sum((v - mean) ** 2 * p for v, p in zip(values_, probs, strict=True))
    return {"mean": mean, "median": pct["p50"], "mode": values_[probs.index(max(probs))],
            "variance": variance, "std_dev": math.sqrt(variance), "min": values_[0],
            "max": values_[-1], "count": count, "total_sum": mean * count, "percentiles": pct,
            "pdf": None, "mean_ci": None, "percentile_cis": None}  # fmt: skip


def _merged(events: Iterable[Weighted]) -> list[Weighted]:
    """Events at one time summed, then runs closer than :data:`MERGE_S` to the run's first
    one summed at the last one's time."""
    summed: dict[float, float] = {}
    for t, w in events:
        summed[t] = summed.get(t, 0.0) + w
    runs: list[list[float]] = []  # [time, weight, the run's first time]
    for t, w in sorted(summed.items()):
        if runs and t - runs[-1][0] <= MERGE_S and runs[-1][2] >= t - MERGE_S:
            runs[-1][1] += w
        else:
            runs.append([t, w, t])
    return [(t, w) for t, w, _ in runs]


def rate(events: Iterable[float | Weighted], start: float | None, end: float | None) -> Summary:
    """The rate of events (each of weight 1 or ``(time, weight)``) between ``start`` and
    ``end``: each event's weight over the time around it, weighted by that time."""
    timed = [(e[0], e[1]) if isinstance(e, tuple) else (float(e), 1.0) for e in events]
    if start is not None:
        timed = [(start, 0.0), *(x for x in timed if x[0] >= start)]
    if end is not None:
        timed = [*(x for x in timed if x[0] <= end), (end, 0.0)]
    timed = _merged(timed)
    if len(timed) <= 1:
        return distribution([], count=len(timed))
    times = [t for t, _ in timed]
    mids = [(a + b) / 2 for a, b in zip(times[1:], times[:-1], strict=True)]
    spans = [mids[0] - times[0], *(b - a for a, b in itertools.pairwise(mids))]
    spans.append(max(times[-1] - mids[-1], TINY))
    weights = [w for _, w in timed]
    return distribution([(w / d, d) for w, d in zip(weights, spans, strict=True)],
                        count=round(sum(weights)))  # fmt: skip


def concurrency(
    intervals: Iterable[tuple[float, float] | tuple[float, float, float]],
    start: float | None, end: float | None,
) -> Summary:  # fmt: skip
    """How many intervals (``(start, end)`` or ``(start, end, weight)``) are open at once
    between ``start`` and ``end``, weighted by the time each level held."""
    spans = [(i[0], i[1], i[2] if len(i) == 3 else 1.0) for i in intervals]
    if start is not None:
        spans = [s for s in spans if s[1] >= start]
    if end is not None:
        spans = [s for s in spans if s[0] <= end]
    count = len(spans)
    steps = _merged([(s, w) for s, _, w in spans] + [(e, -w) for _, e, w in spans])
    if start is not None and steps:
        k = bisect.bisect_left([t for t, _ in steps], start)
        steps = [(start, sum(w for _, w in steps[:k])), *steps[k:]]
    if end is not None and steps:
        k = bisect.bisect_right([t for t, _ in steps], end)
        steps = [*steps[:k], (end, 0.0)]
    levels: list[float] = []
    running = 0.0
    for _, w in steps:
        running += w
        levels.append(max(running, 0.0))
    if len(levels) <= 1:
        return distribution([] if count == 0 else [levels[0]])
    held = [max(b[0] - a[0], 0.0) for a, b in itertools.pairwise(steps)]
    if not any(d > 0 for d in held):
        return distribution([], count=count)
    return distribution(list(zip(levels[:-1], held, strict=True)), count=count)


def by_status(
    groups: Mapping[str, Sequence[Any]], value: Callable[[Any], Any],
    summarize: Callable[[list[Any]], Summary] = distribution,
) -> dict[str, Summary]:  # fmt: skip
    """A StatusDistributionSummary: ``value`` of each request (None: left out; a list: each
    of its items) summarized per status and over all of them."""
    per: dict[str, list[Any]] = {}
    for status in STATUSES:
        items: list[Any] = []
        for request in groups[status]:
            got = value(request)
            if got is None:
                continue
            if isinstance(got, list):
                items.extend(got)
            else:
                items.append(got)
        per[status] = items
    per["total"] = per["successful"] + per["incomplete"] + per["errored"]
    return {k: summarize(per[k]) for k in (*STATUSES, "total")}
