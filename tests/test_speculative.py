"""Speculative decoding changes nothing about what is generated.

* Greedy: every drafter gives token for token the output of plain greedy decoding, on tiny
  random models (many arrivals, cancellations, preemption in a small pool, a cache window) and
  on the real default model (chat prompts and a long input-grounded one, mixed in one batch).
* Sampling: over many seeded samples of a tiny model with a small vocabulary, a chi-square test
  cannot tell speculative from plain sampling at p = 0.001, while it catches a deliberately
  wrong acceptance rule far below that.
* The adaptive rule and the acceptance counters follow their definitions.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.bench.speculative import GROUNDED_PROMPTS
from engine.core.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.core.sampling import SamplingParams
from engine.core.scheduler import SchedulerLimits
from engine.errors import InvalidRequestError
from engine.kv_cache.window import CacheWindow
from engine.loader.load import load_model
from engine.speculative.adaptive import best_k, expected_tokens
from engine.speculative.config import SpeculativeConfig, VerifyCost, parse_speculative
from engine.speculative.drafters import LookupDrafter
from engine.speculative.rule import Draft, accept
from engine.speculative.speculator import SpecStats
from tests.conftest import build_tiny_hf, save_tiny, truncated_copy
from tests.probed import precisions

BS = 4
GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)
FIXED_COST = VerifyCost(0.1, 0.05)  # no timing probe in tests: the same k choices every run

Arrival = tuple[int, list[int], SamplingParams]  # (step, prompt, params)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Callable[[str, bool], tuple[Path, torch.nn.Module]]) -> Path:
    return tiny_model_dir("llama", False)[0]


@pytest.fixture(scope="module")
def other_tiny(
    tiny_model_dir: Callable[[str, bool], tuple[Path, torch.nn.Module]],
    tmp_path_factory: pytest.TempPathFactory,
) -> Path:
    """A separate draft model with the same tokenizer: the target with every weight
    perturbed, so that its guesses are often but not always right."""
    import copy

    model = copy.deepcopy(tiny_model_dir("llama", False)[1])
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.03)
    return save_tiny(model, tmp_path_factory.mktemp("llama-perturbed"))


def spec(text: str, k: int = 4, **options: object) -> SpeculativeConfig:
    return parse_speculative(text, k, verify_cost=FIXED_COST, **options)


def tokens(seed: int, n: int, vocab: int = 320) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def repetitive(seed: int, n: int) -> list[int]:
    """A prompt with repeated stretches, where prompt lookup finds matches."""
    piece = tokens(seed, 9)
    return (piece + tokens(seed + 1, 3) + piece)[:n]


def run(
    engine: LLMEngine, arrivals: list[Arrival], cancel: dict[int, int] | None = None
) -> tuple[dict[int, list[int]], dict[int, str], Counter[str]]:
    """Add each request at its step, cancel request ``i`` at step ``cancel[i]``; returns each
    request's tokens and finish reason, and how many tokens came by each speculation kind."""
    cancel = cancel or {}
    ids: dict[str, int] = {}
    out: dict[int, list[int]] = {i: [] for i in range(len(arrivals))}
    finish: dict[int, str] = {}
    kinds: Counter[str] = Counter()
    step = 0
    while len(ids) < len(arrivals) or engine.has_work():
        for i, (at, prompt, params) in enumerate(arrivals):
            if at == step:
                ids[engine.add_request(prompt, params)] = i
        for i, at in cancel.items():
            if at == step:
                engine.cancel(next(r for r, j in ids.items() if j == i))
        for event in engine.step():
            i = ids[event.request_id]
            if event.token_id is not None:
                out[i].append(event.token_id)
                kinds[event.speculation] += 1
            if event.finish_reason:
                finish[i] = event.finish_reason
        step += 1
        assert step < 5_000, "the engine stopped making progress"
    mgr = engine.kv.manager
    assert mgr.num_used == 0 and mgr.num_free == mgr.num_blocks  # every block came back
    if engine.speculator is not None and hasattr(engine.speculator.drafter, "kv"):
        draft_mgr = engine.speculator.drafter.kv.manager
        assert draft_mgr.num_used == 0, "the draft pool kept blocks of finished requests"
    return out, finish, kinds


