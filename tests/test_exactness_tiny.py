"""Our engine against transformers on tiny random Llama, Qwen2, Qwen3 and Mistral models (fp32).

Logits over the prompt and over 32 greedy decode steps must agree within 1e-4, and the
greedy token ids must be identical to transformers' ``generate``. The tiny Mistral has a
sliding window of 8 tokens (``tests/conftest.py``), so its 13-token prompt and 32 decode
steps run far past it: through the contiguous cache, and through the paged cache with each
decode-attention path while the window's blocks are released.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from engine.core.config import EngineConfig
from engine.core.sampling import SamplingParams
from engine.errors import InvalidRequestError, UnsupportedModelError
from engine.hardware.cpu_paths import cpu_paths, forced_level
from engine.kernels import native, paged_decode
from engine.kernels.packed_linear import PackedLinear
from engine.kv_cache.window import CacheWindow
from engine.loader.load import load_model
from engine.model.config import ModelConfig

DECODE_STEPS = 32
CASES = [
    ("llama", True), ("llama", False), ("qwen2", True), ("qwen2", False), ("qwen3", True),
    ("qwen3", False), ("mistral", False),
]  # fmt: skip


def tiny_prompt(hf: torch.nn.Module) -> torch.Tensor:
    return torch.randint(0, hf.config.vocab_size, (13,), generator=torch.Generator().manual_seed(1))


def hf_greedy(hf: torch.nn.Module, prompt: torch.Tensor) -> list[int]:
    """transformers' greedy ``generate`` of :data:`DECODE_STEPS` tokens (its own KV cache)."""
    with torch.no_grad():
        out = hf.generate(
            prompt[None],
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=DECODE_STEPS,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    return out[0, len(prompt) :].tolist()


def hf_logits(hf: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Every position's logits from one causal forward over ``ids``."""
    with torch.no_grad():
        return hf(ids[None]).logits[0].float()


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "nn.Linear"])
@pytest.mark.parametrize(
    ("arch", "tied"), CASES, ids=[f"{a}-{'tied' if t else 'untied'}" for a, t in CASES]
)
def test_logits_and_greedy_ids_match_transformers(tiny_model_dir, arch, tied, pack):
    folder, hf = tiny_model_dir(arch, tied)
    engine = load_model(folder, precision="fp32", pack=pack)
    packed = any(isinstance(m, PackedLinear) for m in engine.model.modules())
    assert packed == (pack and cpu_paths().packed_fp32.ok)  # "packed" tests the packed path
    prompt = tiny_prompt(hf)

    # Ours: prefill, then one token at a time through the KV cache.
    cache = engine.runner.new_cache(len(prompt) + DECODE_STEPS)
    ours = [engine.runner.forward_logits(prompt.tolist(), cache, 0)]
    generated = [int(ours[-1][-1].argmax())]
    for step in range(DECODE_STEPS - 1):
        ours.append(engine.runner.forward_logits([generated[-1]], cache, len(prompt) + step))
        generated.append(int(ours[-1][-1].argmax()))
    ours_logits = torch.cat(ours)

    # Theirs: one causal forward over prompt + our tokens gives every position's logits.
    ref_logits = hf_logits(hf, torch.cat([prompt, torch.tensor(generated[:-1])]))
    ref_ids = hf_greedy(hf, prompt)

    assert ours_logits.shape == ref_logits.shape
    assert (ours_logits - ref_logits).abs().max().item() <= 1e-4
    assert generated == ref_ids

    # And the public streaming API produces the same ids.
    gen = engine.generate(
        prompt.tolist(), SamplingParams(max_new_tokens=DECODE_STEPS, ignore_eos=True)
    )
    assert [e.token_id for e in gen] == ref_ids


@pytest.mark.parametrize("attention", ["paged", "gather"])
def test_sliding_window_through_the_paged_cache(tiny_model_dir, monkeypatch, attention):
    """Mistral's window of 8 through ``generate``: blocks of 4 tokens, released as the window
    moves on; each step's logits (caught at the model's output) against transformers'."""
    if attention == "paged" and (native.compiler() is None or forced_level() == "DEFAULT"):
        pytest.skip(f"no paged kernel is built here: {paged_decode.status()}")
    if attention == "paged":  # where it is built, a failed build or check is a failure
        assert paged_decode.kernel().available, paged_decode.status()
    folder, hf = tiny_model_dir("mistral", False)
    engine = load_model(folder, config=EngineConfig(block_size=4, num_blocks=32))
    assert engine.cfg.sliding_window == 8
    assert engine.window == CacheWindow(sink=0, window=8)  # the model's own, none asked for
    prompt = tiny_prompt(hf)
    ref_ids = hf_greedy(hf, prompt)
    ref_logits = hf_logits(hf, torch.cat([prompt, torch.tensor(ref_ids[:-1])]))

    kernel_calls: list[int] = []
    real_call = paged_decode._call
    monkeypatch.setattr(paged_decode, "_call", lambda *a: kernel_calls.append(1) or real_call(*a))
    step_logits: list[torch.Tensor] = []
    hook = engine.model.register_forward_hook(lambda _m, _a, out: step_logits.append(out))
    ids, blocks_held = [], []
    path = contextlib.nullcontext() if attention == "paged" else paged_decode.portable()
    try:
        with path:
            params = SamplingParams(max_new_tokens=DECODE_STEPS, ignore_eos=True)
            for event in engine.generate(prompt.tolist(), params):
                ids.append(event.token_id)
                blocks_held.append(engine.kv.manager.num_used)
    finally:
        hook.remove()

    assert ids == ref_ids
    ours = torch.cat(step_logits)  # the prompt's last position, then one row per decode step
    assert (ours - ref_logits[len(prompt) - 1 :]).abs().max().item() <= 1e-4
    assert bool(kernel_calls) == (attention == "paged")
    # 44 tokens would hold 11 blocks; the window's 8 tokens lie in at most 3, plus the next.
    assert max(blocks_held[:-1]) <= 4 and blocks_held[-1] == 0


