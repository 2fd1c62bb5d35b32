"""W8A8: INT8 weights per output channel and INT8 activations per token, multiplied in int32.

Weight-only INT8 (:class:`~engine.quant.int8.Int8Linear`) keeps the activations float, so a
prefill chunk or a large batch runs float GEMMs, and those are bound by compute on a CPU. Here
a product of more rows than a decode step's (:data:`engine.kernels.gemv.MAX_ROWS`) quantizes
each row of its activations to int8 with its own scale (``absmax / 127``, dynamic: nothing to
calibrate), multiplies int8 × int8 → int32 exactly with ``torch._int_mm`` (oneDNN on a CPU,
VNNI where it has it; cuBLASLt on CUDA), and applies the two scales to the int32 sums:

    y[m, n] = (Σ_k xq[m, k] · wq[n, k]) · sx[m] · sw[n]

Decode steps (up to ``MAX_ROWS`` rows) keep the weight-only path: reading the weights is their
cost, and our C kernels (the decode step in one C call) already run it. Which path a
product's row count takes is decided per machine: ``torch._int_mm`` is timed against the
weight-only path on a prefill chunk's rows of this layer's shape at load, and kept where it
measured faster (``kernels.json``); the load report names the path of each shape.

Quantizing the activations is an approximation the weights' quantization does not make: an
activation channel with outliers takes the whole row's scale. SmoothQuant's per-channel
factors (``w8a8-sq``: :mod:`engine.quant.calibration`) move that range into the weights,
folded in at load so that nothing runs for them at inference.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from engine.formats import quantize_int8
from engine.hardware import measured
from engine.kernels import gemv, lowbit
from engine.quant.int8 import PREFILL_TIMED_ROWS, Int8Linear

log = logging.getLogger(__name__)

#: how the load report names the int8 × int8 path
INT_MM = "int8 × int8 GEMM (torch._int_mm, activations per token)"


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Per-row (per-token) symmetric INT8: ``(q int8 [M, K], scale fp32 [M, 1])`` with
    ``x ≈ q · scale``; a row of zeros gets scale 1e-12 and zeros."""
    xf = x.float()
    scale = (xf.abs().amax(dim=1, keepdim=True) / 127).clamp_(min=1e-12)
    return torch.round(xf / scale).clamp_(-127, 127).to(torch.int8), scale


def int8_product(
    xq: Tensor, x_scale: Tensor, weight: Tensor, w_scales: Tensor, dtype: torch.dtype,
    bias: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """``(xq · weightᵀ) · x_scale · w_scales + bias`` in ``dtype``: the int32 sums exact, the
    scales and the bias applied in fp32, one rounding to ``dtype`` at the end. ``xq [M, K]``
    and ``weight [N, K]`` int8, ``x_scale [M, 1]`` and ``w_scales [N]`` fp32."""
    y = torch._int_mm(xq, weight.t()).float() * x_scale * w_scales
    if bias is not None:
        y += bias.float()
    return y.to(dtype)


def dequantized_product(x: Tensor, weight: Tensor, w_scales: Tensor) -> Tensor:
    """What :func:`int8_product` computes, in float64 from the dequantized operands (the
    tests' reference)."""
    xq, sx = quantize_rows(x)
    return (xq.double() * sx.double()) @ (weight.double() * w_scales.double()[:, None]).t()


def time_int_mm(out_features: int, in_features: int, weight_only: Int8Linear) -> lowbit.Timing:
    """The int8 × int8 path (quantizing the activations included) against the weight-only
    layer's own path for a prefill chunk's rows (ms per call; bound by compute)."""
    gen = torch.Generator().manual_seed(0)
    q, scales = quantize_int8(torch.randn(out_features, in_features, generator=gen))
    x = torch.randn(PREFILL_TIMED_ROWS, in_features, generator=gen).to(weight_only.out_dtype)
    dtype = weight_only.out_dtype

    def ours() -> None:
        xq, sx = quantize_rows(x)
        int8_product(xq, sx, q, scales, dtype)

    ours_ms, theirs_ms = measured.best_of_three(
        [ours, lambda: Int8Linear.forward(weight_only, x)], 1
    )
    return lowbit.Timing(ours_ms=ours_ms, torch_ms=theirs_ms)


class W8A8Linear(Int8Linear):
    """INT8 weights (per output channel, as :class:`Int8Linear`), INT8 activations per token
    in products of more than :data:`engine.kernels.gemv.MAX_ROWS` rows.

    ``int_mm``: whether those products run int8 × int8 (None: as measured on this machine,
    :func:`time_int_mm`; the tests force it)."""

    w_scales: Tensor

    def __init__(
        self, weight: Tensor, bias: Tensor | None, dtype: torch.dtype, *, int_mm: bool | None = None
    ) -> None:
        super().__init__(weight, bias, dtype)
        #: the weights' scales in fp32, as the int32 sums take them
        self.register_buffer("w_scales", self.scales.float())
        self.int_mm = self._int_mm() if int_mm is None else int_mm

    def _int_mm(self) -> bool:
        n, k = self.out_features, self.in_features
        if self.weight.device.type == "cuda":  # cuBLASLt's int8 GEMM: K and N multiples of 8
            return n % 8 == 0 and k % 8 == 0
        key = lowbit.shape_key(f"prefill w8a8 {str(self.out_dtype).removeprefix('torch.')}", n, k)
        return lowbit.faster(f"torch._int_mm, torch {torch.__version__}", key,
                             lambda: time_int_mm(n, k, self))  # fmt: skip

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if not self.int_mm or x2.shape[0] <= gemv.MAX_ROWS:
            return super().forward(x)
        xq, sx = quantize_rows(x2)
        y = int8_product(xq, sx, self.weight, self.w_scales, self.out_dtype, self.bias)
        return y.reshape(*shape[:-1], self.out_features)

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.w_scales.numel() * 4

    @property
    def kernel(self) -> str:
        """The path of each step shape, for the load report."""
        small = super().kernel
        if not self.int_mm:
            return f"w8a8 as int8 weight-only ({INT_MM} measured slower here): {small}"
        return f"w8a8: over {gemv.MAX_ROWS} rows {INT_MM}; up to {gemv.MAX_ROWS}: {small}"

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, w8a8"
