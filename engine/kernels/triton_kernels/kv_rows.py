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
