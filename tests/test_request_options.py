"""The per-request options the serving ecosystem sends (issue 47), in the engine: each prompt
token's log-probabilities from the prefill (against transformers' own), ``min_tokens``,
``stop_token_ids``, ``include_stop_str_in_output`` and ``skip_special_tokens``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.core.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.core.output import StopStringMatcher
from engine.core.sampling import SamplingParams
from engine.core.scheduler import SchedulerLimits
from engine.errors import InvalidRequestError
from engine.loader.load import load_model

PROMPT = [3, 17, 52, 9, 88, 41, 5, 23, 70, 12, 61, 33, 7, 95, 28, 14, 44, 2, 81, 36]


@pytest.fixture
def tiny(tiny_model_dir) -> tuple[LLMEngine, torch.nn.Module]:
    folder, hf = tiny_model_dir("llama", False)
    # chunks of 7 tokens and blocks of 4: a prompt's rows span chunks and blocks
    limits = dataclasses.replace(SchedulerLimits(), max_tokens_per_step=7)
    config = EngineConfig(block_size=4, num_blocks=64, limits=limits)
    return load_model(folder, config=config), hf


def run(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list:
    return list(engine.generate(prompt, params))


def oracle(hf: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, -1)


def test_prompt_logprobs_equal_transformers_across_chunks_and_a_warm_prefix_cache(tiny):
    engine, hf = tiny
    table = oracle(hf, PROMPT)
    params = SamplingParams(max_new_tokens=1, prompt_logprobs=3)  # its one token ends it
    run(engine, PROMPT, SamplingParams(max_new_tokens=2))  # the prompt's blocks now cached
    for _ in range(2):  # and once more, after its own pass cached them too
        events = run(engine, PROMPT, params)
        got = events[0].prompt_logprobs
        assert got is not None and len(got) == len(PROMPT) and got[0] is None
        assert all(e.prompt_logprobs is None for e in events[1:])
        for i in range(1, len(PROMPT)):
            lp, top = got[i]
            want = table[i - 1]
            assert lp == pytest.approx(float(want[PROMPT[i]]), abs=1e-4)
            best = want.topk(3)
            assert [t for t, _ in top] == best.indices.tolist()
            assert [v for _, v in top] == pytest.approx(best.values.tolist(), abs=1e-4)


def test_min_tokens_holds_back_the_stop_tokens_then_lets_them_end(tiny):
    engine, _ = tiny
    free = run(engine, PROMPT, SamplingParams(max_new_tokens=12))
    greedy = [e.token_id for e in free if e.token_id is not None]
    end = greedy[0]  # the first greedy token, as a stop token: ends at once
    stopped = run(engine, PROMPT, SamplingParams(max_new_tokens=12, extra_stop_token_ids=(end,)))
    assert [e.token_id for e in stopped] == greedy[:1]
    assert stopped[-1].finish_reason == "stop"
    held = run(engine, PROMPT, SamplingParams(
        max_new_tokens=12, extra_stop_token_ids=(end,), min_tokens=6))  # fmt: skip
    tokens = [e.token_id for e in held if e.token_id is not None]
    assert len(tokens) >= 6 and end not in tokens[:6]
    assert held[-1].finish_reason == ("stop" if tokens[-1] == end else "length")
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(max_new_tokens=4, min_tokens=5)


def test_a_stop_string_is_kept_on_request():
    cut = StopStringMatcher(["END", "EN"])
    assert cut.feed("abc E", final=False) == "abc " and cut.feed("ND more", final=False) == ""
    kept = StopStringMatcher(["END", "EN"], include=True)
    assert kept.feed("abc E", final=False) + kept.feed("ND more", final=False) == "abc END"


@pytest.mark.real_model
def test_special_tokens_show_in_the_text_on_request(default_model):
    """An end token kept going (``ignore_eos``) is text only where the request asks (the
    default model's, a special token; the tiny models' are plain)."""
    engine = load_model(default_model, config=EngineConfig(num_blocks=16))
    eos = min(engine.eos_token_ids)
    shown = engine.tokenizer.decode([eos], skip_special_tokens=False)
    assert shown and engine.tokenizer.decode([eos]) == ""
    for skip, want in ((True, ""), (False, shown)):
        params = SamplingParams(max_new_tokens=3, ignore_eos=True, skip_special_tokens=skip)
        rid = engine.add_request(PROMPT, params)
        seq = engine.sequence(rid)
        event, finish = engine.outputs.token(seq, eos, 0.0)
        assert event.text == want and finish is None
        engine.cancel(rid)
        engine.step()


def test_min_tokens_holds_back_stop_strings_too_as_vllm_does(tiny):
    """vLLM checks no stop string before ``min_tokens``: the reply goes past the first match."""
    engine, _ = tiny
    free = "".join(e.text for e in run(engine, PROMPT, SamplingParams(max_new_tokens=12)))
    stop = free[:2]
    cut = run(engine, PROMPT, SamplingParams(max_new_tokens=12, stop=(stop,)))
    assert "".join(e.text for e in cut) == "" and cut[-1].finish_reason == "stop"
    held = run(engine, PROMPT, SamplingParams(max_new_tokens=12, stop=(stop,), min_tokens=5))
    tokens = [e.token_id for e in held if e.token_id is not None]
    assert len(tokens) >= 5 and "".join(e.text for e in held).startswith(stop)


def test_stop_token_ids_outside_the_vocabulary_are_refused(tiny):
    engine, _ = tiny
    vocab = engine.cfg.vocab_size
    for bad in (vocab, -1):
        params = SamplingParams(max_new_tokens=4, extra_stop_token_ids=(bad,), min_tokens=2)
        with pytest.raises(InvalidRequestError, match="stop token ids"):
            engine.add_request(PROMPT, params)
