"""The engine's instruments, which need torch: the rolling records of steps and finished
requests (:class:`MetricsCollector`) and their percentiles, opt-in per-layer timings
(:class:`LayerTimer`) and memory by kind (:func:`memory_by_kind`). What they produce are the
plain records of :mod:`engine.core.metrics`."""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import torch
from torch import nn

from engine.core.config import layer_block_bytes
from engine.core.metrics import (
    LATENCY_METRICS,
    LayerTiming,
    MemoryByKind,
    MetricsSnapshot,
    RequestMetrics,
    StepRecord,
)
from engine.hardware.nvml import device_memory
from engine.kv_cache.layered import LayeredBlockManager
from engine.model.moe import expert_load

log = logging.getLogger(__name__)


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    t = torch.tensor(values, dtype=torch.float64)
    q = torch.quantile(t, torch.tensor([0.5, 0.95, 0.99], dtype=torch.float64)).tolist()
    return {"p50": q[0], "p95": q[1], "p99": q[2], "mean": float(t.mean()), "count": len(values)}


class MetricsCollector:
    """Rolling records of steps and finished requests; :meth:`snapshot` summarises them."""

    RECENT_STEPS = 256

    def __init__(self, window_s: float = 30.0, max_requests: int = 4096) -> None:
        self.window_s = window_s
        self.steps: deque[StepRecord] = deque()
        self.recent: deque[StepRecord] = deque(maxlen=self.RECENT_STEPS)
        self.total_preemptions = 0
        self.steps_recorded = 0
        self.batch_size_total = 0
        self.requests: deque[tuple[float, RequestMetrics]] = deque(maxlen=max_requests)
        self.total_prompt_tokens = 0
        self.total_generated_tokens = 0

    def record_step(self, record: StepRecord) -> None:
        self.steps.append(record)
        self.recent.append(record)
        self.total_preemptions += record.preempted
        self.steps_recorded += 1
        self.batch_size_total += record.batch_size
        self.total_prompt_tokens += record.prompt_tokens
        self.total_generated_tokens += record.generated_tokens
        self._trim(record.end)

    def record_request(self, now: float, metrics: RequestMetrics) -> None:
        self.requests.append((now, metrics))

    def _trim(self, now: float) -> None:
        while self.steps and self.steps[0].end < now - self.window_s:
            self.steps.popleft()

    def summary(self, now: float) -> dict[str, Any]:
        self._trim(now)
        steps = list(self.steps)
        recent = [m for t, m in self.requests if t >= now - self.window_s]
        span = (steps[-1].end - (steps[0].end - steps[0].duration_s)) if steps else 0.0
        lat: dict[str, list[float]] = {name: [] for name in LATENCY_METRICS}
        for m in recent:
            for name in LATENCY_METRICS:
                if name == "inter_token_latency_seconds":
                    lat[name].extend(m.inter_token_latency_seconds)
                    continue
                value = getattr(m, name)
                if value is not None:
                    lat[name].append(value)
        return {
            "prompt_throughput_tps": sum(s.prompt_tokens for s in steps) / span if span else 0.0,
            "generation_throughput_tps": (
                sum(s.generated_tokens for s in steps) / span if span else 0.0
            ),
            "mean_batch_size": sum(s.batch_size for s in steps) / len(steps) if steps else 0.0,
            "mean_step_time_s": sum(s.duration_s for s in steps) / len(steps) if steps else 0.0,
            "steps": len(steps),
            "latency_percentiles": {k: percentiles(v) for k, v in lat.items() if v},
            "finished_requests": tuple(recent),
        }


