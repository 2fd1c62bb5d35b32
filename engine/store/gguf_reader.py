"""Reading a llama.cpp GGUF file with the ``gguf`` package: its header and metadata, the
Hugging Face-style ``config.json`` it implies, its tensors dequantized under their HF names
(llama.cpp's rotary row permutation of Q/K undone by :func:`unpermute_rotary`), and the sampling
its author recommends.

:func:`read_gguf_header` reads what a file's header says (architecture, parameter count, the
``config.json`` an import would write) without touching its tensor data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import ModelLoadError, UnsupportedModelError
from engine.model.config import ModelConfig

SUPPORTED_ARCHS = ("llama", "qwen2", "phi3", "gemma2", "gemma3", "qwen3moe", "qwen2moe")
#: the transformers class each architecture's folder names
_HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "phi3": "Phi3ForCausalLM",
               "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
               "qwen3moe": "Qwen3MoeForCausalLM",
               "qwen2moe": "Qwen2MoeForCausalLM", "mixtral": "MixtralForCausalLM"}  # fmt: skip
#: the ``model_type`` of each architecture where it is not llama.cpp's name (a ``llama`` GGUF
#: with experts is a Mixtral)
MODEL_TYPES = {"gemma3": "gemma3_text", "qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe"}
#: Phi-3's tensors where llama.cpp keeps them fused as the checkpoint does (q/k/v; gate/up)
_PHI3_TENSORS = {
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
}
#: Gemma 3's: its q/k norms and its four norms of a layer (``ffn_norm`` before the MLP)
_GEMMA3_TENSORS = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
#: a mixture of experts' tensors as llama.cpp keeps them: the router, each layer's experts as
#: one 3-D tensor a product (``{e}``: one HF tensor per expert), Qwen2-MoE's shared expert
_MOE_TENSORS = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.{e}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{e}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{e}.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}
#: Mixtral's (a ``llama`` GGUF with experts) as its checkpoints name them
_MIXTRAL_TENSORS = {
    "ffn_gate_inp.weight": "block_sparse_moe.gate.weight",
    "ffn_gate_exps.weight": "block_sparse_moe.experts.{e}.w1.weight",
    "ffn_up_exps.weight": "block_sparse_moe.experts.{e}.w3.weight",
    "ffn_down_exps.weight": "block_sparse_moe.experts.{e}.w2.weight",
}
#: per architecture, its tensors' names beyond (or in place of) Llama's
_QK_NORMS = {  # Qwen3's
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
#: Gemma 2's: Gemma 3's four norms of a layer, no q/k norms
_GEMMA2_TENSORS = {
    k: v for k, v in _GEMMA3_TENSORS.items() if "_q_norm" not in k and "_k_norm" not in k
}
_ARCH_TENSORS = {"phi3": _PHI3_TENSORS, "gemma2": _GEMMA2_TENSORS, "gemma3": _GEMMA3_TENSORS,
                 "mixtral": _MIXTRAL_TENSORS,
                 "qwen3moe": {**_MOE_TENSORS, **_QK_NORMS}, "qwen2moe": _MOE_TENSORS}  # fmt: skip
#: llama.cpp's choice of renormalising the chosen experts' weights, by architecture
_NORM_EXPERT_WEIGHTS = {"qwen3moe": True, "qwen2moe": False, "mixtral": True}
#: llama.cpp's converter stores Gemma's norm weights ``w`` of ``(1 + w)`` as ``1 + w``
NORM_SHIFT = {"gemma2": 1.0, "gemma3": 1.0}

_TOP_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def open_gguf(path: Path) -> Any:
    import gguf  # heavy import, only when a GGUF is actually read

    if not path.is_file():
        raise ModelLoadError(f"{path} does not exist; give the path of a .gguf file")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError, struct.error, IndexError …
        raise ModelLoadError(
            f"{path.name} is not a readable GGUF file ({type(exc).__name__}: {exc}); "
            "check that the download is complete"
        ) from exc


def gguf_metadata(reader: Any) -> dict[str, Any]:
    out = {}
    for key, field in reader.fields.items():
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                   "tokenizer.ggml.scores"):  # fmt: skip
            continue
        out[key] = field.contents()
    return out


def gguf_array(reader: Any, key: str) -> list[Any]:
    field = reader.fields.get(key)
    return [] if field is None else list(field.contents())


def _array_length(reader: Any, key: str) -> int:
    """Elements of an array field, without decoding them (a vocabulary has 100k+ strings)."""
    field = reader.fields.get(key)
    return 0 if field is None else len(field.data)


def supported_architecture(meta: dict[str, Any], src: Path) -> str:
    arch = str(meta.get("general.architecture", ""))
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedModelError(
            f"{src.name} holds a {arch or 'unknown'!r} model; GGUF import supports the "
            f"architectures {', '.join(SUPPORTED_ARCHS)}"
        )
    return arch


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    """What a GGUF file's header says; its tensor data is never read."""

    path: Path
    architecture: str
    name: str
    parameters: int  # elements of every tensor in this file
    split_count: int  # 1, or how many files a split GGUF spans
    config: dict[str, Any]  # the HF-style config.json an fp16 import writes

    def model_config(self) -> ModelConfig:
        return ModelConfig.from_dict(self.config)


