"""The acceptance rule: which drafted tokens stand, so that the output is distributed
exactly as plain sampling's (greedy: token for token plain greedy's)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from engine.core.sampling import SamplingParams, apply_repetition_penalty, filter_logits


@dataclass(slots=True)
class Draft:
    """Tokens proposed for one sequence and, for a drafter that samples, the distribution each
    was drawn from (``[len(tokens), vocab]``); ``None``: the proposals are certain (one-hot)."""

    tokens: list[int] = field(default_factory=list)
    probs: Tensor | None = None


#: how each output token of a verified step came about (what the chat's overlay marks)
ACCEPTED, CORRECTED, BONUS = "accepted", "corrected", "bonus"


def processed_probs(row: Tensor, params: SamplingParams, seen: Tensor) -> Tensor:
    """The distribution plain sampling draws from for ``row`` (``[V]`` logits): repetition
    penalty over ``seen``, then temperature and filters; greedy: one-hot at the argmax."""
    row = apply_repetition_penalty(row, seen, params.repetition_penalty)
    if params.greedy:
        out = torch.zeros_like(row, dtype=torch.float32)
        out[row.argmax()] = 1.0
        return out
    return filter_logits(row.float(), params).softmax(-1)


def seen_with(history: Tensor, drafted: list[int]) -> Tensor:
    if not drafted:
        return history
    extra = torch.tensor(drafted, dtype=history.dtype, device=history.device)
    return torch.cat([history, extra])


def accept(
    logits: Tensor,
    draft: Draft,
    params: SamplingParams,
    history: Tensor,
    generator: torch.Generator | None,
    rule: str = "exact",
) -> tuple[list[int], int]:
    """The tokens a verified step yields for one sequence and how many of them are accepted
    drafts (they come first; one target token follows). ``logits: [len(draft) + 1, V]`` are
    the target's rows at the last token and at each draft; ``history`` the sequence's tokens
    so far (for the repetition penalty, extended by the drafts before each row). ``rule``:
    ``exact``, or ``resample-from-p``, deliberately wrong (on a rejection it draws from p
    instead of the residual), for the test that must catch it."""
    drafted, d = draft.tokens, len(draft.tokens)
    if params.greedy:
        if params.repetition_penalty == 1.0:
            best = logits.argmax(-1).tolist()
        else:
            best = [
                int(apply_repetition_penalty(logits[j], seen_with(history, drafted[:j]),
                                             params.repetition_penalty).argmax())
                for j in range(d + 1)
            ]  # fmt: skip
        n = 0
        while n < d and drafted[n] == best[n]:
            n += 1
        return [*drafted[:n], best[n]], n
    for j in range(d + 1):
        p = processed_probs(logits[j], params, seen_with(history, drafted[:j]))
        if j == d:  # every draft accepted: the bonus token
            return [*drafted, draw(p, generator)], d
        x = drafted[j]
        q = None if draft.probs is None else draft.probs[j].to(p.device, torch.float32)
        qx = 1.0 if q is None else float(q[x])
        u = float(torch.rand((), generator=generator, device=p.device))
        if u * qx < float(p[x]):  # accepted with probability min(1, p(x) / q(x))
            continue
        if rule == "resample-from-p":
            residual = p
        elif q is None:
            residual = p.clone()
            residual[x] = 0.0  # max(0, p − one-hot(x))
        else:
            residual = (p - q).clamp_min_(0.0)
        if not float(residual.sum()) > 0:  # p ≤ q everywhere: p = q, no rejection possible
            residual = p
        return [*drafted[:j], draw(residual, generator)], j
    raise AssertionError("unreachable")


def draw(weights: Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(weights, 1, generator=generator))
