"""One step of the engine, top to bottom: schedule → draft → forward → sample/verify → commit →
events.

The scheduler picks which tokens of which sequences to compute and the block manager gives
them KV slots; speculative decoding, where it is on, adds each decoding sequence's drafts; the
runner makes one forward over the flattened batch; each sequence that finished its prompt
gets its next token (or its drafts verified); the computed tokens' full blocks are committed
to the prefix cache; the output processor turns the tokens into events, and finished
sequences give their blocks back. Speculative decoding reaches the step only through the
:class:`Speculation` seam.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from engine.core.metrics import StepRecord
from engine.core.output import Logprobs, TokenEvent, logprob_tensors, logprobs, read_logprobs
from engine.core.sampling import sample
from engine.core.scheduler import ScheduledChunk, SchedulerOutput
from engine.core.sequence import FinishReason
from engine.core.sequence import Sequence as Seq
from engine.core.structured import Grammars, apply_masks
from engine.hardware.transfer import fetch, upload
from engine.kv_cache.window import CacheWindow

if TYPE_CHECKING:
    from engine.core.engine import LLMEngine
    from engine.core.runner import Batch
    from engine.speculative.rule import Draft


class Speculation(Protocol):
    """What the step asks of speculative decoding (:class:`engine.speculative.speculator.
    Speculator` is the one implementation)."""

    def plan(self, running: Sequence[Seq]) -> None:
        """Set each running sequence's draft slots for the step about to be scheduled."""

    def drafts_for(
        self, scheduled: Sequence[ScheduledChunk], window: CacheWindow | None
    ) -> dict[str, Draft]:
        """The drafts to verify this step, by request id (non-empty only)."""

    def verify(self, seq: Seq, draft: Draft, logits: torch.Tensor) -> tuple[list[int], list[str]]:
        """The tokens one sequence's verified drafts yield, and how each came."""

    def rollback(self, request_id: str, valid: int) -> None:
        """Only the first ``valid`` tokens of the request stand (its rejected drafts go)."""

    def preempted(self, request_id: str) -> None:
        """The request lost its blocks: its drafter's cache for it goes (its k stays)."""

    def forget(self, request_id: str) -> None:
        """The request finished: drop everything kept for it."""

    def step_done(self, verify_s: float) -> None:
        """The step's forward and verification took ``verify_s``."""


def step(engine: LLMEngine) -> list[TokenEvent]:
    """Run one step of ``engine``; the events of every request it advanced or ended."""
    events, engine.pending = engine.pending, []
    started = time.perf_counter()
    spec = engine.speculator
    mgr = engine.kv.manager

    # schedule
    if spec is not None:
        spec.plan(engine.scheduler.running)
    out = engine.scheduler.schedule(started)
    engine.hold_s = out.hold_s
    events += [engine.finish(seq, FinishReason.TIMEOUT, started) for seq in out.timed_out]
    if spec is not None:
        for seq in out.preempted:
            spec.preempted(seq.request_id)
    if not out.chunks:
        if out.preempted:  # everything running was preempted: the step did no work
            _record(engine, out, started, started, prompt_tokens=0, generated=0)
        return events

    # draft, then forward
    drafts = spec.drafts_for(out.chunks, engine.window) if spec is not None else {}
    forward_started = time.perf_counter()
    batch = engine.runner.batch(out.chunks, drafts, engine.window)
    logits = engine.runner.forward(batch, engine.kv)
    for c in batch.order:  # a chunk that verifies drafts commits once they are checked
        if c.seq.request_id not in drafts:
            c.seq.num_computed = c.start + c.length
            mgr.commit(c.seq.request_id, c.seq.num_computed, c.seq.tokens)

    if batch.prompt_rows:
        _score_prompts(batch, logits)

    # sample or verify, commit, events
    plain = [(c.seq, row) for c, row in batch.samplers if c.seq.request_id not in drafts]
    # a step of prompt chunks only samples nothing: no op, no host transfer
    every_row = not drafts and not batch.prompt_rows
    grammars = engine._grammars
    sampled = _sample(plain, logits, engine.eos_token_ids, grammars, every_row) if plain else {}
    now = time.perf_counter()
    generated = 0
    for c, row in batch.samplers:
        seq = c.seq
        draft = drafts.get(seq.request_id)
        lps: list[Logprobs | None]
        if draft is None:
            token, lp = sampled[seq.request_id]
            outs, kinds, lps = [token], [""], [lp]
        else:
            assert spec is not None
            verified = logits[row : row + 1 + len(draft.tokens)]
            if seq.matcher is not None and grammars is not None:  # held to its grammar
                verified = apply_masks(verified, grammars.draft_masks(seq.matcher, draft.tokens))
            outs, kinds = spec.verify(seq, draft, verified)
            # the last token and the accepted drafts are computed: key their full blocks now,
            # before a stop among them frees the sequence
            mgr.commit(seq.request_id, c.start + len(outs), _reader(seq, outs))
            lps = logprobs(seq, logits[row : row + len(outs)], outs)
        for token, kind, lp in zip(outs, kinds, lps, strict=True):
            event = engine.append(seq, token, now)
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
                spec.rollback(seq.request_id, seq.num_tokens - 1)
    if spec is not None and drafts:
        spec.step_done(time.perf_counter() - forward_started)
    # the blocks fallen out of the cache window, and out of the local layers' own windows
    for seq in engine.scheduler.running:
        mgr.release_outside_window(seq.request_id, engine.window)
    engine.collect_layer_timings()

    prompt_tokens = sum(
        max(0, min(c.start + c.length, len(c.seq.prompt_ids)) - c.start) for c in out.chunks
    )
    _record(engine, out, started, now, prompt_tokens=prompt_tokens, generated=generated)
    return events


