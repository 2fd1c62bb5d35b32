"""The tuner's runs against a server as GuideLLM's report (engine/bench/guidellm_json.py,
app/endpoints/export.py), read by GuideLLM 0.8.1 itself: its report model loads the file, its
metrics recomputed from the exported requests (``GenerativeMetrics.compile``) equal every
figure written, each request's figures are the client's own, and its console and CSV outputs
take it — for a closed loop and an open loop on ``infersight serve``, and for runs the test's
misbehaving server failed or a stop cut short."""

from __future__ import annotations

import asyncio
import csv
import io
import math
import threading
from pathlib import Path
from typing import Any

import pytest

from app.endpoints.client import Endpoint, with_model
from app.endpoints.export import write_guidellm
from app.endpoints.load import EndpointRun, run_load
from engine.bench.load_spec import LoadSpec, PromptMix
from tests.misbehaving import RIGHT
from tests.served import KEY

schemas = pytest.importorskip("guidellm.benchmark.schemas")  # dev extras: the oracle
SHORT = PromptMix(documents=0.0, conversations=0.0, output_median=6, output_min=3, output_max=9)


def differences(ours: Any, theirs: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """Where two JSON trees differ (numbers within 1e-9 relative)."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        return [d for k in sorted(set(ours) | set(theirs))
                for d in differences(ours.get(k), theirs.get(k), f"{path}.{k}")]  # fmt: skip
    if isinstance(ours, int | float) and isinstance(theirs, int | float):
        close = math.isclose(ours, theirs, rel_tol=1e-9, abs_tol=1e-9)
        return [] if close else [(path, ours, theirs)]
    return [] if ours == theirs else [(path, ours, theirs)]


def read_back(path: Path) -> Any:
    """The report as GuideLLM loads it, each benchmark's metrics checked against GuideLLM's
    own from the exported requests, and its console and CSV outputs run on it."""
    from guidellm.benchmark.outputs import GenerativeBenchmarkerConsole, GenerativeBenchmarkerCSV
    from guidellm.utils.console import Console

    report = schemas.GenerativeBenchmarksReport.load_file(path)
    for b in report.benchmarks:
        acc = schemas.GenerativeBenchmarkAccumulator(config=b.config)
        acc.completed.requests_stats = list(b.requests.successful or [])
        acc.errored.requests_stats = list(b.requests.errored or [])
        acc.incomplete.requests_stats = list(b.requests.incomplete or [])
        acc.timings.request_start = acc.timings.measure_start = (
            b.scheduler_metrics.measure_start_time
        )
        acc.timings.request_end = acc.timings.measure_end = b.scheduler_metrics.measure_end_time
        theirs = schemas.GenerativeMetrics.compile(acc).model_dump(mode="json")
        assert differences(b.metrics.model_dump(mode="json"), theirs) == []
    shown = io.StringIO()
    asyncio.run(
        GenerativeBenchmarkerConsole(console=Console(file=shown, width=220)).finalize(report)
    )
    table = path.with_suffix(".csv")
    asyncio.run(GenerativeBenchmarkerCSV(output_path=table).finalize(report))
    rows = list(csv.reader(table.open(encoding="utf-8")))
    assert len(rows) >= 2 + len(report.benchmarks) - 1  # headers and a row per benchmark
    return report, shown.getvalue()


def requests_match(run: EndpointRun, benchmark: Any) -> None:
    """Each exported request's figures, as GuideLLM derives them, are the client's own."""
    exported = {r.request_id: r for r in (*benchmark.requests.successful,
                                          *benchmark.requests.errored,
                                          *benchmark.requests.incomplete)}  # fmt: skip
    assert len(exported) == len(run.records)
    for i, record in enumerate(sorted(run.records, key=lambda r: r.sent)):
        got = exported[str(i)]
        assert got.request_latency == pytest.approx(record.e2e_s, abs=1e-6)
        if record.failure is None:
            assert got.output_tokens == record.output_tokens
            assert got.prompt_tokens == (record.input_tokens or None)  # None: not said
            assert got.time_to_first_token_ms == pytest.approx(
                1e3 * record.time_to_first_token_seconds, abs=1e-3
            )
        else:
            assert got.info.status == "errored" and record.failure in got.info.error


def test_closed_and_open_loop_runs_read_back_in_guidellm(server, tmp_path):
    endpoint = with_model(Endpoint(server, api_key=KEY))
    closed = run_load(endpoint, LoadSpec(users=2, requests=4, seed=1, mix=SHORT))
    opened = run_load(endpoint, LoadSpec(mode="constant", rate=4.0, requests=4, seed=2, mix=SHORT))
    path = tmp_path / "benchmarks.json"
    write_guidellm(path, [closed, opened], endpoint)
    report, shown = read_back(path)
    first, second = report.benchmarks
    assert (first.config.strategy.type_, first.config.strategy.streams) == ("concurrent", 2)
    assert (second.config.strategy.type_, second.config.strategy.rate) == ("constant", 4.0)
    assert report.config.spec.backend.model == endpoint.model
    for run, benchmark in ((closed, first), (opened, second)):
        requests_match(run, benchmark)
        assert benchmark.metrics.request_totals.successful == run.result.completed == 4
        tokens = benchmark.metrics.output_token_count.successful.total_sum
        assert tokens == pytest.approx(run.result.total_output_tokens)
    assert second.metrics.request_dispatch_delay is not None  # arrivals at a rate: their delays
    assert "concurrent@2" in shown and "constant@4.00" in shown


def test_failed_and_stopped_runs_read_back_in_guidellm(misbehaving, tmp_path):
    spec = LoadSpec(users=2, requests=4, seed=0, mix=SHORT)
    busy = run_load(Endpoint(misbehaving, model="busy", api_key=RIGHT), spec)
    dropped = run_load(Endpoint(misbehaving, model="drop", api_key=RIGHT), spec)
    stop = threading.Event()
    threading.Timer(0.6, stop.set).start()
    long = Endpoint(misbehaving, model="long", api_key=RIGHT)
    cut = run_load(long, LoadSpec(users=2, requests=2, mix=SHORT), stop=stop)
    path = tmp_path / "failed.json"
    write_guidellm(path, [busy, dropped, cut], long)
    report, _ = read_back(path)
    for run, benchmark in zip((busy, dropped, cut), report.benchmarks, strict=True):
        requests_match(run, benchmark)
    rate_limited = report.benchmarks[0].requests.errored[0].info.error
    assert rate_limited.startswith("rate_limited:") and "retry after 3 s" in rate_limited
    assert report.benchmarks[1].metrics.request_totals.errored == 4
    stopped = report.benchmarks[2].requests.incomplete
    assert len(stopped) == 2 and all(r.info.status == "cancelled" for r in stopped)


def test_tune_writes_guidellms_report_headless(server, monkeypatch, capsys, tmp_path):
    from app.cli.main import main

    monkeypatch.setenv("INFERSIGHT_ENDPOINT_KEY", KEY)
    path = tmp_path / "sweep.json"
    args = ["tune", "--endpoint", server, "--users", "1", "2", "--requests", "2",
            "--output-median", "4", "--output-max", "6", "--documents", "0",
            "--conversations", "0", "--guidellm", str(path)]  # fmt: skip
    assert main(args) == 0
    report, _ = read_back(path)
    assert [b.config.strategy.streams for b in report.benchmarks] == [1, 2]
    assert report.config.spec.profile.streams == [1, 2]
    assert f"GuideLLM's report of 2 runs: {path}" in capsys.readouterr().err
    assert main(["tune", "--guidellm", str(path)]) == 2  # a local engine's runs: not this
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "give --endpoint URL too" in line
