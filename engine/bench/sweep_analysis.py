"""The batching tuner's settings and the reading of a sweep, as plain data (no torch, no
engine): a :class:`Setting` (scheduler limits and a load), the :func:`grid` of them, the
points a sweep gives, the Pareto front of throughput against latency, the best setting for an
SLO, the knee (where latency starts to grow faster than throughput), the capacity it
implies, and the sweep as a table and as JSON. :class:`~engine.bench.tuning.Sweep` runs the
settings on an engine.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from engine.bench.load_spec import LoadSpec
from engine.bench.report import text_table
from engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from engine.bench.load_spec import SLO, LoadResult

#: the limits a setting may change, in the order labels name them
LIMIT_NAMES = ("max_batch_size", "max_tokens_per_step", "max_wait_ms", "kv_blocks")
_SHORT = {"max_batch_size": "b", "max_tokens_per_step": "t", "max_wait_ms": "w", "kv_blocks": "kv"}


@dataclass(frozen=True, slots=True)
class Setting:
    """Scheduler limits (``None``: as the engine has it) and the load to run under them."""

    limits: dict[str, float] = field(default_factory=dict)
    load: LoadSpec = field(default_factory=LoadSpec)

    def __post_init__(self) -> None:
        unknown = set(self.limits) - set(LIMIT_NAMES)
        if unknown:
            raise InvalidRequestError(f"unknown limit(s) {', '.join(sorted(unknown))}")

    def label(self) -> str:
        parts = [f"{_SHORT[k]}{self.limits[k]:g}" for k in LIMIT_NAMES if k in self.limits]
        return " ".join([*parts, self.load.describe()])

    def as_dict(self) -> dict[str, Any]:
        return {**self.limits, "load": self.load.describe(), "mode": self.load.mode,
                "users": self.load.users, "rate": self.load.rate}  # fmt: skip


def grid(
    base: LoadSpec,
    *,
    max_batch_size: Sequence[int] = (),
    max_tokens_per_step: Sequence[int] = (),
    max_wait_ms: Sequence[float] = (),
    kv_blocks: Sequence[int] = (),
    loads: Sequence[float] = (),
) -> list[Setting]:
    """Every combination of the given values; ``loads`` are users (closed loop) or rates
    (open loop) of ``base``. The load varies fastest, so each limit setting's points form one
    load series (what :func:`knee` reads)."""
    axes: dict[str, Sequence[float]] = {
        "max_batch_size": max_batch_size, "max_tokens_per_step": max_tokens_per_step,
        "max_wait_ms": max_wait_ms, "kv_blocks": kv_blocks,
    }  # fmt: skip
    names = [k for k, v in axes.items() if v]
    out = []
    for values in itertools.product(*(axes[k] for k in names)):
        limits = dict(zip(names, values, strict=True))
        for load in loads or [base.load]:
            spec = (
                replace(base, users=int(load))
                if base.mode == "closed"
                else replace(base, rate=load)
            )
            out.append(Setting(limits, spec))
    return out


@dataclass(frozen=True, slots=True)
class SweepPoint:
    setting: Setting
    result: LoadResult

    @property
    def label(self) -> str:
        return self.setting.label()


@dataclass(frozen=True, slots=True)
class SweepProgress:
    """Where a sweep is (plain data for another thread)."""

    index: int  # the setting running now (== total when done)
    total: int
    label: str
    sent: int
    completed: int
    points: tuple[SweepPoint, ...]


# -- reading a sweep ------------------------------------------------------------------------


def pareto_front(
    points: Iterable[SweepPoint], latency: str = "ttft_ms", stat: str = "p95"
) -> list[SweepPoint]:
    """The points no other point beats on both output throughput (higher) and the latency
    ``stat`` (lower), by throughput."""
    pts = [p for p in points if not math.isnan(getattr(p.result, latency)[stat])]
    front = []
    for p in pts:
        x, y = p.result.output_throughput, getattr(p.result, latency)[stat]
        dominated = any(
            q.result.output_throughput >= x
            and getattr(q.result, latency)[stat] <= y
            and (q.result.output_throughput > x or getattr(q.result, latency)[stat] < y)
            for q in pts
        )
        if not dominated:
            front.append(p)
    return sorted(front, key=lambda p: p.result.output_throughput)


def meets(point: SweepPoint, slo: SLO) -> bool:
    """The setting's p95 TTFT and p95 TPOT are within ``slo``."""
    r = point.result
    if slo.ttft_s is not None and not r.ttft_ms["p95"] <= slo.ttft_s * 1e3:
        return False
    return (
        slo.tpot_s is None or math.isnan(r.tpot_ms["p95"]) or r.tpot_ms["p95"] <= slo.tpot_s * 1e3
    )


def best_for_slo(points: Iterable[SweepPoint], slo: SLO) -> SweepPoint | None:
    """Of the settings that meet ``slo`` at p95, the one with the highest output throughput
    (``None`` if none does)."""
    ok = [p for p in points if p.result.completed and meets(p, slo)]
    return max(ok, key=lambda p: p.result.output_throughput, default=None)