class LayerTimer:
    """Opt-in per-layer timings: forward hooks on each layer's attention and MLP.

    On CUDA the hooks record events on the current stream of the model's device (the
    worker's own stream there), read back after the step; on CPU, ops run synchronously and
    ``perf_counter`` is exact. Hooks cost time, so they are attached only while enabled.
    """

    def __init__(self, layers: nn.ModuleList, device: torch.device) -> None:
        self.device = device  # events and waits name it: the current device may be another
        self.cuda = device.type == "cuda"
        self._handles: list[Any] = []
        self._starts: dict[tuple[int, str], Any] = {}
        self._totals: dict[tuple[int, str], float] = {}
        self._events: list[tuple[tuple[int, str], Any, Any]] = []
        self.layers = layers

    @property
    def enabled(self) -> bool:
        return bool(self._handles)

    def enable(self) -> None:
        if self._handles:
            return
        for index, layer in enumerate(self.layers):
            parts: tuple[tuple[str, nn.Module], ...] = (
                ("attention", layer.get_submodule("attn")),
                ("mlp", layer.get_submodule("mlp")),
            )
            for kind, module in parts:
                key = (index, kind)
                self._handles.append(module.register_forward_pre_hook(self._pre(key)))
                self._handles.append(module.register_forward_hook(self._post(key)))

    def disable(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _now(self) -> Any:
        if self.cuda:
            with torch.cuda.device(self.device):
                event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                event.record(torch.cuda.current_stream(self.device))
            return event
        return time.perf_counter()

    def _pre(self, key: tuple[int, str]) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self._starts[key] = self._now()

        return hook

    def _post(self, key: tuple[int, str]) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            start, end = self._starts.pop(key), self._now()
            if self.cuda:
                self._events.append((key, start, end))
            else:
                self._totals[key] = self._totals.get(key, 0.0) + end - start

        return hook

    def collect(self, timed: Sequence[tuple[float, float]] = ()) -> tuple[LayerTiming, ...]:
        """Timings of the forward passes since the last call (one step's, normally), with
        ``timed``'s (each layer's attention and MLP seconds, as a C decode step times them:
        :mod:`engine.executor.c_step`) added."""
        if self.cuda and self._events:
            # The events were recorded in order on one stream: once the last has happened,
            # every one has. Waiting for the whole device would also wait for other streams
            # (the A/B lab's engines run on one of their own).
            self._events[-1][2].synchronize()
            for key, start, end in self._events:
                self._totals[key] = self._totals.get(key, 0.0) + start.elapsed_time(end) / 1e3
            self._events.clear()
        totals, self._totals = self._totals, {}
        for i, (attention, mlp) in enumerate(timed):
            totals[(i, "attention")] = totals.get((i, "attention"), 0.0) + attention
            totals[(i, "mlp")] = totals.get((i, "mlp"), 0.0) + mlp
        if not totals:
            return ()
        count = len(self.layers)
        return tuple(
            LayerTiming(i, totals.get((i, "attention"), 0.0), totals.get((i, "mlp"), 0.0))
            for i in range(count)
        )


def memory_by_kind(weights_bytes: int, kv_pool_bytes: int, device: torch.device) -> MemoryByKind:
    """Memory by kind; on CUDA also the allocator's figures and the GPU's own (NVML).

    ``cuda_reserved_bytes`` is what predicts running out: the allocator holds it whether or not
    tensors use it, and NVML's used figure adds the CUDA context and other processes.
    """
    rss = None
    try:
        import psutil

        rss = int(psutil.Process(os.getpid()).memory_info().rss)
    except Exception:  # psutil missing or the platform refuses: RSS is optional
        rss = None
    if device.type != "cuda":
        return MemoryByKind(weights_bytes, kv_pool_bytes, None, process_rss_bytes=rss)
    allocated = int(torch.cuda.memory_allocated(device))
    reserved = int(torch.cuda.memory_reserved(device))
    gpu = device_memory(device)
    return MemoryByKind(
        weights_bytes,
        kv_pool_bytes,
        max(0, allocated - weights_bytes - kv_pool_bytes),
        process_rss_bytes=rss,
        cuda_allocated_bytes=allocated,
        cuda_reserved_bytes=reserved,
        nvml_used_bytes=gpu.used_bytes if gpu is not None else None,
        nvml_total_bytes=gpu.total_bytes if gpu is not None else None,
    )


def snapshot(engine: Any) -> MetricsSnapshot:
    """An engine's (:class:`~engine.core.engine.LLMEngine`) figures now: its queues, its KV
    pool block by block (bytes by the pool's real format), memory by kind, the collector's
    window, speculation's and the experts' figures."""
    now = time.perf_counter()
    mgr = engine.kv.manager
    occ = mgr.occupancy()
    summary = engine.collector.summary(now)
    return MetricsSnapshot(
        time=now,
        window_s=engine.collector.window_s,
        num_requests_running=len(engine.scheduler.running),
        num_requests_waiting=len(engine.scheduler.waiting),
        kv_cache_usage_perc=occ.usage,
        kv_blocks_used=occ.used_blocks,
        kv_blocks_total=occ.total_blocks,
        kv_tokens_stored=occ.tokens_stored,
        kv_waste_slots=occ.waste_slots,
        memory=engine.memory(),
        layer_timings=engine.layer_timings,
        total_prompt_tokens=engine.collector.total_prompt_tokens,
        total_generated_tokens=engine.collector.total_generated_tokens,
        kv_block_owners=tuple(mgr.owners()),
        kv_block_cached=tuple(mgr.cached_blocks()),
        kv_blocks_cached=occ.cached_blocks,
        kv_blocks_shared=occ.shared_blocks,
        **_pool_figures(engine),
        prefix_caching=mgr.prefix_caching,
        prefix_cache_query_tokens=mgr.stats.query_tokens,
        prefix_cache_hit_tokens=mgr.stats.hit_tokens,
        limits={**asdict(engine.scheduler.limits), "kv_blocks": mgr.capacity},
        recent_steps=tuple(engine.collector.recent),
        total_preemptions=engine.collector.total_preemptions,
        **(engine.speculator.metrics() if engine.speculator is not None else {}),
        **expert_load(engine.model),
        **summary,
    )


def _pool_figures(engine: Any) -> dict[str, Any]:
    """The pool's format, a block's bytes in it, and the local layers' own pool where they
    have one."""
    mgr, bs, fmt = engine.kv.manager, engine.kv.block_size, engine.kv.format
    full, local = layer_block_bytes(engine.cfg, bs, fmt)
    if not isinstance(mgr, LayeredBlockManager):
        full += local
        return {"kv_block_bytes": full, "kv_dtype": fmt.name}
    return {
        "kv_block_bytes": full, "kv_local_block_bytes": local, "kv_dtype": fmt.name,
        "kv_local_blocks_used": mgr.local.num_used,
        "kv_local_blocks_total": mgr.local.num_blocks,
    }  # fmt: skip
