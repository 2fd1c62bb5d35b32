"""The converted default model (SmolLM2-135M-Instruct) against transformers, exactly."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from engine.core.sampling import SamplingParams
from engine.loader.load import load_model

# The first runs all NEW_TOKENS on every CPU path (the AVX2 leg too); the others are breadth.
PROMPTS = [
    "Write a short poem about the autumn wind.",
    *(
        pytest.param(p, marks=pytest.mark.breadth)
        for p in (
            "What is the capital of France?",
            "Explain in two sentences why the sky is blue.",
            "List three uses of a paperclip.",
            "Translate 'good morning, my friend' into Spanish and French.",
            "What is 17 times 23? Show your steps.",
        )
    ),
]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def engines(default_model: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ours = load_model(default_model, precision="fp32")
    theirs = AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(default_model)
    return ours, theirs, tokenizer


def transformers_choices(
    theirs, prompt_ids: list[int], ids: list[int], repetition_penalty: float | None = None
) -> list[int]:
    """Transformers' greedy choice after ``prompt_ids`` and after each prefix of ``ids``, its
    repetition penalty applied by its own logits processor: where these equal ``ids`` and
    ``ids`` stop where :func:`assert_stops_as_transformers` says, transformers' greedy
    ``generate`` gives ``ids`` token for token. One forward pass over all of them, not one
    decode step per token: its logits differ from ``generate``'s cached steps by rounding
    alone, far below the gap between the top two logits (at least 0.015 on these prompts)."""
    from transformers import RepetitionPenaltyLogitsProcessor

    full = torch.tensor([prompt_ids + ids])
    with torch.no_grad():
        logits = theirs(full).logits[0, len(prompt_ids) - 1 : -1]
    if repetition_penalty is not None:
        penalty = RepetitionPenaltyLogitsProcessor(repetition_penalty)
        logits = torch.cat(
            [penalty(full[:, : len(prompt_ids) + i], logits[i : i + 1]) for i in range(len(ids))]
        )
    return logits.argmax(-1).tolist()


def assert_stops_as_transformers(theirs, ids: list[int], max_new_tokens: int) -> None:
    """``generate`` stops at the first of its end-of-generation ids, or at the limit."""
    eos = theirs.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos)
    assert not eos & set(ids[:-1])
    assert len(ids) == max_new_tokens or ids[-1] in eos


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_ids_identical_to_transformers(engines, prompt):
    ours, theirs, tokenizer = engines
    messages = [{"role": "user", "content": prompt}]
    prompt_ids = ours.chat_prompt_ids(messages)
    hf_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(hf_ids, list):  # newer transformers return a BatchEncoding
        hf_ids = hf_ids["input_ids"]
    assert prompt_ids == list(hf_ids)

    gen = ours.generate(prompt_ids, SamplingParams(max_new_tokens=NEW_TOKENS))
    text = "".join(e.text for e in gen)
    ids = gen.result.token_ids
    assert ids == transformers_choices(theirs, prompt_ids, ids)
    assert_stops_as_transformers(theirs, ids, NEW_TOKENS)
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    assert len(ids) >= 8  # a real answer, not an immediate stop


@pytest.mark.no_engine_paths  # files against files: the same on every CPU kind
def test_converter_matches_transformers_gguf_dequantization(
    default_model: Path, default_gguf: Path, monkeypatch: pytest.MonkeyPatch
):
    """Most of the oracle's time is not dequantizing: transformers reads the file's metadata
    (the tokenizer's 49k tokens and merges, field by field) once for the config and again for
    the weights, and builds gguf's tensor-name map anew for each of the model's 397 modules.
    Both are functions of their arguments alone, so each is made once here; what transformers
    computes from them is unchanged."""
    import gguf
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))

    reference = AutoModelForCausalLM.from_pretrained(
        default_gguf.parent, gguf_file=default_gguf.name, dtype=torch.float32
    ).state_dict()
    checked = 0
    with safe_open(str(default_model / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118
            ours = f.get_tensor(name)
            assert ours.dtype == torch.float16
            expected = reference[name].to(torch.float16)
            assert torch.equal(ours, expected), name
            checked += 1
    assert checked == 30 * 9 + 2  # 9 tensors per layer + embedding + final norm (tied head)


def test_end_of_generation_ids_include_im_end_and_endoftext(engines):
    engine = engines[0]
    tok = engine.tokenizer
    assert {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")} <= engine.eos_token_ids


def test_repetition_penalty_matches_transformers(engines):
    ours, theirs, _ = engines
    prompt_ids = ours.chat_prompt_ids([{"role": "user", "content": "Repeat: la la la la la"}])
    gen = ours.generate(prompt_ids, SamplingParams(max_new_tokens=32, repetition_penalty=1.3))
    list(gen)
    ids = gen.result.token_ids
    assert ids == transformers_choices(theirs, prompt_ids, ids, repetition_penalty=1.3)
    assert_stops_as_transformers(theirs, ids, 32)
