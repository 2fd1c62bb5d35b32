"""Prefix caching through the whole engine: with it on, every output equals the output with it
off (multi-turn chats, n candidates of one prompt, requests sharing a system prompt arriving at
different steps, preemption in a small pool, cancellation, the cache window), and the tokens it
says it reused are the ones a block-level cache can reuse."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.core.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.core.sampling import SamplingParams
from engine.core.scheduler import SchedulerLimits
from engine.kv_cache.window import CacheWindow
from engine.loader.load import load_model

BS = 4  # small blocks: many of them, and many partial ones
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Callable[[str, bool], tuple[Path, torch.nn.Module]]) -> Path:
    return tiny_model_dir("llama", False)[0]


def engines(folder: Path, **config: object) -> tuple[LLMEngine, LLMEngine]:
    """The same model with prefix caching on and off."""
    on, off = (
        load_model(folder, config=EngineConfig(block_size=BS, prefix_caching=caching, **config))  # type: ignore[arg-type]
        for caching in (True, False)
    )
    return on, off


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


Arrival = tuple[int, list[int], SamplingParams]  # (step, prompt, params)


def run(
    engine: LLMEngine, arrivals: list[Arrival], cancel: dict[int, int] | None = None
) -> tuple[dict[int, list[int]], dict[int, str], int]:
    """Add each request at its step, cancel request ``i`` at step ``cancel[i]``; returns the
    tokens and finish reason of each and the most blocks shared at once."""
    cancel = cancel or {}
    ids: dict[str, int] = {}
    out: dict[int, list[int]] = {i: [] for i in range(len(arrivals))}
    finish: dict[int, str] = {}
    shared = step = 0
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
            if event.finish_reason:
                finish[i] = event.finish_reason
        shared = max(shared, engine.kv.manager.num_shared)
        step += 1
        assert step < 5_000, "the engine stopped making progress"
    mgr = engine.kv.manager
    assert mgr.num_used == 0 and mgr.num_free == mgr.num_blocks  # every block came back
    return out, finish, shared


def cached_tokens(engine: LLMEngine, index: int) -> int:
    metrics = engine.request_metrics(f"req-{index}")
    assert metrics is not None
    return metrics.cached_prompt_tokens


def test_a_conversation_reuses_every_full_block_of_its_earlier_turns(tiny):
    on, off = engines(tiny, num_blocks=128)
    history: list[int] = []
    for turn in range(6):
        prompt = history + tokens(turn, 7 + 3 * turn)  # the turns so far and a new message
        got = run(on, [(0, prompt, GREEDY)])[0][0]
        want = run(off, [(0, prompt, GREEDY)])[0][0]
        assert got == want, f"turn {turn}"
        # everything of the last turn lies in full blocks but its last sampled token (never
        # fed back), and the new prompt's last token is always computed
        reusable = min(len(history) - 1, len(prompt) - 1) // BS * BS if history else 0
        assert cached_tokens(on, turn) == reusable
        assert cached_tokens(off, turn) == 0
        history = prompt + got
    stats = on.kv.manager.stats
    assert stats.hit_tokens == sum(cached_tokens(on, t) for t in range(6))
    assert on.metrics().prefix_cache_hit_rate == stats.hit_tokens / stats.query_tokens > 0.5


def test_candidates_of_one_prompt_compute_it_once(tiny):
    on, off = engines(tiny, num_blocks=128)
    prompt = tokens(1, 41)
    arrivals = [
        (0, prompt, SamplingParams(max_new_tokens=12, temperature=0.9, seed=seed))
        for seed in (1, 2, 3)
    ]
    got, _, shared = run(on, arrivals)
    want, _, _ = run(off, arrivals)
    assert got == want
    # the first computes the prompt; the others wait for its blocks, then share all ten
    assert [cached_tokens(on, i) for i in range(3)] == [0, 40, 40]
    assert shared == 10
    assert on.collector.total_prompt_tokens == 41 + 1 + 1
    assert off.collector.total_prompt_tokens == 3 * 41


def shared_system_prompt(n: int, *, every: int) -> list[Arrival]:
    system = tokens(100, 30)
    return [(i * every, system + tokens(200 + i, 5 + i % 4), GREEDY) for i in range(n)]


def test_requests_sharing_a_system_prompt_at_different_steps_with_cancellations(tiny):
    on, off = engines(tiny, num_blocks=128)
    arrivals = shared_system_prompt(8, every=3)
    cancel = {2: 9, 5: 15}  # one while it decodes, one on arrival (before its first step)
    got, finish, shared = run(on, arrivals, cancel)
    want, finish_off, _ = run(off, arrivals, cancel)
    assert got == want and finish == finish_off
    assert sorted(i for i, f in finish.items() if f == "cancelled") == [2, 5]
    assert shared >= 7  # the system prompt's seven full blocks
    assert all(cached_tokens(on, i) == 28 for i in range(1, 8) if finish[i] != "cancelled")


def test_preemption_in_a_small_pool_keeps_outputs_exact(tiny):
    # 16 blocks of 4 tokens: sharing their 7 system-prompt blocks, two sequences are admitted
    # together but cannot grow to 47-50 tokens (5-6 blocks of their own each) together
    on, off = engines(tiny, num_blocks=16, limits=SchedulerLimits(max_tokens_per_step=16))
    arrivals = shared_system_prompt(4, every=1)
    got, _, _ = run(on, arrivals)
    want, _, _ = run(off, arrivals)
    assert got == want
    assert on.metrics().total_preemptions > 0


def test_the_cache_window_reuses_only_what_it_computed_under_the_same_window(tiny):
    window = CacheWindow(sink=4, window=16)
    on, off = engines(tiny, num_blocks=64, window=window)
    history: list[int] = []
    for turn in range(4):
        prompt = history + tokens(10 + turn, 9)
        got, _, _ = run(on, [(0, prompt, GREEDY)])
        want, _, _ = run(off, [(0, prompt, GREEDY)])
        assert got == want, f"turn {turn}"
        history = prompt + got[0]
    assert on.kv.manager.stats.hit_tokens > 0
    # a new window: blocks computed under the old one are never reused
    on.set_window(CacheWindow(sink=4, window=32))
    off.set_window(CacheWindow(sink=4, window=32))
    prompt = history + tokens(20, 5)
    got, _, _ = run(on, [(0, prompt, GREEDY)])
    want, _, _ = run(off, [(0, prompt, GREEDY)])
    assert got == want and cached_tokens(on, 4) == 0


def test_a_windowed_chat_longer_than_the_pool_is_admitted_with_its_cached_prefix(tiny):
    """Under a cache window a request only ever holds sink + window + a chunk, so a chat may
    outgrow the pool; the blocks of its cached prefix that the window leaves out are not taken
    again (taking them all would not fit, and it would wait for ever)."""
    window = CacheWindow(sink=4, window=8)
    limits = SchedulerLimits(max_tokens_per_step=8)
    on, off = engines(tiny, num_blocks=10, window=window, limits=limits)
    first = tokens(30, 36)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    got, _, _ = run(on, [(0, first, params)])
    want, _, _ = run(off, [(0, first, params)])
    assert got == want and on.kv.manager.num_cached > 0
    second = first + got[0] + tokens(31, 8)  # 48 tokens: 12 blocks, more than the pool
    got, _, _ = run(on, [(0, second, params)])
    want, _, _ = run(off, [(0, second, params)])
    assert got == want and cached_tokens(on, 1) > 0


def test_switching_off_and_clearing_forget_the_cache(tiny):
    on, _ = engines(tiny, num_blocks=64)
    prompt = tokens(3, 21)
    run(on, [(0, prompt, GREEDY)])
    assert on.kv.manager.num_cached == 8  # 21 + 12 tokens, all computed but the last
    run(on, [(0, prompt, GREEDY)])
    assert cached_tokens(on, 1) == 20
    # another engine on the same weights (a new precision or pool is a new engine) has a
    # cache of its own, empty
    assert on.sibling(on.config).kv.manager.num_cached == 0 < on.kv.manager.num_cached
    on.clear_prefix_cache()
    assert on.kv.manager.num_cached == 0
    run(on, [(0, prompt, GREEDY)])
    assert cached_tokens(on, 2) == 0
    on.set_prefix_caching(False)
    assert on.kv.manager.num_cached == 0 and not on.config.prefix_caching
    run(on, [(0, prompt, GREEDY)])
    assert cached_tokens(on, 3) == 0 and on.kv.manager.num_cached == 0
    assert not on.with_pool(num_blocks=8).kv.manager.prefix_caching  # the setting carries over
