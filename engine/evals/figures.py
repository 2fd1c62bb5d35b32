"""The A/B comparison's figures from the teacher-forced tables: per token (KL, each model's
probability of the token, each model's top tokens), the first divergence by vLLM's rule, and
the summary on A's output (see :mod:`engine.evals.compare` for each figure).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.evals.scoring import Scores
from engine.evals.sides import SideRun
from engine.model.tokenizer import Tokenizer

TOP_N = 5  # top tokens kept per position, and vLLM's N for the divergence rule
KL_ROWS = 256  # rows per float64 KL computation: bounds its temporaries


def _kl(logp: Tensor, logq: Tensor) -> Tensor:
    """KL(p‖q) per row, in float64 over renormalised rows: the fp32 tables sum to 1 only up
    to rounding, which would leave a KL of ~1e-7 (even negative) where p and q are equal.
    :data:`KL_ROWS` rows at a time, so the float64 copies stay small."""
    out = []
    for i in range(0, len(logp), KL_ROWS):
        p = F.log_softmax(logp[i : i + KL_ROWS].double(), -1)
        q = F.log_softmax(logq[i : i + KL_ROWS].double(), -1)
        out.append((p.exp() * (p - q)).sum(-1).clamp(min=0.0))
    return torch.cat(out) if out else torch.empty(0, dtype=torch.float64)


def _tempered(logp: Tensor, temperature: float) -> Tensor:
    """Probabilities at ``temperature`` (1 where the side is greedy)."""
    t = temperature if temperature and temperature > 0 else 1.0
    return F.softmax(logp / t, dim=-1)


def _quantile(x: Tensor, q: float) -> float | None:
    return float(torch.quantile(x.double(), q)) if len(x) else None


def _top(tokenizer: Tokenizer, logp: Tensor) -> list[list[list[Any]]]:
    values, ids = logp.topk(min(TOP_N, logp.shape[-1]), dim=-1)
    probs = values.exp().tolist()
    return [
        [
            [tokenizer.decode([i], skip_special_tokens=False), p]
            for i, p in zip(row, prow, strict=True)
        ]
        for row, prow in zip(ids.tolist(), probs, strict=True)
    ]


def column_figures(
    tokenizer: Tokenizer, ids: list[int], logp_a: Tensor, logp_b: Tensor, noise: Tensor | None
) -> dict[str, Any]:
    target = torch.tensor(ids, dtype=torch.long)[:, None]
    return {
        "kl": _kl(logp_a, logp_b).tolist(),
        "p_a": logp_a.gather(1, target).exp()[:, 0].tolist() if ids else [],
        "p_b": logp_b.gather(1, target).exp()[:, 0].tolist() if ids else [],
        "noise_kl": None if noise is None else _kl(logp_a, noise).tolist(),
        "top_a": _top(tokenizer, logp_a),
        "top_b": _top(tokenizer, logp_b),
    }


def first_difference(ids_a: Sequence[int], ids_b: Sequence[int]) -> int | None:
    """The first index where two token sequences differ (the shorter one's length where one
    stopped and the other went on), or ``None`` when they are equal."""
    index = next((i for i, (x, y) in enumerate(zip(ids_a, ids_b, strict=False)) if x != y), None)
    if index is None and len(ids_a) != len(ids_b):
        index = min(len(ids_a), len(ids_b))
    return index


def divergence(
    ids_a: list[int], ids_b: list[int], scores: Scores, tokenizer: Tokenizer
) -> dict[str, Any]:
    """vLLM's rule: the first index where the generated tokens differ, and whether each side's
    token is among the other's top-N there. Up to that index the two contexts are the same, so
    A's scores on A's output and B's on B's output describe the same context."""

    def in_top(side: str, index: int, token: int) -> bool:
        table = scores.a_on_a if side == "a" else scores.b_on_b
        return token in table[index].topk(TOP_N).indices.tolist()

    return divergence_by(ids_a, ids_b, tokenizer, in_top)


def divergence_by(
    ids_a: list[int], ids_b: list[int], tokenizer: Tokenizer,
    in_top: Callable[[str, int, int], bool | None],
) -> dict[str, Any]:  # fmt: skip
    """:func:`divergence` with ``in_top(side, index, token)`` saying whether ``token`` is among
    that side's top-N at ``index`` on its own output (None: not known)."""
    index = first_difference(ids_a, ids_b)
    out: dict[str, Any] = {"index": index, "top_n": TOP_N, "a_token": None, "b_token": None,
                           "a_in_b_top": None, "b_in_a_top": None}  # fmt: skip
    if index is None:
        return out
    if index < len(ids_a):
        out["a_token"] = tokenizer.decode([ids_a[index]], skip_special_tokens=False)
    if index < len(ids_b):
        out["b_token"] = tokenizer.decode([ids_b[index]], skip_special_tokens=False)
    if index < len(ids_a) and index < len(ids_b):
        out["a_in_b_top"] = in_top("b", index, ids_a[index])
        out["b_in_a_top"] = in_top("a", index, ids_b[index])
    return out


def summarize(run_a: SideRun, run_b: SideRun, scores: Scores) -> dict[str, Any]:
    """The figures on A's output (see :mod:`engine.evals.compare`)."""
    ids = torch.tensor(run_a.token_ids, dtype=torch.long)
    la, lb = scores.a_on_a, scores.b_on_a
    kl = _kl(la, lb)
    n = len(ids)
    rms_dp: float | None = None  # None when there are no tokens: JSON has no NaN
    top1 = greedy = sampled = rms_dp
    if n:
        pa = la.gather(1, ids[:, None]).exp()[:, 0]
        pb = lb.gather(1, ids[:, None]).exp()[:, 0]
        rms_dp = float(((pb - pa) ** 2).mean().sqrt())
        top1 = float((la.argmax(-1) == lb.argmax(-1)).double().mean())
        # greedy drafting: B's top token is accepted where it is A's top token
        greedy = top1
        # sampling (rejection sampling at each side's temperature; 1 for a greedy side):
        # a drafted token is accepted with probability Σ min(p_A, p_B) = 1 − TV(p_A, p_B)
        pa_t = _tempered(la, run_a.sampling.get("temperature", 0.0))
        pb_t = _tempered(lb, run_b.sampling.get("temperature", 0.0))
        sampled = float(torch.minimum(pa_t, pb_t).sum(-1).double().mean())
    noise = None if scores.noise_on_a is None else _kl(la, scores.noise_on_a)
    return {
        "tokens": n,
        "kl_mean": float(kl.double().mean()) if n else None,
        "kl_p99": _quantile(kl, 0.99),
        "kl_max": float(kl.max()) if n else None,
        "rms_dp": rms_dp,
        "top1_agreement": top1,
        "flips": run_a.token_ids != run_b.token_ids,
        "noise_kl_mean": None if noise is None or not n else float(noise.double().mean()),
        "noise_kl_p99": None if noise is None else _quantile(noise, 0.99),
        "speculative": {
            "greedy_acceptance": greedy,
            "sampling_acceptance": sampled,
            "mode": "greedy" if run_a.sampling.get("temperature", 0.0) == 0 else "sampling",
        },
    }
