"""The timings at load that decide, per layer shape, whether our INT8/INT4 kernels
(:mod:`engine.kernels.lowbit`) run a layer or torch's do: each side on enough copies of the
weights to stream past the caches (:func:`engine.kernels.lowbit.time_kernels`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from engine.formats.int4 import pack_int4
from engine.kernels.lowbit import (
    STREAM_BYTES,
    Timing,
    int4_linear,
    int8_linear,
    time_kernels,
)

#: the smallest problem a kernel's call is timed on (its cost from Python: Timing.call_ms):
#: output rows, and inputs (an INT4 kernel's: one group)
TINY_ROWS, TINY_K = 16, 128


def copies_for(bytes_per_copy: int) -> int:
    """How many distinct weights of this size a timing streams through (:data:`STREAM_BYTES`)."""
    return max(1, min(64, STREAM_BYTES // max(bytes_per_copy, 1)))


def time_int8(
    out_features: int, in_features: int, dtype: torch.dtype,
    kernel: Callable[[Tensor, Tensor, Tensor, torch.dtype], Tensor] = int8_linear,
) -> Timing:  # fmt: skip
    """Ours (``kernel``: the GEMM's by default, or the GEMV's) against
    ``torch._weight_int8pack_mm`` (activations in ``dtype``) for one shape."""
    from engine.formats.int8 import quantize_int8

    gen = torch.Generator().manual_seed(0)
    copies = copies_for(out_features * in_features)
    weights = [quantize_int8(torch.randn(out_features, in_features, generator=gen), dtype)
               for _ in range(copies)]  # fmt: skip
    float_scales = [s.float() for _, s in weights]

    def ours(x: Tensor, i: int) -> object:
        return kernel(x, weights[i][0], float_scales[i], dtype)

    def theirs(x: Tensor, i: int) -> object:
        return torch._weight_int8pack_mm(x, weights[i][0], weights[i][1])

    tiny_w, tiny_s = quantize_int8(torch.randn(TINY_ROWS, TINY_K, generator=gen), dtype)
    tiny_x, tiny_scales = torch.randn(1, TINY_K, generator=gen).to(dtype), tiny_s.float()
    return time_kernels(ours, theirs, copies, in_features, dtype,
                        call=lambda: kernel(tiny_x, tiny_w, tiny_scales, dtype))  # fmt: skip


def time_int4(
    out_features: int, in_features: int, group: int, inner_k_tiles: int, dtype: torch.dtype
) -> Timing:
    """Ours against ``_weight_int4pack_mm_for_cpu`` (bf16 activations) for one shape, from
    and to activations in ``dtype``."""
    from engine.formats.int4 import quantize_int4

    gen = torch.Generator().manual_seed(0)
    copies = copies_for(out_features * in_features // 2)
    rows = -(-out_features // 16) * 16  # torch's packing takes whole 16s of rows
    ours_w, torch_w = [], []
    for _ in range(copies):
        q, scale, zero = quantize_int4(torch.randn(rows, in_features, generator=gen), group)
        n = out_features
        ours_w.append((pack_int4(q[:n]), torch.stack([scale[:n], zero[:n]], dim=2).contiguous()))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, inner_k_tiles)
        torch_w.append((packed, torch.stack([scale, zero], dim=2).transpose(0, 1).contiguous()))

    def ours(x: Tensor, i: int) -> object:
        return int4_linear(x, *ours_w[i], group, dtype)

    def theirs(x: Tensor, i: int) -> object:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.bfloat16(), torch_w[i][0], group, torch_w[i][1]
        )
        return y.to(dtype)

    q, scale, zero = quantize_int4(torch.randn(TINY_ROWS, group, generator=gen), group)
    tiny = (pack_int4(q), torch.stack([scale, zero], dim=2).contiguous())
    tiny_x = torch.randn(1, group, generator=gen).to(dtype)
    return time_kernels(ours, theirs, copies, in_features, dtype,
                        call=lambda: int4_linear(tiny_x, *tiny, group, dtype))  # fmt: skip
