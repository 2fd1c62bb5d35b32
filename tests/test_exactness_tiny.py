"""Our engine against transformers on tiny random Llama and Qwen2 models (fp32).

Logits over the prompt and over 32 greedy decode steps must agree within 1e-4, and the
greedy token ids must be identical to transformers' ``generate``.
"""

from __future__ import annotations

import pytest
import torch

from engine.engine import LLMEngine
from engine.sampling import SamplingParams

DECODE_STEPS = 32
CASES = [("llama", True), ("llama", False), ("qwen2", True), ("qwen2", False)]


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "nn.Linear"])
@pytest.mark.parametrize(
    ("arch", "tied"), CASES, ids=[f"{a}-{'tied' if t else 'untied'}" for a, t in CASES]
)
def test_logits_and_greedy_ids_match_transformers(tiny_model_dir, arch, tied, pack):
    folder, hf = tiny_model_dir(arch, tied)
    engine = LLMEngine.load(folder, precision="fp32", pack=pack)
    prompt = torch.randint(
        0, hf.config.vocab_size, (13,), generator=torch.Generator().manual_seed(1)
    )

    # Ours: prefill, then one token at a time through the KV cache.
    cache = engine.new_cache(len(prompt) + DECODE_STEPS)
    ours = [engine.forward_logits(prompt.tolist(), cache, 0)]
    generated = [int(ours[-1][-1].argmax())]
    for step in range(DECODE_STEPS - 1):
        ours.append(engine.forward_logits([generated[-1]], cache, len(prompt) + step))
        generated.append(int(ours[-1][-1].argmax()))
    ours_logits = torch.cat(ours)

    # Theirs: one causal forward over prompt + our tokens gives every position's logits.
    full = torch.cat([prompt, torch.tensor(generated[:-1])])
    with torch.no_grad():
        ref_logits = hf(full[None]).logits[0].float()
        ref_ids = hf.generate(
            prompt[None],
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=DECODE_STEPS,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )[0, len(prompt) :].tolist()

    assert ours_logits.shape == ref_logits.shape
    assert (ours_logits - ref_logits).abs().max().item() <= 1e-4
    assert generated == ref_ids

    # And the public streaming API produces the same ids.
    gen = engine.generate(
        prompt.tolist(), SamplingParams(max_new_tokens=DECODE_STEPS, ignore_eos=True)
    )
    assert [e.token_id for e in gen] == ref_ids


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    from tests.conftest import build_tiny_hf, save_tiny

    scaling = {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }  # fmt: skip
    hf = build_tiny_hf("llama", tied=False, rope_scaling=scaling, head_dim=32)
    folder = save_tiny(hf, tmp_path)
    engine = LLMEngine.load(folder, precision="fp32")
    assert engine.cfg.rope_scaling.kind == "llama3"
    ids = torch.randint(0, hf.config.vocab_size, (200,), generator=torch.Generator().manual_seed(3))
    ours = engine.forward_logits(ids.tolist(), engine.new_cache(len(ids)), 0)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert (ours - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precisions_stay_close_to_fp32(tiny_model_dir, precision):
    folder, _ = tiny_model_dir("llama", False)
    prompt = list(range(5, 30))
    logits = {}
    for name in ("fp32", precision):
        engine = LLMEngine.load(folder, precision=name)
        assert engine.model.embed.weight.dtype == engine.dtype
        logits[name] = engine.forward_logits(prompt, engine.new_cache(len(prompt)), 0)
    scale = logits["fp32"].abs().max()
    assert (logits[precision] - logits["fp32"]).abs().max() / scale < 0.05
