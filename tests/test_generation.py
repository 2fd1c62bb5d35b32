"""The streaming generate() API on the real model: stop strings, limits, seeds, timings."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from engine.core.engine import LLMEngine
from engine.core.output import StopStringMatcher
from engine.core.sampling import SamplingParams
from engine.errors import InvalidRequestError
from engine.loader.load import load_model


@pytest.fixture(scope="module")
def engine(default_model: Path) -> LLMEngine:
    return load_model(default_model, precision="fp32")


def _run(engine: LLMEngine, prompt: str, **kwargs):
    gen = engine.generate(engine.chat_prompt_ids([{"role": "user", "content": prompt}]),
                          SamplingParams(**kwargs))  # fmt: skip
    events = list(gen)
    return gen.result, events


def test_stop_string_truncates_text_and_ends_generation(engine):
    full, _ = _run(engine, "Tell me about the moon.", max_new_tokens=16, ignore_eos=True)
    words = full.text.split()
    assert len(words) > 8
    stop = " " + words[5]  # a stop string taken from the greedy text itself
    cut = full.text.index(stop)
    result, events = _run(engine, "Tell me about the moon.", max_new_tokens=40, stop=(stop,))
    assert result.finish_reason == "stop"
    assert result.text == full.text[:cut]
    assert "".join(e.text for e in events) == result.text
    assert events[-1].finish_reason == "stop" and all(e.finish_reason is None for e in events[:-1])


def test_max_new_tokens_ends_with_length(engine):
    result, events = _run(engine, "Count from one to fifty.", max_new_tokens=7, ignore_eos=True)
    assert result.finish_reason == "length"
    assert len(result.token_ids) == len(events) == 7


def test_end_of_generation_token_ends_with_stop(engine):
    result, _ = _run(engine, "Say just the word yes.", max_new_tokens=64)
    assert result.finish_reason == "stop"
    assert result.token_ids[-1] in engine.eos_token_ids
    assert "<|im_end|>" not in result.text


def test_generation_stops_at_the_context_limit(tiny_model_dir):
    folder, _ = tiny_model_dir("llama", True)
    tiny = load_model(folder)
    prompt = [7] * (tiny.context_length - 3)
    gen = tiny.generate(prompt, SamplingParams(max_new_tokens=50, ignore_eos=True))
    list(gen)
    assert gen.result.finish_reason == "length"
    assert len(prompt) + len(gen.result.token_ids) == tiny.context_length


def test_prompt_longer_than_context_is_refused(engine):
    with pytest.raises(InvalidRequestError, match="context is 8192"):
        engine.generate([100] * (engine.context_length + 1), SamplingParams())


def test_empty_prompt_is_refused(engine):
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        engine.generate([], SamplingParams())


def test_same_seed_same_text(engine):
    kwargs = dict(max_new_tokens=8, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    a, _ = _run(engine, "Invent a name for a cat.", **kwargs)
    b, _ = _run(engine, "Invent a name for a cat.", **kwargs)
    c, _ = _run(engine, "Invent a name for a cat.", **{**kwargs, "seed": 4321})
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_timings_are_reported(engine):
    """TTFT and TPOT against the caller's clock: the engine steps only when the next token
    is asked for, so token ``i`` was stamped after the caller asked for it and before the
    caller had it, and the request arrived while ``generate`` ran."""
    prompt = engine.chat_prompt_ids([{"role": "user", "content": "Hello!"}])
    before = time.perf_counter()
    gen = engine.generate(prompt, SamplingParams(max_new_tokens=5, ignore_eos=True))
    made = time.perf_counter()
    asked, had = [], []
    it = iter(gen)
    while True:
        asked.append(time.perf_counter())
        try:
            event = next(it)
        except StopIteration:
            break
        had.append(time.perf_counter())
        assert event.token_id is not None  # one token per event
    result, n = gen.result, len(had)
    assert n == 5 and result.ttft_s is not None and result.tpot_s is not None
    assert asked[0] - made <= result.ttft_s <= had[0] - before
    assert (asked[-2] - had[0]) / (n - 1) <= result.tpot_s <= (had[-1] - asked[0]) / (n - 1)


@pytest.mark.parametrize(
    ("pieces", "stops", "released"),
    [
        (["Hel", "lo wo", "rld"], ["wor"], "Hello "),
        (["ab", "c", "d"], ["cd"], "ab"),
        (["a", "b", "c"], ["xyz"], "abc"),
        (["aab", "ab"], ["abaa"], "aabab"),  # a false start that later fails to complete
        (["aab", "aab"], ["abaa"], "a"),  # the stop string spans both pieces
        (["x"], ["x"], ""),
    ],
)
def test_stop_matcher_never_releases_a_stop_string(pieces, stops, released):
    matcher = StopStringMatcher(stops)
    out = []
    for i, piece in enumerate(pieces):
        out.append(matcher.feed(piece, final=i == len(pieces) - 1))
        assert not any(s in "".join(out) for s in stops)
    assert "".join(out) == released
