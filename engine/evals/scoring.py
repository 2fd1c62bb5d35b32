"""Teacher-forced scoring for the A/B comparison: a model's log-probabilities at every
position of a sequence, computed through the engine's own paged cache and attention
(:func:`score`), and the four tables (each model on each side's output) plus the noise floor's
(:class:`Scores`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.core.engine import LLMEngine
from engine.errors import InvalidRequestError
from engine.evals.sides import SideRun
from engine.kv_cache.paged import SeqChunk
from engine.kv_cache.window import CacheWindow

SCORE_ID = "__ab-score__"  # the scratch sequence a scoring pass holds blocks under
SCORE_CHUNK = 512  # tokens per scoring forward: bounds the [tokens, vocab] logits on a device


def score(
    engine: LLMEngine,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    *,
    window: CacheWindow | None = None,
    decode_steps: bool = False,
    check: Callable[[], None] | None = None,
) -> Tensor:
    """Log-probabilities ``[len(output_ids), vocab]`` (fp32, on the CPU) of ``engine``'s next
    token at each output position, teacher-forced on ``prompt_ids + output_ids``.

    It runs through the engine's own paged cache and attention, as generation does, with the
    same cache window, in forwards of up to :data:`SCORE_CHUNK` tokens (and at most the
    scheduler's tokens per step). ``decode_steps`` computes the outputs one token per forward
    after a prefill of the prompt (as generation computed them): the two agree up to
    rounding, which is what the noise floor measures. The engine must be idle and its pool
    must hold the whole sequence. ``check`` runs before each forward; it may raise to cancel.
    """
    prompt, output = list(prompt_ids), list(output_ids)
    if not prompt:
        raise InvalidRequestError("scoring needs a prompt of at least one token")
    vocab = engine.cfg.vocab_size
    if not output:
        return torch.empty(0, vocab)
    seq = prompt + output
    inputs = seq[:-1]  # the last token is a target only
    first_row = len(prompt) - 1  # the position that predicts the first output token
    # chunks of at most a step's tokens, as generation prefills (a local layers' own pool
    # holds a window and a step's tokens, not the sequence)
    chunk = min(SCORE_CHUNK, engine.scheduler.limits.max_tokens_per_step)
    teacher = len(prompt) if decode_steps else len(inputs)
    spans = [(p, min(p + chunk, teacher)) for p in range(0, teacher, chunk)]
    spans += [(p, p + 1) for p in range(teacher, len(inputs))]  # decode_steps: one a forward
    manager = engine.kv.manager
    if manager.blocks_for(len(inputs)) > manager.num_free:
        raise InvalidRequestError(
            f"scoring {len(inputs)} tokens needs {manager.blocks_for(len(inputs))} KV blocks "
            f"but {manager.num_free} are free; give the KV cache more memory"
        )
    out: list[Tensor] = []
    device = engine.device
    try:
        for start, end in spans:
            rows = [r - start for r in range(max(start, first_row), end)]
            if check:
                check()
            # span by span, releasing what the windows leave behind (a local layer's own pool
            # holds its window and a span, not the sequence)
            manager.release_outside_window(SCORE_ID, window)
            if not manager.can_grow(SCORE_ID, end):
                raise InvalidRequestError(
                    f"the KV pool has no room for a scoring span of {end - start} tokens; "
                    "give the KV cache more memory"
                )
            manager.grow(SCORE_ID, end)
            ctx = engine.kv.context([SeqChunk(SCORE_ID, start, end - start, window)])
            logits = engine.runner.executor.forward(
                torch.tensor(inputs[start:end], device=device),
                torch.arange(start, end, device=device),
                ctx,
                torch.tensor(rows, dtype=torch.long, device=device),
            )  # every span runs: the prompt's too fill the cache the outputs attend to
            if rows:
                out.append(F.log_softmax(logits.float(), dim=-1).cpu())
    finally:
        manager.free(SCORE_ID)
    return torch.cat(out)


@dataclass(slots=True)
class Scores:
    """The four teacher-forced tables (``[model][sequence]``) and the noise floor's two
    (A′ on each sequence; absent when not measured)."""

    a_on_a: Tensor
    a_on_b: Tensor
    b_on_a: Tensor
    b_on_b: Tensor
    noise_on_a: Tensor | None = None
    noise_on_b: Tensor | None = None


def score_side(
    engine: LLMEngine,
    prompt_ids: list[int],
    runs: tuple[SideRun, SideRun],
    window: CacheWindow | None,
    *,
    noise: bool = False,
    check: Callable[[], None] | None = None,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """One model's scores of A's and B's outputs, and (``noise``) its A′ scores of both.
    ``check`` runs between passes: it may raise to cancel."""
    out: list[Tensor | None] = []
    for run in runs:
        out.append(score(engine, prompt_ids, run.token_ids, window=window, check=check))
    for run in runs:
        if noise:
            out.append(
                score(engine, prompt_ids, run.token_ids, window=window, decode_steps=True,
                      check=check)
            )  # fmt: skip
        else:
            out.append(None)
    a, b, na, nb = out
    assert a is not None and b is not None
    return a, b, na, nb
