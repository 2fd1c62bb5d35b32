"""Continuous batching: which sequences compute which tokens in the next step.

Every step, finished sequences have left and waiting ones may join. The budgets:

* ``max_batch_size``: sequences computed in one step (and admitted to the running set; when
  it is lowered on a live engine, the running sequences beyond it wait, keeping their KV);
* ``max_tokens_per_step``: tokens computed in one forward (long prompts are prefilled in
  chunks, so one long prompt does not stall everyone else's decode);
* ``max_wait_ms``: how long a lone request may be held hoping for company (0 = never);
* ``max_waiting``: the waiting queue's length; beyond it new requests are refused as busy.

Waiting requests are ordered by priority plus an aging credit (``aging_per_s`` priority units
per second waited), so nothing starves. One is admitted when its whole prompt fits beside the
running set with a 1% watermark (not just its first chunk), starting from the longest prefix
of it already in the KV cache (prefix caching,
:class:`~engine.kv_cache.block_manager.BlockManager`); one whose next block a running sequence
is computing waits for it rather than computing it too.
When the KV pool runs out, the running sequence with the lowest priority is *preempted by
recompute*: its blocks are freed (and stay cached until the pool needs them) and it goes back to
the queue, to be prefilled again (prompt and generated tokens, less what is still cached) when
it is readmitted.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from engine.core.sequence import FinishReason, Sequence, Status
from engine.errors import InvalidRequestError
from engine.kv_cache.block_manager import BlockManager

#: what keys a LongRoPE sequence's blocks apart from a short one's in the prefix cache
LONG_ROPE_SALT = b"longrope"


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    max_batch_size: int = 16
    max_tokens_per_step: int = 512
    max_wait_ms: float = 0.0
    max_waiting: int = 1024
    aging_per_s: float = 1.0

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise InvalidRequestError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_tokens_per_step < 1:
            raise InvalidRequestError(
                f"max_tokens_per_step must be >= 1, got {self.max_tokens_per_step}"
            )
        if not self.max_wait_ms >= 0:
            raise InvalidRequestError(f"max_wait_ms must be >= 0, got {self.max_wait_ms}")
        if self.max_waiting < 1:
            raise InvalidRequestError(f"max_waiting must be >= 1, got {self.max_waiting}")
        if not self.aging_per_s >= 0:
            raise InvalidRequestError(f"aging_per_s must be >= 0, got {self.aging_per_s}")

    def updated(self, **changes: float) -> SchedulerLimits:
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise InvalidRequestError(
                f"unknown scheduler limit(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        return replace(self, **changes)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """``length`` tokens of ``seq`` from ``start``; a decode chunk may also hold slots for
    ``lookahead`` draft tokens to verify (speculative decoding), which the engine fills."""

    seq: Sequence
    start: int
    length: int
    lookahead: int = 0

    @property
    def samples(self) -> bool:
        """The chunk reaches the sequence's last token, so a new token is sampled after it."""
        return self.start + self.length == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    timed_out: list[Sequence] = field(default_factory=list)
    hold_s: float = 0.0  # > 0: nothing scheduled, a lone request is held for company


