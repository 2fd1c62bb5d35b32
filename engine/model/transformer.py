"""The Llama-family transformer (Llama, Mistral, Qwen2, Qwen3) as one plain ``nn.Module``.

Tokens travel flattened: ``input_ids: [T]`` holds the new tokens of every sequence in this
step, ``positions: [T]`` their absolute positions. Attention goes through an
:class:`~engine.model.attention.AttentionContext`, which owns the KV cache.

Two load-time fusions keep decode cheap on a CPU: q/k/v are one matmul (``qkv_proj``) and
gate/up are one matmul (``gate_up_proj``). :mod:`engine.loader.weights` builds them from HF tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.formats import kv as kv_format
from engine.model import lanes
from engine.model.attention import AttentionContext
from engine.model.config import ModelConfig, RopeScaling
from engine.model.mlp import MLP
from engine.model.moe import MoE


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of ``x`` over its last dimension, scaled by ``weight``, as HF computes it."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    # Half precision: normalise in fp32, scale in the activation dtype (as HF does).
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(rms_norm(x + residual), x + residual)``: a residual add and the norm after it."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def rope_store(
    qkv: Tensor, cos: Tensor, sin: Tensor, pool: Tensor, write_slots: Tensor, *,
    num_heads: int, num_kv_heads: int, head_dim: int,
) -> Tensor:  # fmt: skip
    """RoPE on the q and k heads of a fused ``qkv: [T, (H + 2·Hkv)·D]`` and the K/V write into
    ``pool: [slots, 2·Hkv, D]`` at ``write_slots`` (quantized as it goes in where the pool is,
    :mod:`engine.formats.kv`), in torch (the reference of the fused
    kernels, :class:`LayerOps`): the rotated q heads as a ``[T, H, D]`` view of ``qkv``."""
    tokens = qkv.shape[0]
    qk = qkv[:, : (num_heads + num_kv_heads) * head_dim].view(
        tokens, num_heads + num_kv_heads, head_dim
    )
    rotate_(qk, cos, sin)
    kv_format.store(pool, write_slots, qkv[:, num_heads * head_dim :].view(tokens, -1, head_dim))
    return qk[:, :num_heads]


@dataclass(frozen=True, slots=True)
class LayerOps:
    """The operations a decoder layer may hand to fused kernels: the torch code below by
    default (the reference), ours where a load chooses them
    (:mod:`engine.kernels.layer_ops`). ``rope_store`` (None: RoPE in torch, then the context
    stores K/V) rotates q and k of the fused qkv and writes K/V into the pool in one pass,
    where the attention context offers its pool (:meth:`AttentionContext.kv_target`)."""

    rms_norm: Callable[[Tensor, Tensor, float], Tensor] = rms_norm
    add_rms_norm: Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]] = add_rms_norm
    rope_store: Callable[..., Tensor] | None = None
    #: one line for the load report
    name: str = "torch"


TORCH_OPS = LayerOps()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_inverse_frequencies(cfg: ModelConfig, *, long: bool = False) -> Tensor:
    """Inverse frequency of each rotary pair, fp32, with the config's scaling (HF's formulas;
    LongRoPE's ``long`` factors where ``long``, its short ones otherwise)."""
    dim = cfg.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    rs = cfg.rope_scaling
    if rs.kind == "longrope":  # as many factors as pairs (ModelConfig checks)
        factors = rs.long_factor if long else rs.short_factor
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * cfg.rope_theta**exponents)
    inv_freq = 1.0 / (cfg.rope_theta**exponents)
    if rs.kind == "linear":
        inv_freq = inv_freq / rs.factor
    elif rs.kind == "llama3":
        low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
        smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to the context length, built once.

    HF rotates ``x`` as ``x·cos + rotate_half(x)·sin`` with ``rotate_half(x) = [-x₂, x₁]``. Here
    the sign lives in the table (``sin`` holds ``[-sin, sin]``) and ``rotate_half`` becomes
    ``roll(x, D/2)`` = ``[x₂, x₁]``: the same products (IEEE negation is exact), in three fewer
    ops per call. The angles of a step are looked up once (:meth:`angles`) and shared by every
    layer.

    LongRoPE (Phi-3) has two tables, both scaled by the attention factor: the short factors'
    for a sequence within the pretraining context, the long factors' (rows from
    :attr:`long_offset` on) for a sequence longer than it, every position of it, as
    transformers rotates them. A sequence that grows past the context is recomputed whole on
    the long table (the scheduler preempts it: :class:`engine.core.scheduler.Scheduler`), as
    transformers drops its cache there; its blocks are keyed apart in the prefix cache.
    """

    cos: Tensor
    sin: Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        positions = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        rs = cfg.rope_scaling
        inverse = [rope_inverse_frequencies(cfg)]
        #: LongRoPE: a sequence longer than this many tokens is rotated by the long factors,
        #: every position of it (:attr:`long_offset`); None: one table serves every sequence
        self.long_after: int | None = None
        #: where the long factors' rows start in the tables (0: there are none)
        self.long_offset = 0
        if rs.kind == "longrope":
            inverse.append(rope_inverse_frequencies(cfg, long=True))
            self.long_after = rs.original_max_position_embeddings
            self.long_offset = cfg.max_position_embeddings
        freqs = torch.cat([positions[:, None] * f[None, :] for f in inverse])
        # a partly rotated head: its pass-through dimensions turn by angle 0 (cos 1, sin 0),
        # laid out as :func:`rotary_permutation` puts its q/k rows
        half = cfg.head_dim // 2
        freqs = torch.nn.functional.pad(freqs, (0, half - freqs.shape[-1]))
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        if rs.kind == "longrope" and rs.attention_factor != 1.0:
            turned = torch.zeros(half, dtype=torch.bool)
            turned[: cfg.rotary_dim // 2] = True
            scale = torch.where(torch.cat((turned, turned)), rs.attention_factor, 1.0)
            cos, sin = cos * scale, sin * scale
        sin[:, :half].neg_()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def offset(self, length: int) -> int:
        """What to add to the positions of a sequence of ``length`` tokens to look its angles
        up: the long factors' rows where LongRoPE extends past the pretraining context and the
        sequence does."""
        return self.long_offset if self.long_after is not None and length > self.long_after else 0

    def angles(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``(cos, signed sin)`` of ``positions: [T]`` as ``[T, 1, D]`` in ``dtype``."""
        return (
            self.cos[positions].unsqueeze(1).to(dtype),
            self.sin[positions].unsqueeze(1).to(dtype),
        )


