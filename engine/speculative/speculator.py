"""The engine's speculation state: the drafter, each sequence's adaptive k, the counters;
and the seam the step reaches speculative decoding through (:class:`Speculator`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine.core.scheduler import ScheduledChunk
from engine.core.step import history
from engine.kv_cache.window import CacheWindow
from engine.speculative.adaptive import AdaptiveK, best_k
from engine.speculative.config import SpeculativeConfig, VerifyCost
from engine.speculative.drafters import Drafter, ModelDrafter
from engine.speculative.rule import ACCEPTED, BONUS, CORRECTED, Draft, accept

if TYPE_CHECKING:
    from engine.core.sequence import Sequence as Seq


@dataclass(slots=True)
class SpecStats:
    """Counters in vLLM's vocabulary (``spec_decode_num_drafts`` …) and timings."""

    num_drafts: int = 0  # (sequence, step) pairs with at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    #: drafts cut short by a rejection (the rest end with every draft accepted): with the
    #: accepted tokens they give the acceptance of one drafted token, accepted / (accepted +
    #: rejections), which a prediction from the two distributions estimates
    num_rejections: int = 0
    #: at each draft position: drafts that reached it, and drafts accepted there
    draft_tokens_per_pos: list[int] = field(default_factory=list)
    accepted_tokens_per_pos: list[int] = field(default_factory=list)
    steps: int = 0  # steps in which some sequence verified drafts
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    last_draft_s: float = 0.0
    last_verify_s: float = 0.0

    def record(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        self.num_rejections += int(accepted < proposed)
        grow = proposed - len(self.draft_tokens_per_pos)
        if grow > 0:
            self.draft_tokens_per_pos += [0] * grow
            self.accepted_tokens_per_pos += [0] * grow
        for pos in range(proposed):
            self.draft_tokens_per_pos[pos] += 1
            if pos < accepted:
                self.accepted_tokens_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens per verified step, the target's own token included (vLLM's definition)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def acceptance_per_pos(self) -> tuple[float, ...]:
        return tuple(
            a / d if d else 0.0
            for a, d in zip(self.accepted_tokens_per_pos, self.draft_tokens_per_pos, strict=True)
        )


class Speculator:
    """The engine's speculation state: the drafter, each sequence's adaptive k, the stats."""

    def __init__(
        self,
        config: SpeculativeConfig,
        drafter: Drafter,
        verify: VerifyCost | None = None,
        draft_cost: float | None = None,
    ) -> None:
        self.config = config
        self.drafter = drafter
        self.verify_cost = config.verify_cost or verify or VerifyCost()
        #: c_draft: a draft token's cost over the target's decode step, measured at start
        if draft_cost is None:
            draft_cost = 0.5 if isinstance(drafter, ModelDrafter) else 0.0
        self.draft_cost = draft_cost
        self.stats = SpecStats()
        self.rule = "exact"
        self._k: dict[str, AdaptiveK] = {}

    @property
    def label(self) -> str:
        return self.config.label

    def plan(self, running: Sequence[Seq]) -> None:
        """Set each running sequence's ``spec_k`` for the next step: decoding sequences only,
        within their remaining tokens, adaptive per sequence, and within the step's
        verification budget."""
        conf = self.config
        # a sequence short of its min_tokens decodes plainly: its end tokens are masked there
        decoding = [
            s for s in running
            if s.num_tokens - s.num_computed == 1 and len(s.output_ids) >= s.params.min_tokens
        ]  # fmt: skip
        for seq in running:
            seq.spec_k = 0
        if not decoding:
            return
        # every decoding sequence verifies 1 + k tokens: k shrinks as the batch grows
        k_cap = min(conf.k, conf.max_verify_tokens // len(decoding) - 1)
        if k_cap <= 0:
            return
        for seq in decoding:
            left = seq.max_new_tokens - len(seq.output_ids) - 1  # the target's token is one
            k = min(k_cap, left)
            if k <= 0:
                continue
            if conf.adaptive:
                state = self._k.setdefault(seq.request_id, AdaptiveK())
                chosen = best_k(state.alpha, k, self.verify_cost, self.draft_cost)
                if chosen == 0:
                    state.off_steps += 1
                    if state.off_steps < AdaptiveK.PROBE_EVERY:
                        continue
                    chosen, state.off_steps = 1, 0
                k = chosen
            seq.spec_k = k

    def drafts_for(
        self, scheduled: Sequence[ScheduledChunk], window: CacheWindow | None
    ) -> dict[str, Draft]:
        """The drafter's proposals for the chunks that hold slots for them, by request id
        (non-empty only)."""
        ahead = [c for c in scheduled if c.lookahead]
        if not ahead:
            return {}
        started = time.perf_counter()
        made = self.drafter.propose([c.seq for c in ahead], [c.lookahead for c in ahead], window)
        took = time.perf_counter() - started
        self.stats.draft_time_s += took
        self.stats.last_draft_s = took
        return {
            c.seq.request_id: Draft(d.tokens[: c.lookahead], d.probs)
            for c, d in zip(ahead, made, strict=True)
            if d.tokens
        }

    def verify(self, seq: Seq, draft: Draft, logits: torch.Tensor) -> tuple[list[int], list[str]]:
        """The tokens one sequence's verified drafts yield (``logits``: the target's rows for
        its last token and each draft), and how each came."""
        outs, accepted = accept(logits, draft, seq.params, history(seq), seq.generator, self.rule)
        proposed = len(draft.tokens)
        self.stats.record(proposed, accepted)
        if proposed and self.config.adaptive:
            self._k.setdefault(seq.request_id, AdaptiveK()).update(proposed, accepted)
        last = BONUS if accepted == proposed else CORRECTED
        return outs, [ACCEPTED] * accepted + [last]

    def rollback(self, request_id: str, valid: int) -> None:
        self.drafter.rollback(request_id, valid)

    def preempted(self, request_id: str) -> None:
        self.drafter.forget(request_id)

    def step_done(self, verify_s: float) -> None:
        """The step's forward and verification took ``verify_s``."""
        self.stats.steps += 1
        self.stats.verify_time_s += verify_s
        self.stats.last_verify_s = verify_s

    def forget(self, seq_id: str) -> None:
        self._k.pop(seq_id, None)
        self.drafter.forget(seq_id)

    def close(self) -> None:
        self.drafter.close()
        self._k.clear()

    def metrics(self) -> dict[str, Any]:
        """Its figures for the engine's :class:`~engine.core.metrics.MetricsSnapshot`."""
        st = self.stats
        return {
            "speculative": self.label,
            "spec_decode_num_drafts": st.num_drafts,
            "spec_decode_num_draft_tokens": st.num_draft_tokens,
            "spec_decode_num_accepted_tokens": st.num_accepted_tokens,
            "spec_decode_num_draft_tokens_per_pos": tuple(st.draft_tokens_per_pos),
            "spec_decode_num_accepted_tokens_per_pos": tuple(st.accepted_tokens_per_pos),
            "spec_decode_draft_time_seconds": st.draft_time_s,
            "spec_decode_verify_time_seconds": st.verify_time_s,
            "spec_decode_last_draft_seconds": st.last_draft_s,
            "spec_decode_last_verify_seconds": st.last_verify_s,
            "spec_decode_draft_bytes": self.drafter.weights_bytes + self.drafter.kv_bytes,
        }

    def with_config(self, config: SpeculativeConfig) -> Speculator:
        """The same drafter under new k / adaptivity settings (what a k slider changes)."""
        new = Speculator(config, self.drafter, self.verify_cost, self.draft_cost)
        new.stats, new._k, new.rule = self.stats, self._k, self.rule
        return new
