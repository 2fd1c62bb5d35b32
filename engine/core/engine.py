"""`LLMEngine`: load a model, accept requests, step them through continuous batching.

One step = the scheduler picks which tokens of which sequences to compute, the block manager
gives them KV slots, the model runs one forward over the flattened batch, the sampler picks
each finished-prefill sequence's next token, the detokenizer turns it into text, and finished
sequences release their blocks. ``step()`` returns that step's :class:`TokenEvent` list.

``generate()`` wraps this for scripts: it adds one request and steps the engine until that
request finishes (other requests advance too).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.core.metrics import (
    LayerTimer,
    LayerTiming,
    MetricsCollector,
    MetricsSnapshot,
    RequestMetrics,
    StepRecord,
    memory_by_kind,
)
from engine.core.sampling import SamplingParams, make_generator, sample
from engine.core.scheduler import ScheduledChunk, Scheduler, SchedulerLimits, SchedulerOutput
from engine.core.sequence import FinishReason, Status
from engine.core.sequence import Sequence as Seq
from engine.errors import InfersightError, InvalidRequestError, OutOfMemoryError
from engine.kernels import decode_graph
from engine.kv_cache.paged import (
    CacheWindow,
    ContiguousKVCache,
    PagedKVCache,
    SeqChunk,
    effective_window,
)
from engine.loader.load import kv_pool_blocks
from engine.loader.weights import (
    weight_bytes,
    weight_report,
)
from engine.model.config import ModelConfig
from engine.model.tokenizer import IncrementalDetokenizer, Tokenizer
from engine.model.transformer import Transformer
from engine.quant.quantize import (
    PrecisionSpec,
    dtype_name,
    parse_precision_spec,
)
from engine.speculative.speculator import (
    ACCEPTED,
    BONUS,
    CORRECTED,
    Draft,
    SpeculativeConfig,
    Speculator,
    accept,
    build_drafter,
    measure_costs,
    same_drafter,
)

log = logging.getLogger(__name__)


class EngineBusyError(InfersightError):
    """The waiting queue is full; the request was not accepted."""


def parse_precision(text: str, device: torch.device | str = "cpu") -> PrecisionSpec:
    """A precision spec (``fp32``, ``bf16``, ``int8``, ``int4-g64``, ``mixed:…``); see
    :mod:`engine.quant.quantize`. Raises :class:`InvalidRequestError` naming what is available."""
    return parse_precision_spec(text, device)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """KV pool size and scheduling. The pool is ``num_blocks`` blocks if given, else
    ``kv_memory`` bytes (> 1) or that fraction of free memory (<= 1), else a default share
    (10% of available RAM on CPU, 50% of free GPU memory), never more than the running set
    can use at full context. ``prefix_caching``: full KV blocks of a prefix already computed
    are shared by the requests that start with it (:class:`~engine.kv_cache.paged.BlockManager`)."""

    block_size: int = 16
    num_blocks: int | None = None
    kv_memory: float | None = None
    limits: SchedulerLimits = field(default_factory=SchedulerLimits)
    window: CacheWindow | None = None
    metrics_window_s: float = 30.0
    #: ``auto`` / ``on`` / ``off`` (:mod:`engine.kernels.decode_graph`); None:
    #: INFERSIGHT_DECODE_GRAPH
    decode_graph: str | None = None
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        try:
            decode_graph.requested_mode(self.decode_graph)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        if self.block_size < 1:
            raise InvalidRequestError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise InvalidRequestError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_memory is not None and not self.kv_memory > 0:
            raise InvalidRequestError(f"kv_memory must be > 0, got {self.kv_memory}")


@dataclass(slots=True)
class TokenEvent:
    """What one step did for one request: the sampled token and the text it released
    (possibly empty: a held-back partial character or stop-string prefix). ``token_id`` is
    ``None`` for events without a token (cancelled, timed out). ``finish_reason`` is set on a
    request's last event: ``stop``, ``length``, ``cancelled`` or ``timeout``."""

    request_id: str
    token_id: int | None
    text: str
    finish_reason: str | None = None
    #: with ``SamplingParams.logprobs``: the token's log-probability and ``(id, logprob)`` of
    #: the likeliest tokens at its step, best first
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    #: with speculative decoding, how the token came: ``accepted`` (a draft the model
    #: accepted), ``corrected`` (the model's token where it rejected a draft) or ``bonus`` (its
    #: token after accepting every draft); empty for a step without drafts
    speculation: str = ""


