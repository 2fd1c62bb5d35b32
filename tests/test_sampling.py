"""Sampling: parameter validation, transformers' logits processors as the oracle, seeds."""

from __future__ import annotations

import pytest
import torch

from engine.core.sampling import (
    SamplingParams,
    apply_repetition_penalty,
    filter_logits,
    make_generator,
    sample,
)
from engine.errors import InvalidRequestError


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"min_p": 1.0}, r"min_p must be in \[0, 1\)"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"repetition_penalty": -1.0}, "repetition_penalty must be > 0"),
        ({"max_new_tokens": 0}, "max_new_tokens must be at least 1"),
        ({"stop": ("",)}, "stop strings must not be empty"),
        ({"temperature": float("nan")}, "temperature must be >= 0"),
    ],
)
def test_invalid_parameters_are_rejected_with_the_valid_range(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)


def _hf_pipeline(params: SamplingParams):
    from transformers import (
        LogitsProcessorList,
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    procs = [TemperatureLogitsWarper(params.temperature)]
    if params.top_k:
        procs.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1:
        procs.append(TopPLogitsWarper(params.top_p))
    if params.min_p:
        procs.append(MinPLogitsWarper(params.min_p))
    return LogitsProcessorList(procs)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, top_k=20),
        SamplingParams(temperature=0.9, top_p=0.8),
        SamplingParams(temperature=1.3, min_p=0.05),
        SamplingParams(temperature=0.8, top_k=50, top_p=0.95, min_p=0.02),
    ],
    ids=["temperature", "top-k", "top-p", "min-p", "all"],
)
def test_filters_equal_transformers_warpers(params):
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(1000, generator=gen) * 4
        ours = filter_logits(logits, params)
        theirs = _hf_pipeline(params)(torch.zeros(1, 1, dtype=torch.long), logits[None].clone())[0]
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
        finite = ~torch.isinf(ours)
        assert torch.allclose(ours[finite], theirs[finite])


def test_repetition_penalty_equals_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(500, generator=gen) * 3
    seen = torch.tensor([3, 3, 17, 250, 499, 0])
    ours = apply_repetition_penalty(logits, seen, 1.3)
    theirs = RepetitionPenaltyLogitsProcessor(1.3)(seen[None], logits[None].clone())[0]
    assert torch.equal(ours, theirs)


def test_sampled_tokens_stay_inside_the_filtered_set():
    params = SamplingParams(temperature=1.0, top_k=5)
    logits = torch.randn(1, 200, generator=torch.Generator().manual_seed(2))
    allowed = set(torch.topk(logits[0], 5).indices.tolist())
    gen = make_generator(123)
    draws = {
        sample(logits, [params], [torch.tensor([], dtype=torch.long)], [gen])[0] for _ in range(300)
    }
    assert draws <= allowed
    assert len(draws) > 1  # it really samples


def test_same_seed_same_draws_different_seed_different_draws():
    params = SamplingParams(temperature=1.0)
    logits = torch.zeros(1, 1000)
    empty = torch.tensor([], dtype=torch.long)

    def draws(seed: int) -> list[int]:
        gen = make_generator(seed)
        return [sample(logits, [params], [empty], [gen])[0] for _ in range(20)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_greedy_is_argmax():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams()] * 3
    empty = [torch.tensor([], dtype=torch.long)] * 3
    gens = [make_generator(0)] * 3
    assert sample(logits, params, empty, gens) == logits.argmax(-1).tolist()
