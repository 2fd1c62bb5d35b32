"""INT8 weights: per output channel, symmetric: ``w ≈ q · s``, ``q ∈ [-127, 127]``,
``s = max|w| / 127``.

One layout serves every kernel: the int8 matrix ``[N, K]`` row-major and one scale a row in
the model's compute dtype (torch's ``_weight_int8pack_mm``, our Triton GEMMs, our C kernels).
Our C kernels take the scales in fp32: where they run a layer's decode rows, the layer keeps an
fp32 copy beside them (none where the scales are fp32 already).
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine import formats


def quantize_int8(w: Tensor, scale_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """Per-row symmetric INT8: ``(q int8 [N, K], scale [N])`` with ``w ≈ q · scale``.

    The scale is rounded to ``scale_dtype`` *before* ``q`` is computed against it, so that
    dequantization in that dtype is exactly ``q · scale``. Rows are quantized a chunk at a
    time (:func:`engine.formats.row_chunks`): beside ``w``, only the int8 result and one
    chunk's fp32 temporaries exist."""
    n = w.shape[0]
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scale = torch.empty(n, dtype=scale_dtype, device=w.device)
    for rows in formats.row_chunks(n, w.shape[1]):
        chunk = w[rows].float()
        s = (chunk.abs().amax(dim=1) / 127).clamp(min=1e-12).to(scale_dtype)
        q[rows] = torch.round(chunk / s.float()[:, None]).clamp_(-127, 127)
        scale[rows] = s
    return q, scale


def dequantize_int8(q: Tensor, scale: Tensor) -> Tensor:
    return q.float() * scale.float()[:, None]


def read_rows(q: Tensor, scale: Tensor, rows: Tensor) -> Tensor:
    """Rows ``rows`` of the matrix, dequantized in fp32 ``[T, K]``."""
    return dequantize_int8(q[rows], scale[rows])


def bytes_held(n: int, k: int, scale: torch.dtype, *, c_scales: bool) -> int:
    """Bytes of an ``[N, K]`` INT8 weight once loaded (its bias aside): the int8 matrix, one
    ``scale``-dtype scale a row and, where our C kernels run the layer (``c_scales``) and the
    scales are not fp32 already, their fp32 copy."""
    itemsize = torch.empty((), dtype=scale).element_size()
    return n * k + n * itemsize + (4 * n if c_scales and itemsize != 4 else 0)


def load_temporaries(n: int, k: int) -> int:
    """What packing an ``[N, K]`` weight holds beside its float source and the result, past
    the quantization's one chunk of fp32 rows (:data:`engine.formats.QUANT_CHUNK_BYTES`, the
    memory plan's own term): nothing, since each chunk is quantized straight into the final
    matrix."""
    return 0
