"""`LLMEngine`: a model behind a paged KV pool; requests in, token events out.

The request API and the live settings are here; one step of the engine is
:mod:`engine.core.step` (schedule → draft → forward → sample/verify → commit → events), the
model call :mod:`engine.core.runner`, the events and finish rules :mod:`engine.core.output`.
``generate()`` wraps it all for scripts: it adds one request and steps the engine until that
request finishes (other requests advance too).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine import attention
from engine.core import kernel_choice, paths_report
from engine.core import step as stepping
from engine.core.config import (
    EngineConfig,
    kv_format,
    kv_pool_blocks,
    local_blocks,
    pool_bytes,
)
from engine.core.instruments import LayerTimer, MetricsCollector, memory_by_kind, snapshot
from engine.core.metrics import LayerTiming, MemoryByKind, MetricsSnapshot, RequestMetrics
from engine.core.output import OutputProcessor, TokenEvent
from engine.core.pool_profile import PoolSizing, profile_pool
from engine.core.runner import ModelRunner
from engine.core.sampling import SamplingParams, make_generator
from engine.core.scheduler import Scheduler, SchedulerLimits
from engine.core.sequence import FinishReason
from engine.core.sequence import Sequence as Seq
from engine.core.structured import Grammars
from engine.errors import (
    EngineBusyError,
    InvalidRequestError,
    OutOfMemoryError,
)
from engine.executor import cuda_graphs, inductor
from engine.executor.step import LAYER_TIMINGS
from engine.hardware.memory import free_memory
from engine.kv_cache import dtypes as kv_dtypes
from engine.kv_cache.layered import LayeredBlockManager
from engine.kv_cache.paged import PagedKVCache
from engine.kv_cache.window import CacheWindow, effective_window
from engine.model.config import ModelConfig
from engine.model.inventory import weight_bytes
from engine.model.tokenizer import Tokenizer
from engine.model.transformer import Transformer
from engine.quant.inventory import weight_report
from engine.quant.spec import PrecisionSpec, dtype_name

if TYPE_CHECKING:
    from engine.core.generation import Generation
    from engine.speculative.config import SpeculativeConfig
    from engine.speculative.speculator import Speculator

log = logging.getLogger(__name__)

#: ``(config, engine, the speculator it has now)`` → the speculator to use from the next step
SpeculationFactory = Callable[["SpeculativeConfig", "LLMEngine", "Speculator | None"], "Speculator"]


class LLMEngine:
    """A model behind a paged KV pool and a continuous-batching scheduler. Requests go in
    with :meth:`add_request`; each :meth:`step` (:mod:`engine.core.step`) advances them and
    returns its :class:`TokenEvent` list. Settings change live: limits, the cache window,
    prefix caching, speculative decoding, the pool's size (:meth:`with_pool`)."""

    #: the model's own sampling defaults (``generation_config.json``), set by the load
    default_sampling: dict[str, Any]

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        cfg: ModelConfig,
        *,
        eos_token_ids: Sequence[int],
        dtype: torch.dtype,
        device: torch.device,
        name: str = "model",
        num_parameters: int = 0,
        config: EngineConfig | None = None,
        precision: PrecisionSpec | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.eos_token_ids = frozenset(eos_token_ids)
        self.dtype = dtype
        self.device = device
        self.name = name
        #: the folder the model was loaded from (None when built directly)
        self.folder: Path | None = None
        self.num_parameters = num_parameters
        self.precision = precision or PrecisionSpec(dtype_name(dtype), dtype)
        self.config = config or EngineConfig()
        #: bytes of the weights on the engine's device (a GPU's host experts are not)
        self.weights_bytes = weight_bytes(model, device)
        #: weights by kind and the form/path each runs in (the load report, the app's model info)
        self.weight_groups = weight_report(model)
        #: why a GPU's pool has its size (the profiled warm-up's figures); None: the config
        #: gave it, or a CPU's share of its RAM
        self.pool_sizing: PoolSizing | None = None
        #: our kernels that failed their load-time check (:mod:`engine.kernels.triton_check`)
        #: and left their work to torch: each also a line of the load report
        self.kernel_failures: list[str] = []
        #: what attention runs on, and why (a line of the load report)
        failures = self.kernel_failures
        #: what the KV pool holds (:mod:`engine.kv_cache.dtypes`)
        self.kv_format = kv_format(self.config, dtype)
        if why := kv_dtypes.device_refusal(self.kv_format, cfg.head_dim, device):
            raise InvalidRequestError(why)
        self.attention, self.kernels = attention.choose(
            cfg, dtype, device, failures, self.kv_format
        )
        self.triton = self.attention.name == "triton"
        self.kernels += kernel_choice.layers(
            self.model, cfg, dtype, device, self.triton, failures, self.kv_format
        )
        self.kernels += kernel_choice.gemms(self.model, device, dtype, failures)
        blocks = self._pool_blocks()
        self.kv = PagedKVCache(
            cfg,
            num_blocks=blocks,
            block_size=self.config.block_size,
            dtype=dtype,
            device=device,
            prefix_caching=self.config.prefix_caching,
            attention=self.attention,
            local_blocks=local_blocks(cfg, self.config, blocks),
            kv_format=self.kv_format,
        )
        self.scheduler = Scheduler(self.kv.manager, self.config.limits, model.rope.long_after)
        #: the window every sequence runs under: the user's within the model's own sliding
        #: window, or the model's where the user set none (:func:`effective_window`)
        self.window = effective_window(self.config.window, cfg.sliding_window)
        if why := self.attention.window_refusal(cfg, self.window):
            raise InvalidRequestError(why)
        self.kv.manager.set_window(self.window)
        self.collector = MetricsCollector(self.config.metrics_window_s)
        self.layer_timer = LayerTimer(model.layers, device)
        self.layer_timings: tuple[LayerTiming, ...] = ()
        self.runner = ModelRunner(model, cfg, dtype, device)
        self.outputs = OutputProcessor(tokenizer, self.eos_token_ids, self.collector)
        self._grammars: Grammars | None = None  # built at the first constrained request
        self._grammars_lock = threading.Lock()
        #: live requests (unfinished) by id
        self.seqs: dict[str, Seq] = {}
        #: events of requests ended between steps (cancelled), delivered by the next step
        self.pending: list[TokenEvent] = []
        self._ids = itertools.count()
        self.hold_s = 0.0
        #: how decode steps run (eager or one compiled graph), settled by the load
        self.graph = inductor.GraphChoice(False, "not compiled (engine built directly)")
        #: decode steps over static buffers, replayed as CUDA graphs, or why not
        self.graphs = cuda_graphs.GraphsChoice(None, "off (engine built directly)")
        #: the CPU thread count the load settled, and why (one line)
        self.threads_report = ""
        #: builds speculative decoding for :meth:`set_speculation` (it may load a draft
        #: model: :func:`engine.load` wires it; an engine built directly has none)
        self.speculation: SpeculationFactory | None = None
        #: speculative decoding's drafter and state (None: off); :meth:`set_speculation`
        self.speculator: Speculator | None = None
        #: under tensor parallelism, rank 0's driver of the other ranks (its ``close`` stops
        #: them: :func:`engine.loader.parallel.load_parallel`); None on one device
        self.parallel: Any = None

    def with_pool(
        self, *, kv_memory: float | None = None, num_blocks: int | None = None,
        kv_dtype: str | None = None,
    ) -> LLMEngine:  # fmt: skip
        """The same model, tokenizer and settings behind a new KV pool (``kv_memory`` bytes or
        ``num_blocks`` blocks; neither: a GPU's is profiled again, :mod:`engine.core.pool_profile`,
        with this pool left out; ``kv_dtype``: its format, None: this one's): resizing the
        pool or changing what it holds never loads the weights again. Refused
        while this engine has requests (they live in its pool) or when the new pool would not
        fit in the memory free now plus this engine's pool."""
        from dataclasses import replace

        if self.has_work():
            raise InvalidRequestError(
                "the KV pool can change only when no request is running; wait for the "
                "replies to finish or stop them"
            )
        config = replace(
            self.config, kv_memory=kv_memory, num_blocks=num_blocks,
            kv_dtype=self.config.kv_dtype if kv_dtype is None else kv_dtype,
        )  # fmt: skip
        fmt = kv_format(config, self.dtype)
        if why := kv_dtypes.device_refusal(fmt, self.cfg.head_dim, self.device):
            raise InvalidRequestError(why)
        backend = self.attention  # the new pool's, which its warm-up attends with
        if fmt != self.kv_format:
            backend = attention.choose(self.cfg, self.dtype, self.device, [], fmt)[0]
        if self.device.type == "cuda":  # what the allocator caches counts as free here
            torch.cuda.empty_cache()
        # a GPU's default pool is profiled now, this pool left out (the new one replaces it)
        sizing = profile_pool(
            self.model, self.cfg, config, self.dtype, self.device, held=self.kv.nbytes,
            attention=backend,
        )  # fmt: skip
        if sizing is not None:
            config = replace(config, num_blocks=self._check_blocks(sizing.blocks, sizing))
        blocks = kv_pool_blocks(self.cfg, config, self.dtype, self.device)
        size = pool_bytes(self.cfg, config, self.dtype, blocks)
        grow = size - self.kv.nbytes
        free = free_memory(self.device)
        if sizing is None and grow > 0.9 * free:  # a profiled pool fits by its measure
            raise OutOfMemoryError(
                f"a KV pool of {size / 2**20:.0f} MiB needs "
                f"{grow / 2**20:.0f} MiB more than the current one and {self.device} has "
                f"{free / 2**20:.0f} MiB free; choose at most "
                f"{(self.kv.nbytes + 0.9 * free) / 2**20:.0f} MiB"
            )
        self.enable_layer_timing(False)  # its hooks are on the shared model
        # the old pool goes first, and the graphs that hold its addresses with it
        old, self.kv = self.kv, None  # type: ignore[assignment]
        static, self.runner.static = self.runner.static, None
        try:
            new = self.sibling(config)
        except BaseException:
            self.kv, self.runner.static = old, static  # this engine goes on as it was
            raise
        new.speculator, self.speculator = self.speculator, None  # no request holds drafts
        if static is not None:  # captured anew over the new pool
            new.settle_cuda_graphs()
        if sizing is not None:  # the figures the new pool was sized from
            new.pool_sizing = sizing
        return new

    def settle_cuda_graphs(self) -> None:
        """Build (and on a GPU capture) the static decode steps the config asks for
        (:mod:`engine.executor.cuda_graphs`): at load, and for a new pool."""
        self.graphs = cuda_graphs.settle(
            self.config.cuda_graphs, self.model, self.kv, self.config.limits.max_batch_size
        )
        self.runner.static = self.graphs.runner

    def sibling(self, config: EngineConfig) -> LLMEngine:
        """Another engine on this one's weights (shared, not copied), with a KV pool and
        settings of its own: two engines to compare side by side on one model."""
        new = LLMEngine(
            self.model, self.tokenizer, self.cfg, eos_token_ids=sorted(self.eos_token_ids),
            dtype=self.dtype, device=self.device, name=self.name,
            num_parameters=self.num_parameters, config=config, precision=self.precision,
        )  # fmt: skip
        new.default_sampling = dict(getattr(self, "default_sampling", {}))
        new.graph, new.threads_report = self.graph, self.threads_report
        new.folder, new.speculation = self.folder, self.speculation
        if self.parallel is not None:  # the same ranks hold the shared model's other shards
            new.parallel = self.parallel
            new.kernels += f"; {self.parallel.summary}"
        return new

    def _pool_blocks(self) -> int:
        """The pool's size: profiled on a GPU where the config does not give it
        (:mod:`engine.core.pool_profile`, its figures kept in :attr:`pool_sizing`), else
        :func:`kv_pool_blocks`."""
        conf = self.config
        self.pool_sizing = profile_pool(
            self.model, self.cfg, conf, self.dtype, self.device, attention=self.attention
        )
        if self.pool_sizing is not None:
            return self._check_blocks(self.pool_sizing.blocks, self.pool_sizing)
        return self._check_blocks(kv_pool_blocks(self.cfg, conf, self.dtype, self.device))

    def _check_blocks(self, blocks: int, sizing: PoolSizing | None = None) -> int:
        """``blocks``, refused when the budget holds none: with a GPU's figures where it was
        profiled (``sizing``), else with what to give."""
        if blocks >= 1:
            return blocks
        if sizing is not None:
            raise InvalidRequestError(sizing.refusal())
        per_block = PagedKVCache.bytes_per_block(self.cfg, self.config.block_size, self.kv_format)
        raise InvalidRequestError(
            f"the KV budget holds no block ({per_block / 2**20:.2f} MiB each); "
            "give --kv-memory more"
        )

    # -- requests -------------------------------------------------------------------------
    @property
    def context_length(self) -> int:
        return self.cfg.max_position_embeddings

    def chat_prompt_ids(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages, tools=tools))

    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        timeout_s: float | None = None,
        request_id: str | None = None,
        arrival: float | None = None,
    ) -> str:
        """Queue a request; returns its id. Raises at once for a request that can never run
        and :class:`EngineBusyError` when the waiting queue is full. ``arrival`` (a
        ``time.perf_counter()`` time, default now) is when the request was due: a load
        generator that adds it late still counts its queue time and TTFT from then."""
        prompt = list(prompt_ids)
        max_new = self.check_request(prompt, params)
        limits = self.scheduler.limits
        if len(self.scheduler.waiting) >= limits.max_waiting:
            raise EngineBusyError(
                f"the engine is busy: {len(self.scheduler.waiting)} requests are waiting "
                f"(max_waiting={limits.max_waiting}); try again when some have finished"
            )
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.seqs:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        arrived = time.perf_counter() if arrival is None else arrival
        seq = Seq(rid, prompt, params, arrived, priority, timeout_s)
        seq.max_new_tokens = max_new
        if params.constraint is not None:  # a bad grammar is refused before it queues
            seq.matcher = self.grammars.matcher(params.constraint)
        seq.generator = make_generator(params.seed, self.device)
        seq.history = torch.empty(len(prompt) + max_new, dtype=torch.long, device=self.device)
        seq.history[: len(prompt)] = torch.tensor(prompt)
        self.seqs[rid] = seq
        self.outputs.open(seq)
        self.scheduler.add(seq)
        return rid

    @property
    def grammars(self) -> Grammars:
        """The structured-output matchers' tokenizer view (:mod:`engine.core.structured`)."""
        with self._grammars_lock:  # the server's thread may ask while the engine's builds
            if self._grammars is None:
                self._grammars = Grammars(
                    self.tokenizer, self.cfg.vocab_size, sorted(self.eos_token_ids)
                )
        return self._grammars

    def check_request(self, prompt: list[int], params: SamplingParams) -> int:
        """Raise :class:`InvalidRequestError` for a request that could never run here (empty
        or too long a prompt, unknown token ids, more KV than the pool holds); return the new
        tokens it may have (``max_new_tokens`` capped by the context). Reads only settings,
        so a server may ask it from another thread before queueing the request."""
        self.validate_prompt(prompt)
        vocab = self.cfg.vocab_size
        if any(not 0 <= t < vocab for t in params.extra_stop_token_ids):
            raise InvalidRequestError(f"stop token ids must be in [0, {vocab})")
        max_new = min(params.max_new_tokens, self.context_length - len(prompt))
        self._check_fits(len(prompt) + max_new)
        return max_new

    def validate_prompt(self, prompt: list[int]) -> None:
        """Raise :class:`InvalidRequestError` for a prompt that could never run here (empty,
        too long, token ids outside the vocabulary)."""
        if not prompt:
            raise InvalidRequestError("the prompt is empty; give at least one token of text")
        if len(prompt) >= self.context_length:
            raise InvalidRequestError(
                f"the prompt has {len(prompt)} tokens but the model's context is "
                f"{self.context_length}; shorten the prompt or reset the conversation"
            )
        vocab = self.cfg.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")

    def _kv_tokens(
        self, tokens: int, limits: SchedulerLimits | None = None,
        window: CacheWindow | bool | None = True,
    ) -> int:  # fmt: skip
        """KV slots a request of ``tokens`` tokens holds at most at once (under ``limits``
        and ``window``; default: the engine's own)."""
        w = self.window if window is True else window
        if isinstance(w, CacheWindow):  # blocks outside sink + window go back as it runs
            chunk = (limits or self.scheduler.limits).max_tokens_per_step
            tokens = min(tokens, w.sink + w.window + chunk + 2 * self.kv.manager.block_size)
        return tokens

    def _check_fits(self, tokens: int) -> None:
        mgr = self.kv.manager
        tokens = self._kv_tokens(tokens)
        needed = mgr.blocks_for(tokens)
        if needed > mgr.capacity:
            raise InvalidRequestError(
                f"this request needs up to {tokens} tokens of KV cache ({needed} blocks) but the "
                f"pool holds {mgr.capacity} blocks ({mgr.capacity * mgr.block_size} tokens); "
                "shorten the prompt, lower max_new_tokens or give the KV cache more memory"
            )

    def cancel(self, request_id: str) -> bool:
        """Stop a request wherever it is; its blocks are freed at once. The ``cancelled``
        event arrives with the next :meth:`step`. False if it is unknown or already over."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.is_finished:
            return False
        self.scheduler.remove(seq)
        self.pending.append(self.finish(seq, FinishReason.CANCELLED, time.perf_counter()))
        return True

    def update_limits(self, **changes: float) -> SchedulerLimits:
        """Change scheduler limits on a live engine; they apply from the next step.
        ``kv_blocks`` caps the blocks in use at once (at most the pool's size): lowering it
        below what runs makes the scheduler preempt, and it is refused below what the
        largest live request needs on its own."""
        mgr = self.kv.manager
        blocks = int(changes.pop("kv_blocks", mgr.capacity))
        limits = self.scheduler.limits.updated(**changes)
        if not 1 <= blocks <= mgr.num_blocks:
            raise InvalidRequestError(
                f"kv_blocks must be in [1, {mgr.num_blocks}] (the pool's size), got {blocks}"
            )
        self._check_live_requests(blocks, limits, self.window)
        mgr.set_capacity(blocks)
        self.scheduler.limits = limits
        return limits

    def _check_live_requests(
        self, blocks: int, limits: SchedulerLimits, window: CacheWindow | None
    ) -> None:
        """Refuse a KV cap, limits or window under which a request already queued or running
        could no longer fit on its own (it would wait, or preempt itself, for ever), or one
        sequence no longer in the local layers' own pool."""
        mgr = self.kv.manager
        if isinstance(mgr, LayeredBlockManager) and (why := mgr.one_sequence_refusal(window)):
            raise InvalidRequestError(why)
        need = max(
            (self.kv.manager.blocks_for(
                self._kv_tokens(len(s.prompt_ids) + s.max_new_tokens, limits, window))
             for s in self.seqs.values()),
            default=1,
        )  # fmt: skip
        if blocks < need:
            raise InvalidRequestError(
                f"a KV pool of {blocks} blocks cannot hold a live request that needs {need}; "
                f"give it at least {need} blocks, or wait until the long requests finish"
            )

    def set_window(self, window: CacheWindow | None) -> None:
        """Turn the cache window on, off or change it; applies from the next step. Refused
        when a live request would no longer fit the KV pool's usable blocks without it, and,
        for a model with a sliding window of its own, when it reaches beyond that window
        (``None`` then means the model's window)."""
        window = effective_window(window, self.cfg.sliding_window)
        if why := self.attention.window_refusal(self.cfg, window):
            raise InvalidRequestError(why)
        self._check_live_requests(self.kv.manager.capacity, self.scheduler.limits, window)
        self.window = window
        self.kv.manager.set_window(window)

    def set_prefix_caching(self, on: bool) -> None:
        """Share cached prefixes between requests, or not (off also forgets them): for
        measuring what caching saves. Applies to the requests admitted from now on."""
        from dataclasses import replace

        self.kv.manager.set_prefix_caching(on)
        self.config = replace(self.config, prefix_caching=on)

    def set_speculation(self, config: SpeculativeConfig | None) -> None:
        """Speculative decoding with the drafter ``config`` names (:mod:`engine.speculative`),
        or off (``None``). A new drafter is built first (a draft model may be loaded), so a
        failure leaves the engine as it was; changing only k or the adaptive settings keeps
        the drafter. Applies from the next step, running requests included."""
        old = self.speculator
        if config is None:
            self.speculator = None
            for seq in self.seqs.values():
                seq.spec_k = 0  # no slots reserved for drafts from the next step
            if old is not None:
                old.close()
            return
        if self.speculation is None:
            raise InvalidRequestError(
                "speculative decoding needs an engine made by engine.load (a drafter may load "
                "a model); load this model with it"
            )
        self.speculator = self.speculation(config, self, old)

    def clear_prefix_cache(self) -> None:
        """Forget every cached prefix; the blocks of running requests stay theirs."""
        self.kv.manager.clear_cache()

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.pending)

    def sequence(self, request_id: str) -> Seq:
        """The live state of an unfinished request (KeyError once it has finished)."""
        return self.seqs[request_id]

    # -- stepping ----------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """One step (:func:`engine.core.step.step`): the events of every request it advanced
        or ended."""
        return stepping.step(self)

    def append(self, seq: Seq, token: int, now: float) -> TokenEvent:
        """``token`` joins ``seq``; its event (the request's last where the token ends it)."""
        event, finish = self.outputs.token(seq, token, now)
        if finish is None:
            return event
        self.scheduler.remove(seq)
        last = self.finish(seq, finish, now)
        last.token_id, last.text, last.prompt_logprobs = token, event.text, event.prompt_logprobs
        return last

    def finish(self, seq: Seq, reason: FinishReason, now: float) -> TokenEvent:
        """End ``seq`` (already out of the scheduler): its last event."""
        if self.speculator is not None:
            self.speculator.forget(seq.request_id)
        self.seqs.pop(seq.request_id, None)
        return self.outputs.finish(seq, reason, now)

    # -- instruments -------------------------------------------------------------------------
    def enable_layer_timing(self, on: bool = True) -> None:
        """Per-layer timings need every layer called eagerly: while they are on, a compiled
        decode step runs eagerly; a C one (:mod:`engine.executor.c_step`) times its
        layers itself."""
        executor = self.runner.executor
        if on:
            executor.eager_reasons.add(LAYER_TIMINGS)
            self.layer_timer.enable()
        else:
            self.layer_timer.disable()
            executor.eager_reasons.discard(LAYER_TIMINGS)
            self.layer_timings = ()
        if executor.c_step is not None:
            executor.c_step.time_layers(on)

    def collect_layer_timings(self) -> None:
        """The step's per-layer timings, where they are on."""
        if self.layer_timer.enabled:
            step = self.runner.executor.c_step
            taken = step.take_layer_seconds() if step is not None else ()
            self.layer_timings = self.layer_timer.collect(taken)

    def paths(self) -> dict[str, Any]:
        """What ran, and why (:mod:`engine.core.paths_report`)."""
        return paths_report.paths(self)

    def memory(self) -> MemoryByKind:
        """Memory by kind now; under tensor parallelism each rank's too."""
        memory = memory_by_kind(self.weights_bytes, self.kv.nbytes, self.device)
        if self.parallel is None:
            return memory
        return dataclasses.replace(memory, rank_bytes=self.parallel.memory(self.device))

    def metrics(self) -> MetricsSnapshot:
        """The engine's figures now (:func:`engine.core.instruments.snapshot`)."""
        return snapshot(self)

    def request_metrics(self, request_id: str) -> RequestMetrics | None:
        """The figures of a recently finished request (``None`` if unknown or still running)."""
        for _, m in reversed(self.collector.requests):
            if m.request_id == request_id:
                return m
        return None

    def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, priority: int = 0
    ) -> Generation:
        """Start one request; iterate the result for its :class:`TokenEvent` as they come."""
        from engine.core.generation import Generation

        return Generation(self, list(prompt_ids), params, priority)
