"""Decode attention over the paged pool, and the decode step's attention as one torch op.

One query per sequence attends over the keys its block table holds. On CPU the paged kernel
(:mod:`engine.kernels.paged_decode`) reads K/V straight from the pool; elsewhere, or where it is
not available, one padded gather and one SDPA
(:func:`~engine.kernels.gather_attention.gather_attention`, the portable path and the kernel's
reference). ``infersight::paged_decode_attention`` stores the step's K/V and attends, as one op
that a compiled decode step calls as an opaque kernel.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.formats import kv as kv_format
from engine.kernels import paged_decode
from engine.kernels.gather_attention import gather_attention
from engine.model.attention import capped_decode_attention


def decode_attention(
    q: Tensor, pool: Tensor, slots: Tensor, lens: Tensor, mask: Tensor | None,
    softcap: float | None = None,
) -> Tensor:  # fmt: skip
    """One query per sequence (``q: [B, H, D]``) over the keys in the first ``lens[b]``
    columns of its row of ``slots: [B, W]`` (``mask: [B, 1, 1, W]``, additive, or None), its
    scores soft-capped at ``softcap`` (Gemma 2's; None: not). Returns ``[B, H·D]``. On CPU the
    paged kernel reads K/V straight from the pool (:mod:`engine.kernels.paged_decode`);
    elsewhere, or where it is not available, one padded gather and one SDPA, or under a cap
    (which SDPA has not) the textbook computation."""
    if paged_decode.usable(q, pool):
        return paged_decode.paged_attention(q, pool, slots, lens, mask, softcap or 0.0)
    if softcap is not None:
        return capped_decode_attention(q, pool, slots, mask, softcap)
    return gather_attention(q, pool, slots, mask)


# The decode step's attention as one op of its own, so that a compiled graph calls it as an
# opaque kernel (TorchInductor never sees the pool's layout). Declared with the plain
# ``torch.library`` API: ``custom_op`` costs ~20 µs more per call for an op that mutates.
_LIB = torch.library.Library("infersight", "FRAGMENT")  # type: ignore[no-untyped-call]
_LIB.define(  # type: ignore[no-untyped-call]
    "paged_decode_attention(Tensor q, Tensor kv, Tensor(a!) pool, Tensor write_slots, "
    "Tensor slots, Tensor lens, Tensor? mask) -> Tensor"
)


def store_and_attend(
    q: Tensor,
    kv: Tensor,
    pool: Tensor,
    write_slots: Tensor,
    slots: Tensor,
    lens: Tensor,
    mask: Tensor | None,
) -> Tensor:
    """Store ``kv`` at ``write_slots`` of ``pool``, then :func:`decode_attention`."""
    kv_format.store(pool, write_slots, kv)
    return decode_attention(q, pool, slots, lens, mask)


_LIB.impl(  # type: ignore[no-untyped-call]
    "paged_decode_attention", store_and_attend, "CompositeExplicitAutograd"
)


@torch.library.register_fake("infersight::paged_decode_attention", lib=_LIB)  # type: ignore[untyped-decorator]
def _(
    q: Tensor,
    kv: Tensor,
    pool: Tensor,
    write_slots: Tensor,
    slots: Tensor,
    lens: Tensor,
    mask: Tensor | None,
) -> Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


paged_decode_attention = torch.ops.infersight.paged_decode_attention
