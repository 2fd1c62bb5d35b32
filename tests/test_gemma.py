"""Gemma 3 (``model_type: gemma3_text``) against transformers' own ``Gemma3ForCausalLM``:
norms of ``(1 + w)`` before and after attention and the MLP, GeGLU, scaled embeddings, the
attention scaled by ``query_pre_attn_scalar``, local layers with a window and a RoPE base of
their own between global ones, soft-capped logits; what the engine does not run is refused by
name."""

from __future__ import annotations

import pytest
import torch

from engine.core.config import EngineConfig
from engine.core.sampling import SamplingParams
from engine.errors import ModelLoadError, UnsupportedModelError
from engine.kernels import paged_decode
from engine.loader.load import load_model
from engine.model.config import ModelConfig
from tests.conftest import TINY, TINY_ARCH
from tests.test_exactness_tiny import hf_greedy, hf_logits, tiny_prompt
from tests.test_phi3 import check_each_step, check_ragged_on_a_prefix, ours_step_by_step

STEPS = 32
GEMMA = {"model_type": "gemma3_text", **TINY, **TINY_ARCH["gemma3_text"]}


ARCHS = ["gemma3_text", "gemma2"]


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("arch", ARCHS)
def test_gemma_gives_transformers_logits_and_greedy_ids(tiny_model_dir, arch, tied):
    """Gemma 3, and Gemma 2 with its attention scores soft-capped (at 2, hard enough that a
    step that left the cap out would not agree)."""
    folder, hf = tiny_model_dir(arch, tied)
    engine = load_model(folder, precision="fp32")
    assert engine.cfg.local_layers == (0, 2) and engine.cfg.local_window == 8
    prompt = tiny_prompt(hf)
    assert len(prompt) + STEPS > 4 * 8  # the local layers' window slides a long way
    ref_ids = hf_greedy(hf, prompt)
    logits, ids = ours_step_by_step(engine, prompt.tolist(), STEPS)
    ref = hf_logits(hf, torch.cat([prompt, torch.tensor(ref_ids[:-1])]))[len(prompt) - 1 :]
    assert ids == ref_ids
    assert (logits - ref).abs().max().item() <= 1e-4
    assert logits.abs().max().item() < 3.0  # soft-capped
    params = SamplingParams(max_new_tokens=STEPS, ignore_eos=True)
    assert [e.token_id for e in engine.generate(prompt.tolist(), params)] == ref_ids
    if paged_decode.kernel().available:  # the C kernels attend, Gemma 2's capping as they go
        attention = engine.paths()["attention"]
        assert (attention["decode"], attention["prefill"]) == ("C paged decode", "C paged prefill")


