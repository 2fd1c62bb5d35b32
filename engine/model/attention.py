"""Attention over the KV cache.

The model never touches the cache itself: each attention layer hands its freshly projected
q and its k/v (one tensor: k heads then v heads) to an :class:`AttentionContext`, which
stores k/v wherever its cache keeps them and returns the attention output. The contiguous
cache and the paged pool are two implementations of the same seam, so the model does not
change between them.

Shapes use the *flattened token* layout: the tokens of every sequence in a step are
concatenated, ``q: [T, H, D]``, ``kv: [T, 2·Hkv, D]`` (K heads, then V heads), output
``[T, H * D]``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.attention
import torch.nn.functional as F
from torch import Tensor

from engine.formats import kv as kv_format


@dataclass(frozen=True, slots=True)
class DecodeTables:
    """What a decode step's attention reads, for a step run outside the model's modules
    (:mod:`engine.executor.c_step`): each layer's pool ``[slots, 2·Hkv, D]``, where each
    sequence's new K/V go (``write_slots: [B]``), the slots each one's query reads
    (``slots: [B, W]``, the first ``lens[b]`` real) and their additive fp32 mask ``[B, W]``
    (None: every key is visible), all int64 and contiguous; ``owner``: the cache that holds
    the pools (one object per pool, for what is kept per pool)."""

    owner: object
    pools: list[Tensor]
    write_slots: Tensor
    slots: Tensor
    lens: Tensor
    mask: Tensor | None


class AttentionContext(ABC):
    """What one forward pass needs for attention: where new K/V go and what each query sees."""

    @abstractmethod
    def attend(self, layer: int, q: Tensor, kv: Tensor) -> Tensor:
        """Store ``kv`` of this step for ``layer`` and return attention output ``[T, H*D]``."""

    def kv_target(self, layer: int) -> tuple[Tensor, Tensor] | None:
        """Where this step's K/V of ``layer`` go, ``(pool, slots)``, for a fused kernel that
        rotates and stores them itself (then :meth:`attend_stored`); None: :meth:`attend`
        stores them."""
        return None

    def attend_stored(self, layer: int, q: Tensor) -> Tensor:
        """Attention output ``[T, H*D]`` with this step's K/V already in the pool."""
        raise NotImplementedError(f"{type(self).__name__} stores K/V itself (attend)")

    def decode_tables(self) -> DecodeTables | None:
        """The step's :class:`DecodeTables` where it decodes only, on a CPU pool that the
        paged C kernel reads; None otherwise."""
        return None

    def lanes(self) -> tuple[AttentionContext, AttentionContext, int] | None:
        """The step as two micro-batches (:mod:`engine.model.lanes`): a context for its first
        ``n`` rows, one for the rest, and ``n``; None where it does not split (a step that
        is not two or more decode rows)."""
        return None


class AttentionBackend(ABC):
    """What a step's attention runs on (the backends: :mod:`engine.attention`): it builds a
    step's :class:`AttentionContext` once from the scheduled chunks, for every layer; says
    whether a CUDA graph may capture its decode steps (``graph_safe``: every input at a fixed
    address and shape), which dtypes and head sizes it takes, and the workspace it needs per
    token of context a step reads. Its ``name`` is the compatibility table's
    (:mod:`engine.executor.table`)."""

    name: str
    graph_safe: bool

    @abstractmethod
    def context(self, cache: Any, chunks: list[Any]) -> AttentionContext:
        """The step's context over ``cache`` (a :class:`~engine.kv_cache.paged.PagedKVCache`)
        for its ``chunks`` (:class:`~engine.kv_cache.paged.SeqChunk`, decode first)."""

    @abstractmethod
    def refusal(self, cfg: Any, dtype: torch.dtype, device: torch.device) -> str:
        """Why this backend cannot attend for the model of ``cfg`` (its heads) in ``dtype`` on
        ``device``; "" where it can."""

    @abstractmethod
    def workspace_bytes_per_token(
        self, cfg: Any, dtype: torch.dtype, max_batch: int, chunk_tokens: int
    ) -> int:
        """Bytes of attention temporaries per token of context one step reads, in one layer
        (the layers run one after another): ``max_batch`` decode rows, or a prefill chunk
        of ``chunk_tokens`` queries, whichever needs more."""

    def runs_on(self, pool: Tensor) -> str:
        """The backend's name as its steps over ``pool`` run now (a backend that switches
        kernels per pool says which)."""
        return self.name

    def window_refusal(self, cfg: Any, window: Any) -> str:
        """Why this backend cannot run the model of ``cfg`` under the cache window ``window``
        (a :class:`~engine.kv_cache.window.CacheWindow`, or None); "" where it can."""
        return ""


#: set once torch's fused CPU attention has refused this process (:func:`sdpa`)
_FUSED_REFUSED = False


def sdpa(query: Tensor, key: Tensor, value: Tensor, **kwargs: object) -> Tensor:
    """``F.scaled_dot_product_attention``, or its math backend where torch's fused CPU kernel
    refuses to run: torch 2.13's flash attention on a CPU with AMX packs bf16 tiles with an
    AVX-512 routine, and raises (``pack_vnni2 is only supported when avx512 is supported``)
    when ``ATEN_CPU_CAPABILITY`` holds the process below AVX-512, as
    ``INFERSIGHT_CPU_CAPABILITY=AVX2`` does to prove the AVX2 paths on such a machine. Once
    refused, the process takes the math backend for every later call."""
    global _FUSED_REFUSED
    if not _FUSED_REFUSED:
        try:
            return F.scaled_dot_product_attention(query, key, value, **kwargs)  # type: ignore[arg-type]
        except RuntimeError as exc:
            if "only supported when avx512" not in str(exc):
                raise
            _FUSED_REFUSED = True
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        return F.scaled_dot_product_attention(query, key, value, **kwargs)  # type: ignore[arg-type]