def _sample(
    plain: list[tuple[Seq, int]], logits: torch.Tensor, eos: frozenset[int],
    grammars: Grammars | None, every_row: bool,
) -> dict[str, tuple[int, Logprobs | None]]:  # fmt: skip
    """Each sampling sequence's token, and its log-probabilities where it asks for them, read
    back in one transfer: the step's one host sync. ``plain`` pairs each sequence with its
    row of ``logits``; ``every_row``: they are all of its rows, in order. A sequence short of
    its ``min_tokens`` cannot draw an end token (``eos`` or its own stop tokens); one held to a
    grammar draws only what its matcher allows (``grammars``' masks)."""
    seqs = [seq for seq, _ in plain]
    device = logits.device
    rows = logits if every_row else logits.index_select(0, upload([r for _, r in plain], device))
    drawn_from = _without_ends(rows, seqs, eos)
    held = [i for i, s in enumerate(seqs) if s.matcher is not None]
    if held and grammars is not None:
        bits = grammars.masks([seqs[i].matcher for i in held])
        if drawn_from is rows:
            drawn_from = rows.clone()
        rows_held = upload(held, device)
        drawn_from[rows_held] = apply_masks(drawn_from[rows_held], bits)
    tokens = sample(
        drawn_from, [s.params for s in seqs], [history(s) for s in seqs],
        [s.generator for s in seqs],
    )  # fmt: skip
    asking = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    width = max((seqs[i].params.logprobs or 0 for i in asking), default=0)
    extra: list[torch.Tensor] = []
    if asking:
        pick = upload(asking, device) if len(asking) < len(seqs) else slice(None)
        extra = logprob_tensors(rows[pick], tokens[pick], width)
    host = fetch(tokens, *extra)
    at = {i: j for j, i in enumerate(asking)}
    return {
        s.request_id: (
            int(host[0][i]),
            read_logprobs(host[1:], at[i], width, s.params.logprobs or 0) if i in at else None,
        )
        for i, s in enumerate(seqs)
    }


#: prompt rows whose log-softmax is taken at once (bounds its fp32 copy: 256 × vocabulary)
SCORE_SLICE = 256


def _score_prompts(batch: Batch, logits: torch.Tensor) -> None:
    """The prompt tokens' log-probabilities where their sequences ask for them, from the
    prompt rows this step projected (:attr:`Batch.prompt_rows`), in one transfer."""
    for c, first, count in batch.prompt_rows:
        seq, k = c.seq, c.seq.params.prompt_logprobs or 0
        assert seq.prompt_logprobs is not None
        for at in range(0, count, SCORE_SLICE):  # the fp32 log-softmax a slice at a time
            n = min(SCORE_SLICE, count - at)
            start = c.start + 1 + at
            targets = upload(seq.prompt_ids[start : start + n], logits.device)
            host = fetch(*logprob_tensors(logits[first + at : first + at + n], targets, k))
            for j in range(n):
                seq.prompt_logprobs[start + j] = read_logprobs(host, j, k, k)


def _without_ends(rows: torch.Tensor, seqs: list[Seq], eos: frozenset[int]) -> torch.Tensor:
    """``rows`` with the end tokens of each sequence short of its ``min_tokens`` at -inf (a
    copy; the log-probabilities are read from the model's own rows)."""
    short = [
        (i, sorted(set(s.params.extra_stop_token_ids) | (set() if s.params.ignore_eos else eos)))
        for i, s in enumerate(seqs)
        if len(s.output_ids) < s.params.min_tokens and s.matcher is None  # a grammar decides
    ]
    short = [(i, ends) for i, ends in short if ends]
    if not short:
        return rows
    at_row = [i for i, ends in short for _ in ends]
    at_col = [t for _, ends in short for t in ends]
    masked = rows.clone()
    masked[upload(at_row, rows.device), upload(at_col, rows.device)] = float("-inf")
    return masked


def history(seq: Seq) -> torch.Tensor:
    """The sequence's tokens so far (prompt and output), for the repetition penalty."""
    assert seq.history is not None
    return seq.history[: seq.num_tokens]


def _reader(seq: Seq, more: list[int]) -> Callable[[int, int], list[int]]:
    """Tokens ``[start, end)`` of ``seq`` followed by ``more`` (the block manager's way to
    read a sequence), without copying the whole sequence."""
    n = seq.num_tokens

    def read(start: int, end: int) -> list[int]:
        return seq.tokens(start, min(end, n)) + more[max(0, start - n) : max(0, end - n)]

    return read


def _record(
    engine: LLMEngine, out: SchedulerOutput, started: float, now: float, *, prompt_tokens: int,
    generated: int,
) -> None:  # fmt: skip
    decode = sum(1 for c in out.chunks if c.length == 1)
    limits = engine.scheduler.limits
    engine.collector.record_step(
        StepRecord(
            end=now,
            duration_s=now - started,
            batch_size=len(out.chunks),
            prompt_tokens=prompt_tokens,
            generated_tokens=generated,
            kv_used_blocks=engine.kv.manager.num_used,
            decode_tokens=decode,
            prefill_tokens=sum(c.length for c in out.chunks) - decode,
            token_budget=limits.max_tokens_per_step,
            preempted=len(out.preempted),
            waiting=len(engine.scheduler.waiting),
            max_batch_size=limits.max_batch_size,
        )
    )