def assert_same(
    got: dict[int, list[int]], want: dict[int, list[int]], cancelled: dict[int, int]
) -> None:
    """Equal outputs; a request cancelled at a given step was cut wherever each engine had
    got to (a speculative one is further on), so there one is a prefix of the other."""
    for i, tokens_wanted in want.items():
        if i in cancelled:
            n = min(len(got[i]), len(tokens_wanted))
            assert got[i][:n] == tokens_wanted[:n], i
        else:
            assert got[i] == tokens_wanted, i


def mixed_arrivals(n: int = 6) -> list[Arrival]:
    return [(2 * i, repetitive(10 + i, 14 + 3 * i), GREEDY) for i in range(n)]


#: a pool too small for everyone: it preempts
SMALL_POOL = EngineConfig(
    block_size=BS, num_blocks=16, limits=SchedulerLimits(max_tokens_per_step=24)
)
CANCEL = {1: 6, 4: 8}  # request 1 cancelled while decoding, 4 before its first step


@pytest.fixture(scope="module")
def plain_in_a_small_pool(tiny: Path) -> tuple[dict[int, list[int]], dict[int, str]]:
    """Plain decoding's outputs and finish reasons for :func:`mixed_arrivals` in
    :data:`SMALL_POOL`, cancelled as :data:`CANCEL` says: what every drafter must give."""
    want, want_finish, _ = run(load_model(tiny, config=SMALL_POOL), mixed_arrivals(), CANCEL)
    return want, want_finish


@pytest.mark.parametrize("drafter", precisions("lookup", "self:int4-g32", "self:int8", "model"))
def test_greedy_output_is_plain_greedy_output_with_every_drafter(
    tiny, other_tiny, plain_in_a_small_pool, drafter
):
    """Arrivals at different steps, a cancellation while decoding, one before its first
    step, and preemption in a pool too small for everyone: the outputs and finish reasons
    equal plain decoding's, and drafts were really accepted and rejected along the way."""
    fast = load_model(tiny, config=SMALL_POOL)
    text = f"model:{other_tiny}" if drafter == "model" else drafter
    fast.set_speculation(spec(text, k=3, adaptive=False))
    want, want_finish = plain_in_a_small_pool
    got, finish, kinds = run(fast, mixed_arrivals(), CANCEL)
    assert_same(got, want, CANCEL)
    assert finish == want_finish
    assert finish[1] == finish[4] == "cancelled"
    stats = fast.speculator.stats
    assert kinds["accepted"] == stats.num_accepted_tokens > 0
    assert kinds["corrected"] > 0, "no draft was ever rejected: the rollback went untested"
    assert fast.collector.total_preemptions > 0, "the pool was meant to preempt"


def test_greedy_output_is_unchanged_under_a_cache_window(tiny, other_tiny):
    """Under a window, rolled-back drafts and released blocks interleave; the drafter's own
    pool runs under the same window."""
    window = CacheWindow(sink=4, window=12)
    config = EngineConfig(block_size=BS, num_blocks=64, window=window)
    long = SamplingParams(max_new_tokens=60, ignore_eos=True)
    arrivals: list[Arrival] = [(0, repetitive(3, 20), long), (5, repetitive(4, 30), long)]
    plain = load_model(tiny, config=config)
    want, _, _ = run(plain, arrivals)
    for drafter in ("lookup", f"model:{other_tiny}"):
        fast = load_model(tiny, config=config)
        fast.set_speculation(spec(drafter, k=4, adaptive=False))
        got, _, kinds = run(fast, arrivals)
        assert got == want, drafter
        assert kinds["accepted"] > 0


def test_adaptive_k_and_the_verify_budget_keep_outputs_exact(tiny):
    """With adaptive k and a verify budget that a batch of six overruns, k varies per
    sequence and step, down to none; the output is still plain greedy output."""
    config = EngineConfig(block_size=BS, num_blocks=128)
    plain = load_model(tiny, config=config)
    fast = load_model(tiny, config=config)
    fast.set_speculation(spec("lookup", k=6, max_verify_tokens=12))
    arrivals = mixed_arrivals()
    want, _, _ = run(plain, arrivals)
    got, _, kinds = run(fast, arrivals)
    assert got == want
    assert kinds[""] > 0 and kinds["accepted"] > 0  # steps with and without drafts


