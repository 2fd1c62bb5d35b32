"""W8A8 weights: :mod:`engine.formats.int8`'s matrix and scales, and what meeting INT8
activations adds beside them: the scales again in fp32, as the int32 sums take them, and on a
CPU with AMX, where our AMX GEMM measured faster for the shape, the matrix once more in the
AMX tiles' order (as many bytes as the matrix: ``csrc/amx_int8.c``).
"""

from __future__ import annotations

import torch

from engine.formats import int8


def bytes_held(n: int, k: int, scale: torch.dtype, *, c_scales: bool, amx: bool) -> int:
    """Bytes of an ``[N, K]`` W8A8 weight once loaded (its bias aside): INT8's
    (:func:`engine.formats.int8.bytes_held`), the fp32 weight scales, and (``amx``) the matrix
    packed for AMX. Each fp32 copy of the scales is one tensor, and none where the scales are
    fp32 already."""
    int8_bytes = int8.bytes_held(n, k, scale, c_scales=c_scales)
    own_scales = 0 if scale == torch.float32 or c_scales else 4 * n
    return int8_bytes + own_scales + (n * k if amx else 0)
