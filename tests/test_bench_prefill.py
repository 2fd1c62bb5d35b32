"""``infersight bench`` times prefills it computes: its single workload repeats one prompt, and
with prefix caching on (the default) every run after the first would find that prompt cached
unless the bench empties the cache first. Checked by the engine's own counts: each request's
``RequestMetrics.cached_prompt_tokens`` and the block manager's hit counter."""

from __future__ import annotations

from typing import Any

import pytest

import engine.bench.speed as bench
import engine.bench.table as table
from engine.bench.report import format_report, format_table
from engine.bench.speed import BenchConfig, run_bench
from engine.bench.table import run_table
from engine.core.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.core.sampling import SamplingParams

#: Three full 16-token blocks and a partial one: a repeat would find 48 tokens cached.
PROMPT_LEN = 56


@pytest.fixture
def engines(monkeypatch: pytest.MonkeyPatch) -> tuple[list[LLMEngine], list[tuple[Any, str]]]:
    """The engines the bench loads, and every request added to them (engine, id)."""
    loaded: list[LLMEngine] = []
    requests: list[tuple[Any, str]] = []
    load, add = bench.load_model, LLMEngine.add_request

    def recording_load(*args: Any, **kwargs: Any) -> LLMEngine:
        engine = load(*args, **kwargs)
        loaded.append(engine)
        return engine

    def recording_add(self: LLMEngine, *args: Any, **kwargs: Any) -> str:
        rid = add(self, *args, **kwargs)
        requests.append((self, rid))
        return rid

    monkeypatch.setattr(bench, "load_model", recording_load)
    monkeypatch.setattr(table, "load_model", recording_load)
    monkeypatch.setattr(LLMEngine, "add_request", recording_add)
    return loaded, requests


def _cached(requests: list[tuple[Any, str]]) -> list[int]:
    out = []
    for engine, rid in requests:
        m = engine.request_metrics(rid)
        assert m is not None and m.prompt_tokens == PROMPT_LEN
        out.append(m.cached_prompt_tokens)
    return out


def test_no_prefill_of_the_single_workload_reuses_a_cached_block(tiny_model_dir, engines):
    folder, _ = tiny_model_dir("llama", True)
    loaded, requests = engines
    report = run_bench(folder, BenchConfig(prompt_len=PROMPT_LEN, new_tokens=3, repeats=4))
    (engine,) = loaded
    mgr = engine.kv.manager
    assert mgr.prefix_caching  # on, as by default: the bench did not dodge it by turning it off
    assert len(requests) == 1 + 4  # the warm-up and the four measured runs
    assert _cached(requests) == [0] * 5
    assert mgr.stats.query_tokens == 5 * PROMPT_LEN and mgr.stats.hit_tokens == 0
    assert report["prefix_cache"] == "on, emptied before each run"
    assert report["cached_prompt_tokens"] == 0
    assert "prefix cache on, emptied before each run" in format_report(report)
    # The control: the same prompt once more, the cache kept, is found cached (3 full blocks).
    gen = engine.generate(
        bench.bench_prompt(engine, PROMPT_LEN, 0), SamplingParams(max_new_tokens=2)
    )
    for _ in gen:
        pass
    assert _cached(requests[-1:]) == [48]


def test_batch_copies_share_the_timed_request_prompt_but_it_computes_all(tiny_model_dir, engines):
    folder, _ = tiny_model_dir("llama", True)
    _, requests = engines
    report = run_bench(folder, BenchConfig(prompt_len=PROMPT_LEN, new_tokens=3, repeats=3, batch=3))
    cached = _cached(requests)
    assert len(cached) == 3 * (1 + 3)
    assert cached[::3] == [0] * 4  # each run's first request, the one its TTFT times
    assert all(c == 48 for i, c in enumerate(cached) if i % 3)  # its copies share its blocks
    assert report["cached_prompt_tokens"] == 0
    assert "2 other copies of a run's first request share its prompt blocks" in format_report(
        report
    )


def test_with_prefix_caching_off_the_report_says_off(tiny_model_dir, engines):
    folder, _ = tiny_model_dir("llama", True)
    _, requests = engines
    report = run_bench(
        folder, BenchConfig(prompt_len=PROMPT_LEN, new_tokens=3, repeats=2),
        engine_config=EngineConfig(prefix_caching=False),
    )  # fmt: skip
    assert _cached(requests) == [0] * 3
    assert report["prefix_cache"] == "off" and "prefix cache off" in format_report(report)


def test_table_runs_never_reuse_a_cached_block(tiny_model_dir, engines, monkeypatch):
    folder, _ = tiny_model_dir("llama", True)
    loaded, requests = engines
    monkeypatch.setattr(table, "measure_read_bandwidth", lambda: 1e10)
    report = run_table(folder, ["fp32", "int8"], BenchConfig(prompt_len=PROMPT_LEN, new_tokens=3,
                                                             repeats=2))  # fmt: skip
    # a warm-up and two repeats of each row: compiled and eager where the load compiled
    runs = sum(3 * (2 if e.graph.compiled else 1) for e in loaded)
    assert len(requests) == runs
    assert _cached(requests) == [0] * runs
    assert all(e.kv.manager.prefix_caching and e.kv.manager.stats.hit_tokens == 0 for e in loaded)
    assert "prefix cache on, emptied before each run" in format_table(report)
