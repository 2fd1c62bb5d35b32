"""Sampling: parameter validation, transformers' logits processors as the oracle, seeds."""

from __future__ import annotations

import pytest
import torch

from engine.core.sampling import (
    SamplingBatch,
    SamplingParams,
    apply_repetition_penalty,
    filter_batch,
    filter_logits,
    make_generator,
    penalize,
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
        int(sample(logits, [params], [torch.tensor([], dtype=torch.long)], [gen])[0])
        for _ in range(300)
    }
    assert draws <= allowed
    assert len(draws) > 1  # it really samples


def test_same_seed_same_draws_different_seed_different_draws():
    params = SamplingParams(temperature=1.0)
    logits = torch.zeros(1, 1000)
    empty = torch.tensor([], dtype=torch.long)

    def draws(seed: int) -> list[int]:
        gen = make_generator(seed)
        return [int(sample(logits, [params], [empty], [gen])[0]) for _ in range(20)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_greedy_is_argmax():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams()] * 3
    empty = [torch.tensor([], dtype=torch.long)] * 3
    gens = [make_generator(0)] * 3
    assert torch.equal(sample(logits, params, empty, gens), logits.argmax(-1))


#: A batch whose rows each use different filters (and some none): what one vectorized pass
#: must process exactly as each row alone.
MIXED = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=20),
    SamplingParams(),  # greedy
    SamplingParams(temperature=0.9, top_p=0.8),
    SamplingParams(temperature=1.3, min_p=0.05, repetition_penalty=1.2),
    SamplingParams(temperature=0.8, top_k=50, top_p=0.95, min_p=0.02),
    SamplingParams(temperature=1.1, top_k=3, repetition_penalty=0.9),
]


def test_one_pass_over_a_mixed_batch_filters_each_row_as_alone():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(len(MIXED), 1000, generator=gen) * 4
    knobs = SamplingBatch.of(MIXED, 1000, logits.device)
    batch = filter_batch(logits, knobs)
    for i, params in enumerate(MIXED):
        if not params.greedy:  # a greedy row's filtered logits go unused
            assert torch.equal(batch[i], filter_logits(logits[i], params)), params
    # each row alone equals transformers' warpers (test above), so the batch does too


def test_one_pass_penalizes_each_row_as_alone():
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(3, 300, generator=gen) * 3
    seen = [
        torch.tensor([3, 3, 17, 250]),
        torch.tensor([], dtype=torch.long),
        torch.tensor([0, 299]),
    ]
    padded = torch.nn.utils.rnn.pad_sequence(seen, batch_first=True, padding_value=300)
    penalties = [1.3, 1.5, 0.8]
    batch = penalize(logits, padded, torch.tensor(penalties))
    for row, ids, penalty, got in zip(logits, seen, penalties, batch, strict=True):
        assert torch.equal(got, apply_repetition_penalty(row, ids, penalty))


def test_draws_follow_the_filtered_distribution():
    """The exponential race draws token t with probability p[t]: counts over many seeded
    draws (a fixed seed, so the figures are the same on every run) match p within 1%."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0, -30.0]])
    params = SamplingParams(temperature=1.0, top_k=5)
    p = torch.softmax(filter_logits(logits[0], params), -1)
    gen = make_generator(11)
    empty = [torch.tensor([], dtype=torch.long)]
    n = 40_000
    counts = torch.bincount(
        torch.cat([sample(logits, [params], empty, [gen]) for _ in range(n)]), minlength=6
    )
    assert counts[5] == 0  # filtered out: never drawn
    assert torch.allclose(counts / n, p, atol=0.01), (counts / n, p)


def test_a_seeded_row_draws_the_same_tokens_whatever_runs_beside_it():
    gen = torch.Generator().manual_seed(8)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
    empty = torch.tensor([], dtype=torch.long)
    alone_gen, batch_gen = make_generator(42), make_generator(42)
    alone, together = [], []
    for _ in range(30):
        logits = torch.randn(len(MIXED) + 1, 500, generator=gen)
        alone.append(int(sample(logits[:1], [seeded], [empty], [alone_gen])[0]))
        gens = [batch_gen] + [make_generator(None) for _ in MIXED]
        row = sample(logits, [seeded, *MIXED], [empty] * (len(MIXED) + 1), gens)
        together.append(int(row[0]))
    assert alone == together
