"""Speculative decoding in the A/B comparison, measured: A generates again while B's model
drafts for it (:func:`measure_speculation`), and the measured acceptance is put beside the
predicted one (:func:`with_speculation`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from engine.core.engine import LLMEngine
from engine.core.sampling import SamplingParams
from engine.errors import InvalidRequestError, OutOfMemoryError
from engine.evals.figures import first_difference
from engine.kv_cache.window import CacheWindow
from engine.speculative.config import SpeculativeConfig, VerifyCost
from engine.speculative.drafters import ModelDrafter
from engine.speculative.speculator import Speculator

SPEC_K = 4  # tokens B drafts per step when speculative decoding is measured

_OUT_OF_MEMORY = (MemoryError, torch.OutOfMemoryError, OutOfMemoryError)


def measure_speculation(
    target: LLMEngine,
    draft: LLMEngine,
    prompt_ids: list[int],
    params: SamplingParams,
    window: CacheWindow | None = None,
    *,
    expected: Sequence[int] | None = None,
    k: int = SPEC_K,
    check: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Speculative decoding with ``draft``'s model drafting for ``target``, measured:
    ``target`` generates from ``prompt_ids`` with ``params`` under ``window`` while the
    drafter proposes ``k`` tokens at every step (no adaptive k). ``expected`` is the target's
    plain output, which the speculative one is checked against.

    It runs on a sibling of ``target`` (the same weights, a KV pool just large enough, no
    prefix caching): neither engine's state changes, and the drafter and both pools are let go
    before it returns. Returns ``{"measured": {...}}`` (the keys are in
    :data:`MEASURED_KEYS`), or ``{"not_measured": reason}`` where ``draft`` cannot draft for
    ``target`` (another tokenizer or device) or memory is short. ``check`` runs after every
    token (so at least once a step); it may raise to cancel."""
    needed = len(prompt_ids) + params.max_new_tokens + k + 1
    blocks = target.kv.manager.blocks_for(needed) + 1
    config = SpeculativeConfig(
        "model", model_dir=draft.folder or Path(draft.name), k=k, adaptive=False,
        verify_cost=VerifyCost(),  # nothing to time: k is fixed
    )  # fmt: skip
    try:
        engine = target.sibling(replace(target.config, num_blocks=blocks, prefix_caching=False))
        engine.set_window(window)
        drafter = ModelDrafter.from_engine(config.label, draft, engine)
    except InvalidRequestError as exc:
        return {"not_measured": str(exc)}
    except _OUT_OF_MEMORY as exc:
        return {"not_measured": f"out of memory ({exc})"}
    spec = engine.speculator = Speculator(config, drafter)
    gen = engine.generate(prompt_ids, params)
    try:
        for _ in gen:
            if check:
                check()
    except _OUT_OF_MEMORY as exc:
        return {"not_measured": f"out of memory ({exc})"}
    finally:
        engine.cancel(gen.request_id)  # a cancelled run's request ends (no-op when done)
        engine.set_speculation(None)  # closes the drafter: its KV blocks go back
    st, result = spec.stats, gen.result
    ids = result.token_ids
    trials = st.num_accepted_tokens + st.num_rejections
    measured = {
        "k": k,
        "mode": "greedy" if params.greedy else "sampling",
        "tokens": len(ids),
        "drafts": st.num_drafts,
        "draft_tokens": st.num_draft_tokens,
        "accepted_tokens": st.num_accepted_tokens,
        "token_acceptance": st.num_accepted_tokens / trials if trials else None,
        "acceptance_rate": st.acceptance_rate,
        "mean_acceptance_length": st.mean_acceptance_length,
        "acceptance_per_pos": list(st.acceptance_per_pos()),
        "draft_tokens_per_pos": list(st.draft_tokens_per_pos),
        "matches_a": None if expected is None else ids == list(expected),
        "first_difference": None if expected is None else first_difference(ids, expected),
        "tokens_per_s": 1.0 / result.tpot_s if result.tpot_s else None,
    }
    return {"measured": measured}


#: what ``summary["speculative"]["measured"]`` holds: the k drafted per step, the mode (greedy
#: or sampling, A's), the tokens generated, the verified steps with drafts (``drafts``), the
#: drafted and accepted tokens; ``token_acceptance``: accepted / (accepted + rejections), the
#: acceptance of one drafted token, which the prediction estimates; ``acceptance_rate``:
#: accepted / drafted tokens (vLLM's, lower for the drafts a rejection leaves unchecked);
#: ``mean_acceptance_length``: tokens per verified step, the target's own included;
#: ``acceptance_per_pos``: the acceptance rate at each draft position, and
#: ``draft_tokens_per_pos`` the drafts that reached it; ``matches_a``: whether the output is
#: A's plain output (``first_difference``: where it is not); ``tokens_per_s``; and
#: ``predicted_mean_acceptance_length``, what the predicted acceptance gives for these drafts.
MEASURED_KEYS = ("k", "mode", "tokens", "drafts", "draft_tokens", "accepted_tokens",
                 "token_acceptance", "acceptance_rate", "mean_acceptance_length",
                 "acceptance_per_pos", "draft_tokens_per_pos", "matches_a", "first_difference",
                 "tokens_per_s", "predicted_mean_acceptance_length")  # fmt: skip


def with_speculation(summary: dict[str, Any], speculation: dict[str, Any] | None) -> None:
    """Put :func:`measure_speculation`'s result beside the prediction in ``summary``, with
    the mean acceptance length the predicted acceptance α gives for the drafts made: a draft
    that reached position j is accepted with probability α^j (Leviathan et al.; for k drafts
    at every step, ``(1 − α^(k+1)) / (1 − α)``; fewer are drafted near the end).
    ``None``: not attempted, and no key is added."""
    if not speculation:
        return
    spec = summary.setdefault("speculative", {})
    if "measured" in speculation:
        measured = dict(speculation["measured"])
        key = "greedy_acceptance" if measured["mode"] == "greedy" else "sampling_acceptance"
        alpha, drafts = spec.get(key), measured["drafts"]
        reached = measured["draft_tokens_per_pos"]
        measured["predicted_mean_acceptance_length"] = (
            None
            if alpha is None or not drafts
            else 1.0 + sum(n * alpha ** (j + 1) for j, n in enumerate(reached)) / drafts
        )
        spec["measured"] = measured
    else:
        spec["not_measured"] = str(speculation.get("not_measured", "unknown reason"))
