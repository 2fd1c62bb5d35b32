"""The instruments tell the truth: figures against clocks and counts taken outside the engine."""

from __future__ import annotations

import gc
import time
from pathlib import Path

import pytest

from engine.core.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.core.sampling import SamplingParams
from engine.core.scheduler import SchedulerLimits
from engine.kv_cache.block_manager import RELEASED
from engine.loader.load import load_model
from engine.model.inventory import weight_bytes


def load(default_model: Path) -> LLMEngine:
    config = EngineConfig(num_blocks=128, limits=SchedulerLimits(max_batch_size=8))
    return load_model(default_model, config=config)


@pytest.fixture(scope="module")
def engine(default_model: Path) -> LLMEngine:
    """Shared by the tests that count nothing the others add to."""
    return load(default_model)


@pytest.mark.timing  # measures time: run alone (make test)
def test_throughput_ttft_and_kv_usage_match_outside_measurements(default_model: Path):
    engine = load(default_model)  # its own: the counts below are of this test's requests only
    engine.collector.window_s = float("inf")  # however long the run takes on this CPU
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    # no two share a prefix: every prompt token is computed (prompt throughput counts them)
    prompts = [list(range(1000 * i, 1000 * i + n)) for i, n in enumerate((5, 40, 17, 60), 1)]
    added: dict[str, tuple[float, float]] = {}  # before and after add_request
    first_step: dict[str, tuple[float, float]] = {}  # start and end of the first token's step
    generated = 0
    prompt_tokens = sum(len(p) for p in prompts)
    gc_was_enabled = gc.isenabled()
    gc.disable()  # no collection inside a step: the bounds below are a fraction of one
    try:
        start = time.perf_counter()
        for prompt in prompts:
            before = time.perf_counter()
            rid = engine.add_request(prompt, params)
            added[rid] = (before, time.perf_counter())
        usage_checked = 0
        while engine.has_work():
            stepped = time.perf_counter()
            events = engine.step()
            seen_at = time.perf_counter()
            for event in events:
                if event.token_id is not None:
                    generated += 1
                    first_step.setdefault(event.request_id, (stepped, seen_at))
            snap = engine.metrics()
            tables = engine.kv.manager.tables.values()
            held = len({b for table in tables for b in table if b != RELEASED})
            assert snap.kv_blocks_used == held
            assert snap.kv_cache_usage_perc == pytest.approx(held / snap.kv_blocks_total)
            usage_checked += held > 0
        elapsed = time.perf_counter() - start
    finally:
        if gc_was_enabled:
            gc.enable()
    assert usage_checked > 10

    snap = engine.metrics()
    assert generated == 4 * 20
    assert snap.generation_throughput_tps == pytest.approx(generated / elapsed, rel=0.1)
    assert snap.prompt_throughput_tps == pytest.approx(prompt_tokens / elapsed, rel=0.1)
    finished = {r.request_id: r for r in snap.finished_requests}
    for rid, (add_began, add_ended) in added.items():
        inside = finished[rid].time_to_first_token_seconds
        assert inside is not None
        stepped, seen_at = first_step[rid]
        # arrival within add_request, the first token within its step, as the outside clock saw
        assert stepped - add_ended <= inside <= seen_at - add_began
        # and at the end of that step, where the token is made: only its return lies after
        step_s, late = seen_at - stepped, (seen_at - add_began) - inside
        assert late < 0.5 * step_s, (
            f"stamped {late * 1e3:.1f} ms before a {step_s * 1e3:.1f} ms step ended"
        )
        assert finished[rid].output_tokens == 20
        assert len(finished[rid].inter_token_latency_seconds) == 19
    ttft = snap.latency_percentiles["time_to_first_token_seconds"]
    assert ttft["count"] == 4 and ttft["p50"] <= ttft["p95"] <= ttft["p99"]


def test_memory_by_kind_and_layer_timings(engine):
    snap = engine.metrics()
    assert snap.memory.weights_bytes == weight_bytes(engine.model)
    assert snap.memory.kv_pool_bytes == engine.kv.nbytes
    assert snap.memory.process_rss_bytes is not None
    assert snap.memory.process_rss_bytes > snap.memory.weights_bytes

    engine.enable_layer_timing(True)
    rid = engine.add_request(list(range(100, 130)), SamplingParams(max_new_tokens=1))
    started = time.perf_counter()
    engine.step()
    step_time = time.perf_counter() - started
    timings = engine.metrics().layer_timings
    engine.enable_layer_timing(False)
    assert [t.layer for t in timings] == list(range(engine.cfg.num_layers))
    assert all(t.attention_s > 0 and t.mlp_s > 0 for t in timings)
    assert sum(t.attention_s + t.mlp_s for t in timings) < step_time
    assert engine.metrics().layer_timings == ()
    del rid


def test_snapshot_is_plain_data(engine):
    import dataclasses

    import torch

    def walk(value):
        if dataclasses.is_dataclass(value):
            for f in dataclasses.fields(value):
                walk(getattr(value, f.name))
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)
        else:
            assert not isinstance(value, torch.Tensor)
            assert isinstance(value, (int, float, str, type(None)))

    walk(engine.metrics())