def test_gemma2_without_the_c_kernels_caps_in_the_textbook_computation(tiny_model_dir):
    """The portable path (no C compiler, or ``INFERSIGHT_ATTENTION=gather``): SDPA has no
    soft cap, so the scores are capped in the textbook computation, to the same logits."""
    folder, hf = tiny_model_dir("gemma2", True)
    engine = load_model(folder, precision="fp32")
    prompt = tiny_prompt(hf)
    ref_ids = hf_greedy(hf, prompt)
    with paged_decode.portable():
        assert engine.paths()["attention"]["decode"] == "gather + textbook attention (soft cap)"
        logits, ids = ours_step_by_step(engine, prompt.tolist(), STEPS)
    ref = hf_logits(hf, torch.cat([prompt, torch.tensor(ref_ids[:-1])]))[len(prompt) - 1 :]
    assert ids == ref_ids
    assert (logits - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_gemma_through_the_scheduler_gives_each_steps_logits(tiny_model_dir, arch):
    """The paged cache in blocks of 4, the window of 8 spanning blocks: each step's logits as
    transformers' with its own cache."""
    folder, hf = tiny_model_dir(arch, True)
    engine = load_model(folder, precision="fp32", config=EngineConfig(block_size=4, num_blocks=48))
    prompt = tiny_prompt(hf)
    check_each_step(engine, hf, prompt)


@pytest.mark.parametrize(
    ("arch", "speculative"),
    [("gemma3_text", False), ("gemma3_text", True), ("gemma2", True)],
    ids=["gemma3-plain", "gemma3-lookup-drafts", "gemma2-lookup-drafts"],
)
def test_gemma_in_a_ragged_batch_sharing_a_prefix_gives_each_prompts_own_ids(
    tiny_model_dir, arch, speculative
):
    """Four prompts of 13 to 40 tokens on one 12-token prefix, arriving a step apart in
    chunks of at most 16 tokens, repetitive enough that lookup drafts get accepted: each
    one's ids are transformers' for it alone, and the shared prefix is read from the cache."""
    folder, hf = tiny_model_dir(arch, False)
    check_ragged_on_a_prefix(folder, hf, speculative=speculative, seed=7, steps=20)


def test_gemma3s_config_as_transformers_reads_it():
    cfg = ModelConfig.from_dict(GEMMA)
    assert (cfg.local_layers, cfg.local_window, cfg.sliding_window) == ((0, 2), 8, None)
    assert (cfg.rope_theta, cfg.local_rope_theta) == (5000.0, 300.0)
    assert cfg.query_scale == pytest.approx((16 / 8) ** 0.5)
    assert cfg.embed_scale == pytest.approx(64**0.5) and cfg.final_softcap == 3.0
    # transformers 5's layout: RoPE per layer kind; the global layers' scaled
    raw = {k: v for k, v in GEMMA.items() if k not in ("rope_theta", "rope_local_base_freq")}
    raw["rope_parameters"] = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    cfg = ModelConfig.from_dict(raw)
    assert (cfg.rope_theta, cfg.local_rope_theta) == (1e6, 1e4)
    assert (cfg.rope_scaling.kind, cfg.rope_scaling.factor) == ("linear", 8.0)
    # without layer_types: every sixth layer global, as Gemma3TextConfig says
    raw = {k: v for k, v in GEMMA.items() if k != "layer_types"} | {"num_hidden_layers": 7}
    assert ModelConfig.from_dict(raw).local_layers == (0, 1, 2, 3, 4, 6)
    # a window no shorter than the context: none, while the local layers keep their RoPE
    wide = ModelConfig.from_dict({**GEMMA, "sliding_window": 256})
    assert (wide.local_window, wide.local_layers, wide.window_count) == (None, (0, 2), 1)


def test_gemma2s_config_as_transformers_reads_it():
    import transformers

    raw = {"model_type": "gemma2", **TINY, **TINY_ARCH["gemma2"], "num_hidden_layers": 5}
    ours, theirs = ModelConfig.from_dict(raw), transformers.Gemma2Config(**raw)
    local = tuple(i for i, k in enumerate(theirs.layer_types) if k == "sliding_attention")
    assert ours.local_layers == local == (0, 2, 4) and ours.local_window == 8
    assert (ours.attn_softcap, ours.final_softcap) == (2.0, 3.0)
    assert ours.local_rope_theta is None  # one RoPE for every layer
    assert ours.query_scale == pytest.approx((16 / 8) ** 0.5) and not ours.qk_norm


def test_what_gemma_runs_not_is_refused_by_name():
    with pytest.raises(ModelLoadError, match="layer_types must name 3 layers"):
        ModelConfig.from_dict({**GEMMA, "layer_types": ["full_attention"]})
    with pytest.raises(UnsupportedModelError, match="hidden_activation 'silu'"):
        ModelConfig.from_dict({**GEMMA, "hidden_activation": "silu"})


@pytest.mark.parametrize("prefix", ["model.language_model.", "language_model.model."])
def test_an_image_and_text_gemma3_loads_its_language_model(tiny_model_dir, tmp_path, prefix):
    """A published Gemma 3 of 4B and up is the image-and-text model: ``model_type: gemma3``,
    its language model's numbers in ``text_config`` over Gemma3TextConfig's defaults, its
    tensors under transformers 5's prefix (or 4's), beside a vision tower. The engine loads the
    language model alone, with transformers' text model's logits."""
    import json

    from safetensors.torch import load_file, save_file

    folder, hf = tiny_model_dir("gemma3_text", True)
    text = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gemma3", "eos_token_id": [2, 5], "torch_dtype": "float32",
        "text_config": {k: v for k, v in text.items() if k not in ("eos_token_id", "dtype")},
        "vision_config": {"model_type": "siglip_vision_model"},
    }))  # fmt: skip
    tensors = {
        prefix + name.removeprefix("model."): t
        for name, t in load_file(folder / "model.safetensors").items()
    }
    tensors["model.vision_tower.vision_model.post_layernorm.weight"] = torch.ones(4)
    tensors["model.multi_modal_projector.mm_soft_emb_norm.weight"] = torch.ones(4)
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    engine = load_model(tmp_path, precision="fp32")
    assert engine.cfg.model_type == "gemma3_text" and engine.cfg.eos_token_ids == (2, 5)
    prompt = tiny_prompt(hf)
    ref = hf_logits(hf, prompt)
    ours = engine.runner.forward_logits(prompt.tolist(), engine.runner.new_cache(len(prompt)), 0)
    assert (ours - ref).abs().max().item() <= 1e-4


