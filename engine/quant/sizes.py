"""Weight bytes, predicted from the config alone.

:func:`estimate_weight_bytes` predicts the bytes a spec's weights will take once loaded, block
by block (:func:`block_bytes`) and linear by linear (:func:`linear_bytes`), without reading a
single tensor: what a planner needs to fit a budget before loading.
"""

from __future__ import annotations

import torch

from engine.kernels.packed_linear import packs
from engine.model.config import ModelConfig
from engine.quant.int4 import padded_width
from engine.quant.spec import LAYER_PARTS, PrecisionSpec, QuantKind


def linear_bytes(
    out_features: int, in_features: int, kind: QuantKind | None, dtype: torch.dtype
) -> int:
    """Bytes of one linear's weight (bias aside) as the loader stores it.

    ``None``: the float matrix in ``dtype``. INT8: the int8 matrix and one bf16 scale a row
    (:class:`~engine.quant.int8.Int8Linear`). INT4: two values a byte of the matrix padded to
    the kernel's shape (K to :func:`~engine.quant.int4.padded_width`, N to a multiple of 16),
    and a bf16 (scale, zero) pair per group and padded row
    (:class:`~engine.quant.int4.Int4Linear`); the CUDA and CPU packings are the same size.
    """
    if kind is None:
        return out_features * in_features * _itemsize(dtype)
    if kind.bits == 8:
        return out_features * in_features + out_features * 2
    assert kind.group is not None
    k = padded_width(in_features, kind.group)
    n = -(-out_features // 16) * 16
    return n * k // 2 + (k // kind.group) * n * 2 * 2


def block_bytes(cfg: ModelConfig, part: str, kind: QuantKind | None, compute: torch.dtype) -> int:
    """Bytes of one layer's ``attn`` block (qkv_proj + o_proj, with the q/k/v biases of a
    Qwen2-style model) or ``mlp`` block (gate_up_proj + down_proj) stored in ``kind``
    (``None``: the ``compute`` dtype). A quantized linear keeps its bias in bf16."""
    hidden = cfg.hidden_size
    if part == "attn":
        qkv = cfg.q_size + 2 * cfg.kv_size
        total = linear_bytes(qkv, hidden, kind, compute) + linear_bytes(
            hidden, cfg.q_size, kind, compute
        )
        if cfg.attention_bias:
            total += qkv * (_itemsize(compute) if kind is None else 2)
        return total
    if part == "mlp":
        inner = cfg.intermediate_size
        return linear_bytes(2 * inner, hidden, kind, compute) + linear_bytes(
            hidden, inner, kind, compute
        )
    raise ValueError(f"part {part!r} is not a layer block; use one of {', '.join(LAYER_PARTS)}")


def estimate_weight_bytes(
    cfg: ModelConfig, spec: PrecisionSpec, *, packed: bool | None = None
) -> int:
    """Bytes the weights of ``cfg`` will take loaded at ``spec``: exactly the
    ``weights_bytes`` of :func:`engine.load <engine.loader.load.load_model>`, without reading
    a single tensor (what a planner needs to fit a budget before loading).

    It counts what :func:`engine.model.inventory.weight_bytes` counts: the embedding, the norms,
    every block at its format (:func:`block_bytes`), and the LM head. A tied head is stored
    once, as the embedding or, quantized, as the head that the embedding reads its rows from
    (:class:`~engine.quant.embedding.QuantizedEmbedding`). One case depends on the machine: on
    a CPU whose oneDNN path runs the compute dtype and measured faster for the head's shape,
    the loader lays a tied float head out as a second, packed matrix beside the embedding.
    ``packed`` says whether it does: ``None`` asks :func:`engine.kernels.packed_linear.packs`,
    as a default CPU load does; pass ``True`` for ``pack=True`` and ``False`` for ``pack=False``
    or a GPU.
    """
    return sum(weight_bytes_by_kind(cfg, spec, packed=packed).values())


def weight_bytes_by_kind(
    cfg: ModelConfig, spec: PrecisionSpec, *, packed: bool | None = None
) -> dict[str, int]:
    """:func:`estimate_weight_bytes` by the kinds of the load report
    (:func:`engine.loader.weights.weight_report`): ``embedding``, ``attention`` (Qwen3's q/k norms
    included), ``mlp``, ``norm`` and ``lm_head``."""
    compute, size = spec.compute, _itemsize(spec.compute)
    hidden, vocab = cfg.hidden_size, cfg.vocab_size
    kinds = {"embedding": 0, "attention": 0, "mlp": 0, "norm": hidden * size, "lm_head": 0}
    for layer in range(cfg.num_layers):
        kinds["norm"] += 2 * hidden * size  # input and post-attention norms
        kinds["attention"] += 2 * cfg.head_dim * size if cfg.qk_norm else 0  # Qwen3
        kinds["attention"] += block_bytes(cfg, "attn", spec.block_kind("attn", layer), compute)
        kinds["mlp"] += block_bytes(cfg, "mlp", spec.block_kind("mlp", layer), compute)
    head = spec.parts.get("head")
    embedding = vocab * hidden * size
    if head is not None:  # a tied embedding reads its rows from the quantized head
        kinds["lm_head"] = linear_bytes(vocab, hidden, head, compute)
        kinds["embedding"] = 0 if cfg.tie_word_embeddings else embedding
        return kinds
    if packed is None:
        packed = packs(compute, vocab, hidden)
    kinds["embedding"] = embedding
    kinds["lm_head"] = embedding if packed or not cfg.tie_word_embeddings else 0
    return kinds


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
