"""Write small GGUF files the way llama.cpp's converter does, for import tests."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.conftest import rope_theta

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def bytes_to_unicode() -> list[str]:
    """GPT-2's byte → printable character table (the 256 byte-level BPE base tokens)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs, strict=True))
    return [chr(table[b]) for b in range(256)]


def byte_level_vocab(size: int) -> tuple[list[str], list[int], list[str]]:
    """``size`` tokens: 3 control tokens, 256 bytes, then merged pairs."""
    base = bytes_to_unicode()
    tokens = SPECIALS + base
    merges: list[str] = []
    letters = [c for c in "etaoinshrdlu"]
    for a in ["Ġ", *letters]:
        for b in letters:
            if len(tokens) >= size:
                break
            if a + b not in tokens:
                tokens.append(a + b)
                merges.append(f"{a} {b}")
    assert len(tokens) == size, len(tokens)
    types = [3] * len(SPECIALS) + [1] * (size - len(SPECIALS))
    return tokens, types, merges


# gguf's Python package dequantizes K-quants but cannot quantize to them, so tests fill
# blocks with random bytes and set each block's fp16 scale fields (byte offsets) to sane values.
K_QUANT_SCALE_OFFSETS = {"Q4_K": (0, 2), "Q6_K": (208,)}


def random_k_quant_blocks(shape: tuple[int, ...], quant: str, seed: int = 0) -> np.ndarray:
    import gguf

    qtype = gguf.GGMLQuantizationType[quant]
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    raw = np.random.default_rng(seed).integers(0, 256, (rows, cols // block, nbytes), np.uint8)
    scale = np.frombuffer(np.float16(0.004).tobytes(), dtype=np.uint8)
    for offset in K_QUANT_SCALE_OFFSETS[quant]:
        raw[:, :, offset : offset + 2] = scale
    return raw.reshape(rows, -1)


def permute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert-time Q/K permutation (``LlamaModel.permute``)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_gguf(
    hf_model: torch.nn.Module,
    path: Path,
    *,
    arch: str,
    quant: str = "F32",
    pre: str = "smollm",
    tensor_type_override: str | None = None,
    extra_uint16: dict[str, int] | None = None,
) -> Path:
    """Write ``hf_model`` (a tiny transformers Llama/Qwen2/Phi-3/Gemma 3) as a GGUF of ``arch``.

    ``quant`` is the type of 2-D weight matrices (``F32``, ``F16``, ``Q8_0``, ``Q4_0`` …);
    norms stay F32 as in llama.cpp. ``arch`` may name an architecture we do not support.
    ``tensor_type_override`` stores one tensor with that raw type, to test refusals.
    ``extra_uint16`` adds metadata keys (say ``split.count``, as llama.cpp's splitter writes).
    """
    import gguf

    cfg = hf_model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny test model")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(rope_theta(cfg))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = getattr(cfg, "rope_parameters", None) or {}
    partial = rope.get("partial_rotary_factor") or getattr(cfg, "partial_rotary_factor", 1.0)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(int(head_dim * (partial or 1.0)))
    tokens, types, merges = byte_level_vocab(cfg.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)
    for key, value in (extra_uint16 or {}).items():
        writer.add_uint16(key, value)

    qtype = gguf.GGMLQuantizationType[quant]
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    layer = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.q_proj.bias": "attn_q.bias",
        "self_attn.k_proj.bias": "attn_k.bias",
        "self_attn.v_proj.bias": "attn_v.bias",
        "self_attn.o_proj.weight": "attn_output.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
        # Qwen3's (and Gemma 3's) q/k norms
        "self_attn.q_norm.weight": "attn_q_norm.weight",
        "self_attn.k_norm.weight": "attn_k_norm.weight",
        # Phi-3's, fused in the checkpoint and kept so by llama.cpp
        "self_attn.qkv_proj.weight": "attn_qkv.weight",
        "mlp.gate_up_proj.weight": "ffn_up.weight",
    }
    if arch == "phi3":
        _phi3_metadata(writer, cfg)
    if arch in ("gemma2", "gemma3"):  # its norms, as llama.cpp's converter names them
        layer |= {
            "self_attn.q_norm.weight": "attn_q_norm.weight",
            "self_attn.k_norm.weight": "attn_k_norm.weight",
            "post_attention_layernorm.weight": "post_attention_norm.weight",
            "pre_feedforward_layernorm.weight": "ffn_norm.weight",
            "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
        }
        writer.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":  # Gemma2Model.set_gguf_parameters' soft caps
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch == "gemma3":
        scaling = cfg.rope_parameters["full_attention"]
        if scaling.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(scaling["factor"])
    state = hf_model.state_dict()
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    if getattr(cfg, "num_experts_per_tok", None):  # a mixture of experts
        state = _moe_as_llama_cpp(writer, cfg, state, arch, layer, quant)
    for hf_name, tensor in state.items():
        if hf_name in names:
            name = names[hf_name]
        else:
            _, _, idx, rest = hf_name.split(".", 3)
            name = f"blk.{idx}.{layer[rest]}"
        data = tensor.detach().float().numpy()
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):  # 1 + w, stored so
            data = data + np.float32(1.0)
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_q.bias")):
            data = permute_rotary(data, cfg.num_attention_heads)
        elif arch == "llama" and name.endswith(("attn_k.weight", "attn_k.bias")):
            data = permute_rotary(data, cfg.num_key_value_heads)
        if tensor_type_override and name == "output_norm.weight":
            raw = gguf.GGMLQuantizationType[tensor_type_override]
            block, nbytes = gguf.GGML_QUANT_SIZES[raw]
            fake = np.zeros((1, (data.size // block) * nbytes), dtype=np.uint8)
            writer.add_tensor(name, fake, raw_dtype=raw)
        elif name.endswith("ffn_gate_inp.weight"):  # a router: F32, never quantized
            writer.add_tensor(name, data)
        elif data.ndim == 2 and quant in K_QUANT_SCALE_OFFSETS:
            writer.add_tensor(name, random_k_quant_blocks(data.shape, quant), raw_dtype=qtype)
        elif data.ndim == 2 and quant not in ("F32", "F16"):
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        elif data.ndim == 2 and quant == "F16":
            writer.add_tensor(name, data.astype(np.float16))
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _phi3_metadata(writer: Any, cfg: Any) -> None:
    """What llama.cpp's converter writes of a Phi-3 beyond a Llama: its window, and LongRoPE's
    pretraining context, attention factor (from the context's ratio to it) and factors (as
    the F32 tensors ``rope_factors_long`` / ``rope_factors_short``)."""
    if getattr(cfg, "sliding_window", None):
        writer.add_uint32("phi3.attention.sliding_window", cfg.sliding_window)
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if rope.get("rope_type") != "longrope":
        return
    original = cfg.original_max_position_embeddings
    scale = cfg.max_position_embeddings / original
    writer.add_uint32("phi3.rope.scaling.original_context_length", original)
    writer.add_float32(
        "phi3.rope.scaling.attn_factor",
        math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0,
    )
    for kind in ("long", "short"):
        factors = np.asarray(rope[f"{kind}_factor"], dtype=np.float32)
        writer.add_tensor(f"rope_factors_{kind}.weight", factors)


def _moe_as_llama_cpp(
    writer: Any, cfg: Any, state: dict, arch: str, layer: dict, quant: str
) -> dict:
    """A mixture of experts as llama.cpp's converter writes it: its expert counts and sizes as
    metadata, each layer's experts as one 3-D tensor a product (transformers holds gate and up
    fused, ``[E, 2I, H]``), the router as ``ffn_gate_inp``, Qwen2-MoE's shared expert as
    ``*_shexp`` and its gate as a vector; returns the state left to write as a dense model's."""
    prefix = "llama" if arch == "llama" else arch
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    writer.add_uint32(f"{prefix}.expert_count", experts)
    writer.add_uint32(f"{prefix}.expert_used_count", cfg.num_experts_per_tok)
    if arch != "llama":
        writer.add_uint32(f"{prefix}.expert_feed_forward_length", cfg.moe_intermediate_size)
    if arch == "qwen2moe":
        writer.add_uint32(
            f"{prefix}.expert_shared_feed_forward_length", cfg.shared_expert_intermediate_size
        )
    layer |= {
        "mlp.gate.weight": "ffn_gate_inp.weight",
        "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
        "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
        "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
        "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    }
    import gguf

    def matrix(name: str, data: np.ndarray) -> None:  # in the file's type, as its 2-D ones
        if quant == "F16":
            writer.add_tensor(name, data.astype(np.float16))
        elif quant == "F32":
            writer.add_tensor(name, data)
        else:
            qtype = gguf.GGMLQuantizationType[quant]
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    rest = {}
    for name, tensor in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            idx = name.split(".")[2]
            gate, up = tensor.detach().float().chunk(2, dim=1)
            matrix(f"blk.{idx}.ffn_gate_exps.weight", gate.contiguous().numpy())
            matrix(f"blk.{idx}.ffn_up_exps.weight", up.contiguous().numpy())
        elif name.endswith("mlp.experts.down_proj"):
            idx = name.split(".")[2]
            matrix(f"blk.{idx}.ffn_down_exps.weight", tensor.detach().float().numpy())
        elif name.endswith("mlp.shared_expert_gate.weight"):
            idx = name.split(".")[2]
            writer.add_tensor(f"blk.{idx}.ffn_gate_inp_shexp.weight",
                              tensor.detach().float().reshape(-1).numpy())  # fmt: skip
        else:
            rest[name] = tensor
    return rest
