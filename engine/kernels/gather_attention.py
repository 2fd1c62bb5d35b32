"""The portable decode attention: each sequence's keys gathered from the paged pool into one
padded tensor, then one SDPA. It runs wherever torch does, and it is the reference every
faster decode kernel is checked against."""

from __future__ import annotations

from torch import Tensor

from engine.formats import kv as kv_format
from engine.model.attention import sdpa


def gather_attention(q: Tensor, pool: Tensor, slots: Tensor, mask: Tensor | None) -> Tensor:
    """The portable decode attention: one padded gather from ``pool`` (its rows dequantized where
    the pool is quantized, :mod:`engine.formats.kv`), one SDPA."""
    b, width = slots.shape
    _, heads, dim = q.shape
    kv_heads = pool.shape[1] // 2
    rows = kv_format.gather(pool, slots.view(-1), q.dtype)  # a quantized pool's dequantized
    rows = rows.view(b, width, 2 * kv_heads, dim).transpose(1, 2)  # [B, 2·Hkv, W, D]
    att = sdpa(
        q.view(b, kv_heads, heads // kv_heads, dim),
        rows[:, :kv_heads],
        rows[:, kv_heads:],
        attn_mask=mask,
    )
    return att.reshape(b, heads * dim)
