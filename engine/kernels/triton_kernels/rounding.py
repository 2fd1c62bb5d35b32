"""fp32 rounded to an activation dtype inside our Triton kernels, written once.

A GPU's conversion rounds to nearest even (``cvt.rn.bf16.f32``, ``cvt.rn.f16.f32``). Triton's
interpreter rounds fp32 to bf16 toward zero (its round-to-nearest mode does not carry), so
under it :func:`round_to` rounds to nearest even with integer ops, the GPU's bits (NaN stays
NaN): the interpreter tests then check the bits a GPU computes. Compiled kernels convert as
usual. The fused norm and RoPE (:mod:`~engine.kernels.triton_kernels.fused`) and the quantized
GEMMs' epilogue and dequantization (:mod:`~engine.kernels.triton_kernels.quant_gemm_kernels`)
round through it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine.kernels import triton_support

#: whether these kernels run under Triton's interpreter (``TRITON_INTERPRET=1``)
INTERPRETED = tl.constexpr(triton_support.interpreting())


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 ``x`` rounded to nearest even in ``dtype``."""
    if INTERPRETED and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits += 0x7FFF + ((bits >> 16) & 1)
        upper = tl.where(x != x, 0x7FC0, bits >> 16).to(tl.uint16)  # NaN stays NaN
        return upper.to(tl.bfloat16, bitcast=True)
    return x.to(dtype)