def read_gguf_header(path: Path) -> GGUFHeader:
    """The header of the GGUF ``path``; raises :class:`UnsupportedModelError` for an
    architecture the import does not support, :class:`ModelLoadError` for an unreadable file."""
    reader = open_gguf(path)
    meta = gguf_metadata(reader)
    arch = supported_architecture(meta, path)
    return GGUFHeader(
        path=path,
        architecture=arch,
        name=str(meta.get("general.name", path.stem)),
        parameters=sum(int(t.n_elements) for t in reader.tensors),
        split_count=int(meta.get("split.count", 1) or 1),
        config=hf_config(meta, arch, reader, "fp16"),
    )


def count_gguf_parameters(path: Path) -> int:
    """Elements of every tensor in a GGUF file (any architecture; say, a split file's
    second part, whose header holds no model metadata)."""
    return sum(int(t.n_elements) for t in open_gguf(path).tensors)


def gguf_model_config(path: Path) -> ModelConfig:
    """The :class:`ModelConfig` of the model a GGUF file holds, from its header alone."""
    return read_gguf_header(path).model_config()


def hf_config(meta: dict[str, Any], arch: str, reader: Any, dtype: str) -> dict[str, Any]:
    def key(name: str, default: Any = None) -> Any:
        prefix = "llama" if arch == "mixtral" else arch
        value = meta.get(f"{prefix}.{name}", default)
        if value is None:
            raise UnsupportedModelError(f"the GGUF lacks the metadata key {prefix}.{name}")
        return value

    arch = model_arch(meta, arch)
    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    names = {t.name for t in reader.tensors}
    vocab = _array_length(reader, "tokenizer.ggml.tokens") or int(key("vocab_size"))
    config: dict[str, Any] = {
        "architectures": [_HF_CLASSES[arch]],
        "model_type": MODEL_TYPES.get(arch, arch),
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": int(key("rope.dimension_count", hidden // heads)),
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}[dtype],
    }
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in names
        config["mlp_bias"] = False
    if arch == "phi3":
        config.update(_phi3_config(meta, reader, names, config))
    if arch == "gemma3":
        config.update(_gemma3_config(meta, config))
    if arch == "gemma2":
        config.update(_gemma2_config(meta, config))
    if arch in _NORM_EXPERT_WEIGHTS:  # a mixture of experts
        config.update({
            "num_experts" if arch != "mixtral" else "num_local_experts": int(key("expert_count")),
            "num_experts_per_tok": int(key("expert_used_count")),
            "norm_topk_prob": bool(key("expert_weights_norm", _NORM_EXPERT_WEIGHTS[arch])),
        })  # fmt: skip
        if arch != "mixtral":
            config["moe_intermediate_size"] = int(key("expert_feed_forward_length"))
        if arch == "qwen2moe":
            config["shared_expert_intermediate_size"] = int(
                key("expert_shared_feed_forward_length")
            )
        if arch == "qwen3moe":
            config["head_dim"] = int(key("attention.key_length", config["head_dim"]))
    if "rope_freqs.weight" in names:  # Llama 3's RoPE scaling, as llama.cpp keeps it
        divisors = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        scaling = llama3_scaling(
            np.asarray(divisors.data, dtype=np.float64), config["rope_theta"], config["head_dim"]
        )
        if scaling is not None:
            config["rope_scaling"] = scaling
    for gguf_key, hf_key in (
        ("bos_token_id", "bos_token_id"),
        ("padding_token_id", "pad_token_id"),
    ):
        if f"tokenizer.ggml.{gguf_key}" in meta:
            config[hf_key] = int(meta[f"tokenizer.ggml.{gguf_key}"])
    return config


