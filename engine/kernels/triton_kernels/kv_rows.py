"""Quantized KV rows as our Triton attention kernels read them (:mod:`engine.formats.kv`: a
head's ``D`` int8 values, then the row's fp32 scale in the next four bytes): device functions
the kernels share. A tile of int8 keys or values is widened to the queries' dtype (exact: an
int8 value is exact in fp16 and bf16) and its products scaled by each row's scale, which is
the product with the dequantized row, read at a quarter (fp32) or half (16-bit) the bytes."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def row_scales(rows, HEAD_DIM: tl.constexpr, mask):
    """The fp32 scale after the ``HEAD_DIM`` values of each quantized row starting at
    ``rows`` (pointers into an int8 pool); 0 where ``mask`` is False."""
    at = (rows + HEAD_DIM).to(tl.pointer_type(tl.float32), bitcast=True)
    return tl.load(at, mask=mask, other=0.0)


@triton.jit
def scaled_values(p, v, scales, dtype: tl.constexpr):
    """``p · (v · scales)`` of a tile: probabilities ``p [M, N]`` over int8 value rows
    ``v [N, D]`` with their scales ``[N]``, in fp32. Each probability is weighted by its row's
    scale over the tile's largest (so the weights stay in [0, 1], as plain probabilities do,
    and fp16 keeps them out of its subnormals), the product taken in ``dtype`` on the tensor
    cores, then times that largest scale."""
    top = tl.max(scales, 0)
    top = tl.where(top > 0, top, 1.0)
    weights = (p * tl.math.div_rn(scales, top)[None, :]).to(dtype)
    values = v.to(tl.float32).to(dtype)
    return tl.dot(weights, values, input_precision="ieee") * top


@triton.jit
def _round_even(x):
    """fp32 ``x`` (|x| < 2**22) rounded to the nearest integer, ties to even: adding and
    taking away 1.5·2**23 leaves the float's rounding of the sum (the conversion to an
    integer truncates, here and in Triton's interpreter alike)."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def quantize_rows(first, second, inside):
    """Rows given as their two halves ``[R, HALF]`` (any float dtype; lanes outside
    ``inside`` ignored) as int8 values and each row's fp32 scale, as
    :func:`engine.formats.kv.quantize` makes them: ``scale = max|x| / 127``, each value
    ``x / scale`` rounded to nearest even (correctly rounded divisions: Triton's ``/`` is
    approximate)."""
    x1 = tl.where(inside, first.to(tl.float32), 0.0)
    x2 = tl.where(inside, second.to(tl.float32), 0.0)
    amax = tl.maximum(tl.max(tl.abs(x1), 1), tl.max(tl.abs(x2), 1))
    scale = tl.math.div_rn(amax, 127.0)
    by = tl.where(scale > 0, scale, 1.0)[:, None]
    q1 = tl.minimum(tl.maximum(_round_even(tl.math.div_rn(x1, by)), -127.0), 127.0)
    q2 = tl.minimum(tl.maximum(_round_even(tl.math.div_rn(x2, by)), -127.0), 127.0)
    return q1.to(tl.int8), q2.to(tl.int8), scale