def rotary_permutation(cfg: ModelConfig) -> Tensor | None:
    """The order of each q/k head's rows (``new[i] = old[perm[i]]``) where RoPE rotates only
    part of the head (None where it rotates all of it). transformers rotates the first
    ``rotary_dim`` dimensions in pairs ``(i, i + rotary_dim/2)`` and passes the rest through;
    the rotated halves go to the head's two halves here, so that every kernel rotates pairs
    ``(i, i + D/2)`` as for a whole head, the pass-through dimensions by angle 0. q and k are
    permuted alike, so their products, the attention, are unchanged; V is not."""
    dim, rot = cfg.head_dim, cfg.rotary_dim
    if rot == dim:
        return None
    rest = (dim - rot) // 2
    return torch.cat([
        torch.arange(0, rot // 2), torch.arange(rot, rot + rest),
        torch.arange(rot // 2, rot), torch.arange(rot + rest, dim),
    ])  # fmt: skip


def permute_rotary_rows(qkv: Tensor, cfg: ModelConfig, perm: Tensor) -> Tensor:
    """``qkv`` (a fused projection's weight ``[(H + 2·Hkv)·D, ·]`` or bias) with each q and k
    head's rows in :func:`rotary_permutation`'s order."""
    heads = cfg.num_heads + cfg.num_kv_heads
    qk = qkv[: heads * cfg.head_dim].reshape(heads, cfg.head_dim, *qkv.shape[1:])
    permuted = qk[:, perm.to(qkv.device)].reshape(heads * cfg.head_dim, *qkv.shape[1:])
    return torch.cat([permuted, qkv[heads * cfg.head_dim :]])


def rotate_(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x: [T, heads, D]`` in place by the angles from :meth:`RotaryEmbedding.angles`."""
    rotated = x.roll(x.shape[-1] // 2, -1) * sin
    if torch.compiler.is_compiling():  # a graph has no ``out=`` into a strided view
        return x.copy_(x * cos + rotated)
    return torch.add(x * cos, rotated, out=x)


class Attention(nn.Module):
    #: Qwen3's per-head RMSNorm weights of q and k (``[D]`` each), or None. Parameters of this
    #: module, not ``RMSNorm`` submodules: the quantization plan reads every ``….attn.*.weight``
    #: as a linear of the attention block.
    q_norm_weight: nn.Parameter | None
    k_norm_weight: nn.Parameter | None

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        #: the operations it may hand to fused kernels (:meth:`Transformer.set_ops`)
        self.ops = TORCH_OPS
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.norm_eps = cfg.rms_norm_eps
        self.q_norm_weight = nn.Parameter(torch.ones(cfg.head_dim)) if cfg.qk_norm else None
        self.k_norm_weight = nn.Parameter(torch.ones(cfg.head_dim)) if cfg.qk_norm else None
        #: under tensor parallelism, the sum across the ranks of ``o_proj``'s partial outputs
        #: (:meth:`Transformer.set_parallel`); None on one device
        self.reduce: Callable[[Tensor], Tensor] | None = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: AttentionContext) -> Tensor:
        out = self.o_proj(self.attend_qkv(self.qkv_proj(x), cos, sin, ctx))
        return out if self.reduce is None else self.reduce(out)

    def attend_qkv(self, qkv: Tensor, cos: Tensor, sin: Tensor, ctx: AttentionContext) -> Tensor:
        """Everything between the two products: RoPE on the q and k heads of ``qkv [T, (H +
        2·Hkv)·D]``, the K/V write, the attention; its output, ``[T, H·D]``, is ``o_proj``'s
        input."""
        tokens = qkv.shape[0]
        ops = self.ops
        target = None if ops.rope_store is None else ctx.kv_target(self.layer)
        # q and k rotate together and in place (one RoPE over H + Hkv heads); then k and v
        # lie next to each other in ``qkv`` and reach the cache as one [T, 2·Hkv, D] tensor.
        qk = qkv[:, : self.q_size + self.kv_size].view(
            tokens, self.num_heads + self.num_kv_heads, self.head_dim
        )
        if self.q_norm_weight is not None and self.k_norm_weight is not None:
            self.norm_heads_(qk, self.q_norm_weight, self.k_norm_weight)
        if target is not None:  # RoPE and the K/V write in one pass, then attention alone
            assert ops.rope_store is not None
            q = ops.rope_store(
                qkv, cos, sin, *target, num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            )  # fmt: skip
            return ctx.attend_stored(self.layer, q)
        rotate_(qk, cos, sin)
        q = qk[:, : self.num_heads]
        kv = qkv[:, self.q_size :].view(tokens, 2 * self.num_kv_heads, self.head_dim)
        return ctx.attend(self.layer, q, kv)

    def norm_heads_(self, qk: Tensor, q_weight: Tensor, k_weight: Tensor) -> None:
        """RMSNorm each head of ``qk: [T, H + Hkv, D]`` in place: q heads by ``q_weight``,
        k heads by ``k_weight`` (Qwen3; before RoPE)."""
        heads = self.num_heads
        qk[:, :heads] = rms_norm(qk[:, :heads], q_weight, self.norm_eps)
        qk[:, heads:] = rms_norm(qk[:, heads:], k_weight, self.norm_eps)


class VocabParallelEmbedding(nn.Module):
    """The embedding rows ``[start, stop)`` of a vocabulary split across tensor-parallel
    ranks: a token outside them looks up zeros, and the all-reduce (:attr:`reduce`, set by
    :meth:`Transformer.set_parallel`) adds the one rank's row to the others' zeros, exactly
    the whole table's row. The rows are a float table of its own (``weight``), or another
    module's lookup of them (``lookup``: a tied quantized head's rows of this rank,
    :class:`engine.quant.embedding.QuantizedEmbedding`)."""

    weight: nn.Parameter

    def __init__(self, start: int, stop: int, hidden: int, lookup: nn.Module | None = None):
        super().__init__()
        self.start, self.stop = start, stop
        self.lookup = lookup
        if lookup is None:
            self.weight = nn.Parameter(torch.empty(stop - start, hidden))
        self.reduce: Callable[[Tensor], Tensor] | None = None

    def forward(self, ids: Tensor) -> Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.stop - self.start)
        clamped = local.clamp(0, self.stop - self.start - 1)
        rows = F.embedding(clamped, self.weight) if self.lookup is None else self.lookup(clamped)
        rows = rows * inside.unsqueeze(-1).to(rows.dtype)
        return rows if self.reduce is None else self.reduce(rows)


#: a decoder layer's fused forward (:attr:`DecoderLayer.fused`): the layer, its input, the
#: rotary tables and the attention context; the output, or None where it does not apply
FusedLayer = Callable[["DecoderLayer", Tensor, Tensor, Tensor, AttentionContext], "Tensor | None"]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer)
        #: the operations it may hand to fused kernels (:meth:`Transformer.set_ops`)
        self.ops = TORCH_OPS
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: MLP | MoE = MoE(cfg) if cfg.is_moe(layer) else MLP(cfg)
        #: Gemma's norms of the attention's and the MLP's outputs, before each residual add
        #: (its ``post_attention_layernorm`` and ``post_feedforward_layernorm``; its
        #: ``pre_feedforward_layernorm`` is :attr:`post_attn_norm`, as Llama's norm before the
        #: MLP); None in Llama's layer
        self.attn_out_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if cfg.gemma else None
        self.mlp_out_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if cfg.gemma else None
        #: the whole layer in fewer, fused calls where its quantization has them (W8A8 on a
        #: CPU: :func:`engine.quant.w8a8.fused_layer`); it returns None for a step it does not
        #: take (few rows, say), which then runs the code below
        self.fused: FusedLayer | None = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: AttentionContext) -> Tensor:
        if self.fused is not None:
            out = self.fused(self, x, cos, sin, ctx)
            if out is not None:
                return out
        h, x = self.attend(x, cos, sin, ctx)
        return self.add_mlp(x, self.mlp(h))

    def attend(
        self, x: Tensor, cos: Tensor, sin: Tensor, ctx: AttentionContext
    ) -> tuple[Tensor, Tensor]:
        """The layer up to its MLP: the MLP's input, and the residual stream after the
        attention."""
        ops, eps = self.ops, self.input_norm.eps
        attended = self.attn(ops.rms_norm(x, self.input_norm.weight, eps), cos, sin, ctx)
        if self.attn_out_norm is not None:
            attended = ops.rms_norm(attended, self.attn_out_norm.weight, eps)
        # the residual add and the norm after it, one pass where ours run
        return self.ops.add_rms_norm(
            attended, x, self.post_attn_norm.weight, self.post_attn_norm.eps
        )

    def add_mlp(self, x: Tensor, out: Tensor) -> Tensor:
        """The residual stream ``x`` plus the MLP's output ``out`` (normed first in Gemma)."""
        if self.mlp_out_norm is not None:
            out = self.ops.rms_norm(out, self.mlp_out_norm.weight, self.input_norm.eps)
        return x + out


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # Built under torch.device("meta") by the loader: the embedding gets an empty weight
        # (its random init on meta imports TorchInductor's tracer, seconds per process) and
        # the rotary tables are real, computed on the CPU.
        self.embed = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        with torch.device("cpu"):
            self.rope = RotaryEmbedding(cfg)
            #: the local layers' own tables (Gemma's, another base, no scaling); None: every
            #: layer turns by :attr:`rope`
            self.rope_local = (
                RotaryEmbedding(replace(cfg, rope_theta=cfg.local_rope_theta,
                                        rope_scaling=RopeScaling()))
                if cfg.local_layers and cfg.local_rope_theta is not None else None
            )  # fmt: skip
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        #: how its steps run: the executors a load settled for these weights, shared by the
        #: engines on them (:func:`engine.executor.step.of`); None until then
        self.executor: object | None = None
        #: the layers' fused operations (:meth:`set_ops`)
        self.ops = TORCH_OPS
        #: decode steps run in two lanes (experts in host memory: :mod:`engine.model.lanes`)
        self.laned_steps = 0
        #: under tensor parallelism on the driving rank, what tells the other ranks about each
        #: forward before it runs (its inputs and attention context:
        #: :class:`engine.parallel.executor.Driver`); None on one device and on the others
        self.announce: Callable[[Tensor, Tensor, AttentionContext, Tensor | None], None] | None = (
            None
        )
        #: the all-reduce the layers' row-parallel products end in (:meth:`set_parallel`)
        self.all_reduce: Callable[[Tensor], Tensor] | None = None
        #: under vocabulary parallelism, what joins the ranks' logits columns into the whole
        #: vocabulary's (:meth:`set_parallel`)
        self.gather: Callable[[Tensor], Tensor] | None = None

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        ctx: AttentionContext,
        logits_indices: Tensor | None = None,
    ) -> Tensor:
        """Logits ``[N, vocab]`` (fp32) for the rows in ``logits_indices`` (default: every token).

        Generation asks only for each sequence's last token: the LM head is the largest
        single matmul of a small model, and the other rows would be thrown away. This is the
        eager step, one operator at a time; the other executors of a step (compiled, the C
        step, CUDA graphs) are :mod:`engine.executor`'s.
        """
        if self.announce is not None:  # the other ranks run this forward beside us
            self.announce(input_ids, positions, ctx, logits_indices)
        with torch.inference_mode():
            return self.body(self.embed_ids(input_ids), positions, ctx, logits_indices)

    def embed_ids(self, input_ids: Tensor) -> Tensor:
        """The rows of ``input_ids``, scaled where the model scales them (Gemma: by
        sqrt(hidden) rounded to the rows' dtype, as transformers does)."""
        x = self.embed(input_ids)
        scale = self.cfg.embed_scale
        return x if scale is None else x * torch.tensor(scale, dtype=x.dtype)

    def angles(self, positions: Tensor, dtype: torch.dtype) -> list[tuple[Tensor, Tensor]]:
        """Each layer's ``(cos, signed sin)`` of ``positions`` (:meth:`RotaryEmbedding.angles`),
        looked up once per table: a local layer's from :attr:`rope_local` where it has one."""
        both = self.rope.angles(positions, dtype)
        if self.rope_local is None:
            return [both] * len(self.layers)
        local = self.rope_local.angles(positions, dtype)
        return [local if i in self.cfg.local_layers else both for i in range(len(self.layers))]

    def set_parallel(
        self,
        all_reduce: Callable[[Tensor], Tensor] | None,
        gather: Callable[[Tensor], Tensor] | None = None,
    ) -> None:
        """This rank's part of a tensor-parallel model (its weights sharded by
        :mod:`engine.parallel.shard`): ``all_reduce`` sums ``o_proj``'s and ``down_proj``'s
        partial outputs across the ranks, twice a layer (and a vocabulary-parallel
        embedding's rows); ``gather`` joins a vocabulary-parallel head's logits; None: one
        device."""
        self.all_reduce = all_reduce
        self.gather = gather
        if isinstance(self.embed, VocabParallelEmbedding):
            self.embed.reduce = all_reduce
        for layer in self.layers:
            decoder = cast(DecoderLayer, layer)
            decoder.attn.reduce = decoder.mlp.reduce = all_reduce

    def set_ops(self, ops: LayerOps) -> None:
        """Every layer's fused operations (:class:`LayerOps`): the torch code, or ours."""
        self.ops = ops
        for layer in self.layers:
            decoder = cast(DecoderLayer, layer)
            decoder.ops = decoder.attn.ops = ops

    def body(
        self,
        x: Tensor,
        positions: Tensor,
        ctx: AttentionContext,
        logits_indices: Tensor | None = None,
    ) -> Tensor:
        """Everything after the embedding, one operator at a time (what the decode graph
        compiles); a decode step of a model whose experts live in host memory in two lanes
        (:mod:`engine.model.lanes`)."""
        if lanes.applies(self):
            laned = lanes.body(self, x, positions, ctx)
            if laned is not None:
                return self.head(laned, logits_indices)
        for layer, (cos, sin) in zip(self.layers, self.angles(positions, x.dtype), strict=True):
            x = layer(x, cos, sin, ctx)
        return self.head(x, logits_indices)

    def head(self, x: Tensor, logits_indices: Tensor | None = None) -> Tensor:
        """fp32 logits of the rows ``logits_indices`` (default: all) of the hidden states
        ``x`` after the last layer: the final norm and the LM head."""
        if logits_indices is not None:
            if logits_indices.numel() == 0:
                # A step of mid-prompt chunks only samples nothing. No GEMM is launched on 0
                # rows: CUDA's INT4 kernel (tinygemm) fails on the empty grid and the INT8
                # kernel's error surfaces at a later launch (a shape check, no sync).
                return x.new_empty((0, self.cfg.vocab_size), dtype=torch.float32)
            x = x[logits_indices]
        logits = self.lm_head(self.norm(x)).float()
        logits = logits if self.gather is None else self.gather(logits)
        cap = self.cfg.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