def _phi3_config(
    meta: dict[str, Any], reader: Any, names: set[str], config: dict[str, Any]
) -> dict[str, Any]:
    """Phi-3's window and LongRoPE as llama.cpp keeps them: the short and long factors as the
    ``rope_factors_short`` / ``rope_factors_long`` tensors, the pretraining context and the
    attention factor as metadata; a model that rotates only part of each head (Phi-4-mini),
    by llama.cpp's rotary dimension count under the head's width."""
    context = config["max_position_embeddings"]
    head = int(meta.get("phi3.attention.key_length") or 0) or (
        config["hidden_size"] // config["num_attention_heads"]
    )
    out: dict[str, Any] = {}
    if config["head_dim"] != head:  # llama.cpp's rotary dimension count: a part of the head
        out["partial_rotary_factor"] = config["head_dim"] / head
        out["head_dim"] = head
    window = meta.get("phi3.attention.sliding_window")
    if window:
        out["sliding_window"] = int(window)
    original = meta.get("phi3.rope.scaling.original_context_length")
    out["original_max_position_embeddings"] = int(original or context)
    if {"rope_factors_long.weight", "rope_factors_short.weight"} <= names:
        factors = {
            t.name: np.asarray(t.data, dtype=np.float64).tolist()
            for t in reader.tensors
            if t.name in ("rope_factors_long.weight", "rope_factors_short.weight")
        }
        scaling: dict[str, Any] = {
            "rope_type": "longrope",
            "long_factor": factors["rope_factors_long.weight"],
            "short_factor": factors["rope_factors_short.weight"],
        }
        # kept in float32: where it is the factor the context's ratio gives, that ratio is
        # left to give it in full precision, as the original config did
        attention = meta.get("phi3.rope.scaling.attn_factor")
        original = out["original_max_position_embeddings"]
        ratio = context / original
        implied = math.sqrt(1 + math.log(ratio) / math.log(original)) if ratio > 1 else 1.0
        if attention is not None and np.float32(attention) != np.float32(implied):
            scaling["attention_factor"] = float(attention)
        out["rope_scaling"] = scaling
    return out


#: llama.cpp's Gemma 3: every sixth layer global, the local ones on RoPE base 10000
GEMMA3_PATTERN = 6
GEMMA3_LOCAL_BASE = 10000.0


def _gemma_layers(
    meta: dict[str, Any], config: dict[str, Any], arch: str, pattern: int, big: int
) -> dict[str, Any]:
    """What every Gemma GGUF says or llama.cpp fixes alike: the head's width
    (``key_length``), GeGLU's tanh GELU, the local layers' window, every ``pattern``-th layer
    global, and the attention's scale as llama.cpp derives it: over the hidden size per
    head for the ``big``-layer 27B, over the head's width otherwise."""
    head = int(meta.get(f"{arch}.attention.key_length") or config["head_dim"])
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    return {
        "head_dim": head,
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": int(meta.get(f"{arch}.attention.sliding_window") or 4096),
        "layer_types": [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
        ],
        "query_pre_attn_scalar": config["hidden_size"] // heads if layers == big else head,
    }