def test_a_cache_window_can_only_narrow_the_models_window(tiny_model_dir):
    folder, hf = tiny_model_dir("mistral", False)
    engine = load_model(folder, config=EngineConfig(block_size=4, num_blocks=32))
    # Sink tokens (Mistral never sees its first tokens again) or more than 8 recent tokens
    # would show keys the model cannot see: refused, and the window stays the model's.
    for wider in (CacheWindow(sink=4, window=4), CacheWindow(sink=0, window=9)):
        with pytest.raises(InvalidRequestError, match="its last 8 tokens only"):
            engine.set_window(wider)
        assert engine.window == CacheWindow(sink=0, window=8)
    with pytest.raises(InvalidRequestError, match="sink 0 and a window of at most 8"):
        load_model(folder, config=EngineConfig(window=CacheWindow(sink=4, window=64)))

    # A narrower window runs as that model with a window of 5 would, in transformers too.
    narrow = CacheWindow(sink=0, window=5)
    engine.set_window(narrow)
    assert engine.window == narrow
    hf5 = copy.deepcopy(hf)
    hf5.config.sliding_window = 5
    prompt = tiny_prompt(hf)
    gen = engine.generate(
        prompt.tolist(), SamplingParams(max_new_tokens=DECODE_STEPS, ignore_eos=True)
    )
    assert [e.token_id for e in gen] == hf_greedy(hf5, prompt)
    engine.set_window(None)  # none asked for: the model's own again
    assert engine.window == CacheWindow(sink=0, window=8)


BASE = {
    "vocab_size": 16, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 3,
    "num_attention_heads": 2, "max_position_embeddings": 64,
}  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "window"),
    [
        ({"model_type": "mistral", "sliding_window": 8}, 8),
        ({"model_type": "mistral", "sliding_window": None}, None),
        ({"model_type": "mistral", "sliding_window": 64}, None),  # no shorter than the context
        ({"model_type": "llama", "sliding_window": 8}, None),
        ({"model_type": "qwen2", "sliding_window": 8, "use_sliding_window": False}, None),
        ({"model_type": "qwen3", "sliding_window": None, "use_sliding_window": False}, None),
        (
            {"model_type": "qwen2", "sliding_window": 8, "use_sliding_window": True,
             "max_window_layers": 0},
            8,
        ),
        (
            {"model_type": "qwen3", "sliding_window": 8, "use_sliding_window": True,
             "layer_types": ["full_attention"] * 3},
            None,
        ),
    ],
)  # fmt: skip
def test_the_models_own_window_is_read_as_transformers_applies_it(extra, window):
    assert ModelConfig.from_dict({**BASE, **extra}).sliding_window == window


def test_a_window_on_some_layers_only_is_refused():
    raw = {**BASE, "model_type": "qwen2", "sliding_window": 8, "use_sliding_window": True,
           "max_window_layers": 1}  # fmt: skip
    with pytest.raises(UnsupportedModelError, match="on some layers"):
        ModelConfig.from_dict(raw)


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    from tests.conftest import build_tiny_hf, save_tiny

    scaling = {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }  # fmt: skip
    hf = build_tiny_hf("llama", tied=False, rope_scaling=scaling, head_dim=32)
    folder = save_tiny(hf, tmp_path)
    engine = load_model(folder, precision="fp32")
    assert engine.cfg.rope_scaling.kind == "llama3"
    ids = torch.randint(0, hf.config.vocab_size, (200,), generator=torch.Generator().manual_seed(3))
    ours = engine.runner.forward_logits(ids.tolist(), engine.runner.new_cache(len(ids)), 0)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert (ours - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize(
    ("arch", "precision"), [("llama", "bf16"), ("llama", "fp16"), ("qwen3", "bf16")]
)
def test_half_precisions_stay_close_to_fp32(tiny_model_dir, arch, precision):
    folder, _ = tiny_model_dir(arch, False)
    prompt = list(range(5, 30))
    logits = {}
    for name in ("fp32", precision):
        engine = load_model(folder, precision=name)
        assert engine.model.embed.weight.dtype == engine.dtype
        logits[name] = engine.runner.forward_logits(prompt, engine.runner.new_cache(len(prompt)), 0)
    scale = logits["fp32"].abs().max()
    assert (logits[precision] - logits["fp32"]).abs().max() / scale < 0.05
