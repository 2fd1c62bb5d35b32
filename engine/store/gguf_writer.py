"""Hugging Face-style weights → a llama.cpp GGUF file (F16), for the benchmark peer.

``make bench-peers`` runs llama.cpp beside the engine on a synthetic model too (random weights
of a published config, :mod:`engine.store.synthetic_store`): both must read the very same
values. This writes them as llama.cpp's own converter would lay out a Llama checkpoint: GGUF
tensor names (the inverse of :mod:`engine.store.gguf_reader`'s), each head's Q/K rows
interleaved for llama.cpp's adjacent-pair rotation (:func:`permute_rotary`, the inverse of
:func:`~engine.store.gguf_reader.unpermute_rotary`), Llama 3's RoPE scaling as the per-pair
frequency divisors llama.cpp reads from ``rope_freqs.weight``, and a vocabulary of as many
tokens as the model has (token ids go in and out; their text is the synthetic tokenizer's
``t0`` … ``tN``). llama.cpp then requantizes the file to Q4_1, Q8_0 … itself.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.model.config import ModelConfig
from engine.store.gguf_reader import (
    GEMMA2_PATTERN,
    GEMMA3_LOCAL_BASE,
    GEMMA3_PATTERN,
    NORM_SHIFT,
)

_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
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
}

#: Phi-3's tensors as llama.cpp keeps them, fused as the checkpoint holds them (q/k/v; gate/up)
_PHI3 = {
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
}
#: Gemma 3's, its norms where they differ from Llama's (``ffn_norm`` is the one before the MLP)
_GEMMA3 = {
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
#: a mixture of experts' router and Qwen2-MoE's shared expert; the routed experts go into one
#: 3-D tensor a product and layer (:data:`_EXPERT`)
_MOE = {
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",  # Qwen3-MoE's
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}
_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$"
)
#: a mixture of experts' router, which llama.cpp keeps in F32
_ROUTER = re.compile(r"\.(?:mlp|block_sparse_moe)\.gate\.weight$")
_EXPERT_PRODUCTS = {
    "gate_proj": "ffn_gate_exps", "w1": "ffn_gate_exps", "up_proj": "ffn_up_exps",
    "w3": "ffn_up_exps", "down_proj": "ffn_down_exps", "w2": "ffn_down_exps",
}  # fmt: skip
_ARCH_NAMES = {"phi3": _PHI3, "gemma2": _GEMMA3, "gemma3": _GEMMA3, "qwen3moe": _MOE,
               "qwen2moe": _MOE}  # fmt: skip
#: the architectures this writes, as llama.cpp names them, by our ``model_type`` (Mixtral: a
#: ``llama`` with experts)
ARCHITECTURES = {"llama": "llama", "phi3": "phi3", "gemma2": "gemma2", "gemma3_text": "gemma3",
                 "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}  # fmt: skip


def gguf_tensor_name(hf_name: str, arch: str = "llama") -> str:
    """The GGUF name of an HF tensor of ``arch`` (``model.layers.3.mlp.up_proj.weight`` →
    ``blk.3.ffn_up.weight``)."""
    if hf_name in _TOP:
        return _TOP[hf_name]
    parts = hf_name.split(".", 3)
    names = {**_LAYER, **_ARCH_NAMES.get(arch, {}), **_MOE}
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in names:
        return f"blk.{parts[2]}.{names[parts[3]]}"
    raise ValueError(f"{hf_name}: no GGUF name for this tensor of a {arch} checkpoint")


def permute_rotary(weight: np.ndarray, heads: int) -> np.ndarray:
    """Each head's Q/K rows from HF's half-split order into llama.cpp's interleaved one: row
    ``j`` of a head's first half goes to ``2j``, row ``j`` of its second half to ``2j + 1``."""
    rows = weight.shape[0]
    half = rows // heads // 2
    return weight.reshape(heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def rope_divisors(cfg: ModelConfig) -> np.ndarray | None:
    """Llama 3's RoPE scaling as llama.cpp reads it: per rotary pair, the unscaled frequency
    over the scaled one (``rope_freqs.weight``); None where the config scales nothing
    per pair."""
    from dataclasses import replace

    from engine.model.config import RopeScaling
    from engine.model.transformer import rope_inverse_frequencies

    if cfg.rope_scaling.kind != "llama3":
        return None
    plain = rope_inverse_frequencies(replace(cfg, rope_scaling=RopeScaling()))
    return (plain / rope_inverse_frequencies(cfg)).numpy().astype(np.float32)


#: llama.cpp's ``general.file_type`` by the type of the file's matrices (``llama_ftype``)
FILE_TYPES = {"F16": 1, "Q4_1": 3, "Q8_0": 7}


def write_gguf(
    path: Path,
    cfg: ModelConfig,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    name: str,
    tokens: list[str],
    ftype: str = "F16",
    shapes: dict[str, tuple[int, ...]] | None = None,
) -> Path:
    """Write ``tensors`` (HF names) of a model of ``cfg`` to the GGUF ``path``, with ``tokens``
    as its vocabulary: matrices in ``ftype`` (F16; or Q4_1 / Q8_0, quantized here by the
    ``gguf`` package, every matrix the head included), norms, biases and a mixture's routers
    in float32, as llama.cpp's converter does. A Phi-3 model keeps its fused tensors, its
    window and LongRoPE as llama.cpp's converter writes them.

    ``shapes``: every tensor's shape, by HF name, in the order ``tensors`` yields them; given,
    the tensors stream to the file one at a time (a model larger than memory is written with
    one layer's experts held at most); else ``tensors`` is read whole first."""
    import gguf

    if cfg.model_type not in ARCHITECTURES:
        raise ValueError(f"writing a GGUF of a {cfg.model_type!r} model is not supported")
    if ftype not in FILE_TYPES:
        raise ValueError(f"writing {ftype!r} matrices is not supported; one of {list(FILE_TYPES)}")
    arch = ARCHITECTURES[cfg.model_type]
    if len(tokens) != cfg.vocab_size:
        raise ValueError(f"{len(tokens)} tokens for a vocabulary of {cfg.vocab_size}")
    if shapes is None:
        held = [(n, t.detach().cpu()) for n, t in tensors]
        shapes, tensors = {n: tuple(t.shape) for n, t in held}, held
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_file_type(FILE_TYPES[ftype])
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    # a SentencePiece-style vocabulary: llama.cpp reads the tokens' text, scores and types
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    if cfg.bos_token_id is not None:
        writer.add_bos_token_id(cfg.bos_token_id)
    if cfg.eos_token_ids:
        writer.add_eos_token_id(cfg.eos_token_ids[0])
    extras: list[tuple[str, np.ndarray]] = []  # float32 vectors that are not the checkpoint's
    divisors = rope_divisors(cfg)
    if divisors is not None:
        extras.append(("rope_freqs.weight", divisors))
    if arch == "phi3":
        extras += _phi3_extras(writer, cfg)
    if arch == "gemma3":
        _gemma3_extras(writer, cfg)
    if arch == "gemma2":
        _gemma2_extras(writer, cfg)
    if cfg.num_experts:
        _moe_extras(writer, cfg, arch)
    for extra, values in extras:
        _declare(writer, extra, values.shape, gguf.GGMLQuantizationType.F32)
    for gguf_name, shape, kind in _layout(cfg, arch, shapes, ftype):
        _declare(writer, gguf_name, shape, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, values in extras:
        writer.write_tensor_data(values)
    _write_data(writer, cfg, arch, tensors, ftype)
    writer.close()
    return path


def _declare(writer: Any, name: str, shape: tuple[int, ...], kind: Any) -> None:
    """A tensor's entry in the file's table, its data written later in the same order."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if kind in (GGMLQuantizationType.F16, GGMLQuantizationType.F32):
        dtype = np.dtype(np.float16 if kind == GGMLQuantizationType.F16 else np.float32)
        writer.add_tensor_info(name, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
        return
    block, size = GGML_QUANT_SIZES[kind]
    nbytes = int(np.prod(shape[:-1])) * shape[-1] // block * size
    writer.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=kind)


def _matrix_kind(shape: tuple[int, ...], ftype: str) -> Any:
    """A matrix's type in the file: ``ftype``, or F16 where its rows do not fill whole blocks
    (as llama.cpp's quantizer falls back)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    kind = GGMLQuantizationType[ftype]
    return kind if shape[-1] % GGML_QUANT_SIZES[kind][0] == 0 else GGMLQuantizationType.F16


def _layout(
    cfg: ModelConfig, arch: str, shapes: dict[str, tuple[int, ...]], ftype: str
) -> list[tuple[str, tuple[int, ...], Any]]:
    """Each tensor the file holds, in the order :func:`_write_data` writes them: GGUF name,
    shape and type (a layer's routed experts as one 3-D tensor a product, where its last
    expert arrives)."""
    from gguf import GGMLQuantizationType

    out: list[tuple[str, tuple[int, ...], Any]] = []
    seen: dict[tuple[str, str], int] = {}
    for hf_name, shape in shapes.items():
        expert = _EXPERT.match(hf_name)
        if expert and expert.group(3) in _EXPERT_PRODUCTS:
            layer, product = expert.group(1), _EXPERT_PRODUCTS[expert.group(3)]
            seen[(layer, product)] = seen.get((layer, product), 0) + 1
            if seen[(layer, product)] == cfg.num_experts:
                stacked = (cfg.num_experts, *shape)
                out.append((f"blk.{layer}.{product}.weight", stacked, _matrix_kind(shape, ftype)))
            continue
        gguf_name = gguf_tensor_name(hf_name, arch)
        if hf_name.endswith("shared_expert_gate.weight"):  # llama.cpp's is a vector, F32
            out.append((gguf_name, (int(np.prod(shape)),), GGMLQuantizationType.F32))
        elif len(shape) == 1 or _ROUTER.search(hf_name):  # llama.cpp never quantizes a router
            out.append((gguf_name, shape, GGMLQuantizationType.F32))
        else:
            out.append((gguf_name, shape, _matrix_kind(shape, ftype)))
    return out


def _write_data(
    writer: Any,
    cfg: ModelConfig,
    arch: str,
    tensors: Iterable[tuple[str, torch.Tensor]],
    ftype: str,
) -> None:
    """Each tensor's values, converted as llama.cpp's converter does and encoded in its type,
    in :func:`_layout`'s order."""
    from gguf import quants

    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}  # (layer, product) → expert → rows

    def encoded(array: np.ndarray) -> np.ndarray:
        kind = _matrix_kind(array.shape, ftype)
        if kind.name == "F16":
            return array.astype(np.float16)
        return quants.quantize(array.astype(np.float32), kind)

    for hf_name, tensor in tensors:
        host = tensor.detach().cpu()
        array = host.float().numpy()
        expert = _EXPERT.match(hf_name)
        if expert and expert.group(3) in _EXPERT_PRODUCTS:  # stacked once the layer's are in
            layer, product = expert.group(1), _EXPERT_PRODUCTS[expert.group(3)]
            held = experts.setdefault((layer, product), {})
            held[int(expert.group(2))] = encoded(array)
            if len(held) == cfg.num_experts:
                writer.write_tensor_data(np.stack([held[e] for e in range(cfg.num_experts)]))
                del experts[(layer, product)]
            continue
        if hf_name.endswith("shared_expert_gate.weight"):  # llama.cpp's is a vector, F32
            writer.write_tensor_data(np.ascontiguousarray(array.reshape(-1)))
            continue
        if arch in NORM_SHIFT and hf_name.endswith("norm.weight"):  # llama.cpp keeps 1 + w
            array = array + np.float32(NORM_SHIFT[arch])
        if hf_name.endswith(("q_proj.weight", "q_proj.bias")) and arch == "llama":
            array = permute_rotary(array, cfg.num_heads)
        elif hf_name.endswith(("k_proj.weight", "k_proj.bias")) and arch == "llama":
            array = permute_rotary(array, cfg.num_kv_heads)
        array = np.ascontiguousarray(array)
        vector = array.ndim == 1 or _ROUTER.search(hf_name)
        writer.write_tensor_data(array if vector else encoded(array))
    if experts:
        raise ValueError(f"experts missing from {sorted(experts)[:2]}: every expert of a layer")
    unwritten = [name for part in writer.tensors for name in part]
    if unwritten:
        raise ValueError(f"{len(unwritten)} tensor(s) declared but not given, {unwritten[0]} first")


def _moe_extras(writer: Any, cfg: ModelConfig, arch: str) -> None:
    """A mixture of experts' counts and sizes as llama.cpp's converter writes them (a Mixtral's
    under ``llama``; its experts as large as the config's intermediate size)."""
    writer.add_expert_count(cfg.num_experts)
    writer.add_expert_used_count(cfg.experts_per_token)
    if arch != "llama":
        writer.add_expert_feed_forward_length(cfg.expert_intermediate_size)
    if cfg.shared_expert_size:
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_size)


def _phi3_extras(writer: Any, cfg: ModelConfig) -> list[tuple[str, np.ndarray]]:
    """Phi-3's window and LongRoPE as llama.cpp's converter writes them: the pretraining
    context and the attention factor as metadata, the short and long factors as the
    ``rope_factors_short`` / ``rope_factors_long`` tensors (its rotation is NEOX's, on the
    halves of each head as transformers', so no row is permuted)."""
    rs = cfg.rope_scaling
    if cfg.sliding_window:
        writer.add_uint32("phi3.attention.sliding_window", cfg.sliding_window)
    if rs.kind != "longrope":
        return []
    writer.add_uint32("phi3.rope.scaling.original_context_length",
                      rs.original_max_position_embeddings)  # fmt: skip
    writer.add_float32("phi3.rope.scaling.attn_factor", rs.attention_factor)
    return [
        (f"rope_factors_{kind}.weight", np.asarray(factors, dtype=np.float32))
        for kind, factors in (("long", rs.long_factor), ("short", rs.short_factor))
    ]


def _gemma2_extras(writer: Any, cfg: ModelConfig) -> None:
    """Gemma 2's window and soft caps as llama.cpp's converter writes them; its layer pattern
    and the attention's scale llama.cpp fixes (:func:`engine.store.gguf_reader._gemma2_config`),
    which this model must have."""
    expected = tuple(i for i in range(cfg.num_layers) if (i + 1) % GEMMA2_PATTERN)
    head = cfg.hidden_size // cfg.num_heads if cfg.num_layers == 46 else cfg.head_dim
    if (
        cfg.local_layers != expected
        or abs(cfg.query_scale - (cfg.head_dim / head) ** 0.5) > 1e-12
        or cfg.attn_softcap is None
        or cfg.final_softcap is None
    ):
        raise ValueError("llama.cpp's GGUF of a Gemma 2 holds its own layer pattern and "
                         "attention scale, and soft-caps scores and logits; this model's "
                         "differ")  # fmt: skip
    if cfg.local_window is not None:
        writer.add_sliding_window(cfg.local_window)
    writer.add_attn_logit_softcapping(cfg.attn_softcap)
    writer.add_final_logit_softcapping(cfg.final_softcap)


def _gemma3_extras(writer: Any, cfg: ModelConfig) -> None:
    """Gemma 3's window and its global layers' RoPE scaling as llama.cpp's converter writes
    them; the rest llama.cpp fixes for every Gemma 3 (its layer pattern, the local RoPE base,
    the attention's scale: :func:`engine.store.gguf_reader._gemma3_config`), which this
    model must have."""
    expected = tuple(i for i in range(cfg.num_layers) if (i + 1) % GEMMA3_PATTERN)
    head = cfg.hidden_size // cfg.num_heads if cfg.num_layers == 62 else cfg.head_dim
    if (
        cfg.local_layers != expected
        or cfg.local_rope_theta != GEMMA3_LOCAL_BASE
        or abs(cfg.query_scale - (cfg.head_dim / head) ** 0.5) > 1e-12
    ):
        raise ValueError("llama.cpp's GGUF of a Gemma 3 holds its own layer pattern, local "
                         "RoPE base and attention scale; this model's differ")  # fmt: skip
    if cfg.local_window is not None:
        writer.add_sliding_window(cfg.local_window)
    if cfg.rope_scaling.kind == "linear":
        import gguf

        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(cfg.rope_scaling.factor)
    if cfg.final_softcap is not None:
        writer.add_final_logit_softcapping(cfg.final_softcap)