@dataclass(slots=True)
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    ttft_s: float | None = None  # request arrival → first token sampled
    tpot_s: float | None = None  # mean time per output token after the first

    def as_dict(self) -> dict[str, object]:
        return {
            "prompt_ids": self.prompt_ids,
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
        }


@dataclass(slots=True)
class _Stream:
    """Text state of one request: detokenizer, stop-string matcher, text so far."""

    detok: IncrementalDetokenizer
    stops: StopStringMatcher
    text: str = ""


class LLMEngine:
    #: the model's own sampling defaults (``generation_config.json``), set by :meth:`load`
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
        self.weights_bytes = weight_bytes(model)
        #: weights by kind and the form/path each runs in (the load report, the app's model info)
        self.weight_groups = weight_report(model)
        self.kv = PagedKVCache(
            cfg,
            num_blocks=self._pool_blocks(),
            block_size=self.config.block_size,
            dtype=dtype,
            device=device,
            prefix_caching=self.config.prefix_caching,
        )
        self.scheduler = Scheduler(self.kv.manager, self.config.limits)
        #: the window every sequence runs under: the user's within the model's own sliding
        #: window, or the model's where the user set none (:func:`effective_window`)
        self.window = effective_window(self.config.window, cfg.sliding_window)
        self.kv.manager.set_window(self.window)
        self.collector = MetricsCollector(self.config.metrics_window_s)
        self.layer_timer = LayerTimer(model.layers, device)
        self._layer_timings: tuple[LayerTiming, ...] = ()
        self._seqs: dict[str, Seq] = {}
        self._streams: dict[str, _Stream] = {}
        self._pending: list[TokenEvent] = []
        self._ids = itertools.count()
        self.hold_s = 0.0
        #: how decode steps run (eager or one compiled graph), settled by :meth:`load`
        self.graph = decode_graph.GraphChoice(False, "not compiled (engine built directly)")
        #: the CPU thread count the load settled, and why (one line)
        self.threads_report = ""
        #: speculative decoding's drafter and state (None: off); :meth:`set_speculation`
        self.speculator: Speculator | None = None

    def with_pool(
        self, *, kv_memory: float | None = None, num_blocks: int | None = None
    ) -> LLMEngine:
        """The same model, tokenizer and settings behind a new KV pool (``kv_memory`` bytes or
        ``num_blocks`` blocks): resizing the pool never loads the weights again. Refused while
        this engine has requests (they live in its pool) or when the new pool would not fit
        in the memory free now plus this engine's pool."""
        from dataclasses import replace

        from engine.loader.load import free_memory, kv_pool_blocks

        if self.has_work():
            raise InvalidRequestError(
                "the KV pool can change only when no request is running; wait for the "
                "replies to finish or stop them"
            )
        config = replace(self.config, kv_memory=kv_memory, num_blocks=num_blocks)
        if self.device.type == "cuda":  # what the allocator caches counts as free here
            torch.cuda.empty_cache()
        blocks = kv_pool_blocks(self.cfg, config, self.dtype, self.device)
        per_block = PagedKVCache.bytes_per_block(self.cfg, config.block_size, self.dtype)
        grow = (blocks - self.kv.manager.num_blocks) * per_block
        free = free_memory(self.device)
        if grow > 0.9 * free:
            raise OutOfMemoryError(
                f"a KV pool of {blocks * per_block / 2**20:.0f} MiB needs "
                f"{grow / 2**20:.0f} MiB more than the current one and {self.device} has "
                f"{free / 2**20:.0f} MiB free; choose at most "
                f"{(self.kv.nbytes + 0.9 * free) / 2**20:.0f} MiB"
            )
        self.enable_layer_timing(False)  # its hooks are on the shared model
        old, self.kv = self.kv, None  # type: ignore[assignment]  # the old pool goes first
        try:
            new = self.sibling(config)
        except BaseException:
            self.kv = old  # this engine goes on as it was
            raise
        new.speculator, self.speculator = self.speculator, None  # no request holds drafts
        return new

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
        new.folder = self.folder
        return new

    def _settle_decode_graph(self) -> decode_graph.GraphChoice:
        """Compile the decode step where :func:`decode_graph.choose` says so, and compile it
        now: a few warm-up steps on scratch sequences, so that no reply waits for it."""
        choice = decode_graph.choose(self.config.decode_graph, self.device)
        if not choice.compiled:
            return choice
        model = self.model
        compiled = decode_graph.CompiledDecode(model.body)
        model.compiled_decode = compiled
        started = time.perf_counter()
        try:
            self._warm_decode(compiled)
            compiled.warm = True
        except Exception as exc:  # an Inductor failure on this model: eager still works
            model.compiled_decode = None
            why = decode_graph.reason(exc)
            log.warning("compiling the decode step failed, running eagerly: %s", why)
            return decode_graph.GraphChoice(False, f"compiling failed ({why}); eager")
        took = time.perf_counter() - started
        return decode_graph.GraphChoice(True, f"{choice.why}, compiled in {took:.0f} s")

    def _warm_decode(self, compiled: decode_graph.CompiledDecode) -> None:
        """Decode steps of batch 2 and 1 on scratch sequences: the two graphs that every later
        decode step uses (:func:`decode_graph.compile_forward`). Errors propagate (the
        model's forward would fall back to eager and hide them)."""
        mgr = self.kv.manager
        per_seq = mgr.blocks_for(4)
        if mgr.num_free < per_seq:
            raise RuntimeError("the KV pool has no room for the warm-up's scratch sequence")
        batch = 2 if mgr.num_free >= 2 * per_seq else 1
        ids = [f"\0warm{i}" for i in range(batch)]
        model = self.model
        try:
            for rid in ids:
                mgr.grow(rid, 2)
            model(
                torch.zeros(2 * batch, dtype=torch.long, device=self.device),
                torch.arange(2, device=self.device).repeat(batch),
                self.kv.context([SeqChunk(rid, 0, 2) for rid in ids]),
            )
            for b in range(batch, 0, -1):
                for pos in (2, 3):
                    for rid in ids[:b]:
                        mgr.grow(rid, pos + 1)
                    with torch.inference_mode():
                        compiled(
                            model.embed(torch.zeros(b, dtype=torch.long, device=self.device)),
                            torch.full((b,), pos, device=self.device),
                            self.kv.context([SeqChunk(rid, pos, 1) for rid in ids[:b]]),
                            torch.arange(b, device=self.device),
                        )
        finally:
            for rid in ids:
                mgr.free(rid)

    def _pool_blocks(self) -> int:
        conf = self.config
        blocks = kv_pool_blocks(self.cfg, conf, self.dtype, self.device)
        if blocks < 1:
            per_block = PagedKVCache.bytes_per_block(self.cfg, conf.block_size, self.dtype)
            raise InvalidRequestError(
                f"the KV budget holds no block ({per_block / 2**20:.2f} MiB each); "
                "give --kv-memory more"
            )
        return blocks

    # -- requests -------------------------------------------------------------------------
    @property
    def context_length(self) -> int:
        return self.cfg.max_position_embeddings

    def chat_prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages))

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
        if rid in self._seqs:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        arrived = time.perf_counter() if arrival is None else arrival
        seq = Seq(rid, prompt, params, arrived, priority, timeout_s)
        seq.max_new_tokens = max_new
        seq.generator = make_generator(params.seed, self.device)
        seq.history = torch.empty(len(prompt) + max_new, dtype=torch.long, device=self.device)
        seq.history[: len(prompt)] = torch.tensor(prompt)
        self._seqs[rid] = seq
        self._streams[rid] = _Stream(
            IncrementalDetokenizer(self.tokenizer), StopStringMatcher(params.stop)
        )
        self.scheduler.add(seq)
        return rid

    def check_request(self, prompt: list[int], params: SamplingParams) -> int:
        """Raise :class:`InvalidRequestError` for a request that could never run here (empty
        or too long a prompt, unknown token ids, more KV than the pool holds); return the new
        tokens it may have (``max_new_tokens`` capped by the context). Reads only settings,
        so a server may ask it from another thread before queueing the request."""
        self._validate_prompt(prompt)
        max_new = min(params.max_new_tokens, self.context_length - len(prompt))
        self._check_fits(len(prompt) + max_new)
        return max_new

    def _validate_prompt(self, prompt: list[int]) -> None:
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
        seq = self._seqs.get(request_id)
        if seq is None or seq.is_finished:
            return False
        self.scheduler.remove(seq)
        self._pending.append(self._finish(seq, FinishReason.CANCELLED, time.perf_counter()))
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
        could no longer fit on its own (it would wait, or preempt itself, for ever)."""
        need = max(
            (self.kv.manager.blocks_for(
                self._kv_tokens(len(s.prompt_ids) + s.max_new_tokens, limits, window))
             for s in self._seqs.values()),
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
        """Speculative decoding with the drafter ``config`` names
        (:mod:`engine.speculative.speculator`), or off (``None``). A new drafter is built first
        (a draft model is loaded), so a failure leaves the engine as it was; changing only k or
        the adaptive settings keeps the drafter. Applies from the next step, running requests
        included."""
        old = self.speculator
        if config is None:
            self.speculator = None
            for seq in self._seqs.values():
                seq.spec_k = 0  # no slots reserved for drafts from the next step
            if old is not None:
                old.close()
            return
        if old is not None and same_drafter(old.config, config):
            self.speculator = old.with_config(config)
            return
        drafter = build_drafter(config, self)
        try:
            verify, draft = measure_costs(self, drafter, config.k, config.verify_cost)
        except BaseException:
            drafter.close()
            raise
        if old is not None:
            old.close()
        self.speculator = Speculator(config, drafter, verify, draft)
        log.info(
            "speculative decoding: %s, k up to %d; here verifying k drafts costs %.2f + "
            "%.3f·k of a decode step, a draft token %.2f", config.label, config.k,
            verify.fixed, verify.per_token, draft,
        )  # fmt: skip

    def clear_prefix_cache(self) -> None:
        """Forget every cached prefix; the blocks of running requests stay theirs."""
        self.kv.manager.clear_cache()

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending)

    def sequence(self, request_id: str) -> Seq:
        """The live state of an unfinished request (KeyError once it has finished)."""
        return self._seqs[request_id]

    # -- stepping -------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        events, self._pending = self._pending, []
        started = time.perf_counter()
        spec = self.speculator
        if spec is not None:
            spec.plan(self.scheduler.running)
        out = self.scheduler.schedule(started)
        self.hold_s = out.hold_s
        for seq in out.timed_out:
            events.append(self._finish(seq, FinishReason.TIMEOUT, started))
        if spec is not None:
            for seq in out.preempted:  # its draft cache goes with its blocks
                spec.drafter.forget(seq.request_id)
        if not out.chunks:
            if out.preempted:  # everything running was preempted: the step did no work
                self._record_step(out, started, started, prompt_tokens=0, generated=0)
            return events

        drafts = self._draft(out.chunks) if spec is not None else {}
        forward_started = time.perf_counter()
        # A chunk verifying drafts is 1 + d tokens long: it goes after the decode chunks.
        order = sorted(out.chunks, key=lambda c: c.length != 1 or c.seq.request_id in drafts)
        ids: list[int] = []
        positions: list[int] = []
        chunks: list[SeqChunk] = []
        rows: list[int] = []
        samplers: list[tuple[ScheduledChunk, int]] = []  # (chunk, its first row of logits)
        for c in order:
            rid = c.seq.request_id
            new = c.seq.tokens(c.start, c.start + c.length)
            if rid in drafts:
                new += drafts[rid].tokens
            ids += new
            positions += range(c.start, c.start + len(new))
            chunks.append(SeqChunk(rid, c.start, len(new), self.window))
            if c.samples:
                samplers.append((c, len(rows)))
                drafted = len(drafts[rid].tokens) if rid in drafts else 0
                rows += range(len(ids) - 1 - drafted, len(ids))
        ctx = self.kv.context(chunks)
        logits = self.model(
            torch.tensor(ids, device=self.device),
            torch.tensor(positions, device=self.device),
            ctx,
            torch.tensor(rows, dtype=torch.long, device=self.device),
        )
        mgr = self.kv.manager
        for c in order:
            if c.seq.request_id not in drafts:
                c.seq.num_computed = c.start + c.length
                mgr.commit(c.seq.request_id, c.seq.num_computed, c.seq.tokens)
        plain = [(c.seq, row) for c, row in samplers if c.seq.request_id not in drafts]
        tokens = sample(
            logits[[row for _, row in plain]] if drafts else logits,
            [s.params for s, _ in plain],
            [_history(s) for s, _ in plain],
            [s.generator for s, _ in plain if s.generator is not None],
        )
        now = time.perf_counter()
        generated = 0
        plain_tokens = iter(tokens)
        for c, row in samplers:
            seq = c.seq
            draft = drafts.get(seq.request_id)
            if draft is None:
                outs, kinds = [next(plain_tokens)], [""]
            else:
                outs, kinds = self._verify(seq, draft, logits[row : row + 1 + len(draft.tokens)])
                # the last token and the accepted drafts are computed: key their full blocks
                # now, before a stop among them frees the sequence
                mgr.commit(seq.request_id, c.start + len(outs), _reader(seq, outs))
            lps = self._logprobs(seq, logits[row : row + len(outs)], outs)
            for token, kind, lp in zip(outs, kinds, lps, strict=True):
                event = self._append(seq, token, now)
                event.speculation = kind
                if lp is not None:
                    event.logprob, event.top_logprobs = lp
                events.append(event)
                generated += 1
                if seq.is_finished:
                    break
            if c.lookahead and not seq.is_finished:
                if draft is not None:  # K/V of the accepted tokens stay, the rest roll back
                    seq.num_computed = c.start + len(outs)
                mgr.truncate(seq.request_id, seq.num_computed)
                if spec is not None:
                    spec.drafter.rollback(seq.request_id, seq.num_tokens - 1)
        if spec is not None and drafts:
            spec.step_done(time.perf_counter() - forward_started)
        if self.window is not None:
            for seq in self.scheduler.running:
                mgr.release_outside_window(seq.request_id, self.window)
        if self.layer_timer.enabled:
            self._layer_timings = self.layer_timer.collect()

        prompt_tokens = sum(
            max(0, min(c.start + c.length, len(c.seq.prompt_ids)) - c.start) for c in out.chunks
        )
        self._record_step(out, started, now, prompt_tokens=prompt_tokens, generated=generated)
        return events

    def _draft(self, scheduled: list[ScheduledChunk]) -> dict[str, Draft]:
        """The drafter's proposals for the chunks that hold slots for them (non-empty only)."""
        assert self.speculator is not None
        ahead = [c for c in scheduled if c.lookahead]
        if not ahead:
            return {}
        made = self.speculator.draft(
            [c.seq for c in ahead], [c.lookahead for c in ahead], self.window
        )
        return {
            c.seq.request_id: Draft(d.tokens[: c.lookahead], d.probs)
            for c, d in zip(ahead, made, strict=True)
            if d.tokens
        }

    def _verify(self, seq: Seq, draft: Draft, logits: torch.Tensor) -> tuple[list[int], list[str]]:
        """The tokens one sequence's verified drafts yield, and how each came."""
        assert self.speculator is not None
        outs, accepted = accept(
            logits, draft, seq.params, _history(seq), seq.generator, self.speculator.rule
        )
        self.speculator.verified(seq, len(draft.tokens), accepted)
        last = BONUS if accepted == len(draft.tokens) else CORRECTED
        return outs, [ACCEPTED] * accepted + [last]

    @staticmethod
    def _logprobs(
        seq: Seq, logits: torch.Tensor, tokens: list[int]
    ) -> list[tuple[float, tuple[tuple[int, float], ...]] | None]:
        """Each token's log-probability under the model (row ``i`` for token ``i``) and the
        likeliest tokens there, where the request asks for them."""
        k = seq.params.logprobs
        if k is None:
            return [None] * len(tokens)
        table = torch.log_softmax(logits.float(), dim=-1)
        out: list[tuple[float, tuple[tuple[int, float], ...]] | None] = []
        for row, token in zip(table, tokens, strict=True):
            top: tuple[tuple[int, float], ...] = ()
            if k:
                best = row.topk(k)
                top = tuple(zip(best.indices.tolist(), best.values.tolist(), strict=True))
            out.append((float(row[token]), top))
        return out

    def _record_step(
        self, out: SchedulerOutput, started: float, now: float, *, prompt_tokens: int,
        generated: int,
    ) -> None:  # fmt: skip
        decode = sum(1 for c in out.chunks if c.length == 1)
        self.collector.record_step(
            StepRecord(
                end=now,
                duration_s=now - started,
                batch_size=len(out.chunks),
                prompt_tokens=prompt_tokens,
                generated_tokens=generated,
                kv_used_blocks=self.kv.manager.num_used,
                decode_tokens=decode,
                prefill_tokens=sum(c.length for c in out.chunks) - decode,
                token_budget=self.scheduler.limits.max_tokens_per_step,
                preempted=len(out.preempted),
                waiting=len(self.scheduler.waiting),
                max_batch_size=self.scheduler.limits.max_batch_size,
            )
        )

    def _append(self, seq: Seq, token: int, now: float) -> TokenEvent:
        seq.output_ids.append(token)
        if seq.history is not None:
            seq.history[seq.num_tokens - 1] = token
        times = seq.times
        if times.first_token is None:
            times.first_token = now
        times.last_token = now
        times.token_times.append(now)
        stream = self._streams[seq.request_id]
        params = seq.params
        finish: FinishReason | None = None
        ends = token in params.extra_stop_token_ids
        ends |= not params.ignore_eos and token in self.eos_token_ids
        if ends:
            piece, finish = stream.stops.feed(stream.detok.flush(), final=True), FinishReason.STOP
        else:
            piece = stream.stops.feed(stream.detok.add(token), final=False)
            if stream.stops.hit:
                finish = FinishReason.STOP
            elif len(seq.output_ids) >= seq.max_new_tokens:
                piece += stream.stops.feed(stream.detok.flush(), final=True)
                finish = FinishReason.LENGTH
        stream.text += piece
        if finish is None:
            return TokenEvent(seq.request_id, token, piece)
        self.scheduler.remove(seq)
        event = self._finish(seq, finish, now)
        event.token_id, event.text = token, piece
        return event

    def _finish(self, seq: Seq, reason: FinishReason, now: float) -> TokenEvent:
        seq.status, seq.finish_reason = Status.FINISHED, reason
        if self.speculator is not None:
            self.speculator.forget(seq.request_id)
        seq.times.finished = now
        self.collector.record_request(now, _request_metrics(seq))
        self._seqs.pop(seq.request_id, None)
        self._streams.pop(seq.request_id, None)
        return TokenEvent(seq.request_id, None, "", reason.value)

    # -- instruments ----------------------------------------------------------------------
    def enable_layer_timing(self, on: bool = True) -> None:
        """Per-layer timings need every layer called eagerly: while they are on, a compiled
        decode step runs eagerly."""
        if on:
            self.model.eager_reasons.add("layer timings")
            self.layer_timer.enable()
        else:
            self.layer_timer.disable()
            self.model.eager_reasons.discard("layer timings")
            self._layer_timings = ()

    def metrics(self) -> MetricsSnapshot:
        now = time.perf_counter()
        mgr = self.kv.manager
        occ = mgr.occupancy()
        summary = self.collector.summary(now)
        return MetricsSnapshot(
            time=now,
            window_s=self.collector.window_s,
            num_requests_running=len(self.scheduler.running),
            num_requests_waiting=len(self.scheduler.waiting),
            kv_cache_usage_perc=occ.usage,
            kv_blocks_used=occ.used_blocks,
            kv_blocks_total=occ.total_blocks,
            kv_tokens_stored=occ.tokens_stored,
            kv_waste_slots=occ.waste_slots,
            memory=memory_by_kind(self.weights_bytes, self.kv.nbytes, self.device),
            layer_timings=self._layer_timings,
            total_prompt_tokens=self.collector.total_prompt_tokens,
            total_generated_tokens=self.collector.total_generated_tokens,
            kv_block_owners=tuple(mgr.owners()),
            kv_block_cached=tuple(mgr.cached_blocks()),
            kv_blocks_cached=occ.cached_blocks,
            kv_blocks_shared=occ.shared_blocks,
            kv_block_bytes=PagedKVCache.bytes_per_block(self.cfg, mgr.block_size, self.dtype),
            prefix_caching=mgr.prefix_caching,
            prefix_cache_query_tokens=mgr.stats.query_tokens,
            prefix_cache_hit_tokens=mgr.stats.hit_tokens,
            limits={**asdict(self.scheduler.limits), "kv_blocks": mgr.capacity},
            recent_steps=tuple(self.collector.recent),
            total_preemptions=self.collector.total_preemptions,
            **self._spec_metrics(),
            **summary,
        )

    def _spec_metrics(self) -> dict[str, Any]:
        spec = self.speculator
        if spec is None:
            return {}
        st = spec.stats
        return {
            "speculative": spec.label,
            "spec_decode_num_drafts": st.num_drafts,
            "spec_decode_num_draft_tokens": st.num_draft_tokens,
            "spec_decode_num_accepted_tokens": st.num_accepted_tokens,
            "spec_decode_num_draft_tokens_per_pos": tuple(st.draft_tokens_per_pos),
            "spec_decode_num_accepted_tokens_per_pos": tuple(st.accepted_tokens_per_pos),
            "spec_decode_draft_time_seconds": st.draft_time_s,
            "spec_decode_verify_time_seconds": st.verify_time_s,
            "spec_decode_last_draft_seconds": st.last_draft_s,
            "spec_decode_last_verify_seconds": st.last_verify_s,
            "spec_decode_draft_bytes": spec.drafter.weights_bytes + spec.drafter.kv_bytes,
        }

    def request_metrics(self, request_id: str) -> RequestMetrics | None:
        """The figures of a recently finished request (``None`` if unknown or still running)."""
        for _, m in reversed(self.collector.requests):
            if m.request_id == request_id:
                return m
        return None

    # -- single sequences, for scripts and tests --------------------------------------------
    def forward_logits(
        self, token_ids: Sequence[int], cache: ContiguousKVCache, start: int
    ) -> torch.Tensor:
        """Logits for every position of ``token_ids`` continuing a sequence at ``start``,
        through a private contiguous cache (not the engine's pool)."""
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(ids), device=self.device)
        ctx = cache.context([0], [start], [len(ids)])
        return self.model(ids, positions, ctx)

    def new_cache(self, capacity: int) -> ContiguousKVCache:
        return ContiguousKVCache(
            self.cfg, slots=1, capacity=capacity, dtype=self.dtype, device=self.device
        )

    def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, priority: int = 0
    ) -> Generation:
        """Start one request; iterate the result for its :class:`TokenEvent` as they come."""
        return Generation(self, list(prompt_ids), params, priority)


