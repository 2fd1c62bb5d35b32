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
from torch.nn.utils.rnn import pad_sequence

from engine.core.structured import Constraint
from engine.errors import InvalidRequestError
from engine.hardware.transfer import to_device

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
    #: the same for each prompt token after the first (computed in the prefill, which then
    #: takes no prefix-cache hits: every prompt row is projected to the vocabulary)
    prompt_logprobs: int | None = None
    #: no end-of-generation or stop token, and no stop string, before this many tokens (as
    #: vLLM's ``min_tokens``)
    min_tokens: int = 0
    skip_special_tokens: bool = True  # in the reply's text
    include_stop_str_in_output: bool = False  # the stop string that ended a reply, kept
    #: the grammar the reply must match (a JSON schema, …): :mod:`engine.core.structured`
    constraint: Constraint | None = None

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
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise InvalidRequestError(f"{name} must be in [0, {MAX_LOGPROBS}], got {k}")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise InvalidRequestError(
                f"min_tokens must be in [0, max_new_tokens = {self.max_new_tokens}], got "
                f"{self.min_tokens}"
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
    """Make tokens in ``seen`` less likely: positive logits divided, negative ones multiplied
    (one ``[V]`` row; :func:`penalize` does a batch)."""
    if penalty == 1.0 or seen.numel() == 0:
        return logits
    return penalize(logits[None], seen[None], logits.new_full((1,), penalty))[0]


def filter_logits(logits: Tensor, params: SamplingParams) -> Tensor:
    """Temperature, then top-k / top-p / min-p masking (``-inf``) over a ``[V]`` row
    (:func:`filter_batch` does a batch)."""
    knobs = SamplingBatch.of([params], logits.shape[-1], logits.device)
    return filter_batch(logits[None], knobs)[0]


@dataclass(frozen=True, slots=True)
class SamplingBatch:
    """A batch's sampling settings on the device, one entry per row, sent up in one queued
    copy (:mod:`engine.hardware.transfer`). A filter no row uses is None, and costs nothing."""

    greedy: Tensor  # [B] bool
    temperature: Tensor  # [B]; 1 on greedy rows (their filtered logits go unused)
    top_k: Tensor | None  # [B] long; the vocabulary's size where a row has it off
    top_p_drop: Tensor | None  # [B]; drop the tail whose mass is at most this (-1: off)
    min_p: Tensor | None  # [B]; 0 where off
    penalty: Tensor | None  # [B]; 1 where off
    all_greedy: bool
    any_greedy: bool

    @classmethod
    def of(
        cls, params: Sequence[SamplingParams], vocab: int, device: torch.device
    ) -> SamplingBatch:
        host = torch.tensor(
            [
                [
                    float(p.greedy),
                    p.temperature or 1.0,
                    p.top_k if 0 < p.top_k < vocab else vocab,
                    1 - p.top_p if p.top_p < 1 else -1.0,
                    p.min_p,
                    p.repetition_penalty,
                ]
                for p in params
            ],
            dtype=torch.float32,
        )
        greedy, temperature, top_k, top_p_drop, min_p, penalty = to_device(
            host.T.contiguous(), device
        )
        return cls(
            greedy=greedy.bool(),
            temperature=temperature,
            top_k=top_k.long() if any(0 < p.top_k < vocab for p in params) else None,
            top_p_drop=top_p_drop if any(p.top_p < 1 for p in params) else None,
            min_p=min_p if any(p.min_p > 0 for p in params) else None,
            penalty=penalty if any(p.repetition_penalty != 1 for p in params) else None,
            all_greedy=all(p.greedy for p in params),
            any_greedy=any(p.greedy for p in params),
        )


def penalize(logits: Tensor, seen: Tensor, penalty: Tensor) -> Tensor:
    """The repetition penalty over a batch: ``logits: [B, V]``; ``seen: [B, L]``, the ids each
    row has seen, padded with ``V`` (which marks nothing); ``penalty: [B]`` (1: off)."""
    rows, vocab = logits.shape
    hit = logits.new_zeros((rows, vocab + 1), dtype=torch.bool).scatter_(1, seen, True)
    scale = penalty[:, None]
    penalized = torch.where(logits > 0, logits / scale, logits * scale)
    return torch.where(hit[:, :vocab], penalized, logits)


def filter_batch(logits: Tensor, knobs: SamplingBatch) -> Tensor:
    """Temperature, then top-k / top-p / min-p masking (``-inf``) over ``[B, V]``, each row
    with its own settings. Top-k and top-p share one sort: both keep a suffix of each row's
    ascending order, and masking that order's front keeps it sorted."""
    logits = logits / knobs.temperature[:, None]
    if knobs.top_k is not None or knobs.top_p_drop is not None:
        ascending, order = logits.sort(dim=-1)
        if knobs.top_k is not None:
            kth = ascending.gather(1, (logits.shape[-1] - knobs.top_k)[:, None])
            ascending = ascending.masked_fill(ascending < kth, float("-inf"))
        if knobs.top_p_drop is not None:
            cumulative = ascending.softmax(-1).cumsum(-1)
            drop = cumulative <= knobs.top_p_drop[:, None]
            drop[:, -1] = False  # the most likely token always survives
            ascending = ascending.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, ascending)
    if knobs.min_p is not None:
        probs = logits.softmax(-1)
        floor = knobs.min_p[:, None] * probs.amax(-1, keepdim=True)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def sample(
    logits: Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[Tensor],
    generators: Sequence[torch.Generator | None],
) -> Tensor:
    """One token for each row of ``logits: [B, V]``, as a ``[B]`` tensor on their device (no
    host sync: the caller reads it back with whatever else it needs). Row ``i`` uses
    ``params[i]``, ``histories[i]`` (token ids seen so far, for the repetition penalty) and
    ``generators[i]``.

    Every row is processed at once, and drawn by :func:`race` from its own generator: a
    seeded request draws the same tokens whatever runs beside it."""
    if all(p.greedy and p.repetition_penalty == 1 for p in params):
        return logits.argmax(-1)
    vocab = logits.shape[-1]
    knobs = SamplingBatch.of(params, vocab, logits.device)
    if knobs.penalty is not None:
        seen = pad_sequence(list(histories), batch_first=True, padding_value=vocab)
        logits = penalize(logits, seen, knobs.penalty)
    if knobs.all_greedy:
        return logits.argmax(-1)
    drawn = race(filter_batch(logits, knobs).softmax(-1), generators)
    if knobs.any_greedy:
        drawn = torch.where(knobs.greedy, logits.argmax(-1), drawn)
    return drawn


def race(weights: Tensor, generators: Sequence[torch.Generator | None]) -> Tensor:
    """One index per row of ``weights: [R, V]`` (≥ 0, not necessarily normalised), drawn
    with probability proportional to its weight, on the device (no host sync). An exponential
    race: ``argmax(w / E)`` with ``E ~ Exp(1)`` from row ``i``'s ``generators[i]``."""
    arrival = torch.empty_like(weights, dtype=torch.float32)
    for row, generator in enumerate(generators):
        arrival[row].exponential_(generator=generator)
    # a draw of exactly 0 would make a zero weight's 0 / 0 a NaN, which argmax picks
    arrival.clamp_min_(torch.finfo(arrival.dtype).tiny)
    return (weights / arrival).argmax(-1)