def series(points: Iterable[SweepPoint]) -> dict[str, list[SweepPoint]]:
    """Points grouped by their limits (one load series each), loads ascending."""
    out: dict[str, list[SweepPoint]] = {}
    for p in points:
        key = " ".join(f"{_SHORT[k]}{p.setting.limits[k]:g}" for k in LIMIT_NAMES
                       if k in p.setting.limits) or "engine limits"  # fmt: skip
        out.setdefault(key, []).append(p)
    for pts in out.values():
        pts.sort(key=lambda p: p.setting.load.load)
    return out


@dataclass(frozen=True, slots=True)
class Knee:
    """Where a load series saturates: ``point`` is the last load at which throughput still
    grows at least as fast as latency; beyond it latency grows faster (non-linearly)."""

    point: SweepPoint
    load: float
    request_throughput: float
    output_throughput: float


def knee(points: Sequence[SweepPoint], latency: str = "ttft_ms", stat: str = "p95") -> Knee | None:
    """The load that maximises Kleinrock's *power*, throughput / latency (request throughput
    over p95 TTFT by default): power rises while throughput grows faster than latency and
    falls once the machine saturates and queueing makes latency outgrow it. Needs three loads
    of one series and a maximum before the last of them (else latency has not bent within
    the range swept: ``None``, sweep further)."""
    pts = sorted(points, key=lambda p: p.setting.load.load)
    power = []
    for p in pts:
        lat = getattr(p.result, latency)[stat]
        power.append(p.result.request_throughput / lat if lat > 0 else math.nan)
    if len(pts) < 3 or any(math.isnan(x) for x in power):
        return None
    i = max(range(len(pts)), key=lambda k: power[k])
    if i == len(pts) - 1 or power[i] <= min(power) * (1 + 1e-6):
        return None
    r = pts[i].result
    return Knee(pts[i], pts[i].setting.load.load, r.request_throughput, r.output_throughput)


@dataclass(frozen=True, slots=True)
class Capacity:
    target_rate: float  # requests/s on average
    peak_factor: float
    headroom: float
    per_machine_rate: float  # requests/s one machine serves at its knee
    tokens_per_request: float
    machines: int

    @property
    def needed_rate(self) -> float:
        return self.target_rate * self.peak_factor * self.headroom

    def describe(self) -> str:
        return (
            f"{self.target_rate:g} req/s average × peak {self.peak_factor:g} × headroom "
            f"{self.headroom:g} = {self.needed_rate:.2f} req/s "
            f"({self.needed_rate * self.tokens_per_request:,.0f} tokens/s at "
            f"{self.tokens_per_request:.0f} tokens per request); one machine like this serves "
            f"{self.per_machine_rate:.2f} req/s at its knee: {self.machines} needed"
        )


def capacity(
    knee_point: Knee, target_rate: float, *, peak_factor: float = 3.0, headroom: float = 1.5
) -> Capacity:
    """Machines like this one that serve ``target_rate`` requests/s with the peak and the
    headroom asked for, each run at its knee's request throughput."""
    if not (target_rate > 0 and peak_factor >= 1 and headroom >= 1):
        raise InvalidRequestError("need a target rate > 0, a peak factor >= 1, headroom >= 1")
    per = knee_point.request_throughput
    if not per > 0:
        raise InvalidRequestError("the knee's setting completed no request; run a longer sweep")
    need = target_rate * peak_factor * headroom
    return Capacity(
        target_rate, peak_factor, headroom, per,
        knee_point.point.result.mean_tokens_per_request, max(1, math.ceil(need / per - 1e-9)),
    )  # fmt: skip


def knee_concurrency(k: Knee) -> int:
    """Requests in progress at the knee: its users (closed loop), or by Little's law its
    request throughput × mean end-to-end latency (open loop)."""
    load = k.point.setting.load
    if load.mode == "closed":
        return load.users
    return max(1, math.ceil(k.request_throughput * k.point.result.e2el_ms["mean"] / 1e3 - 1e-9))


#: the application builder a Ray Serve config names (:mod:`app.replicas.deployments`)
SERVE_IMPORT_PATH = "app.replicas.deployments:build"


def serve_config(
    k: Knee, cap: Capacity, *, model: str, precision: str, host: str = "127.0.0.1",
    port: int = 8000,
) -> dict[str, Any]:  # fmt: skip
    """A Ray Serve config (``serve --ray --config FILE``, or ``serve run FILE`` on a cluster)
    for the capacity found: as many engine replicas as machines were needed, each taking at
    most the knee's requests in progress (Ray holds the rest in its queue), with the knee
    setting's batch limits."""
    limits = {name: k.point.setting.limits[name] for name in ("max_batch_size",
              "max_tokens_per_step") if k.point.setting.limits.get(name) is not None}  # fmt: skip
    return {
        "http_options": {"host": host, "port": port},
        "applications": [{
            "name": "infersight", "route_prefix": "/", "import_path": SERVE_IMPORT_PATH,
            "args": {"model": model, "precision": precision,
                     **{n: int(v) for n, v in limits.items()}},
            "deployments": [{
                "name": "engine", "num_replicas": cap.machines,
                "max_ongoing_requests": knee_concurrency(k),
            }],
        }],
    }  # fmt: skip


