"""Quantized KV rows as our Triton attention kernels read them (:mod:`engine.formats.kv`: a
head's ``D`` int8 or fp8 values, then the row's fp32 scale in the next four bytes): device
functions the kernels share. A tile of keys or values is widened to the queries' dtype
(exactly: an int8 value, and an e4m3 one, is exact in fp16 and bf16) and its products scaled by
each row's scale, which is the product with the dequantized row, read at a quarter (fp32) or
half (16-bit) the bytes."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: what a pool's rows hold, as the attention kernels' ``KV_ROWS`` says: floats, int8 values,
#: or fp8 (e4m3) values read as bytes (:func:`widen`)
FLOAT_ROWS, INT8_ROWS, FP8_ROWS = 0, 1, 2
#: every kind, each one's pool pointer for the ahead-of-time build (a float pool's is the
#: compute dtype's), and the suffix of its configurations' names
ROWS = (FLOAT_ROWS, INT8_ROWS, FP8_ROWS)
ROW_POINTERS = {INT8_ROWS: "*i8", FP8_ROWS: "*u8"}
ROW_NAMES = {FLOAT_ROWS: "", INT8_ROWS: "_int8kv", FP8_ROWS: "_fp8kv"}
#: the oldest architecture each kind is built for: an fp8 cache is refused below sm_89
#: (:mod:`engine.kv_cache.dtypes`), so its configurations are built from sm_89 on (sm_90 in
#: make test's build, sm_89 too with ``--all-targets``)
ROW_TARGETS = {FLOAT_ROWS: 0, INT8_ROWS: 0, FP8_ROWS: 89}


def rows_of(pool: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``pool`` as the kernels take it (an fp8 pool as its bytes: no fp8 type before
    sm_89), and its ``KV_ROWS``."""
    rows = {torch.int8: INT8_ROWS, torch.float8_e4m3fn: FP8_ROWS}.get(pool.dtype, FLOAT_ROWS)
    return (pool.view(torch.uint8) if rows == FP8_ROWS else pool), rows


@triton.jit
def row_scales(rows, HEAD_DIM: tl.constexpr, mask, KV_ROWS: tl.constexpr):
    """The fp32 scale after the ``HEAD_DIM`` values of each quantized row starting at
    ``rows`` (pointers into the pool's bytes); 0 where ``mask`` is False. An fp8 row's
    scale comes times 256, what :func:`widen`'s values lack."""
    at = (rows + HEAD_DIM).to(tl.pointer_type(tl.float32), bitcast=True)
    scale = tl.load(at, mask=mask, other=0.0)
    if KV_ROWS == 2:
        scale = scale * 256.0
    return scale


@triton.jit
def widen(v, KV_ROWS: tl.constexpr, dtype: tl.constexpr):
    """A tile of quantized values in ``dtype``, exactly: int8 as it is (through fp32: the
    interpreter turns int8 into bf16 wrong); fp8 e4m3 bytes as fp16 bits, their sign, then
    their exponent and mantissa seven places up, which is the value times 2**-8 (subnormals
    included: fp16's exponent bias is 8 more than e4m3's), on any GPU (no fp8 type: sm_75 on)
    and in the interpreter alike."""
    if KV_ROWS == 2:
        bits = v.to(tl.uint16)
        half = ((bits & 0x80) << 8) | ((bits & 0x7F) << 7)
        return half.to(tl.float16, bitcast=True).to(tl.float32).to(dtype)
    return v.to(tl.float32).to(dtype)


@triton.jit
def scaled_values(p, v, scales, dtype: tl.constexpr, KV_ROWS: tl.constexpr):
    """``p · (v · scales)`` of a tile: probabilities ``p [M, N]`` over int8 value rows
    ``v [N, D]`` with their scales ``[N]``, in fp32. Each probability is weighted by its row's
    scale over the tile's largest (so the weights stay in [0, 1], as plain probabilities do,
    and fp16 keeps them out of its subnormals), the product taken in ``dtype`` on the tensor
    cores, then times that largest scale."""
    top = tl.max(scales, 0)
    top = tl.where(top > 0, top, 1.0)
    weights = (p * tl.math.div_rn(scales, top)[None, :]).to(dtype)
    return tl.dot(weights, widen(v, KV_ROWS, dtype), input_precision="ieee") * top


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