class Generation:
    """One request driven to its end by stepping the engine; ``result`` fills in as it goes."""

    def __init__(
        self, engine: LLMEngine, prompt_ids: list[int], params: SamplingParams, priority: int
    ) -> None:
        self.engine = engine
        self.request_id = engine.add_request(prompt_ids, params, priority=priority)
        self._seq = engine.sequence(self.request_id)
        self.result = GenerationResult(prompt_ids=prompt_ids)

    def __iter__(self) -> Iterator[TokenEvent]:
        engine, result, seq = self.engine, self.result, self._seq
        try:
            while result.finish_reason is None:
                events = engine.step()
                if not events and engine.hold_s > 0:
                    time.sleep(min(engine.hold_s, 0.01))
                for event in events:
                    if event.request_id != self.request_id:
                        continue
                    if event.token_id is not None:
                        result.token_ids.append(event.token_id)
                    result.text += event.text
                    if event.finish_reason is not None:
                        result.finish_reason = event.finish_reason
                        timings = _request_metrics(seq)
                        result.ttft_s = timings.time_to_first_token_seconds
                        result.tpot_s = timings.time_per_output_token_seconds
                    yield event
        finally:
            if result.finish_reason is None:  # the caller stopped iterating (or Ctrl-C)
                engine.cancel(self.request_id)