def test_stop_strings_and_max_tokens_end_a_reply_inside_accepted_drafts(tiny):
    """A reply ends at its stop token or length even when a verified step yielded more."""
    prompt = repetitive(7, 20)
    base = SamplingParams(max_new_tokens=30, ignore_eos=True)
    plain = load_model(tiny, config=EngineConfig(block_size=BS, num_blocks=64))
    full = run(plain, [(0, prompt, base)])[0][0]
    stop_at = full[len(full) // 2]
    for params in (
        SamplingParams(max_new_tokens=13, ignore_eos=True),
        SamplingParams(max_new_tokens=30, extra_stop_token_ids=(stop_at,), ignore_eos=True),
    ):
        want, want_finish, _ = run(plain, [(0, prompt, params)])
        fast = load_model(tiny, config=EngineConfig(block_size=BS, num_blocks=64))
        fast.set_speculation(spec("lookup", k=6, adaptive=False))
        got, finish, _ = run(fast, [(0, prompt, params)])
        assert got == want and finish == want_finish


def test_logprobs_under_speculation_are_the_models_own(tiny):
    prompt = repetitive(8, 20)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True, logprobs=2)
    engines = []
    for drafter in (None, "lookup"):
        engine = load_model(tiny, config=EngineConfig(block_size=BS, num_blocks=64))
        if drafter:
            engine.set_speculation(spec(drafter, adaptive=False))
        engines.append(engine)
    events = []
    for engine in engines:
        rid = engine.add_request(prompt, params)
        got = []
        while engine.has_work():
            got += [e for e in engine.step() if e.request_id == rid and e.token_id is not None]
        events.append(got)
    assert [e.token_id for e in events[0]] == [e.token_id for e in events[1]]
    for a, b in zip(*events, strict=True):
        assert b.logprob == pytest.approx(a.logprob, abs=1e-4)
        assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]


# -- sampling: the distribution is unchanged ------------------------------------------------

VOCAB = 8
N_SAMPLES = 1200
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A target over an 8-token vocabulary and its draft model: the same weights with the
    head's logits tripled, an over-confident copy whose guess is often, not always, the
    target's likeliest token. Where a draft is rejected, the exact rule's residual then
    differs much from the target's distribution, which is what a wrong rule would draw from."""
    model = build_tiny_hf("llama", tied=False, seed=1, vocab_size=VOCAB)
    target = save_tiny(model, tmp_path_factory.mktemp("vocab8"))
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    return target, save_tiny(model, tmp_path_factory.mktemp("vocab8-sharp"))


def chi_square_p(a: Counter[tuple[int, ...]], b: Counter[tuple[int, ...]]) -> float:
    """p-value of the chi-square test that two samples come from one distribution (a 2×C
    contingency table; cells expected below 5 pooled into one)."""
    na, nb = sum(a.values()), sum(b.values())
    cells, rest = [], [0, 0]
    for key in set(a) | set(b):
        total = a[key] + b[key]
        if total * min(na, nb) / (na + nb) < 5:
            rest[0] += a[key]
            rest[1] += b[key]
        else:
            cells.append((a[key], b[key]))
    if sum(rest):
        cells.append((rest[0], rest[1]))
    stat = 0.0
    for x, y in cells:
        total = x + y
        for observed, n in ((x, na), (y, nb)):
            expected = total * n / (na + nb)
            stat += (observed - expected) ** 2 / expected
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(stat / 2)))


def sampling_engine(
    small_vocab: tuple[Path, Path], speculative: str | None = None, rule: str = "exact"
) -> LLMEngine:
    """The 8-token target in a pool for :data:`N_SAMPLES` sequences at once; with
    ``speculative`` (``model``: the over-confident copy, or ``lookup``) every sequence drafts
    each step, as far as its remaining tokens allow (the draft model's pool holds every
    sequence whole: 8 blocks of 4 tokens each), so the rule ``rule`` decides everything."""
    target, draft = small_vocab
    n = N_SAMPLES
    config = EngineConfig(
        block_size=BS, num_blocks=3 * n,
        limits=SchedulerLimits(max_batch_size=n, max_waiting=n, max_tokens_per_step=4 * n),
    )  # fmt: skip
    e = load_model(target, config=config)
    if speculative:
        text = f"model:{draft}" if speculative == "model" else speculative
        e.set_speculation(spec(text, k=3, adaptive=False, max_verify_tokens=4 * n,
                               ngram_min=1, draft_blocks=8 * n))  # fmt: skip
        e.speculator.rule = rule
    return e