def test_gemma_3_12bs_published_config_reads_as_gemma3textconfig_does():
    import json

    import transformers

    from engine.store.synthetic_store import CONFIGS

    raw = json.loads((CONFIGS / "gemma-3-12b.json").read_text())
    ours = ModelConfig.from_dict(raw)
    theirs = transformers.Gemma3TextConfig(**raw["text_config"])
    assert (ours.hidden_size, ours.num_layers, ours.num_heads, ours.num_kv_heads) == (
        theirs.hidden_size, theirs.num_hidden_layers, theirs.num_attention_heads,
        theirs.num_key_value_heads,
    )  # fmt: skip
    assert (ours.head_dim, ours.vocab_size, ours.local_window) == (
        theirs.head_dim,
        theirs.vocab_size,
        theirs.sliding_window,
    )
    kinds = theirs.layer_types
    assert ours.local_layers == tuple(i for i, k in enumerate(kinds) if k == "sliding_attention")
    full, local = (
        theirs.rope_parameters["full_attention"],
        theirs.rope_parameters["sliding_attention"],
    )
    assert (ours.rope_theta, ours.local_rope_theta) == (full["rope_theta"], local["rope_theta"])
    assert (ours.rope_scaling.kind, ours.rope_scaling.factor) == (full["rope_type"], full["factor"])
    assert ours.query_scale == 1.0 and ours.eos_token_ids == (1, 106)


def gemma3_as_llama_cpp_has_it(**overrides):
    """A tiny Gemma 3 with what llama.cpp fixes for every Gemma 3: every sixth layer global,
    the local layers on RoPE base 10000, the attention over the head's width; the global
    layers' RoPE scaled linearly, as the 4B and larger are."""
    from tests.conftest import build_tiny_hf

    return build_tiny_hf(
        "gemma3_text", tied=True, num_hidden_layers=7, layer_types=None,
        rope_local_base_freq=10000.0, query_pre_attn_scalar=16, final_logit_softcapping=None,
        rope_scaling={"rope_type": "linear", "factor": 4.0}, **overrides,
    )  # fmt: skip