def _gemma3_config(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's numbers as llama.cpp reads them (:func:`_gemma_layers`, every
    :data:`GEMMA3_PATTERN`-th layer global, the 27B of 62 layers), the local ones turning by
    :data:`GEMMA3_LOCAL_BASE` (``rope.freq_base_swa`` where the file says), and the global
    ones' linear RoPE scaling."""
    out = _gemma_layers(meta, config, "gemma3", GEMMA3_PATTERN, big=62)
    out["rope_local_base_freq"] = float(meta.get("gemma3.rope.freq_base_swa") or GEMMA3_LOCAL_BASE)
    if str(meta.get("gemma3.rope.scaling.type", "")) == "linear":
        out["rope_scaling"] = {"rope_type": "linear",
                               "factor": float(meta["gemma3.rope.scaling.factor"])}  # fmt: skip
    softcap = meta.get("gemma3.final_logit_softcapping")
    if softcap:
        out["final_logit_softcapping"] = float(softcap)
    return out


#: llama.cpp's Gemma 2: every other layer local (the even ones), scores soft-capped at 50 and
#: logits at 30 where the file does not say
GEMMA2_PATTERN = 2
GEMMA2_SOFTCAPS = (50.0, 30.0)


def _gemma2_config(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2's numbers as llama.cpp reads them (:func:`_gemma_layers`, every
    :data:`GEMMA2_PATTERN`-nd layer global, the 27B of 46 layers), and the attention scores'
    and the logits' soft caps."""
    attention, final = GEMMA2_SOFTCAPS
    return _gemma_layers(meta, config, "gemma2", GEMMA2_PATTERN, big=46) | {
        "attn_logit_softcapping": float(meta.get("gemma2.attn_logit_softcapping") or attention),
        "final_logit_softcapping": float(meta.get("gemma2.final_logit_softcapping") or final),
    }


