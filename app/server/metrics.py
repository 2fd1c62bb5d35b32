"""The server's Prometheus metrics, with vLLM's names, types and buckets (``vllm:`` prefix,
a ``model_name`` label), so that dashboards and benchmark tools made for vLLM read them
unchanged. The engine loop fills them: gauges and counters from the engine's snapshot a few
times a second, histograms from each request's figures as it finishes."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from engine.core.metrics import MetricsSnapshot, RequestMetrics
from engine.core.output import TokenEvent
from engine.hardware.nvml import device_utilization

if TYPE_CHECKING:
    from engine.core.engine import LLMEngine

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                         5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


def _token_buckets(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, … up to ``limit`` (vLLM's ``build_1_2_5_buckets``)."""
    out: list[float] = []
    power = 1
    while True:
        for m in (1, 2, 5):
            if m * power > limit:
                return tuple(out)
            out.append(float(m * power))
        power *= 10


#: our finish reasons that vLLM's ``request_success`` labels ``abort``
ABORTED = {"cancelled": "abort", "timeout": "abort"}


class ServerMetrics:
    def __init__(self, model_name: str, context_length: int = 1 << 20) -> None:
        self.registry = registry = CollectorRegistry()
        label = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, label, registry=registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, label, registry=registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, label, buckets=buckets, registry=registry).labels(
                model_name
            )

        self.running = gauge("vllm:num_requests_running", "Requests in the running set.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge(
            "vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1)."
        )
        self.kv_blocks = (
            gauge("infersight:kv_blocks_used", "KV-cache blocks held by requests."),
            gauge("infersight:kv_blocks_cached", "KV-cache blocks held by none, kept as a "
                  "reusable prefix."),
            gauge("infersight:kv_blocks_total", "KV-cache blocks in the pool."),
        )  # fmt: skip
        # vLLM's meanings: a served request's whole prompt (cached tokens too) once it has its
        # first token, and each token as it is made; the server's self-tests are not counted
        self.prompt_tokens = counter(
            "vllm:prompt_tokens", "Prompt tokens of requests that reached their first token."
        )
        self.prompt_tokens_cached = counter(
            "infersight:prompt_tokens_cached", "Of those, the tokens found in the prefix cache."
        )
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.preemptions = counter("vllm:num_preemptions", "Preemptions by recompute.")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self.success = Counter(
            "vllm:request_success", "Requests finished, by finish reason.",
            ["model_name", "finished_reason"], registry=registry,
        )  # fmt: skip
        self.model_name = model_name
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Time between tokens.", TOKEN_LATENCY_BUCKETS
        )
        self.tpot = histogram(
            "vllm:time_per_output_token_seconds", "Mean time per output token after the first.",
            TOKEN_LATENCY_BUCKETS,
        )  # fmt: skip
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to finish.", REQUEST_LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds", "Time waiting before first scheduled.",
            REQUEST_LATENCY_BUCKETS,
        )  # fmt: skip
        tokens = _token_buckets(context_length)
        self.request_prompt = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per request.", tokens
        )
        self.request_generation = histogram(
            "vllm:request_generation_tokens", "Generated tokens per request.", tokens
        )
        # ours: what was refused before reaching the engine (by HTTP status) and engine faults
        self._rejected = Counter(
            "infersight:rejected_requests", "Requests refused, by HTTP status.",
            ["model_name", "status"], registry=registry,
        )  # fmt: skip
        self.engine_errors = counter("infersight:engine_errors", "Engine steps that failed.")
        # the error rate is rate(request_errors) / rate(vllm:request_success + request_errors)
        self.request_errors = counter(
            "infersight:request_errors", "Requests ended by an engine error."
        )
        self.gpu_utilization = gauge(
            "infersight:gpu_utilization_perc", "GPU busy share over NVML's last sample (0-100)."
        )
        self.spec_drafts = counter(
            "vllm:spec_decode_num_drafts", "Speculative steps: (sequence, step) pairs with drafts."
        )
        self.spec_draft_tokens = counter(
            "vllm:spec_decode_num_draft_tokens", "Draft tokens proposed."
        )
        self.spec_accepted_tokens = counter(
            "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted."
        )
        self._spec_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position.",
            ["model_name", "position"], registry=registry,
        )  # fmt: skip
        self._totals = (0,) * 6
        self._per_pos: tuple[int, ...] = ()
        self._prefilled: set[str] = set()  # served requests past their first token

    def reject(self, status: int) -> None:
        self._rejected.labels(self.model_name, str(status)).inc()

    def observe_engine(self, snap: MetricsSnapshot) -> None:
        """Gauges from a snapshot; counters by what their engine totals grew since the last."""
        self.running.set(snap.num_requests_running)
        self.waiting.set(snap.num_requests_waiting)
        self.kv_usage.set(snap.kv_cache_usage_perc)
        for gauge, value in zip(self.kv_blocks, (snap.kv_blocks_used, snap.kv_blocks_cached,
                                                 snap.kv_blocks_total), strict=True):  # fmt: skip
            gauge.set(value)
        totals = (snap.total_preemptions, snap.prefix_cache_query_tokens,
                  snap.prefix_cache_hit_tokens, snap.spec_decode_num_drafts,
                  snap.spec_decode_num_draft_tokens,
                  snap.spec_decode_num_accepted_tokens)  # fmt: skip
        counters = (self.preemptions, self.prefix_queries, self.prefix_hits, self.spec_drafts,
                    self.spec_draft_tokens, self.spec_accepted_tokens)  # fmt: skip
        for c, new, old in zip(counters, totals, self._totals, strict=True):
            if new > old:
                c.inc(new - old)
        self._totals = totals
        # a new drafter starts its counts at zero: only growth is added
        per_pos = snap.spec_decode_num_accepted_tokens_per_pos
        for pos, new in enumerate(per_pos):
            old = self._per_pos[pos] if pos < len(self._per_pos) else 0
            if new > old:
                self._spec_per_pos.labels(self.model_name, str(pos)).inc(new - old)
        self._per_pos = per_pos

    def observe_gpu(self, device: torch.device) -> None:
        busy = device_utilization(device)
        if busy is not None:
            self.gpu_utilization.set(busy)

    def observe_event(self, event: TokenEvent, engine: LLMEngine) -> None:
        """A served request's event, on the engine's thread: its token counted as made, and
        with its first, its whole prompt (and the share the prefix cache held)."""
        rid = event.request_id
        if event.token_id is not None:
            self.generation_tokens.inc()
            if rid not in self._prefilled:
                self._prefilled.add(rid)
                seq = engine.seqs.get(rid)
                if seq is not None:
                    prompt, cached = len(seq.prompt_ids), seq.num_cached
                else:  # ended with its first token: the engine has let it go
                    done = engine.request_metrics(rid)
                    prompt, cached = (
                        (done.prompt_tokens, done.cached_prompt_tokens) if done else (0, 0)
                    )
                self.prompt_tokens.inc(prompt)
                self.prompt_tokens_cached.inc(cached)
        if event.finish_reason is not None:
            self._prefilled.discard(rid)

    def forget(self, request_id: str) -> None:
        """A request that failed (no finish event will come)."""
        self._prefilled.discard(request_id)

    def observe_request(self, m: RequestMetrics) -> None:
        reason = ABORTED.get(m.finish_reason, m.finish_reason)
        self.success.labels(self.model_name, reason).inc()
        if m.time_to_first_token_seconds is not None:
            self.ttft.observe(m.time_to_first_token_seconds)
        for gap in m.inter_token_latency_seconds:
            self.itl.observe(gap)
        if m.time_per_output_token_seconds is not None:
            self.tpot.observe(m.time_per_output_token_seconds)
        self.e2e.observe(m.e2e_request_latency_seconds)
        if m.request_queue_time_seconds is not None:
            self.queue_time.observe(m.request_queue_time_seconds)
        self.request_prompt.observe(m.prompt_tokens)
        self.request_generation.observe(m.output_tokens)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