def _reader(seq: Seq, more: list[int]) -> Callable[[int, int], list[int]]:
    """Tokens ``[start, end)`` of ``seq`` followed by ``more`` (the block manager's way to
    read a sequence), without copying the whole sequence."""
    n = seq.num_tokens

    def read(start: int, end: int) -> list[int]:
        return seq.tokens(start, min(end, n)) + more[max(0, start - n) : max(0, end - n)]

    return read


def _history(seq: Seq) -> torch.Tensor:
    assert seq.history is not None
    return seq.history[: seq.num_tokens]


def _request_metrics(seq: Seq) -> RequestMetrics:
    t = seq.times
    end = t.finished if t.finished is not None else time.perf_counter()
    gaps = tuple(b - a for a, b in itertools.pairwise(t.token_times))
    n = len(seq.output_ids)
    return RequestMetrics(
        request_id=seq.request_id,
        finish_reason=seq.finish_reason.value if seq.finish_reason else "",
        prompt_tokens=len(seq.prompt_ids),
        output_tokens=n,
        request_queue_time_seconds=None if t.scheduled is None else t.scheduled - t.arrival,
        time_to_first_token_seconds=None if t.first_token is None else t.first_token - t.arrival,
        prefill_time_seconds=(
            None if t.first_token is None or t.scheduled is None else t.first_token - t.scheduled
        ),
        cached_prompt_tokens=seq.num_cached,
        time_per_output_token_seconds=(
            (t.last_token - t.first_token) / (n - 1)
            if n > 1 and t.first_token is not None and t.last_token is not None
            else None
        ),
        e2e_request_latency_seconds=end - t.arrival,
        inter_token_latency_seconds=gaps,
        preemptions=seq.num_preemptions,
    )


class StopStringMatcher:
    """Releases streamed text, holding back any tail that could still become a stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.held = ""
        self.hit = False

    def feed(self, delta: str, *, final: bool) -> str:
        if self.hit:
            return ""
        text = self.held + delta
        if not self.stops:
            self.held = ""
            return text
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.hit, self.held = True, ""
            return text[:cut]
        if final:
            self.held = ""
            return text
        keep = max((_overlap(text, s) for s in self.stops), default=0)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``stop``."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
