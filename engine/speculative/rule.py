"""The acceptance rule: which drafted tokens stand, so that the output is distributed
exactly as plain sampling's (greedy: token for token plain greedy's)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from engine.core.sampling import SamplingBatch, SamplingParams, filter_batch, penalize, race
from engine.hardware.transfer import fetch, upload


@dataclass(slots=True)
class Draft:
    """Tokens proposed for one sequence and, for a drafter that samples, the distribution each
    was drawn from (``[len(tokens), vocab]``); ``None``: the proposals are certain (one-hot)."""

    tokens: list[int] = field(default_factory=list)
    probs: Tensor | None = None


#: how each output token of a verified step came about (what the chat's overlay marks)
ACCEPTED, CORRECTED, BONUS = "accepted", "corrected", "bonus"


def distributions(
    logits: Tensor, params: Sequence[SamplingParams], seen: Sequence[Tensor]
) -> Tensor:
    """The distributions plain sampling draws from for each row of ``logits: [R, V]``, in one
    pass: row ``i``'s repetition penalty over ``seen[i]``, then its temperature and filters;
    a greedy row is one-hot at its (penalized) argmax."""
    vocab = logits.shape[-1]
    knobs = SamplingBatch.of(params, vocab, logits.device)
    logits = logits.float()
    if knobs.penalty is not None:
        padded = pad_sequence(list(seen), batch_first=True, padding_value=vocab)
        logits = penalize(logits, padded, knobs.penalty)
    probs = logits.new_zeros(logits.shape)
    if not knobs.all_greedy:
        probs = filter_batch(logits, knobs).softmax(-1)
    if knobs.any_greedy:
        best = logits.new_zeros(logits.shape).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(knobs.greedy[:, None], best, probs)
    return probs


def seen_with(history: Tensor, drafted: Tensor) -> Tensor:
    """The ids a row sees: the sequence's so far, then the drafts before the row."""
    return torch.cat([history, drafted]) if len(drafted) else history


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
    instead of the residual), for the test that must catch it.

    Every draft is checked at once and the host reads the outcome back once: draft ``j``
    stands with probability ``min(1, p(x) / q(x))``, and at each ``j`` a token is drawn
    from the residual ``max(0, p − q)`` (the bonus row from ``p``) before knowing which
    one the first rejection will need. Each draw is independent of the checks before it,
    so the output is distributed as drawing it after them."""
    drafted, d = draft.tokens, len(draft.tokens)
    x = upload(drafted, logits.device)
    seen = [seen_with(history, x[:j]) for j in range(d + 1)]
    p = distributions(logits, [params] * (d + 1), seen)
    if params.greedy:
        best = [int(t) for t in fetch(p.argmax(-1))[0]]
        n = 0
        while n < d and drafted[n] == best[n]:
            n += 1
        return [*drafted[:n], best[n]], n
    pd = p[:d]
    px = pd.gather(1, x[:, None])[:, 0]
    if draft.probs is None:  # one-hot proposals: q(x) = 1, residual max(0, p − one-hot(x))
        qx = torch.ones_like(px)
        residual = pd.scatter(1, x[:, None], 0.0)
    else:
        q = draft.probs[:d].to(p.device, torch.float32)
        qx = q.gather(1, x[:, None])[:, 0]
        residual = (pd - q).clamp_min_(0.0)
    if rule == "resample-from-p":
        residual = pd
    # p ≤ q everywhere means p = q, where no rejection is possible: draw from p
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, pd)
    u = torch.rand(d, generator=generator, device=p.device)
    stands = u * qx < px
    picks = race(torch.cat([residual, p[d:]]), [generator] * (d + 1))
    flags, tokens = fetch(stands, picks)
    n = next((j for j, ok in enumerate(flags) if not ok), d)
    return [*drafted[:n], int(tokens[n])], n
