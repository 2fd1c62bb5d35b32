"""Going on after a step runs out of memory, the same way in ``infersight serve``'s engine loop
(:mod:`app.server.engine_loop`) and the app's engine worker (:mod:`app.gui.worker_loop`):
:class:`StepRecovery`.

A step that runs out of GPU memory has changed little: the KV cache is committed only after the
forward, so the step can run again. The recovery lets go of the memory margin held back for
this moment and empties the allocator's cache; then, where prompts are still being computed,
it halves the prefill chunk (``max_tokens_per_step``) and runs the step again, since a
prefill's temporaries (attention scores, gathers) grow with its chunk. Where no chunk can be
made smaller it ends only the largest live request, the one most likely not to fit, and runs
the step again for the others. Each round either makes the chunk smaller or ends a request, so
it stops. The front end is told which requests ended (:attr:`Stepped.failed`) and says so its
own way: a 503 for the server, a message in the chat for the app.

A lowered chunk stays for the rest of the engine's life: the next turn of a conversation is
longer still, and would run out at the old chunk again.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.core.output import TokenEvent

if TYPE_CHECKING:
    from engine.core.engine import LLMEngine
    from engine.core.sequence import Sequence as Seq

log = logging.getLogger(__name__)

#: the smallest prefill chunk the recovery lowers to (tokens a step): below it a step's
#: temporaries are dominated by the weights' own, and halving again would not help
MIN_CHUNK = 16


@dataclass(slots=True)
class Stepped:
    """What :meth:`StepRecovery.step` did: the events to hand on (those of failed requests
    left out), the requests it ended for want of memory (with the error), and, where it
    lowered the prefill chunk, from what to what."""

    events: list[TokenEvent] = field(default_factory=list)
    failed: dict[str, BaseException] = field(default_factory=dict)
    #: each failed request as it was when it ended (its prompt and output, for a log line)
    ended: dict[str, Seq] = field(default_factory=dict)
    chunk: tuple[int, int] | None = None  # (before, after) the first and last lowering
    out_of_memory: int = 0  # attempts of this step that ran out of memory


@dataclass(slots=True)
class _Before:
    """An engine just before a step: what a failed step would lose or leave half done."""

    pending: list[TokenEvent]
    seqs: dict[str, Seq]
    tokens: dict[str, int]

    @classmethod
    def of(cls, engine: LLMEngine) -> _Before:
        seqs = dict(engine.seqs)
        return cls(list(engine.pending), seqs, {r: s.num_tokens for r, s in seqs.items()})


class StepRecovery:
    """Runs an engine's steps and recovers from the ones that run out of memory (see the
    module's docstring). ``margin_bytes``: memory held back (:meth:`reserve`, when the engine
    is idle) and let go when a step runs out, so that recovering has room. One per front end;
    it may step several engines in turn (the app's current and retiring ones)."""

    def __init__(self, margin_bytes: int = 0) -> None:
        self.margin_bytes = margin_bytes
        self._margin: torch.Tensor | None = None
        self.out_of_memory = 0  # steps that ran out of memory
        self.chunks_lowered = 0
        self.requests_failed = 0

    # -- the margin ------------------------------------------------------------------------
    @property
    def margin_held(self) -> bool:
        return self._margin is not None

    def reserve(self, device: torch.device) -> None:
        """Hold the margin back on ``device`` (a no-op when it is held there already, or when
        there is not that much free: the next idle moment tries again)."""
        if not self.margin_bytes:
            return
        if self._margin is not None and self._margin.device == device:
            return
        self.release()
        with contextlib.suppress(torch.OutOfMemoryError):
            self._margin = torch.empty(self.margin_bytes, dtype=torch.uint8, device=device)

    def release(self) -> None:
        """Let the margin go (a load or a new KV pool is about to need the memory)."""
        self._margin = None

    # -- stepping ----------------------------------------------------------------------------
    def step(self, engine: LLMEngine) -> Stepped:
        """One step of ``engine``, recovered from running out of memory. Raises what else
        the step raises, and the out-of-memory error itself when nothing is left to make
        smaller or to end (the caller then fails the engine's requests as for any error)."""
        out = Stepped()
        while True:
            before = _Before.of(engine)
            try:
                out.events += engine.step()
            except torch.OutOfMemoryError as exc:
                out.out_of_memory += 1
                self._ran_out(engine)
                failed = len(out.failed)
                out.events += self._lost(engine, before, exc, out)
                acted = self._lower_chunk(engine, out) or len(out.failed) > failed
                if not acted and not self._end_largest(engine, exc, out):
                    raise
                if engine.has_work():
                    continue
            break
        out.events = [e for e in out.events if e.request_id not in out.failed]
        return out

    def _ran_out(self, engine: LLMEngine) -> None:
        """Make room: the margin goes and the allocator hands its cached blocks back."""
        self.out_of_memory += 1
        self.release()
        if engine.device.type == "cuda":
            torch.cuda.empty_cache()

    def _lost(
        self, engine: LLMEngine, before: _Before, exc: BaseException, out: Stepped
    ) -> list[TokenEvent]:
        """Put right what the failed step left: the events it had taken up (cancellations,
        timeouts) come back; a request that already got a token in it lost that token's event,
        so it fails; one whose whole chunk was computed before sampling failed computes its
        last token again (else it would wait for ever for a token never sampled); a drafter
        forgets what it drafted."""
        events = list(before.pending)
        for rid, seq in before.seqs.items():
            if seq.num_tokens != before.tokens[rid]:  # its new token's event is gone
                with contextlib.suppress(Exception):
                    engine.cancel(rid)
                self._fail(seq, exc, out)
            elif rid not in engine.seqs and seq.finish_reason is not None:  # timed out
                events.append(TokenEvent(rid, None, "", seq.finish_reason.value))
            elif seq.num_computed >= seq.num_tokens:
                seq.num_computed = seq.num_tokens - 1
        if engine.speculator is not None:
            for rid in engine.seqs:
                engine.speculator.preempted(rid)
        return events

    def _lower_chunk(self, engine: LLMEngine, out: Stepped) -> bool:
        """Halve the prefill chunk where a prompt is still to compute and the chunk is above
        :data:`MIN_CHUNK`; False where that would not make the step smaller."""
        left = max((s.num_tokens - s.num_computed for s in engine.seqs.values()), default=0)
        was = engine.scheduler.limits.max_tokens_per_step
        chunk = min(was, left)
        if left <= 1 or chunk <= MIN_CHUNK:
            return False
        lowered = max(MIN_CHUNK, chunk // 2)
        try:
            engine.update_limits(max_tokens_per_step=lowered)
        except Exception:  # refused for a live request: end a request instead
            log.exception("lowering the prefill chunk to %d tokens failed", lowered)
            return False
        self.chunks_lowered += 1
        out.chunk = (out.chunk[0] if out.chunk else was, lowered)
        log.warning(
            "%s ran out of memory in a step; computing prompts %d tokens a step (was %d)",
            engine.name, lowered, was,
        )  # fmt: skip
        return True

    def _end_largest(self, engine: LLMEngine, exc: BaseException, out: Stepped) -> bool:
        """End the live request with the most tokens (the latest of equals); False if none."""
        live = [s for s in engine.seqs.values() if not s.is_finished]
        if not live:
            return False
        largest = max(live, key=lambda s: (s.num_tokens, s.arrival))
        engine.cancel(largest.request_id)
        self._fail(largest, exc, out)
        log.warning(
            "%s ran out of memory in a step; ended request %s (%d tokens) so that the others "
            "go on", engine.name, largest.request_id, largest.num_tokens,
        )  # fmt: skip
        return True

    def _fail(self, seq: Seq, exc: BaseException, out: Stepped) -> None:
        if seq.request_id not in out.failed:
            out.failed[seq.request_id], out.ended[seq.request_id] = exc, seq
            self.requests_failed += 1