def format_points(points: Sequence[SweepPoint], slo: SLO | None = None) -> str:
    """The sweep as a table, vLLM bench's figures per setting."""
    cols = ["setting", "done", "req/s", "out tok/s", "TTFT ms p50/p95/p99",
            "TPOT ms p50/p95/p99", "ITL ms p50/p99", "batch", "preempt"]  # fmt: skip
    if slo is not None:
        cols.append(f"goodput ({slo.describe()})")
    rows = []
    for p in points:
        r = p.result
        t, o, i = r.ttft_ms, r.tpot_ms, r.itl_ms
        row = [
            p.label, str(r.completed), f"{r.request_throughput:.2f}",
            f"{r.output_throughput:.1f}",
            f"{t['median']:.0f}/{t['p95']:.0f}/{t['p99']:.0f}",
            f"{o['median']:.0f}/{o['p95']:.0f}/{o['p99']:.0f}",
            f"{i['median']:.0f}/{i['p99']:.0f}", f"{r.mean_batch_size:.1f}", str(r.preemptions),
        ]  # fmt: skip
        if slo is not None:
            row.append(f"{r.request_goodput or 0:.2f} req/s ({r.slo_attainment or 0:.0%})")
        rows.append(row)
    return "\n".join(text_table(cols, rows))


def format_reading(
    points: Sequence[SweepPoint], report: dict[str, Any], slo: SLO | None,
    capacity: float | None, *, replicas: bool,
) -> str:  # fmt: skip
    """A sweep's table and its reading (``infersight tune``, of a local engine or an
    endpoint): the Pareto front, the best setting for the SLO, each knee and its capacity
    (``replicas``: as Ray Serve replicas of ours)."""
    lines = [
        format_points(points, slo),
        "Pareto front (output tok/s vs p95 TTFT): " + ", ".join(report["pareto_ttft"]),
    ]
    if slo is not None:
        lines.append(f"best for {slo.describe()} at p95: "
                     f"{report['best_for_slo'] or 'none meets it'}")  # fmt: skip
    for name, k in report["knees"].items():
        lines.append(f"knee of {name}: {k['label']} ({k['request_throughput']:.2f} req/s)")
        if "capacity" in k:
            lines.append("  " + k["capacity"]["text"])
            if replicas:
                lines.append(f"  as Ray Serve replicas: {k['capacity']['machines']} of at most "
                             f"{k['concurrency']} requests in progress each (--json writes the "
                             "config `infersight serve --ray --config FILE` takes)")  # fmt: skip
    if capacity is not None and not report["knees"]:
        lines.append("no knee: sweep at least three loads of one setting, up to where latency "
                     "grows")  # fmt: skip
    return "\n".join(lines)


def sweep_report(
    points: Sequence[SweepPoint],
    slo: SLO | None,
    *,
    target_rate: float | None = None,
    peak_factor: float = 3.0,
    headroom: float = 1.5,
    model: str | None = None,
    precision: str | None = None,
) -> dict[str, Any]:
    """What ``infersight tune --json`` prints and the app exports: each point's vLLM-bench
    figures, the Pareto front, the best setting for the SLO, each series' knee and, with a
    target rate, the machines needed and (``model`` and ``precision`` given) a Ray Serve
    config of that many replicas (:func:`serve_config`)."""
    out: dict[str, Any] = {
        "slo": slo.describe() if slo else None,
        "points": [{"label": p.label, **p.result.as_json()} for p in points],
        "pareto_ttft": [p.label for p in pareto_front(points, "ttft_ms")],
        "pareto_tpot": [p.label for p in pareto_front(points, "tpot_ms")],
    }
    best = best_for_slo(points, slo) if slo else None
    out["best_for_slo"] = best.label if best else None
    knees = {}
    for name, pts in series(points).items():
        k = knee(pts)
        if k is not None:
            knees[name] = {"label": k.point.label, "load": k.load,
                           "request_throughput": k.request_throughput,
                           "output_throughput": k.output_throughput}  # fmt: skip
            if target_rate is not None:
                cap = capacity(k, target_rate, peak_factor=peak_factor, headroom=headroom)
                knees[name]["capacity"] = {**asdict(cap), "text": cap.describe()}
                knees[name]["concurrency"] = knee_concurrency(k)
                if model is not None and precision is not None:
                    knees[name]["ray_serve"] = serve_config(
                        k, cap, model=model, precision=precision
                    )
    out["knees"] = knees
    return out