def check_gguf_import(hf, arch: str, tmp_path, fields: tuple[str, ...]) -> None:
    """``hf`` written as llama.cpp's converter writes an ``arch`` GGUF, imported into a
    folder: the original config's ``fields`` and transformers' logits (within 1e-4)."""
    from engine.store.gguf_import import import_gguf
    from tests.gguf_factory import write_gguf as write_like_llama_cpp

    cfg = ModelConfig.from_dict(hf.config.to_dict())
    gguf = write_like_llama_cpp(hf, tmp_path / f"{arch}.gguf", arch=arch)
    folder = tmp_path / "imported"
    import_gguf(gguf, folder, dtype="fp32")
    imported = ModelConfig.from_file(folder / "config.json")
    for field in fields:
        assert getattr(imported, field) == getattr(cfg, field), field
    engine = load_model(folder, precision="fp32")
    prompt = torch.randint(0, TINY["vocab_size"], (40,), generator=torch.Generator().manual_seed(4))
    ours = engine.runner.forward_logits(prompt.tolist(), engine.runner.new_cache(40), 0)
    assert (ours - hf_logits(hf, prompt)).abs().max().item() <= 1e-4


def check_gguf_layout(hf, arch: str, tmp_path, keys: tuple[str, ...]) -> dict:
    """Our writer's GGUF of ``hf`` against llama.cpp's converter's: the same tensors under the
    same names, bit for bit, and the same metadata ``keys``; returns ours' metadata."""
    import numpy as np

    from engine.store.gguf_reader import gguf_metadata, open_gguf
    from engine.store.gguf_writer import write_gguf
    from tests.gguf_factory import write_gguf as write_like_llama_cpp

    cfg = ModelConfig.from_dict(hf.config.to_dict())
    tokens = [f"t{i}" for i in range(cfg.vocab_size)]
    saved = [(n, t) for n, t in hf.state_dict().items() if n != "lm_head.weight"]  # tied
    ours = open_gguf(write_gguf(tmp_path / "ours.gguf", cfg, saved, name="t", tokens=tokens))
    want = open_gguf(write_like_llama_cpp(hf, tmp_path / "want.gguf", arch=arch, quant="F16"))
    got = {t.name: t for t in ours.tensors}
    assert set(got) == {t.name for t in want.tensors}
    for tensor in want.tensors:
        assert np.array_equal(got[tensor.name].data, tensor.data), tensor.name
    assert all(gguf_metadata(ours)[k] == pytest.approx(gguf_metadata(want)[k]) for k in keys)
    return gguf_metadata(ours)


def refused_gguf(tmp_path, cfg: ModelConfig) -> None:
    """Our writer refuses ``cfg`` (raises; the caller says with what)."""
    from engine.store.gguf_writer import write_gguf

    tokens = [f"t{i}" for i in range(cfg.vocab_size)]
    write_gguf(tmp_path / "odd.gguf", cfg, [], name="t", tokens=tokens)


def test_a_gemma3_gguf_imports_to_transformers_logits(tmp_path):
    """A Gemma 3 GGUF as llama.cpp's converter lays it out (its norms stored as 1 + w, its
    q/k norms, no row permuted, the window and the linear RoPE scaling as metadata),
    imported into a folder: the original's config and transformers' logits."""
    hf = gemma3_as_llama_cpp_has_it()
    assert ModelConfig.from_dict(hf.config.to_dict()).local_layers == (0, 1, 2, 3, 4, 6)
    check_gguf_import(hf, "gemma3", tmp_path, ("local_layers", "local_window",
                      "local_rope_theta", "rope_theta", "rope_scaling", "query_scale",
                      "head_dim", "embed_scale"))  # fmt: skip


def test_our_gemma3_gguf_is_laid_out_as_llama_cpps_converter_does(tmp_path):
    """The benchmark peer's GGUF (:mod:`engine.store.gguf_writer`) of a Gemma 3: the same
    tensors under the same names, norms as 1 + w, and the same Gemma 3 metadata; a Gemma 3
    whose layers llama.cpp could not read as it wrote them is refused."""
    from tests.conftest import build_tiny_hf

    keys = ("gemma3.attention.sliding_window", "gemma3.rope.freq_base")
    meta = check_gguf_layout(gemma3_as_llama_cpp_has_it(), "gemma3", tmp_path, keys)
    assert meta["gemma3.rope.scaling.factor"] == 4.0
    odd = ModelConfig.from_dict(build_tiny_hf("gemma3_text", tied=True).config.to_dict())
    with pytest.raises(ValueError, match="layer pattern, local RoPE base and attention scale"):
        refused_gguf(tmp_path, odd)