def unpermute_rotary(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's convert-time permutation of Q/K rows.

    HF Llama rotates the two *halves* of each head (``rotate_half``); llama.cpp rotates
    *adjacent pairs*, so its converter interleaves each head's rows. This is the inverse.
    """
    rows = weight.shape[0]
    half = rows // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def dequantize_tensor(tensor: Any) -> np.ndarray:
    from gguf.quants import dequantize

    data = dequantize(tensor.data, tensor.tensor_type)
    return np.asarray(data, dtype=np.float32)


#: how far the divisors a recovered scaling gives may be from the file's (float32, relative)
_DIVISOR_TOLERANCE = 1e-4


def llama3_scaling(divisors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any] | None:
    """The ``rope_scaling`` of ``config.json`` that gives llama.cpp's per-pair frequency
    divisors (``rope_freqs.weight``: a pair's frequency is its plain one over its divisor),
    None where they scale nothing. Llama 3's scaling divides the low frequencies by ``factor``,
    keeps the high ones and blends between, linearly in 1/wavelength (``low_freq_factor`` 1,
    as every Llama 3 config has it): Llama 3's own (4, 8192) where they give the same divisors,
    else two blended pairs give the span and the original length, one blended pair the length
    for a span, none any length between the kept and the divided pairs; the first that gives
    the file's divisors (by the engine's own formula) is taken. Raises
    :class:`UnsupportedModelError` for divisors no such scaling gives, rather than import a
    model that would rotate its queries and keys otherwise than it was trained."""
    import math

    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
    plain = 1.0 / (theta ** exponents.astype(np.float64))
    if divisors.shape != plain.shape:
        raise UnsupportedModelError(
            f"the GGUF's rope_freqs has {divisors.size} values for {plain.size} rotary pairs"
        )
    factor = float(divisors.max())
    if abs(factor - 1.0) < _DIVISOR_TOLERANCE and abs(float(divisors.min()) - 1.0) < 1e-6:
        return None
    wavelength = 2 * math.pi / plain
    ones = np.abs(divisors - 1) <= _DIVISOR_TOLERANCE
    full = np.abs(divisors - factor) <= _DIVISOR_TOLERANCE * factor
    blended = ~(ones | full)
    # the blend of a pair is (original / wavelength - lf) / (hf - lf), lf = 1 in every Llama 3
    blend = (1 / divisors - 1 / factor) / (1 - 1 / factor)
    candidates: list[tuple[float, float]] = [(4.0, 8192.0)]  # (hf, original): Llama 3's own
    if blended.sum() >= 2:  # a line through the blended pairs gives both
        slope, intercept = np.polyfit(1 / wavelength[blended], blend[blended], 1)
        if intercept < 0:
            high = 1 - 1 / intercept
            candidates.append((round(high, 4), slope * (high - 1)))
    for high in (4.0, 2.0, 8.0, 3.0, 1.5, 16.0):  # the blend's span: Llama 3's, then others
        if blended.sum() == 1:  # one blended pair: the original length for this span
            w, b = wavelength[blended][0], blend[blended][0]
            candidates.append((high, w * (1 + b * (high - 1))))
        elif not blended.any():  # any length whose span falls between the kept and the divided
            kept = wavelength[ones].max() if ones.any() else 0.0
            divided = wavelength[full].min() if full.any() else math.inf
            fits = [2.0**k for k in range(4, 24) if high * kept < 2.0**k < divided]
            candidates += [(high, fits[-1])] if fits else []
    for high, original in candidates:
        scaling = {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": high,
            "original_max_position_embeddings": round(original),
        }
        if np.allclose(_llama3_divisors(theta, head_dim, scaling), divisors,
                       rtol=_DIVISOR_TOLERANCE):  # fmt: skip
            return scaling
    raise UnsupportedModelError(
        "the GGUF's rope_freqs are not Llama 3's RoPE scaling, the only per-pair scaling the "
        "import knows (a model imported without it would rotate its queries and keys otherwise "
        "than it was trained); load the model's Hugging Face folder instead"
    )


def _llama3_divisors(theta: float, head_dim: int, scaling: dict[str, Any]) -> np.ndarray:
    """Each pair's divisor under ``scaling``, by the engine's own formula."""
    from engine.model.transformer import rope_inverse_frequencies

    raw = {"model_type": "llama", "vocab_size": 1, "hidden_size": head_dim,
           "intermediate_size": 1, "num_hidden_layers": 1, "num_attention_heads": 1,
           "head_dim": head_dim, "rope_theta": theta}  # fmt: skip
    plain = rope_inverse_frequencies(ModelConfig.from_dict(raw))
    scaled = rope_inverse_frequencies(ModelConfig.from_dict({**raw, "rope_scaling": scaling}))
    return (plain / scaled).double().numpy()


def model_arch(meta: dict[str, Any], arch: str) -> str:
    """The architecture a GGUF of llama.cpp's ``arch`` holds: ``mixtral`` for a ``llama``
    with experts (its keys stay llama's), else ``arch``."""
    return "mixtral" if arch == "llama" and meta.get("llama.expert_count") else arch


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The HF name of a GGUF tensor of ``arch`` (None: not a checkpoint tensor, such as
    llama.cpp's RoPE tables, which the config carries instead; ``{e}`` in it: one tensor per
    expert of a 3-D tensor of experts, :func:`model_arch`'s ``mixtral`` for Mixtral's)."""
    if gguf_name in _TOP_TENSORS:
        return _TOP_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) != 3 or parts[0] != "blk":
        return None
    names = {**_LAYER_TENSORS, **_ARCH_TENSORS.get(arch, {})}
    return f"model.layers.{parts[1]}.{names[parts[2]]}" if parts[2] in names else None


#: llama.cpp's recommended-sampling keys → ``generation_config.json`` keys
_GGUF_SAMPLING = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def gguf_sampling(meta: dict[str, Any]) -> dict[str, Any]:
    """The sampling a GGUF's author recommends (``general.sampling.*``), as
    ``generation_config.json`` keys; ``{}`` when the file says nothing."""
    out: dict[str, Any] = {}
    for key, name in _GGUF_SAMPLING.items():
        value = meta.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            # GGUF stores float32: 0.9 reads back as 0.8999999761…
            out[name] = int(value) if name == "top_k" else float(f"{value:.6g}")
    if out:
        out["do_sample"] = out.get("temperature", 1.0) > 0
    return out
