"""The engine with our Triton kernels forced on (``INFERSIGHT_KERNELS=triton``; on these CPUs
in Triton's interpreter): transformers' greedy ids on the tiny models with 64-wide heads,
alone and in a ragged batch, with prefix caching and a cache window; the default model's
tokens equal to the plain engine's, token for token."""

from __future__ import annotations

import pytest
import torch

from engine.core.config import EngineConfig
from engine.core.sampling import SamplingParams
from engine.errors import InfersightError
from engine.kernels.triton_kernels import fused
from engine.kv_cache.window import CacheWindow
from engine.loader.load import load_model
from tests.conftest import WIDE_HEADS, truncated_copy
from tests.test_exactness_tiny import tiny_prompt

CASES = [("llama", False), ("qwen2", True), ("qwen3", False), ("mistral", False)]
#: Tokens per reply: the interpreter runs each program of a kernel's grid in numpy (tens of
#: milliseconds a launch); Mistral's 13-token prompt alone lies past its window of 8.
STEPS = 6


def hf_greedy(hf: torch.nn.Module, prompt: torch.Tensor, steps: int = STEPS) -> list[int]:
    """transformers' greedy ``generate`` (its own KV cache): the oracle."""
    with torch.no_grad():
        out = hf.generate(
            prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=steps, do_sample=False, pad_token_id=0, eos_token_id=None,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.fixture
def triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERSIGHT_KERNELS", "triton")


def spy_kernels(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count the calls that reach our attention kernels (the path under test really ran)."""
    from engine.kernels.triton_kernels import decode_attention, prefill_attention

    calls = {"decode": 0, "prefill": 0}
    for name, module, fn in (
        ("decode", decode_attention, "paged_decode_attention"),
        ("prefill", prefill_attention, "paged_prefill_attention"),
    ):
        real = getattr(module, fn)

        def counted(*a: object, _real: object = real, _name: str = name, **k: object) -> object:
            calls[_name] += 1
            return _real(*a, **k)  # type: ignore[operator]

        monkeypatch.setattr(module, fn, counted)
    return calls


def generate(engine, prompts: list[list[int]], steps: int = STEPS) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=steps, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_work():
        for event in engine.step():
            if event.token_id is not None:
                out[event.request_id].append(event.token_id)
    return [out[rid] for rid in ids]


@pytest.mark.parametrize(("arch", "tied"), CASES, ids=[a for a, _ in CASES])
def test_greedy_ids_equal_transformers_alone_and_llamas_in_a_ragged_batch(
    tiny_model_dir, triton, monkeypatch, arch, tied
):
    folder, hf = tiny_model_dir(arch, tied, **WIDE_HEADS)
    # blocks of 4 tokens: the block tables of a 13-token prompt span several blocks
    engine = load_model(folder, config=EngineConfig(block_size=4, num_blocks=96))
    assert engine.triton and "interpreted" in engine.kernels
    # the layers' norms and RoPE + K/V write on our fused kernels too
    assert "RoPE + KV write" in engine.kernels
    assert engine.model.ops.rope_store is fused.rope_store
    calls = spy_kernels(monkeypatch)
    prompt = tiny_prompt(hf)
    want = hf_greedy(hf, prompt)
    assert generate(engine, [prompt.tolist()]) == [want]
    assert calls["prefill"] and calls["decode"]
    if arch != "llama":
        return
    # a ragged batch: the same prompt beside shorter and longer ones, each as it is alone
    others = [prompt[:5], torch.cat([prompt, prompt[:6]])]
    alone = [hf_greedy(hf, p) for p in others]
    assert generate(engine, [p.tolist() for p in [others[0], prompt, others[1]]]) == [
        alone[0], want, alone[1],
    ]  # fmt: skip


def test_prefix_caching_reads_the_shared_blocks_through_the_tables(tiny_model_dir, triton):
    folder, hf = tiny_model_dir("llama", False, **WIDE_HEADS)
    engine = load_model(folder, config=EngineConfig(block_size=4, num_blocks=96))
    prompt = tiny_prompt(hf)
    first = generate(engine, [prompt.tolist()], steps=4)
    again = generate(engine, [prompt.tolist()], steps=4)
    assert first == again == [hf_greedy(hf, prompt, 4)]
    cached = [m.cached_prompt_tokens for _, m in engine.collector.requests]
    assert cached[-1] >= 8  # the second prompt's full blocks came from the cache


def test_a_cache_window_with_sinks_through_the_kernels(tiny_model_dir, triton):
    """A window narrower than the reply: the kernels skip released blocks and keep the sinks,
    as the torch paths do (their tokens, token for token)."""
    folder, hf = tiny_model_dir("llama", False, **WIDE_HEADS)
    window = CacheWindow(sink=4, window=8)
    config = EngineConfig(block_size=4, num_blocks=96, window=window)
    prompt = tiny_prompt(hf).tolist()
    ours = generate(load_model(folder, config=config), [prompt])
    with pytest.MonkeyPatch.context() as m:
        m.setenv("INFERSIGHT_KERNELS", "torch")
        plain = generate(load_model(folder, config=config), [prompt])
    assert ours == plain


def test_a_model_with_other_head_dims_is_refused_by_name(tiny_model_dir, triton):
    folder, _ = tiny_model_dir("llama", False)  # heads 8 wide
    built = "attention kernels are built for heads 64, 128 or 256 wide, not 8"
    with pytest.raises(InfersightError, match=built):
        load_model(folder)


def test_the_default_models_layers_give_the_plain_runs_tokens(default_model, triton, tmp_path):
    """The default model's weights and shapes (9 query heads over 3 KV heads of 64, the tied
    head) through our kernels, at 4 of its 30 layers: every layer launches the same kernels,
    and Triton's interpreter takes seconds a layer."""
    folder = truncated_copy(default_model, tmp_path / "first-layers", layers=4)
    engine = load_model(folder)
    assert engine.triton
    prompt = engine.tokenizer.encode("The capital of France is")
    ours = generate(engine, [prompt], steps=4)
    with pytest.MonkeyPatch.context() as m:
        m.setenv("INFERSIGHT_KERNELS", "torch")
        plain = load_model(folder)
        assert not plain.triton
        assert generate(plain, [prompt], steps=4) == ours
