"""Adaptive k: each sequence's acceptance rate, the k with the most expected tokens per unit
of cost, and those costs measured on this machine when speculation starts."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.executor import step as step_executor
from engine.kv_cache.paged import PagedKVCache, SeqChunk
from engine.speculative.config import VerifyCost
from engine.speculative.drafters import Drafter, ModelDrafter

if TYPE_CHECKING:
    from engine.model.transformer import Transformer


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a step yields on average when each draft is accepted with probability α:
    ``(1 − α^(k+1)) / (1 − α)`` (Leviathan et al., eq. 1)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def best_k(alpha: float, k_max: int, verify: VerifyCost, draft_per_token: float = 0.0) -> int:
    """The k in ``[0, k_max]`` with the most expected tokens per unit of step cost
    ``1 + verify.at(k) + k·draft_per_token``; 0 where no draft pays."""
    scores = [
        expected_tokens(alpha, k) / (1.0 + verify.at(k) + k * draft_per_token)
        for k in range(k_max + 1)
    ]
    return max(range(k_max + 1), key=lambda k: (scores[k], -k))


def _time_forward(
    model: Transformer, kv: PagedKVCache, lengths: Sequence[int], repeats: int = 5,
) -> dict[int, float] | None:  # fmt: skip
    """Median seconds of ``model``'s forward over ``length`` new tokens after 64 others on a
    scratch sequence of ``kv``'s pool, for each length; None where the pool has no room."""
    mgr, rid, context = kv.manager, "\0spec-probe", 64
    longest = context + max(lengths)
    if not mgr.can_grow(rid, longest):
        return None
    device = kv.device
    times = {}
    try:
        mgr.grow(rid, longest)
        ids = torch.zeros(longest, dtype=torch.long, device=device)
        step = step_executor.of(model).forward  # as generation runs its steps
        step(ids[:context], torch.arange(context, device=device),
             kv.context([SeqChunk(rid, 0, context)]))  # fmt: skip
        for length in lengths:
            runs = []
            for _ in range(repeats):
                started = time.perf_counter()
                step(
                    ids[:length], torch.arange(context, context + length, device=device),
                    kv.context([SeqChunk(rid, context, length)]),
                    torch.arange(length, device=device),
                ).sum().item()  # fmt: skip
                runs.append(time.perf_counter() - started)
            times[length] = sorted(runs)[len(runs) // 2]
    finally:
        mgr.free(rid)
    return times


def measure_costs(
    model: Transformer, kv: PagedKVCache, drafter: Drafter, k: int,
    verify: VerifyCost | None = None,
) -> tuple[VerifyCost, float]:  # fmt: skip
    """What speculation costs here, as fractions of the target's (``model`` over a scratch
    sequence of its pool ``kv``) one-token decode step: the target's forward at 1, 2 and 1 + k
    new tokens fitted to :class:`VerifyCost` (unless ``verify`` is given), and a draft model's
    one-token forward (``c_draft``; 0 for a drafter without a model). The defaults where a pool
    has no room for the scratch sequence."""
    model_drafter = isinstance(drafter, ModelDrafter)
    if verify is not None and not model_drafter:
        return verify, 0.0
    times = _time_forward(model, kv, (1,) if verify else (1, 2, 1 + k))
    if times is None:
        return verify or VerifyCost(), 0.5 if model_drafter else 0.0
    one = times[1]
    if verify is None:
        per_token = max(0.0, (times[1 + k] - times[2]) / one / max(1, k - 1))
        verify = VerifyCost(max(0.0, times[2] / one - 1.0 - per_token), per_token)
    draft = 0.0
    if isinstance(drafter, ModelDrafter):
        drafted = _time_forward(drafter.model, drafter.kv, (1,))
        draft = 0.5 if drafted is None else drafted[1] / one
    return verify, draft


@dataclass(slots=True)
class AdaptiveK:
    """One sequence's acceptance, decayed so that recent steps count most. Each verified
    step is a run of accepted drafts ended by a rejection (or by the end of the draft): the
    maximum-likelihood α of a geometric run is accepted / (accepted + rejections)."""

    accepted: float = 2.0  # prior: α = 2/3
    trials: float = 3.0
    #: steps without speculation since k fell to 0; it starts due, so that a sequence whose
    #: prior says "do not draft" drafts one token at once and learns its own α
    off_steps: int = 16
    DECAY = 0.8
    PROBE_EVERY = 16  # a sequence with k = 0 drafts one token again after this many steps

    @property
    def alpha(self) -> float:
        return self.accepted / self.trials

    def update(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        self.accepted = self.DECAY * self.accepted + accepted
        self.trials = self.DECAY * self.trials + accepted + (1 if accepted < proposed else 0)
