"""Phi-3 and Phi-4 (``model_type: phi3``) against transformers' own ``Phi3ForCausalLM``: q/k/v
and gate/up fused in the checkpoint itself, LongRoPE's short and long factors and its
attention factor, a window on every layer; what the engine does not run is refused by name."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine.core.config import EngineConfig
from engine.core.sampling import SamplingParams
from engine.core.scheduler import SchedulerLimits
from engine.errors import ModelLoadError
from engine.loader.load import load_model
from engine.model.config import ModelConfig
from tests.conftest import TINY, build_tiny_hf, save_tiny
from tests.test_exactness_tiny import hf_greedy, hf_logits, tiny_prompt

STEPS = 32


def ours_step_by_step(engine, prompt: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    """Prefill, then one token at a time through the paged cache: each step's logits."""
    cache = engine.runner.new_cache(len(prompt) + steps)
    rows = [engine.runner.forward_logits(prompt, cache, 0)[-1:]]
    ids = [int(rows[-1][-1].argmax())]
    for step in range(steps - 1):
        rows.append(engine.runner.forward_logits([ids[-1]], cache, len(prompt) + step))
        ids.append(int(rows[-1][-1].argmax()))
    return torch.cat(rows), ids


@pytest.mark.parametrize("tied", [False, True])
def test_phi3_gives_transformers_logits_and_greedy_ids(tiny_model_dir, tied):
    folder, hf = tiny_model_dir("phi3", tied)
    names = {n for n, _ in hf.named_parameters()}
    assert any("qkv_proj" in n for n in names) and any("gate_up_proj" in n for n in names)
    engine = load_model(folder, precision="fp32")
    prompt = tiny_prompt(hf)
    ref_ids = hf_greedy(hf, prompt)
    logits, ids = ours_step_by_step(engine, prompt.tolist(), STEPS)
    ref = hf_logits(hf, torch.cat([prompt, torch.tensor(ref_ids[:-1])]))[len(prompt) - 1 :]
    assert ids == ref_ids
    assert (logits - ref).abs().max().item() <= 1e-4
    params = SamplingParams(max_new_tokens=STEPS, ignore_eos=True)
    assert [e.token_id for e in engine.generate(prompt.tolist(), params)] == ref_ids


