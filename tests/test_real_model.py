"""The converted default model (SmolLM2-135M-Instruct) against transformers, exactly."""

from __future__ import annotations

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
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        ref = theirs.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False
        )[0, len(prompt_ids) :].tolist()
    assert gen.result.token_ids == ref
    assert text == tokenizer.decode(ref, skip_special_tokens=True)
    assert len(ref) >= 8  # a real answer, not an immediate stop


@pytest.mark.no_engine_paths  # files against files: the same on every CPU kind
def test_converter_matches_transformers_gguf_dequantization(
    default_model: Path, default_gguf: Path
):
    from transformers import AutoModelForCausalLM

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


def test_end_of_generation_ids_include_im_end_and_endoftext(default_model: Path):
    engine = load_model(default_model, precision="fp32")
    tok = engine.tokenizer
    assert {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")} <= engine.eos_token_ids


def test_repetition_penalty_matches_transformers(engines):
    ours, theirs, _ = engines
    prompt_ids = ours.chat_prompt_ids([{"role": "user", "content": "Repeat: la la la la la"}])
    gen = ours.generate(prompt_ids, SamplingParams(max_new_tokens=32, repetition_penalty=1.3))
    list(gen)
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        ref = theirs.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=32,
            do_sample=False,
            repetition_penalty=1.3,
        )[0, len(prompt_ids) :].tolist()
    assert gen.result.token_ids == ref