def gemma2_as_llama_cpp_has_it():
    """A tiny Gemma 2 as llama.cpp reads every Gemma 2 but the 27B: the even layers local,
    the attention over the head's width; scores soft-capped at 2, logits at 3."""
    from tests.conftest import build_tiny_hf

    return build_tiny_hf("gemma2", tied=True, num_hidden_layers=4, query_pre_attn_scalar=16)


def test_a_gemma2_gguf_imports_to_transformers_logits(tmp_path):
    """A Gemma 2 GGUF as llama.cpp's converter lays it out (its norms stored as 1 + w, the
    window and both soft caps as metadata), imported into a folder: the original's config
    and transformers' logits."""
    hf = gemma2_as_llama_cpp_has_it()
    cfg = ModelConfig.from_dict(hf.config.to_dict())
    assert cfg.local_layers == (0, 2) and cfg.attn_softcap == 2.0
    check_gguf_import(hf, "gemma2", tmp_path, ("local_layers", "local_window", "rope_theta",
                      "query_scale", "head_dim", "embed_scale", "attn_softcap",
                      "final_softcap", "gemma"))  # fmt: skip


def test_our_gemma2_gguf_is_laid_out_as_llama_cpps_converter_does(tmp_path):
    """The benchmark peer's GGUF of a Gemma 2: the same tensors under the same names, norms as
    1 + w, and the same Gemma 2 metadata; a Gemma 2 whose attention llama.cpp would scale
    otherwise is refused."""
    from tests.conftest import build_tiny_hf

    keys = ("gemma2.attention.sliding_window", "gemma2.attn_logit_softcapping",
            "gemma2.final_logit_softcapping")  # fmt: skip
    check_gguf_layout(gemma2_as_llama_cpp_has_it(), "gemma2", tmp_path, keys)
    odd = ModelConfig.from_dict(build_tiny_hf("gemma2", tied=True).config.to_dict())
    with pytest.raises(ValueError, match="Gemma 2 holds its own layer pattern and attention"):
        refused_gguf(tmp_path, odd)


@pytest.mark.parametrize("arch", ARCHS)
def test_gemma_on_our_triton_kernels_attends_each_layer_under_its_window(
    tiny_model_dir, monkeypatch, arch
):
    """Our Triton attention (the interpreter's, in fp32): the local layers under their window
    of 8, the global ones over everything, in blocks of 4, Gemma 2's scores soft-capped (at 2)
    in the kernels: each step's logits as transformers'. A cache window without sinks narrows
    both; one with sinks is refused."""
    from engine.errors import InvalidRequestError
    from engine.kv_cache.window import CacheWindow
    from tests.conftest import WIDE_HEADS

    monkeypatch.setenv("INFERSIGHT_KERNELS", "triton")
    folder, hf = tiny_model_dir(arch, True, **WIDE_HEADS)
    engine = load_model(folder, precision="fp32", config=EngineConfig(block_size=4, num_blocks=48))
    assert engine.paths()["attention"] == {
        "backend": "triton",
        "decode": "triton paged decode",
        "prefill": "triton paged prefill",
    }
    prompt = tiny_prompt(hf)
    check_each_step(engine, hf, prompt)
    with pytest.raises(InvalidRequestError, match="keep no sinks on a model with local layers"):
        engine.set_window(CacheWindow(sink=2, window=16))
    engine.set_window(CacheWindow(sink=0, window=16))  # narrows the global layers only