def first_tokens(
    engine: LLMEngine, prompt: list[int], n: int, seed0: int
) -> Counter[tuple[int, ...]]:
    """The second and third tokens of ``n`` seeded samples of ``prompt`` (one pair per sample,
    so the counts are a multinomial sample): both come from the first verified step (the
    first token is sampled after the prefill, before any draft)."""
    out: dict[str, list[int]] = {}
    for i in range(n):
        params = SamplingParams(
            max_new_tokens=4, temperature=TEMPERATURE, seed=seed0 + i, ignore_eos=True
        )
        out[engine.add_request(prompt, params)] = []
    while engine.has_work():
        for event in engine.step():
            if event.token_id is not None:
                out[event.request_id].append(event.token_id)
    return Counter(tuple(t[1:3]) for t in out.values())


@pytest.fixture(scope="module")
def plain_samples(
    small_vocab: tuple[Path, Path],
) -> tuple[list[int], Counter[tuple[int, ...]]]:
    """The prompt, which ends with the target's own greedy continuation, and plain sampling's
    draws from it: what both drafters' samples are compared with."""
    plain_engine = sampling_engine(small_vocab)
    start = [3, 1, 4, 1, 5, 0, 2, 6, 5, 7]  # every token: prompt lookup always finds a match
    greedy = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompt = start + run(plain_engine, [(0, start, greedy)])[0][0]
    return prompt, first_tokens(plain_engine, prompt, N_SAMPLES, seed0=0)


@pytest.mark.parametrize("drafter", ["model", "lookup"])
def test_sampling_distribution_is_unchanged_and_a_wrong_rule_is_caught(
    small_vocab, plain_samples, drafter
):
    """The target samples at temperature 0.7 from a prompt that ends with its own greedy
    continuation, so prompt lookup proposes tokens the model finds likely (and the draft
    model, the over-confident copy, mostly its likeliest): many drafts are accepted and many
    rejected, and a rule that resampled from p on a rejection would over-draw the drafts.

    The samples depend on the CPU's rounding of the logits, so a new CPU kind or torch
    version is a fresh draw: at p = 0.001 a correct rule fails one draw in a thousand, while
    the wrong rule's p-value lies many orders of magnitude lower (measured over three seed
    draws: below 1e-19 for the draft model, about 1e-12 for prompt lookup)."""
    n = N_SAMPLES
    prompt, plain = plain_samples
    fast_engine = sampling_engine(small_vocab, drafter)
    fast = first_tokens(fast_engine, prompt, n, seed0=100_000)
    stats = fast_engine.speculator.stats
    assert stats.num_draft_tokens > n, "the drafts must be many for the test to mean anything"
    # two tokens (all its remaining ones allow) at every sequence's first verified step: a
    # draft pool too small for the batch would leave some sequences undrafted there
    assert stats.draft_tokens_per_pos[1] == n
    assert 0.1 < stats.acceptance_rate < 0.9, "many drafts accepted, many rejected"
    assert chi_square_p(plain, fast) > 1e-3
    wrong_engine = sampling_engine(small_vocab, drafter, "resample-from-p")
    wrong = first_tokens(wrong_engine, prompt, n, seed0=100_000)
    assert chi_square_p(plain, wrong) < 1e-3


# -- the rule and the instruments, in isolation ---------------------------------------------


def test_greedy_accepts_the_longest_matching_prefix_then_the_models_token():
    logits = torch.full((4, 6), -1.0)
    for row, best in enumerate([2, 4, 1, 5]):
        logits[row, best] = 3.0
    params = SamplingParams()
    history = torch.tensor([0, 1])
    assert accept(logits, Draft([2, 4, 1]), params, history, None) == ([2, 4, 1, 5], 3)
    assert accept(logits, Draft([2, 3, 1]), params, history, None) == ([2, 4], 1)
    assert accept(logits, Draft([0, 4, 1]), params, history, None) == ([2], 0)