def grouped_attention(
    q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, *, causal: bool = False
) -> Tensor:
    """GQA attention of one sequence's queries ``q: [L, H, D]`` over its keys/values
    ``[Hkv, T, D]``; ``mask: [L, T]`` (True = visible) or ``None`` for all visible; with
    ``causal`` (``T == L``, no mask), query ``i`` sees keys ``0 … i``. Returns ``[L, H*D]``.

    Query heads are grouped under their KV head (``[Hkv, G*L, D]``) so that grouped-query
    attention runs without materialising repeated K/V. A causal call hands SDPA the heads as
    they are (its own GQA) and ``is_causal``: its flash kernel then skips the tiles above the
    diagonal, where a mask would have it compute them all.
    """
    length, heads, dim = q.shape
    kv_heads = keys.shape[0]
    if causal:
        out = sdpa(
            q.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
            is_causal=True, enable_gqa=heads != kv_heads,
        )  # fmt: skip
        return out[0].transpose(0, 1).reshape(length, heads * dim)
    group = heads // kv_heads
    qg = q.view(length, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(kv_heads, -1, dim)
    out = sdpa(
        qg.unsqueeze(0),
        keys.unsqueeze(0),
        values.unsqueeze(0),
        attn_mask=None if mask is None else mask.repeat(group, 1),
    )
    return out.view(kv_heads, group, length, dim).permute(2, 0, 1, 3).reshape(length, heads * dim)


def sequence_attention(
    q: Tensor, keys: Tensor, values: Tensor, start: int, window: int | None = None
) -> Tensor:
    """Causal :func:`grouped_attention` for queries at positions ``start .. start+L-1`` over
    keys ``0 .. start+L-1``; with a sliding ``window``, query ``p`` sees keys ``> p - window``
    only (keys older than the first query's window are not read at all)."""
    length, total = q.shape[0], keys.shape[1]
    first = 0 if window is None else max(0, start - window + 1)
    keys, values = keys[:, first:], values[:, first:]
    mask = None
    if length > 1:
        q_pos = torch.arange(start, start + length, device=q.device)[:, None]
        k_pos = torch.arange(first, total, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
    return grouped_attention(q, keys, values, mask)


def reference_attention(q: Tensor, keys: Tensor, values: Tensor, start: int) -> Tensor:
    """The textbook version of :func:`sequence_attention`, for tests: repeat K/V, mask, softmax."""
    length, heads, dim = q.shape
    kv_heads, total, _ = keys.shape
    group = heads // kv_heads
    k = keys.repeat_interleave(group, dim=0).float()  # [H, total, D]
    v = values.repeat_interleave(group, dim=0).float()
    scores = torch.einsum("lhd,htd->hlt", q.float(), k) / dim**0.5
    q_pos = torch.arange(start, start + length)[:, None]
    allowed = torch.arange(total)[None, :] <= q_pos
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.einsum("hlt,htd->lhd", scores.softmax(dim=-1), v)
    return out.reshape(length, heads * dim).to(q.dtype)


def capped_attention(
    q: Tensor, keys: Tensor, values: Tensor, visible: Tensor | None, cap: float
) -> Tensor:
    """:func:`grouped_attention` with soft-capped scores (Gemma 2): ``cap · tanh(s / cap)``
    of each score before the mask and the softmax, as transformers computes it (scores in
    ``q``'s dtype, the softmax in fp32). ``visible: [L, T]`` (None: causal, ``T == L``).
    SDPA has no soft-cap, so this is the textbook computation."""
    length, heads, dim = q.shape
    group = heads // keys.shape[0]
    k = keys.repeat_interleave(group, dim=0)  # [H, T, D]
    v = values.repeat_interleave(group, dim=0)
    scores = torch.einsum("lhd,htd->hlt", q, k) * dim**-0.5
    scores = torch.tanh(scores / cap) * cap
    if visible is None:
        visible = torch.ones(length, k.shape[1], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~visible[None], float("-inf"))
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.einsum("hlt,htd->lhd", probs, v).reshape(length, heads * dim)


def capped_decode_attention(
    q: Tensor, pool: Tensor, slots: Tensor, mask: Tensor | None, cap: float
) -> Tensor:
    """One query per sequence (``q: [B, H, D]``) over the keys at its row of ``slots: [B, W]``
    with soft-capped scores (:func:`capped_attention`); ``mask: [B, 1, 1, W]`` additive, or
    None where every column is a key of the row's sequence."""
    batch, heads, dim = q.shape
    kv_heads = pool.shape[1] // 2
    group = heads // kv_heads
    rows = kv_format.gather(pool, slots, q.dtype)  # [B, W, 2·Hkv, D]
    k = rows[:, :, :kv_heads].repeat_interleave(group, dim=2)  # [B, W, H, D]
    v = rows[:, :, kv_heads:].repeat_interleave(group, dim=2)
    scores = torch.einsum("bhd,bwhd->bhw", q, k) * dim**-0.5
    scores = torch.tanh(scores / cap) * cap
    if mask is not None:
        scores = scores + mask.reshape(batch, 1, -1).to(scores.dtype)
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.einsum("bhw,bwhd->bhd", probs, v).reshape(batch, heads * dim)
