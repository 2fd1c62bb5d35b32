"""Weight bytes, predicted from the config alone.

:func:`estimate_weight_bytes` predicts the bytes a spec's weights will take once loaded, block
by block (:func:`block_bytes`) and linear by linear (:func:`linear_bytes`), without reading a
single tensor: what a planner needs to fit a budget before loading. A quantized weight's bytes
are its format's (:mod:`engine.formats`), in the packing of the kernels the load would run it
on (:class:`Backends`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.formats import int4, int8, w8a8
from engine.kernels import amx, lowbit
from engine.kernels.packed_linear import packs
from engine.model.config import ModelConfig
from engine.quant.spec import LAYER_PARTS, PrecisionSpec, QuantKind


@dataclass(frozen=True, slots=True)
class Backends:
    """The kernels a load runs its quantized linears on, as far as they change the bytes a
    weight holds.

    * ``triton``: our Triton GEMMs (a GPU): INT4 in our layout (:data:`engine.formats.int4.OURS`);
    * ``cuda``: torch's CUDA kernels (a GPU without ours): INT4 in torch's CUDA tiles;
    * else a CPU, where ``c_kernels`` says whether our C kernels run the decode rows (INT8:
      an fp32 copy of the scales; INT4: our layout, N unpadded) or torch's kernels do (INT4
      in torch's CPU layout, N padded to 16). The load decides per layer shape by timing
      (:func:`engine.kernels.lowbit.chosen`); ``None`` counts the larger of the two, as a plan
      made before the timings must. ``amx``: W8A8 layers that fit AMX's tiles hold their
      matrix packed for them too (``None``: where our AMX GEMM runs on this CPU and our
      kernels may run, the larger again).
    """

    triton: bool = False
    cuda: bool = False
    c_kernels: bool | None = None
    amx: bool | None = None

    def c_scales(self) -> bool:
        """Whether INT8 weights hold our C kernels' fp32 scales (``None``: unless
        ``INFERSIGHT_LOWBIT=torch`` keeps them off)."""
        if self.triton or self.cuda:
            return False
        return self.c_kernels if self.c_kernels is not None else lowbit.requested() != "torch"

    def int4_packing(self) -> int4.Packing:
        """The INT4 layout (``None`` on a CPU: torch's, whose padded rows make it the larger,
        unless ``INFERSIGHT_LOWBIT=ours`` gives every layer ours)."""
        if self.triton or (not self.cuda and self.c_kernels):
            return int4.OURS
        if self.cuda:
            return int4.TORCH_CUDA
        ours = self.c_kernels is None and lowbit.requested() == "ours"
        return int4.OURS if ours else int4.torch_cpu(None)

    def amx_packs(self, out_features: int, in_features: int) -> bool:
        if self.triton or self.cuda or not amx.fits(out_features, in_features):
            return False
        if self.amx is not None:
            return self.amx
        if not torch.cpu._is_amx_tile_supported() or lowbit.requested() == "torch":
            return False
        return amx.library().available


#: a CPU load whose per-shape choices are not known yet: the larger bytes of each
CPU = Backends()


def linear_bytes(
    out_features: int, in_features: int, kind: QuantKind | None, dtype: torch.dtype,
    backends: Backends = CPU,
) -> int:  # fmt: skip
    """Bytes of one linear's weight (bias aside) as the loader stores it: ``None``, the float
    matrix in ``dtype``; else its format's (:func:`engine.formats.int8.bytes_held`,
    :func:`engine.formats.w8a8.bytes_held`, :meth:`engine.formats.int4.Packing.bytes_held`)
    on ``backends``, the scales of INT8 in ``dtype``.
    """
    n, k = out_features, in_features
    if kind is None:
        return n * k * _itemsize(dtype)
    c_scales = backends.c_scales()
    if kind.activations:
        return w8a8.bytes_held(n, k, dtype, c_scales=c_scales, amx=backends.amx_packs(n, k))
    if kind.bits == 8:
        return int8.bytes_held(n, k, dtype, c_scales=c_scales)
    assert kind.group is not None
    return backends.int4_packing().bytes_held(n, k, kind.group)


def linear_load_temporaries(
    out_features: int, in_features: int, kind: QuantKind, backends: Backends = CPU
) -> int:
    """What packing one quantized linear's weight holds beside it while it loads, in its
    format's packing on ``backends`` (:func:`engine.formats.int8.load_temporaries`,
    :meth:`engine.formats.int4.Packing.load_temporaries`)."""
    if kind.bits == 8:
        return int8.load_temporaries(out_features, in_features)
    assert kind.group is not None
    return backends.int4_packing().load_temporaries(out_features, in_features, kind.group)


def block_bytes(
    cfg: ModelConfig, part: str, kind: QuantKind | None, compute: torch.dtype,
    backends: Backends = CPU, layer: int | None = None,
) -> int:  # fmt: skip
    """Bytes of one layer's ``attn`` block (qkv_proj + o_proj, with the q/k/v biases of a
    Qwen2-style model) or ``mlp`` block (gate_up_proj + down_proj; in a mixture of experts,
    every expert's, the shared expert's, and the router and the shared expert's gate, which
    stay in the compute dtype) stored in ``kind`` (``None``: the ``compute`` dtype). A
    quantized linear keeps its bias in bf16. ``layer``: which layer (one of a mixture of
    experts' dense layers holds a plain MLP); None: a layer of experts where the model has
    them."""
    hidden = cfg.hidden_size
    if part == "attn":
        qkv = cfg.q_size + 2 * cfg.kv_size
        total = linear_bytes(qkv, hidden, kind, compute, backends) + linear_bytes(
            hidden, cfg.q_size, kind, compute, backends
        )
        if cfg.attention_bias:
            total += qkv * (_itemsize(compute) if kind is None else 2)
        return total
    if part == "mlp":

        def mlp(inner: int) -> int:
            return linear_bytes(2 * inner, hidden, kind, compute, backends) + linear_bytes(
                hidden, inner, kind, compute, backends
            )

        if not cfg.num_experts or (layer is not None and not cfg.is_moe(layer)):
            return mlp(cfg.intermediate_size)
        total = cfg.num_experts * mlp(cfg.expert_intermediate_size)
        total += cfg.num_experts * hidden * _itemsize(compute)  # the router
        if cfg.shared_expert_size:  # and its gate
            total += mlp(cfg.shared_expert_size) + hidden * _itemsize(compute)
        return total
    raise ValueError(f"part {part!r} is not a layer block; use one of {', '.join(LAYER_PARTS)}")


def estimate_weight_bytes(
    cfg: ModelConfig, spec: PrecisionSpec, *, packed: bool | None = None,
    backends: Backends = CPU,
) -> int:  # fmt: skip
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
    as a default CPU load does (unless ``backends`` says our GEMV takes the head: it reads the
    embedding itself); pass ``True`` for ``pack=True`` and ``False`` for ``pack=False`` or a
    GPU. ``backends``: the kernels the quantized linears run on (:class:`Backends`).
    """
    return sum(weight_bytes_by_kind(cfg, spec, packed=packed, backends=backends).values())


def weight_bytes_by_kind(
    cfg: ModelConfig, spec: PrecisionSpec, *, packed: bool | None = None,
    backends: Backends = CPU,
) -> dict[str, int]:  # fmt: skip
    """:func:`estimate_weight_bytes` by the kinds of the load report
    (:func:`engine.loader.weights.weight_report`): ``embedding``, ``attention`` (Qwen3's q/k norms
    included), ``mlp``, ``norm`` and ``lm_head``."""
    compute, size = spec.compute, _itemsize(spec.compute)
    hidden, vocab = cfg.hidden_size, cfg.vocab_size
    kinds = {"embedding": 0, "attention": 0, "mlp": 0, "norm": hidden * size, "lm_head": 0}
    for layer in range(cfg.num_layers):
        # input and post-attention norms (Gemma's: and those after attention and the MLP)
        kinds["norm"] += (4 if cfg.gemma else 2) * hidden * size
        kinds["attention"] += 2 * cfg.head_dim * size if cfg.qk_norm else 0  # Qwen3
        kinds["attention"] += block_bytes(
            cfg, "attn", spec.block_kind("attn", layer), compute, backends
        )
        kinds["mlp"] += block_bytes(
            cfg, "mlp", spec.block_kind("mlp", layer), compute, backends, layer
        )
    head = spec.parts.get("head")
    embedding = vocab * hidden * size
    if head is not None:  # a tied embedding reads its rows from the quantized head
        kinds["lm_head"] = linear_bytes(vocab, hidden, head, compute, backends)
        kinds["embedding"] = 0 if cfg.tie_word_embeddings else embedding
        return kinds
    if packed is None:  # our GEMV reads a tied head from the embedding itself
        gemv = backends.c_kernels is True and compute in (torch.float32, torch.bfloat16)
        packed = not gemv and packs(compute, vocab, hidden)
    kinds["embedding"] = embedding
    kinds["lm_head"] = embedding if packed or not cfg.tie_word_embeddings else 0
    return kinds


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