def test_repetition_penalty_sees_the_drafts_before_each_row():
    """Row j's penalty covers the drafts before it: token 2, drafted at row 0, loses row 1's
    argmax to token 3 under a strong penalty."""
    logits = torch.zeros(3, 5)
    logits[:, 2], logits[:, 3] = 4.0, 3.0
    params = SamplingParams(repetition_penalty=2.0)
    history = torch.tensor([0])
    assert accept(logits, Draft([2, 3]), params, history, None) == ([2, 3, 2], 2)
    assert accept(logits, Draft([2, 2]), params, history, None) == ([2, 3], 1)


def test_expected_tokens_and_best_k():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    free = VerifyCost(0.0, 0.0)
    assert best_k(0.9, 8, free) == 8  # drafting costs nothing: draft as far as allowed
    assert best_k(0.05, 8, VerifyCost(0.2, 0.05)) == 0  # nothing is accepted: stop drafting
    # costly drafts favour a short k (Leviathan et al.'s figure 3)
    assert 0 < best_k(0.7, 8, VerifyCost(0.1, 0.05), draft_per_token=0.3) < 4


def test_acceptance_counters_follow_vllms_definitions():
    stats = SpecStats()
    stats.record(4, 2)
    stats.record(2, 2)
    stats.record(0, 0)  # no draft: not counted
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 6, 4)
    assert stats.acceptance_rate == pytest.approx(4 / 6)
    assert stats.mean_acceptance_length == pytest.approx(1 + 4 / 2)
    assert stats.acceptance_per_pos() == (1.0, 1.0, 0.0, 0.0)


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    class Seq:
        request_id = "a"

        def __init__(self, prompt: list[int]) -> None:
            self.prompt_ids = prompt
            self.output_ids: list[int] = []

    drafter = LookupDrafter(ngram_min=1, ngram_max=3)
    seq = Seq([5, 6, 7, 8, 9, 1, 5, 6, 7, 2, 3, 5, 6])
    # "5 6" was followed by 7 8 9 … and later by 7 2 3: the latest counts
    assert drafter.propose([seq], [3], None)[0].tokens == [7, 2, 3]
    assert drafter.propose([Seq([1, 2, 3])], [3], None)[0].tokens == []  # no match


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("self", "self-speculation needs a precision: self:int4-g32+head"),
        ("model:", "a draft model needs its folder: model:DIR"),
        ("ngram", "unknown --speculative 'ngram'; give self:PRECISION"),
        ("lookup:3", "unknown --speculative 'lookup:3'; give self:PRECISION"),
        ("self:int4-g32+head:x", "unknown precision 'int4-g32+head:x'; choose one of"),
    ],
)
def test_bad_speculative_options_say_what_to_give(text, needle):
    with pytest.raises(InvalidRequestError, match=re.escape(needle)):
        parse_speculative(text, 4)


def test_a_draft_model_with_another_tokenizer_is_refused(tiny, small_vocab):
    engine = load_model(tiny, config=EngineConfig(block_size=BS, num_blocks=16))
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        engine.set_speculation(spec(f"model:{small_vocab[0]}"))
    assert engine.speculator is None  # the engine goes on as it was


# -- the real default model -----------------------------------------------------------------


REAL_CANCEL = {2: 9}


@pytest.fixture(scope="module")
def real_plain(
    default_model: Path,
) -> tuple[LLMEngine, list[Arrival], tuple[dict[int, list[int]], dict[int, str]]]:
    """The real model under a cache window, and plain greedy's replies to two chat prompts
    and a bug-fixing prompt with the code in it, arriving at different steps, one cancelled
    mid-reply: what every drafter must give."""
    config = EngineConfig(num_blocks=96, window=CacheWindow(sink=4, window=160))
    engine = load_model(default_model, config=config)
    chats = [
        "What is the capital of France? Answer in one sentence.",
        GROUNDED_PROMPTS[0],  # "fix the bug in this code", 20 lines of Python in the prompt
        "Write a haiku about autumn.",
    ]
    params = SamplingParams(max_new_tokens=28)
    arrivals: list[Arrival] = [
        (at, engine.chat_prompt_ids([{"role": "user", "content": c}]), params)
        for at, c in zip((0, 0, 3), chats, strict=True)
    ]
    want, want_finish, _ = run(engine, arrivals, REAL_CANCEL)
    return engine, arrivals, (want, want_finish)


