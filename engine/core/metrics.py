"""The engine's instruments: per-request timings, rolling engine-wide figures, memory by
kind and opt-in per-layer timings. :class:`MetricsSnapshot` is plain data (no tensors), safe
to hand to another thread. Names follow vLLM's metric vocabulary."""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from engine.hardware.nvml import device_memory

log = logging.getLogger(__name__)

LATENCY_METRICS = (
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "time_per_output_token_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
)


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    request_id: str
    finish_reason: str
    prompt_tokens: int
    output_tokens: int
    request_queue_time_seconds: float | None
    time_to_first_token_seconds: float | None
    time_per_output_token_seconds: float | None  # mean gap after the first token
    e2e_request_latency_seconds: float
    inter_token_latency_seconds: tuple[float, ...]
    preemptions: int = 0
    #: TTFT = queue time + prefill time (admission to first token), in which the
    #: ``cached_prompt_tokens`` found in the prefix cache cost nothing; the rest was computed
    prefill_time_seconds: float | None = None
    cached_prompt_tokens: int = 0

    @property
    def computed_prompt_tokens(self) -> int:
        return self.prompt_tokens - self.cached_prompt_tokens


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One step, and how its token budget was spent: ``decode_tokens`` (one per decoding
    sequence) + ``prefill_tokens`` (prompt chunks, recomputation after a preemption included)
    out of ``token_budget`` (``max_tokens_per_step``); the rest went unused."""

    end: float
    duration_s: float
    batch_size: int
    prompt_tokens: int  # tokens of prompts prefilled (recomputation included)
    generated_tokens: int
    kv_used_blocks: int
    decode_tokens: int = 0
    prefill_tokens: int = 0  # tokens in chunks longer than one (prompt and recomputed output)
    token_budget: int = 0
    preempted: int = 0  # sequences preempted by recompute while scheduling this step
    waiting: int = 0  # requests left waiting after scheduling
    max_batch_size: int = 0  # the limit this step was scheduled under


@dataclass(frozen=True, slots=True)
class MemoryByKind:
    weights_bytes: int
    kv_pool_bytes: int
    workspace_bytes: int | None  # CUDA: allocated − weights − pool; CPU: not separable
    process_rss_bytes: int | None = None
    cuda_allocated_bytes: int | None = None
    cuda_reserved_bytes: int | None = None
    nvml_used_bytes: int | None = None
    nvml_total_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class LayerTiming:
    layer: int
    attention_s: float
    mlp_s: float


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    time: float
    window_s: float
    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage_perc: float  # 0..1, as vLLM reports it
    kv_blocks_used: int
    kv_blocks_total: int
    kv_tokens_stored: int
    kv_waste_slots: int
    prompt_throughput_tps: float
    generation_throughput_tps: float
    mean_batch_size: float
    mean_step_time_s: float
    steps: int
    latency_percentiles: dict[str, dict[str, float]]
    memory: MemoryByKind
    layer_timings: tuple[LayerTiming, ...] = ()
    finished_requests: tuple[RequestMetrics, ...] = ()
    total_prompt_tokens: int = 0
    total_generated_tokens: int = 0
    #: the request ids holding each pool block (two or more: shared by prefix caching)
    kv_block_owners: tuple[tuple[str, ...], ...] = ()
    kv_block_cached: tuple[bool, ...] = ()  # held by none, keeping a reusable prefix
    kv_blocks_cached: int = 0
    kv_blocks_shared: int = 0
    kv_block_bytes: int = 0  # K and V of one block, every layer
    prefix_caching: bool = False
    #: tokens of the requests admitted while prefix caching was on, and of those, the tokens
    #: found cached (vLLM's prefix_cache_queries / prefix_cache_hits)
    prefix_cache_query_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    #: the scheduler limits in force (``SchedulerLimits`` fields) and the KV pool's usable cap
    limits: dict[str, float] = field(default_factory=dict)
    #: the last steps, oldest first (what the tuner's per-step strip draws)
    recent_steps: tuple[StepRecord, ...] = ()
    total_preemptions: int = 0
    #: speculative decoding's drafter (``self:int4-g32+head``, ``lookup``, ``model:DIR``; empty:
    #: off) and its counters since it started, in vLLM's names: drafts ((sequence, step) pairs
    #: with drafts), draft tokens, accepted tokens, and both per draft position
    speculative: str = ""
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_draft_tokens_per_pos: tuple[int, ...] = ()
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    #: seconds spent drafting and verifying (the target's forward and the rule), in all and in
    #: the last step that verified drafts; the draft model's memory (weights and KV pool)
    spec_decode_draft_time_seconds: float = 0.0
    spec_decode_verify_time_seconds: float = 0.0
    spec_decode_last_draft_seconds: float = 0.0
    spec_decode_last_verify_seconds: float = 0.0
    spec_decode_draft_bytes: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Prompt tokens reused / prompt tokens, since the engine started (None: none yet)."""
        q = self.prefix_cache_query_tokens
        return self.prefix_cache_hit_tokens / q if q else None

    @property
    def spec_decode_acceptance_rate(self) -> float | None:
        """Accepted draft tokens / draft tokens (None: nothing drafted yet)."""
        d = self.spec_decode_num_draft_tokens
        return self.spec_decode_num_accepted_tokens / d if d else None

    @property
    def spec_decode_mean_acceptance_length(self) -> float | None:
        """Tokens a verifying step yields per sequence: 1 + accepted / drafts (vLLM's)."""
        n = self.spec_decode_num_drafts
        return 1.0 + self.spec_decode_num_accepted_tokens / n if n else None

    @property
    def spec_decode_acceptance_per_pos(self) -> tuple[float, ...]:
        """At each draft position, the share of the drafts reaching it that were accepted."""
        return tuple(
            a / d if d else 0.0
            for a, d in zip(
                self.spec_decode_num_accepted_tokens_per_pos,
                self.spec_decode_num_draft_tokens_per_pos,
                strict=True,
            )
        )


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

    def collect(self) -> tuple[LayerTiming, ...]:
        """Timings of the forward passes since the last call (one step's, normally)."""
        if self.cuda and self._events:
            torch.cuda.synchronize(self.device)
            for key, start, end in self._events:
                self._totals[key] = self._totals.get(key, 0.0) + start.elapsed_time(end) / 1e3
            self._events.clear()
        totals, self._totals = self._totals, {}
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
