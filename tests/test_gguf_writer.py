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


def _streamed(path, cfg, state, quant):
    """Our GGUF of ``state`` in ``quant``, its tensors streamed to the file (shapes first)."""
    tokens = [f"t{i}" for i in range(cfg.vocab_size)]
    shapes = {name: tuple(t.shape) for name, t in state.items()}
    return _tensors(write_gguf(path, cfg, iter(state.items()), name="t", tokens=tokens,
                               ftype=quant, shapes=shapes))  # fmt: skip


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_1"])
def test_a_quantized_gguf_streams_the_blocks_llama_cpps_converter_writes(tmp_path, quant):
    # The peer's GGUF of a model too large for the disk in float16 is written already
    # quantized, one tensor at a time: every matrix (the head too) in the file's type, the
    # same blocks the gguf package gives the llama.cpp-like writer, norms in float32.
    hf = build_tiny_hf("llama", tied=False, intermediate_size=128).half()
    cfg = ModelConfig.from_dict(hf.config.to_dict())
    ours = _streamed(tmp_path / "ours.gguf", cfg, hf.state_dict(), quant)
    want = _tensors(write_like_llama_cpp(hf.float(), tmp_path / "want.gguf", arch="llama",
                                         quant=quant))  # fmt: skip
    assert set(ours) == set(want)
    for name, tensor in want.items():
        assert ours[name].tensor_type == tensor.tensor_type, name
        assert np.array_equal(ours[name].data, tensor.data), name
    assert {t.tensor_type.name for t in ours.values() if len(t.shape) > 1} == {quant}
    from engine.bench.table import gguf_file_type

    assert gguf_file_type(tmp_path / "ours.gguf") == quant


def test_rows_that_do_not_fill_whole_blocks_stay_float16(tmp_path):
    # llama.cpp's quantizer keeps a matrix in F16 where its rows are not whole blocks (here
    # the MLP's down projection, 112 wide): so does ours.
    hf = build_tiny_hf("llama", tied=True).half()
    cfg = ModelConfig.from_dict(hf.config.to_dict())
    state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    ours = _streamed(tmp_path / "ours.gguf", cfg, state, "Q8_0")
    kinds = {name: t.tensor_type.name for name, t in ours.items() if len(t.shape) > 1}
    assert kinds["blk.0.ffn_down.weight"] == "F16" and kinds["blk.0.ffn_up.weight"] == "Q8_0"
    assert kinds["token_embd.weight"] == "Q8_0"


def test_a_mixture_of_experts_streams_its_experts_stacked_and_quantized(tmp_path):
    from tests.conftest import save_tiny

    hf = build_tiny_hf("qwen3_moe", tied=False, mlp_only_layers=[], moe_intermediate_size=32)
    folder = save_tiny(hf.half(), tmp_path / "hf")
    cfg = ModelConfig.from_file(folder / "config.json")
    state = load_file(str(folder / "model.safetensors"))  # the checkpoint's per-expert names
    ours = _streamed(tmp_path / "ours.gguf", cfg, state, "Q8_0")
    want = _tensors(write_like_llama_cpp(hf.float(), tmp_path / "want.gguf", arch="qwen3moe",
                                         quant="Q8_0"))  # fmt: skip
    assert set(ours) == set(want)
    for name, tensor in want.items():
        assert np.array_equal(ours[name].data, tensor.data), name
    assert ours["blk.0.ffn_up_exps.weight"].tensor_type.name == "Q8_0"


def test_a_drawn_synthetic_model_loads_the_values_its_gguf_holds(tmp_path):
    from engine.loader.load import load_model
    from engine.loader.random_weights import DRAWN
    from engine.store.synthetic_store import peer_ggufs, write_drawn_synthetic

    raw = TINY_LLAMA3 | {"intermediate_size": 128}
    drawn = write_drawn_synthetic(raw, tmp_path / "drawn", ("Q8_0",), seed=3)
    files = write_synthetic(raw, tmp_path / "files", seed=3)
    assert (drawn / DRAWN).is_file() and not list(drawn.glob("*.safetensors"))
    assert peer_ggufs(drawn) == {"Q8_0": drawn / "model-q8_0.gguf"}
    assert peer_ggufs(files) == {"F16": files / GGUF_NAME}
    # the load draws the very values the float16 file holds
    a, b = (load_model(f, precision="fp32").model.state_dict() for f in (drawn, files))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # and the Q8_0 GGUF holds their Q8_0 blocks
    import gguf

    state = load_file(str(files / "model.safetensors"))
    tensor = _tensors(drawn / "model-q8_0.gguf")["blk.0.ffn_up.weight"]
    want = gguf.quants.quantize(state["model.layers.0.mlp.up_proj.weight"].float().numpy(),
                                gguf.GGMLQuantizationType.Q8_0)  # fmt: skip
    assert np.array_equal(tensor.data, want)
    assert not list(drawn.glob(".*partial*"))


def test_a_synthetic_model_of_fewer_layers_keeps_their_shapes():
    from engine.errors import ModelLoadError
    from engine.store.synthetic_store import with_layers

    raw = published_config("gemma-3-4b")
    cut = ModelConfig.from_dict(with_layers(raw, 6))
    full = ModelConfig.from_dict(raw)
    assert cut.num_layers == 6 and cut.hidden_size == full.hidden_size == 2560
    assert cut.local_layers == full.local_layers[:5]  # every sixth layer is global
    qwen = ModelConfig.from_dict(with_layers(published_config("qwen3-30b-a3b"), 12))
    assert (qwen.num_layers, qwen.num_experts, qwen.expert_intermediate_size) == (12, 128, 768)
    with pytest.raises(ModelLoadError, match="layers 1 to 48"):
        with_layers(published_config("qwen3-30b-a3b"), 49)