# The self-drafter runs on every CPU path (the AVX2 leg too: its INT4 draft weights take the
# level's kernel); the others draft down paths the tiny models' cases already take.
@pytest.mark.parametrize(
    "drafter",
    [
        pytest.param("lookup", marks=pytest.mark.breadth),
        "self:int4-g32+head",
        pytest.param("model", marks=pytest.mark.breadth),
    ],
)
def test_real_model_greedy_is_unchanged_by_every_drafter(real_plain, default_model, drafter,
                                                         tmp_path):  # fmt: skip
    """Every drafter gives plain greedy's tokens on the real model (see :func:`real_plain`)."""
    engine, arrivals, (want, want_finish) = real_plain
    if drafter == "model":
        # SmolLM2-135M is the smallest of its family: its first 22 layers make a smaller
        # model with its tokenizer (a poor drafter, α ≈ 0.1, so drafted every step to be
        # tested at all; two tokens a step: at that α a third or fourth guess is all but
        # never accepted, and each costs a draft step and a verified token)
        draft_dir = truncated_copy(default_model, tmp_path / "draft", layers=22)
        engine.set_speculation(spec(f"model:{draft_dir}", k=2, adaptive=False))
    else:
        engine.set_speculation(spec(drafter, k=4, adaptive=True))
    try:
        got, finish, kinds = run(engine, arrivals, REAL_CANCEL)
    finally:
        engine.set_speculation(None)
    assert_same(got, want, REAL_CANCEL)
    assert finish == want_finish, drafter
    assert kinds["accepted"] > 0, drafter


def test_draft_slots_never_keep_a_waiting_request_out():
    """The scheduler reserves slots for drafts only from what is left once the running
    sequences have their tokens and the waiting ones are admitted: a request that fits the
    pool exactly is admitted although a decoding sequence wants four draft slots."""
    from engine.core.scheduler import Scheduler
    from engine.core.sequence import Sequence
    from engine.kv_cache.block_manager import BlockManager

    mgr = BlockManager(num_blocks=10, block_size=4, prefix_caching=False)
    sched = Scheduler(mgr)
    a = Sequence("a", list(range(1, 8)), GREEDY, arrival=0.0)
    sched.add(a)
    (first,) = sched.schedule(0.0).chunks
    a.num_computed = first.start + first.length
    a.output_ids.append(9)  # decoding now: its next token lies in its second block
    a.spec_k = 4
    b = Sequence("b", list(range(1, 28)), GREEDY, arrival=1.0)  # 7 blocks + 1 of watermark
    sched.add(b)
    out = sched.schedule(1.0)
    by_id = {c.seq.request_id: c for c in out.chunks}
    assert set(by_id) == {"a", "b"}, "the waiting request was kept out"
    assert by_id["a"].lookahead in (0, 4)  # drafts only from what was left
    assert mgr.num_used <= mgr.num_blocks


def test_a_draft_model_catches_up_on_a_long_prompt_in_chunks(tiny, other_tiny, monkeypatch):
    """A prompt longer than the catch-up chunk reaches the draft model's cache in pieces, one
    a step, before the sequence drafts; the output is plain greedy output."""
    from engine.speculative import drafters

    monkeypatch.setattr(drafters, "CATCH_UP", 8)
    config = EngineConfig(block_size=BS, num_blocks=64)
    arrivals: list[Arrival] = [(0, repetitive(21, 21) + repetitive(22, 21), GREEDY)]
    want, _, _ = run(load_model(tiny, config=config), arrivals)
    fast = load_model(tiny, config=config)
    fast.set_speculation(spec(f"model:{other_tiny}", k=3, adaptive=False))
    calls = []
    real = drafters.ModelDrafter._catch_up
    monkeypatch.setattr(
        drafters.ModelDrafter, "_catch_up",
        lambda self, behind, window: (calls.append(len(behind)), real(self, behind, window)),
    )  # fmt: skip
    got, _, kinds = run(fast, arrivals)
    assert got == want
    assert sum(calls) == 5  # 42 prompt tokens + 1: five chunks of 8 behind, then drafting
    assert kinds["accepted"] > 0