class Scheduler:
    def __init__(
        self, manager: BlockManager, limits: SchedulerLimits | None = None,
        long_rope_after: int | None = None,
    ) -> None:  # fmt: skip
        self.manager = manager
        self.limits = limits or SchedulerLimits()
        #: LongRoPE's pretraining context: a sequence that grows past it is recomputed on the
        #: long factors (:meth:`_rope_switch`); None: the model has no LongRoPE
        self.long_rope_after = long_rope_after
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.manager.free(seq.request_id)  # an id used before: nothing of the old one is kept
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take ``seq`` out of whichever queue holds it and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.manager.free(seq.request_id)

    def _order(self, seqs: list[Sequence], now: float) -> list[Sequence]:
        aging = self.limits.aging_per_s
        return sorted(seqs, key=lambda s: (-s.effective_priority(now, aging), s.arrival))

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.manager.free(seq.request_id, keep_keys=True)  # its blocks may still be cached
        seq.num_computed = 0
        seq.spec_k = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.waiting.append(seq)
        out.preempted.append(seq)

    def schedule(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput()
        limits = self.limits
        for seq in list(self.waiting):
            never_ran = seq.times.scheduled is None
            if never_ran and seq.timeout_s is not None and now - seq.arrival > seq.timeout_s:
                self.waiting.remove(seq)
                self.manager.free(seq.request_id)  # the block keys of its lookups
                seq.status, seq.finish_reason = Status.FINISHED, FinishReason.TIMEOUT
                out.timed_out.append(seq)

        if not self.running and 0 < len(self.waiting) < limits.max_batch_size:
            oldest = min(s.arrival for s in self.waiting)
            hold = limits.max_wait_ms / 1e3 - (now - oldest)
            if hold > 0:
                out.hold_s = hold
                return out

        budget = limits.max_tokens_per_step
        # what one sequence may compute in a step besides the budget (a pool of the local
        # layers' own holds its window and one chunk: engine/kv_cache/layered.py)
        chunk = self.manager.chunk_limit() or budget
        # Decoding sequences first (one token each), so a long prefill never delays them;
        # the last of the queue (lowest priority, prefilling) is the first to be preempted.
        ordered = self._order(self.running, now)
        queue = [s for s in ordered if s.num_tokens - s.num_computed == 1]
        queue += [s for s in ordered if s.num_tokens - s.num_computed != 1]
        # A max batch size lowered on a live engine takes effect at once: the sequences
        # beyond it (lowest priority, latest arrivals) sit this step out, keeping their KV.
        del queue[limits.max_batch_size :]
        while queue:
            seq = queue.pop(0)
            if self._rope_switch(seq):  # recomputed whole on the long factors
                self._preempt(seq, out)
                continue
            need = min(seq.num_tokens - seq.num_computed, budget, chunk)
            if need <= 0:
                continue
            while not self.manager.can_grow(seq.request_id, seq.num_computed + need):
                victim = queue.pop() if queue else seq
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                self.manager.grow(seq.request_id, seq.num_computed + need)
                out.chunks.append(ScheduledChunk(seq, seq.num_computed, need))
                budget -= need

        if not out.preempted:  # admitting right after preempting would only thrash
            budget = self._admit(out, budget, now)
        self._lookahead(out, budget)

        out.chunks.sort(key=lambda c: c.length != 1)  # decode chunks first (stable)
        return out

    def _rope_switch(self, seq: Sequence) -> bool:
        """Whether ``seq``, running on LongRoPE's short factors, computes its next token past
        the pretraining context this step: then it is marked long and preempted, so that it
        is recomputed whole on the long factors, as transformers drops its cache at that
        token and recomputes the sequence. Drafts to verify before then stop at the context's
        end, so that no step computes a token on each side of it."""
        after = self.long_rope_after
        if after is None or seq.rope_long:
            return False
        if seq.num_tokens > after:  # its next token's position is past the context
            seq.rope_long = True
            return True
        seq.spec_k = min(seq.spec_k, after - seq.num_tokens)
        return False

    def _lookahead(self, out: SchedulerOutput, budget: int) -> None:
        """Slots for the draft tokens each decoding sequence verifies this step (its
        ``spec_k``), from what the step's budget and the pool have left once every running
        sequence has its token and the waiting ones are admitted: speculation never preempts
        a sequence or keeps one waiting."""
        for i, c in enumerate(out.chunks):
            seq = c.seq
            extra = min(seq.spec_k, budget)
            if c.length != 1 or c.start + 1 != seq.num_tokens or extra <= 0:
                continue
            if self.manager.can_grow(seq.request_id, c.start + 1 + extra):
                self.manager.grow(seq.request_id, c.start + 1 + extra)
                out.chunks[i] = replace(c, lookahead=extra)
                budget -= extra

    def _admit(self, out: SchedulerOutput, budget: int, now: float) -> int:
        """Move waiting sequences to the running set, best first, while they fit. A sequence
        starts with the blocks of its longest cached prefix (:meth:`BlockManager.cached_prefix`)
        and computes only the rest. Returns the token budget left."""
        mgr, limits = self.manager, self.limits
        watermark = max(1, mgr.capacity // 100)
        for seq in self._order(self.waiting, now):
            if len(self.running) >= limits.max_batch_size or budget <= 0:
                break
            rid, read = seq.request_id, seq.tokens
            if self.long_rope_after is not None and seq.num_tokens > self.long_rope_after:
                seq.rope_long = True
            if seq.rope_long:  # its K/V differ from a short sequence's of the same tokens
                mgr.set_salt(rid, LONG_ROPE_SALT)
            # a prompt scored token by token is computed whole: no cached prefix
            scored = seq.params.prompt_logprobs is not None and seq.times.first_token is None
            hit = [] if scored else mgr.cached_prefix(rid, seq.num_tokens, read)
            if not scored and mgr.computing(rid, len(hit), read, seq.num_tokens):
                continue  # a running sequence is computing its next block: share it instead
            cached = len(hit) * mgr.block_size
            need = min(seq.num_tokens - cached, budget, mgr.chunk_limit() or budget)
            # Admitted only if its first chunk fits, and its whole prompt and first new token
            # beside what runs, with a watermark for their growth (vLLM's rule): admitting on
            # the first chunk alone let later chunks preempt the running sequences, which were
            # then recomputed and preempted in turn (thrashing, seen in the tuner).
            reserve = watermark if self.running else None
            if not mgr.admits(hit, cached + need, seq.num_tokens + 1, reserve):
                break
            self.waiting.remove(seq)
            self.running.append(seq)
            seq.status = Status.RUNNING
            first = seq.times.scheduled is None
            if first:
                seq.times.scheduled = now
            seq.num_computed = mgr.admit(rid, hit, seq.num_tokens, first=first)
            if first:
                seq.num_cached = seq.num_computed
            mgr.grow(rid, seq.num_computed + need)
            out.chunks.append(ScheduledChunk(seq, seq.num_computed, need))
            budget -= need
        return budget
