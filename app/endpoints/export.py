"""A server's load runs written out: as GuideLLM's report (``benchmarks.json``,
:mod:`engine.bench.guidellm_json`), which ``guidellm export`` and every tool that reads
GuideLLM's JSON read as a run of its own, one benchmark per run of a sweep."""

from __future__ import annotations

import importlib.metadata
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from app.endpoints.client import Endpoint, server_url
from app.endpoints.load import EndpointRun, Record
from engine.bench.guidellm_json import Run, TimedRequest, write_report
from engine.bench.load_spec import LoadSpec


def timed(record: Record, index: int, run: EndpointRun, offset: float) -> TimedRequest:
    """A record by the wall clock (``offset``: Unix seconds less ``time.perf_counter``)."""
    start = record.sent + offset
    first = None
    if record.time_to_first_token_seconds is not None:
        first = start + record.time_to_first_token_seconds
    last = None if first is None else first + sum(record.itl_s)
    status = "errored" if record.failure else ("cancelled" if record.cut else "completed")
    error = None
    if record.failure:
        error = f"{record.failure}: {run.first_failure.get(record.failure, '')}"
    return TimedRequest(
        request_id=f"{index}", status=status, start=start, end=start + record.e2e_s,
        first_token=first, last_token=last,
        iterations=0 if first is None else len(record.itl_s) + 1,
        prompt_tokens=record.input_tokens or None,
        output_tokens=record.output_tokens if record.failure is None else None,
        targeted_start=None if record.due is None else record.due + offset, error=error,
    )  # fmt: skip


def guidellm_runs(runs: Sequence[EndpointRun]) -> list[Run]:
    """The runs as GuideLLM's benchmarks, their requests in the order they were sent."""
    offset = time.time() - time.perf_counter()
    out = []
    for run in runs:
        records = sorted(run.records, key=lambda r: r.sent)
        spec = run.spec or LoadSpec()
        requests = tuple(timed(r, i, run, offset) for i, r in enumerate(records))
        constraints: dict[str, dict[str, Any]] = {}
        if spec.requests is not None:
            constraints["max_requests"] = {"max_num": spec.requests}
        if spec.duration_s is not None:
            constraints["max_duration"] = {"max_duration": spec.duration_s}
        environment: dict[str, Any] = {}
        label = spec.describe()
        if len(run.users) > 1:  # turned while it ran: GuideLLM's strategy holds the last level
            environment["turned"] = [{"at_s": t, "load": load} for t, load in run.users]
            label = "turned " + " → ".join(f"{load:g}" for _, load in run.users) + (
                " users" if spec.mode == "closed" else " req/s")  # fmt: skip
        if spec.mode == "poisson" and spec.burstiness != 1:  # gamma gaps, not GuideLLM's own
            environment["burstiness"] = spec.burstiness
        out.append(Run(spec.mode, spec.load, requests, label, constraints, environment))
    return out


def write_guidellm(path: Path, runs: Sequence[EndpointRun], endpoint: Endpoint) -> None:
    """``runs`` (a sweep's, or one live run) as GuideLLM's ``benchmarks.json`` at ``path``."""
    try:
        version = importlib.metadata.version("infersight")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout not installed
        version = ""
    write_report(path, guidellm_runs(runs), target=server_url(endpoint.base_url) + "/v1",
                 model=endpoint.model, source="infersight", version=version)  # fmt: skip
