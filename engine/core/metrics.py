"""The engine's metrics records: per-request timings, steps, memory by kind, per-layer
timings and :class:`MetricsSnapshot`, the rolling engine-wide figures. Plain data (no
tensors), safe to hand to another thread, and this module imports no torch, so the app's
views and the server read them without it. What measures them is
:mod:`engine.core.instruments`. Names follow vLLM's metric vocabulary."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    #: under tensor parallelism each rank's memory, rank 0 first: its GPU's used memory
    #: (NVML), or on a CPU its process's resident set; None where it cannot be read
    rank_bytes: tuple[int | None, ...] = ()


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
    kv_block_bytes: int = 0  # K and V of one block, every layer (the full ones: below)
    #: what the pool holds (:mod:`engine.formats.kv`: fp32, bf16, fp16, int8, fp8): the
    #: bytes above are its
    kv_dtype: str = ""
    #: the local layers' own pool where they have one (Gemma's sliding layers: only their
    #: windows), beside the full layers' blocks above: blocks held, blocks, and one's bytes
    kv_local_blocks_used: int = 0
    kv_local_blocks_total: int = 0
    kv_local_block_bytes: int = 0
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
    #: a mixture of experts: its layers of experts and, per layer, the tokens routed to each
    #: expert since the load (:func:`engine.model.moe.expert_load`); empty for a dense model
    expert_layers: tuple[int, ...] = ()
    expert_tokens: tuple[tuple[int, ...], ...] = ()

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
