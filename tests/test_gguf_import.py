"""GGUF import on GGUF files written here the way llama.cpp writes them."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engine.errors import ModelLoadError, UnsupportedModelError
from engine.loader.load import load_model
from engine.model.tokenizer import Tokenizer
from engine.store.gguf_import import import_gguf
from tests.conftest import build_tiny_hf
from tests.gguf_factory import K_QUANT_SCALE_OFFSETS, write_gguf

# 256-wide matrices: every GGML block size (32 and the K-quants' 256) divides the rows.
SIZES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("tied", [True, False])
def test_f32_import_recovers_the_original_weights_and_logits(tmp_path, arch, tied):
    hf = build_tiny_hf(arch, tied=tied, **SIZES)
    src = write_gguf(hf, tmp_path / "m.gguf", arch=arch, quant="F32")
    out = tmp_path / "model"
    import_gguf(src, out, dtype="fp32")

    imported = load_file(str(out / "model.safetensors"))
    expected = hf.state_dict()
    if tied:
        expected.pop("lm_head.weight")
    assert set(imported) == set(expected)
    for name, tensor in expected.items():  # permutation undone, names mapped, nothing lost
        assert torch.equal(imported[name], tensor), name

    engine = load_model(out, precision="fp32")
    ids = list(range(10, 40))
    ours = engine.runner.forward_logits(ids, engine.runner.new_cache(len(ids)), 0)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("quant", ["F16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_quantized_import_equals_gguf_dequantization(tmp_path, quant):
    hf = build_tiny_hf("llama", tied=True, **SIZES)
    src = write_gguf(hf, tmp_path / "m.gguf", arch="llama", quant=quant)
    import_gguf(src, tmp_path / "model", dtype="fp32")
    imported = load_file(str(tmp_path / "model" / "model.safetensors"))

    reader = gguf.GGUFReader(str(src))
    down = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
    expected = gguf.quants.dequantize(down.data, down.tensor_type)
    assert np.array_equal(imported["model.layers.1.mlp.down_proj.weight"].numpy(), expected)
    if quant in K_QUANT_SCALE_OFFSETS:
        return  # random blocks: there is no original to compare with
    # Q (permuted in the file) comes back to HF's layout: close to the original weights.
    q = imported["model.layers.0.self_attn.q_proj.weight"]
    original = hf.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    assert (q - original).abs().max() < 0.15 * original.abs().max()


def test_import_writes_tokenizer_config_and_generation_config(tmp_path):
    hf = build_tiny_hf("llama", tied=True, **SIZES)
    src = write_gguf(hf, tmp_path / "m.gguf", arch="llama")
    out = tmp_path / "model"
    import_gguf(src, out)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [0, 2]  # <|endoftext|> and <|im_end|>
    tok = Tokenizer.from_folder(out)
    assert tok.chat_template is not None
    text = "hello there 2024 <|im_end|>"
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert 2 in ids  # the special token is one token
    digits = [tok.decode([i]) for i in ids if any(c.isdigit() for c in tok.decode([i]))]
    assert digits == ["2", "0", "2", "4"]


def test_unsupported_architecture_is_refused_and_writes_nothing(tmp_path):
    hf = build_tiny_hf("llama", tied=True, **SIZES)
    src = write_gguf(hf, tmp_path / "m.gguf", arch="gpt2")
    with pytest.raises(UnsupportedModelError, match="supports the architectures llama, qwen2"):
        import_gguf(src, tmp_path / "model")
    assert not (tmp_path / "model").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


def test_unsupported_tensor_type_is_refused_and_writes_nothing(tmp_path):
    hf = build_tiny_hf("llama", tied=True, **SIZES)
    src = write_gguf(hf, tmp_path / "m.gguf", arch="llama", tensor_type_override="IQ4_XS")
    with pytest.raises(UnsupportedModelError, match=r"IQ4_XS.*supports F32"):
        import_gguf(src, tmp_path / "model")
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


def test_unknown_pre_tokenizer_is_refused(tmp_path):
    hf = build_tiny_hf("llama", tied=True, **SIZES)
    src = write_gguf(hf, tmp_path / "m.gguf", arch="llama", pre="mystery-pre")
    with pytest.raises(UnsupportedModelError, match="'mystery-pre' is not supported"):
        import_gguf(src, tmp_path / "model")


def test_not_a_gguf_file_is_a_clear_error(tmp_path):
    bogus = tmp_path / "x.gguf"
    bogus.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        import_gguf(bogus, tmp_path / "model")


def test_import_refuses_a_non_empty_destination(tmp_path):
    hf = build_tiny_hf("llama", tied=True, **SIZES)
    src = write_gguf(hf, tmp_path / "m.gguf", arch="llama")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "keep.txt").write_text("mine")
    with pytest.raises(ModelLoadError, match="not empty"):
        import_gguf(src, tmp_path / "model")
    assert (tmp_path / "model" / "keep.txt").read_text() == "mine"