def longrope_model(tmp_path):
    """A tiny Phi-3 pretrained on 64 positions, extended to 256 by LongRoPE (factor 4)."""
    half = (TINY["hidden_size"] // TINY["num_attention_heads"]) // 2
    gen = torch.Generator().manual_seed(5)
    scaling = {
        "rope_type": "longrope",
        "short_factor": (1 + torch.rand(half, generator=gen)).tolist(),
        "long_factor": (2 + 4 * torch.rand(half, generator=gen)).tolist(),
    }
    hf = build_tiny_hf(
        "phi3", tied=False, rope_scaling=scaling, original_max_position_embeddings=64
    )
    return hf, save_tiny(hf, tmp_path)


def hf_steps(hf, prompt: torch.Tensor, steps: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy ``generate`` with its own cache: the ids and each step's logits."""
    with torch.no_grad():
        out = hf.generate(
            prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=steps, do_sample=False, pad_token_id=0, eos_token_id=None,
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    return out.sequences[0, len(prompt) :].tolist(), torch.cat([r.float() for r in out.logits])


def engine_steps(engine, prompts: list[list[int]], steps: int) -> list[tuple[list[int], list]]:
    """The engine's greedy ids and each step's logits (caught at the model's output), for
    ``prompts`` run one after the other through the scheduler and the paged cache."""
    results = []
    for prompt in prompts:
        rows: list[torch.Tensor] = []
        hook = engine.model.register_forward_hook(lambda _m, _a, out, rows=rows: rows.append(out))
        try:
            params = SamplingParams(max_new_tokens=steps, ignore_eos=True)
            ids = [e.token_id for e in engine.generate(prompt, params)]
        finally:
            hook.remove()
        results.append((ids, rows))
    return results


@pytest.mark.parametrize("prompt_len", [50, 90])
def test_longrope_follows_transformers_across_the_pretraining_context(tmp_path, prompt_len):
    """Pretrained on 64 positions, extended to 256. A prompt of 50 decoded past 64:
    transformers rotates by the short factors, then, at the token that passes 64, drops its
    cache and recomputes the whole sequence by the long ones; a prompt of 90 is long from its
    first token. The engine gives the same logits at every step (the sequence is recomputed
    when it passes 64), with prompts split into chunks of 16 and blocks of 8."""
    hf, folder = longrope_model(tmp_path)
    limits = SchedulerLimits(max_tokens_per_step=16)
    config = EngineConfig(block_size=8, num_blocks=64, limits=limits)
    engine = load_model(folder, precision="fp32", config=config)
    rope = engine.cfg.rope_scaling
    assert rope.kind == "longrope" and rope.original_max_position_embeddings == 64
    assert rope.attention_factor == pytest.approx(math.sqrt(1 + math.log(4) / math.log(64)))
    gen = torch.Generator().manual_seed(prompt_len)
    prompt = torch.randint(0, TINY["vocab_size"], (prompt_len,), generator=gen)
    check_each_step(engine, hf, prompt)
    recomputed = 1 if prompt_len < 64 else 0
    assert engine.metrics().total_preemptions == recomputed


def test_a_long_sequence_never_shares_a_short_ones_blocks(tmp_path):
    """The same 40 tokens, rotated by the short factors in one sequence and by the long ones
    in another (it is 90 tokens long): their blocks are keyed apart, so the second computes
    its own and both equal transformers."""
    hf, folder = longrope_model(tmp_path)
    engine = load_model(folder, precision="fp32", config=EngineConfig(block_size=8))
    gen = torch.Generator().manual_seed(9)
    head = torch.randint(0, TINY["vocab_size"], (40,), generator=gen)
    short, long = (
        head,
        torch.cat([head, torch.randint(0, TINY["vocab_size"], (50,), generator=gen)]),
    )
    runs = engine_steps(engine, [short.tolist(), long.tolist(), short.tolist()], 4)
    for prompt, (ids, _) in zip((short, long, short), runs, strict=True):
        assert ids == hf_steps(hf, prompt, 4)[0]
    stats = engine.kv.manager.stats
    assert stats.hit_tokens == 32  # the third run found the first one's four full blocks


def test_a_partial_rotary_factor_that_leaves_an_odd_part_is_refused_by_name():
    raw = {"model_type": "phi3", **TINY, "num_hidden_layers": 1, "partial_rotary_factor": 0.25}
    assert ModelConfig.from_dict(raw).rotary_dim == 2  # one pair of each head's 8
    with pytest.raises(ModelLoadError, match=r"partial_rotary_factor 0\.375 rotates 3"):
        ModelConfig.from_dict({**raw, "partial_rotary_factor": 0.375})


def run_ragged(engine, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """``prompts`` arriving one a step, decoded together: each one's greedy ids."""
    params = SamplingParams(max_new_tokens=steps, ignore_eos=True)
    ids: dict[str, int] = {}
    out: list[list[int]] = [[] for _ in prompts]
    pending = list(enumerate(prompts))
    while pending or engine.has_work():
        if pending:
            i, prompt = pending.pop(0)
            ids[engine.add_request(prompt, params)] = i
        for event in engine.step():
            if event.token_id is not None:
                out[ids[event.request_id]].append(event.token_id)
    return out


def check_each_step(engine, hf, prompt: torch.Tensor, steps: int = STEPS) -> None:
    """``prompt`` through the engine's scheduler for ``steps`` greedy steps: the ids
    transformers' (with its own cache) gives, and each step's sampled logits row (a prompt's
    last chunk's, then one per decode step; a step that recomputed the sequence gives its last
    row's) within 1e-4 of transformers'."""
    ref_ids, ref = hf_steps(hf, prompt, steps)
    ((ids, rows),) = engine_steps(engine, [prompt.tolist()], steps)
    assert ids == ref_ids
    ours = torch.cat([r[-1:] for r in rows if r.shape[0]])[-steps:]
    assert (ours - ref).abs().max().item() <= 1e-4


def check_ragged_on_a_prefix(
    folder, hf, *, speculative: bool, seed: int, steps: int, max_batch: int = 16
):
    """Four prompts on one 12-token prefix (then 1 to 28 tokens of a repeated motif), arriving
    a step apart in chunks of at most 16 tokens through a cache of blocks of 4, lookup drafts
    where ``speculative``, at most ``max_batch`` at once: each prompt's ``steps`` greedy ids
    are transformers' for it alone, the shared prefix is read from the cache, and drafts get
    accepted. Returns the engine."""
    from engine.speculative.config import parse_speculative

    limits = SchedulerLimits(max_tokens_per_step=16, max_batch_size=max_batch)
    engine = load_model(folder, precision="fp32", config=EngineConfig(block_size=4, limits=limits))
    if speculative:
        engine.set_speculation(parse_speculative("lookup", 3, adaptive=False))
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, TINY["vocab_size"], (12,), generator=gen)
    prompts = []
    for n in (1, 9, 20, 28):
        motif = torch.randint(0, TINY["vocab_size"], (3,), generator=gen)
        prompts.append(torch.cat([prefix, motif.repeat(n // 3 + 1)[:n]]))
    got = run_ragged(engine, [p.tolist() for p in prompts], steps)
    for prompt, ids in zip(prompts, got, strict=True):
        assert ids == hf_steps(hf, prompt, steps)[0]
    assert engine.metrics().prefix_cache_hit_tokens >= 3 * 12 - 4  # whole blocks of it
    if speculative:
        assert engine.speculator.stats.num_accepted_tokens > 0
    return engine


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "lookup-drafts"])
def test_longrope_in_a_ragged_batch_with_drafts_gives_each_prompts_own_ids(tmp_path, speculative):
    """Five prompts of 20 to 100 tokens arriving a step apart, crossing the pretraining
    context at steps of their own, starting past it or never reaching it, repetitive enough
    that lookup drafts get accepted: each one's ids are transformers' for it alone."""
    from engine.speculative.config import parse_speculative

    hf, folder = longrope_model(tmp_path)
    limits = SchedulerLimits(max_tokens_per_step=48)
    engine = load_model(folder, precision="fp32", config=EngineConfig(block_size=8, limits=limits))
    if speculative:
        engine.set_speculation(parse_speculative("lookup", 3, adaptive=False))
    gen = torch.Generator().manual_seed(11)
    prompts = []
    for n in (20, 45, 60, 63, 100):
        motif = torch.randint(0, TINY["vocab_size"], (5,), generator=gen)
        prompts.append(torch.cat([motif.repeat(n // 5), motif[: n % 5]]))
    got = run_ragged(engine, [p.tolist() for p in prompts], 24)
    for prompt, ids in zip(prompts, got, strict=True):
        assert ids == hf_steps(hf, prompt, 24)[0]
    # recomputed on the long factors: the prompts of 45, 60 and 63 as they pass 64 (the one of
    # 20 never reaches it, the one of 100 starts past it)
    assert engine.metrics().total_preemptions == 3
    if speculative:
        assert engine.speculator.stats.num_accepted_tokens > 0


def test_phi3_under_its_sliding_window(tiny_model_dir):
    """Phi-3-mini-4k sets a window on every layer: transformers applies it, and so does the
    engine, through the paged cache."""
    folder, hf = tiny_model_dir("phi3", False, sliding_window=8)
    engine = load_model(folder, precision="fp32", config=EngineConfig(block_size=4, num_blocks=32))
    assert engine.cfg.sliding_window == 8
    check_each_step(engine, hf, tiny_prompt(hf))


def phi3_for_gguf(tmp_path, longrope: bool):
    if longrope:
        return longrope_model(tmp_path / "hf")[0]
    return build_tiny_hf("phi3", tied=False, sliding_window=8)


@pytest.mark.parametrize("longrope", [False, True], ids=["window", "longrope"])
def test_a_phi3_gguf_imports_to_transformers_logits(tmp_path, longrope):
    """A Phi-3 GGUF as llama.cpp's converter lays it out (q/k/v and gate/up fused, no row
    permuted, the window and LongRoPE's factors as llama.cpp keeps them), imported into a
    folder: its config is the original's and its logits are transformers'."""
    from engine.store.gguf_import import import_gguf
    from tests.gguf_factory import write_gguf as write_like_llama_cpp

    hf = phi3_for_gguf(tmp_path, longrope)
    cfg = ModelConfig.from_dict(hf.config.to_dict())
    gguf = write_like_llama_cpp(hf, tmp_path / "phi.gguf", arch="phi3")
    folder = tmp_path / "imported"
    import_gguf(gguf, folder, dtype="fp32")
    imported = ModelConfig.from_file(folder / "config.json")
    assert imported.rope_scaling == cfg.rope_scaling
    assert imported.sliding_window == cfg.sliding_window
    engine = load_model(folder, precision="fp32")
    prompt = torch.randint(0, TINY["vocab_size"], (90,), generator=torch.Generator().manual_seed(4))
    ours = engine.runner.forward_logits(prompt.tolist(), engine.runner.new_cache(90), 0)
    assert (ours - hf_logits(hf, prompt)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("longrope", [False, True], ids=["window", "longrope"])
def test_our_phi3_gguf_is_laid_out_as_llama_cpps_converter_does(tmp_path, longrope):
    """The benchmark peer's GGUF (:mod:`engine.store.gguf_writer`): the same tensors under the
    same names, F16 matrices and F32 norms and factors, and the same Phi-3 metadata."""
    from engine.store.gguf_reader import gguf_metadata, open_gguf
    from engine.store.gguf_writer import write_gguf
    from tests.gguf_factory import write_gguf as write_like_llama_cpp

    hf = phi3_for_gguf(tmp_path, longrope)
    cfg = ModelConfig.from_dict(hf.config.to_dict())
    tokens = [f"t{i}" for i in range(cfg.vocab_size)]
    ours = open_gguf(write_gguf(tmp_path / "ours.gguf", cfg, hf.state_dict().items(),
                                name="t", tokens=tokens))  # fmt: skip
    want = open_gguf(write_like_llama_cpp(hf, tmp_path / "want.gguf", arch="phi3", quant="F16"))
    got = {t.name: t for t in ours.tensors}
    assert set(got) == {t.name for t in want.tensors}
    for tensor in want.tensors:
        assert got[tensor.name].tensor_type == tensor.tensor_type, tensor.name
        assert np.array_equal(got[tensor.name].data, tensor.data), tensor.name
    keys = [k for k in gguf_metadata(want) if k.startswith("phi3.")]
    assert keys and all(
        gguf_metadata(ours)[k] == pytest.approx(gguf_metadata(want)[k]) for k in keys
    )


def test_a_synthetic_phi3_is_a_phi3_checkpoint(tmp_path):
    """Synthetic real-size weights of a Phi-3 config (``models synth``, the benchmark peer's
    model) hold Phi-3's fused tensors: transformers' own class loads the folder, and the
    engine gives its logits; the GGUF beside it imports to the same config."""
    import transformers

    from engine.store.gguf_reader import read_gguf_header
    from engine.store.synthetic_store import GGUF_NAME, write_synthetic

    half = (TINY["hidden_size"] // TINY["num_attention_heads"]) // 2
    raw = {
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", **TINY,
        "original_max_position_embeddings": 64, "sliding_window": 48,
        "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0 + i for i in range(half)],
                         "long_factor": [2.0 + i for i in range(half)]},
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "float16",
    }  # fmt: skip
    folder = write_synthetic(raw, tmp_path / "synthetic", seed=2)
    hf = transformers.Phi3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    engine = load_model(folder, precision="fp32")
    prompt = torch.randint(0, TINY["vocab_size"], (80,), generator=torch.Generator().manual_seed(6))
    ours = engine.runner.forward_logits(prompt.tolist(), engine.runner.new_cache(80), 0)
    assert (ours - hf_logits(hf, prompt)).abs().max().item() <= 1e-4
    header = read_gguf_header(folder / GGUF_NAME).model_config()
    assert header.rope_scaling == engine.cfg.rope_scaling
    assert header.sliding_window == engine.cfg.sliding_window == 48


@pytest.mark.parametrize("longrope", [False, True], ids=["plain", "longrope"])
def test_a_partly_rotated_head_gives_transformers_logits(tmp_path, longrope):
    """Phi-4-mini rotates 3/4 of each head: transformers rotates the first dimensions in pairs
    and passes the rest; the engine, with each q/k head's rows reordered at load, gives its
    logits, through the paged cache and a GGUF import (llama.cpp's rotary dimension count)."""
    from engine.store.gguf_import import import_gguf
    from tests.gguf_factory import write_gguf as write_like_llama_cpp

    extra: dict = {"partial_rotary_factor": 0.5}  # 4 of each head's 8
    if longrope:
        gen = torch.Generator().manual_seed(8)
        extra["rope_scaling"] = {
            "rope_type": "longrope",
            "short_factor": (1 + torch.rand(2, generator=gen)).tolist(),
            "long_factor": (2 + torch.rand(2, generator=gen)).tolist(),
        }
        extra["original_max_position_embeddings"] = 64
    hf = build_tiny_hf("phi3", tied=False, **extra)
    folder = save_tiny(hf, tmp_path / "hf")
    gguf = write_like_llama_cpp(hf, tmp_path / "phi.gguf", arch="phi3")
    import_gguf(gguf, tmp_path / "imported", dtype="fp32")
    prompt = torch.randint(0, TINY["vocab_size"], (90,), generator=torch.Generator().manual_seed(7))
    ref = hf_logits(hf, prompt)
    for source in (folder, tmp_path / "imported"):
        engine = load_model(source, precision="fp32")
        assert engine.cfg.rotary_dim == 4 and engine.cfg.head_dim == 8
        ours = engine.runner.forward_logits(prompt.tolist(), engine.runner.new_cache(90), 0)
        assert (ours - ref).abs().max().item() <= 1e-4, source
    ref_ids, ref_steps = hf_steps(hf, prompt[:50], STEPS)  # decoded past 64 where longrope
    engine = load_model(folder, precision="fp32")
    ((ids, rows),) = engine_steps(engine, [prompt[:50].tolist()], STEPS)
    assert ids == ref_ids
    ours_steps = torch.cat([r[-1:] for r in rows if r.shape[0]])[-STEPS:]
    assert (ours_steps - ref_steps).abs().max().item() <= 1e-4
