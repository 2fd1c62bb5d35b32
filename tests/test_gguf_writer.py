"""The F16 GGUF we write for llama.cpp (``engine/store/gguf_writer.py``) and the synthetic
models that carry one beside their safetensors (``engine/store/synthetic_store.py``): laid
out as llama.cpp's converter lays out a Llama checkpoint, holding the very values the engine
loads."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engine.model.config import ModelConfig
from engine.store.gguf_reader import (
    hf_tensor_name,
    llama3_scaling,
    open_gguf,
    read_gguf_header,
    unpermute_rotary,
)
from engine.store.gguf_writer import rope_divisors, write_gguf
from engine.store.synthetic_store import GGUF_NAME, published_config, write_synthetic
from tests.conftest import TINY, build_tiny_hf
from tests.gguf_factory import write_gguf as write_like_llama_cpp

#: a tiny Llama with Llama 3's RoPE scaling, which llama.cpp reads from a tensor of its own
TINY_LLAMA3 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    **TINY,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": [2, 3],
    "torch_dtype": "float16",
}  # fmt: skip


def _tensors(path):
    return {t.name: t for t in open_gguf(path).tensors}


@pytest.mark.parametrize("tied", [True, False])
def test_the_tensors_are_laid_out_as_llama_cpps_converter_does(tmp_path, tied):
    # The test's own writer follows llama.cpp's converter (names, the Q/K row permutation,
    # F16 matrices and F32 norms): ours must write the same bytes under the same names.
    hf = build_tiny_hf("llama", tied=tied).half()
    cfg = ModelConfig.from_dict(hf.config.to_dict())
    state = hf.state_dict()
    if tied:
        state.pop("lm_head.weight")
    tokens = [f"t{i}" for i in range(cfg.vocab_size)]
    ours = _tensors(write_gguf(tmp_path / "ours.gguf", cfg, state.items(), name="t", tokens=tokens))
    want = _tensors(write_like_llama_cpp(hf.float(), tmp_path / "want.gguf", arch="llama",
                                         quant="F16"))  # fmt: skip
    assert set(ours) == set(want)
    for name, tensor in want.items():
        assert ours[name].tensor_type == tensor.tensor_type, name
        assert np.array_equal(ours[name].data, tensor.data), name


def test_a_synthetic_model_holds_the_same_values_in_its_folder_and_its_gguf(tmp_path):
    folder = write_synthetic(TINY_LLAMA3, tmp_path / "synthetic", seed=3)
    assert not list(tmp_path.glob(".*partial*"))
    state = load_file(str(folder / "model.safetensors"))
    assert {t.dtype for t in state.values()} == {torch.float16}
    gguf = folder / GGUF_NAME
    cfg = ModelConfig.from_dict(json.loads((folder / "config.json").read_text()))
    seen = set()
    for tensor in open_gguf(gguf).tensors:
        data = np.asarray(tensor.data)
        if tensor.name == "rope_freqs.weight":  # llama.cpp divides each pair's frequency
            assert np.array_equal(data, rope_divisors(cfg))
            continue
        name = hf_tensor_name(tensor.name)
        if tensor.name.endswith("attn_q.weight"):
            data = unpermute_rotary(data, cfg.num_heads)
        elif tensor.name.endswith("attn_k.weight"):
            data = unpermute_rotary(data, cfg.num_kv_heads)
        assert torch.equal(torch.from_numpy(data.copy()).half(), state[name]), name
        seen.add(name)
    assert seen == set(state)
    divisors = rope_divisors(cfg)
    assert divisors is not None and divisors.min() == 1.0 and divisors.max() == 32.0
    # the GGUF's header describes the same model
    read = read_gguf_header(gguf).model_config()
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "tie_word_embeddings", "bos_token_id"):  # fmt: skip
        assert getattr(read, field) == getattr(cfg, field), field
    for field in ("rms_norm_eps", "rope_theta"):  # GGUF keeps them as float32
        assert getattr(read, field) == float(np.float32(getattr(cfg, field))), field


def test_a_synthetic_folder_loads_and_generates(tmp_path):
    from engine.core.sampling import SamplingParams
    from engine.loader.load import load_model

    folder = write_synthetic(TINY_LLAMA3, tmp_path / "synthetic")
    engine = load_model(folder, precision="fp32")
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    generation = engine.generate([5, 6, 7], params)
    list(generation)
    assert len(generation.result.token_ids) == 4


def test_the_published_configs_have_their_shapes():
    raw = published_config("llama-3.2-1b")
    cfg = ModelConfig.from_dict(raw)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (2048, 8192, 16)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (32, 8, 64, 128256)
    assert cfg.rope_scaling.kind == "llama3" and cfg.tie_word_embeddings
    assert raw["torch_dtype"] == "float16" and "_comment" not in raw


def test_an_unknown_synthetic_model_is_refused_with_the_known_ones(capsys):
    from app.cli.main import main

    assert main(["models", "synth", "llama-9"]) != 0
    err = capsys.readouterr().err
    assert "no published config named 'llama-9'" in err and "llama-3.2-1b" in err


def test_the_gguf_header_gives_back_llama3_rope_scaling(tmp_path):
    """The import reads Llama 3's scaling back from llama.cpp's per-pair divisors: the config
    it writes rotates as the original (a GGUF of a Llama 3.x model lost it before)."""
    from engine.model.transformer import rope_inverse_frequencies

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 2.0, "original_max_position_embeddings": 256}  # fmt: skip
    raw = {**TINY_LLAMA3, "num_attention_heads": 2, "num_key_value_heads": 1,
           "rope_theta": 10000.0, "rope_scaling": scaling}  # fmt: skip  # head_dim 32
    folder = write_synthetic(raw, tmp_path / "synthetic")
    read = read_gguf_header(folder / GGUF_NAME).config
    assert read["rope_scaling"] == scaling
    want = rope_inverse_frequencies(ModelConfig.from_dict(raw))
    torch.testing.assert_close(rope_inverse_frequencies(ModelConfig.from_dict(read)), want)
    # Meta's published configs, through the divisors llama.cpp would keep, and back
    for name in ("llama-3.2-1b", "llama-3.1-8b"):
        cfg = ModelConfig.from_dict(published_config(name))
        divisors = rope_divisors(cfg)
        assert divisors is not None
        got = llama3_scaling(divisors.astype(np.float64), cfg.rope_theta, cfg.head_dim)
        assert got == published_config(name)["rope_scaling"]


def test_divisors_that_are_not_llama3s_scaling_are_refused_by_name():
    from engine.errors import UnsupportedModelError

    with pytest.raises(
        UnsupportedModelError, match=r"not Llama 3's RoPE scaling.*Hugging Face folder"
    ):
        llama3_scaling(np.linspace(1, 5, 16), 10000.0, 32)
    assert llama3_scaling(np.ones(16), 10000.0, 32) is None  # no scaling at all
