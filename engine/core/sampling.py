"""Sampling parameters (validated on entry) and the sampler that turns logits into tokens.

The processing order follows the usual convention (and transformers'): repetition penalty,
temperature, top-k, top-p, min-p, then a draw from the request's own seeded generator.
Temperature 0 means greedy.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from engine.errors import InvalidRequestError

MAX_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    extra_stop_token_ids: tuple[int, ...] = field(default=())
    #: None: no log-probabilities; k >= 0: each token's, and the k likeliest at its step
    #: (of the model's own distribution, before penalties, temperature or filters)
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise InvalidRequestError(
                f"max_new_tokens must be at least 1, got {self.max_new_tokens}"
            )
        if not self.temperature >= 0:
            raise InvalidRequestError(
                f"temperature must be >= 0 (0 = greedy), got {self.temperature}"
            )
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise InvalidRequestError(f"min_p must be in [0, 1) (0 = off), got {self.min_p}")
        if not self.repetition_penalty > 0:
            raise InvalidRequestError(
                f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}"
            )
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must not be empty")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(
                f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A private RNG for one request: the same seed gives the same draws whatever runs beside it."""
    gen = torch.Generator(device=device)
    gen.manual_seed(secrets.randbits(63) if seed is None else seed)
    return gen


def apply_repetition_penalty(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """Make tokens in ``seen`` less likely: positive logits divided, negative ones multiplied."""
    if penalty == 1.0 or seen.numel() == 0:
        return logits
    picked = logits.gather(-1, seen)
    picked = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits.scatter(-1, seen, picked)


def filter_logits(logits: Tensor, params: SamplingParams) -> Tensor:
    """Temperature, then top-k / top-p / min-p masking (``-inf``) over a ``[V]`` row."""
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cumulative <= 1 - params.top_p
        drop_sorted[-1] = False  # the most likely token always survives
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    if params.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return logits


def sample(
    logits: Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[Tensor],
    generators: Sequence[torch.Generator],
) -> list[int]:
    """One token for each row of ``logits: [B, V]``; row ``i`` uses ``params[i]``,
    ``histories[i]`` (token ids seen so far, for the repetition penalty) and ``generators[i]``."""
    out = []
    greedy_rows = [i for i, p in enumerate(params) if p.greedy and p.repetition_penalty == 1.0]
    if len(greedy_rows) == len(params):
        return [int(t) for t in logits.argmax(-1).tolist()]
    for i, p in enumerate(params):
        row = apply_repetition_penalty(logits[i], histories[i], p.repetition_penalty)
        if p.greedy:
            out.append(int(row.argmax()))
            continue
        probs = filter_logits(row, p).softmax(-1)
        out.append(int(torch.multinomial(probs, 1, generator=generators[i])))
    return out
