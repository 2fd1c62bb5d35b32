"""``infersight tune --endpoint URL``: the batching tuner's load, sweep and reading of it
(Pareto front, best load for the SLO, knee, capacity) against an OpenAI-compatible server
instead of a local engine (:mod:`app.endpoints.load`); the limits are the server's own."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def tune_endpoint(args: argparse.Namespace, settings: list[Any], slo: Any) -> int:
    from app.endpoints import keys
    from app.endpoints.client import Endpoint, with_model
    from app.endpoints.load import failure_counts, outcome_counts, run_load
    from engine.bench.sweep_analysis import SweepPoint, format_reading, sweep_report

    endpoint = with_model(
        Endpoint(args.endpoint, model=args.endpoint_model, api_key=keys.key(args.endpoint))
    )
    points: list[SweepPoint] = []
    runs = []
    failures: dict[str, dict[str, Any]] = {}
    outcomes: dict[str, dict[str, int]] = {}
    try:
        for i, setting in enumerate(settings):
            run = run_load(endpoint, setting.load, slo, ignore_eos=not args.endpoint_eos)
            points.append(SweepPoint(setting, run.result))
            runs.append(run)
            r = run.result
            line = f"{r.output_throughput:.1f} out tok/s, p95 TTFT {r.ttft_ms['p95']:.0f} ms"
            if run.failures:  # the run marked where the server failed
                line += f"; failed: {failure_counts(run)}"
                failures[setting.label()] = {"counts": dict(run.failures),
                                             "first": run.first_failure}  # fmt: skip
            if args.traffic:  # how each request ended, by its fault
                ended = outcome_counts(run)
                outcomes[setting.label()] = ended
                line += "; " + ", ".join(f"{n} {k}" for k, n in ended.items())
            print(f"[{i + 1}/{len(settings)}] {setting.label()}: {line}", file=sys.stderr)
    except KeyboardInterrupt:
        print("stopped: the loads measured so far follow", file=sys.stderr)
    report = sweep_report(points, slo, target_rate=args.capacity,
                          peak_factor=args.peak_factor, headroom=args.headroom)  # fmt: skip
    report = {"endpoint": endpoint.name, "failures": failures, **report}
    if args.traffic:
        report["traffic"], report["outcomes"] = settings[0].load.traffic.describe(), outcomes
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{endpoint.name} · the server's own limits")
        print(format_reading(points, report, slo, args.capacity, replicas=False))
    if args.guidellm is not None and runs:  # after the reading: a path refused loses nothing
        from app.endpoints.export import write_guidellm

        try:
            write_guidellm(args.guidellm, runs, endpoint)
        except (OSError, ValueError) as exc:
            print(f"could not write GuideLLM's report to {args.guidellm}: {exc}", file=sys.stderr)
            return 1
        print(f"GuideLLM's report of {len(runs)} runs: {args.guidellm}", file=sys.stderr)
    return 0
