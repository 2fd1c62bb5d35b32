"""The INT4 linear: group-wise INT4 weights packed for torch's INT4 kernels, or for ours.

On CPU ``_weight_int4pack_mm_for_cpu``, on CUDA ``_weight_int4pack_mm`` (sm80+), both with bf16
activations. Where our Triton kernels run (:func:`engine.kernels.triton_support.chosen`: a CUDA
GPU with Triton), the layer holds their layout instead
(:data:`engine.formats.int4.OURS`, the same 4-bit values, scales and
zeros) and computes in the model's dtype: that is how INT4 runs on sm_75, in fp16. Where the
input width K does not fit a kernel (it must be a multiple of the group and of 32), K is padded
with zero columns and the load report says so. There is no fallback: a device without a kernel
refuses INT4 by name when the spec is parsed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.formats import int4
from engine.formats.int4 import Packing, dequantize_int4, pack_int4, padded_width, quantize_int4
from engine.hardware import measured
from engine.hardware.cpu_paths import cpu_paths
from engine.kernels import decode_step, gemv, lowbit, lowbit_timing
from engine.quant.int8 import (
    LOWBIT_KERNEL,
    PREFILL_BF16,
    PREFILL_TIMED_ROWS,
    TRITON_KERNEL,
    in_row_blocks,
    triton_gemms,
)


def _triton_int4(device: torch.device, dtype: torch.dtype) -> Callable[..., Tensor] | None:
    """Our INT4 launcher where our GEMMs run on ``device``
    (:func:`~engine.quant.int8.triton_gemms`; imported only there: Triton may be missing)."""
    if not triton_gemms(device, dtype)[0]:
        return None
    from engine.kernels.triton_kernels.quant_gemm import int4_linear

    return int4_linear


def _lowbit_int4(n: int, k: int, group: int, inner_k_tiles: int, dtype: torch.dtype) -> bool:
    """Whether our C kernel runs a CPU layer of this shape (:func:`engine.kernels.lowbit.chosen`,
    with the C decode step's slack; it takes groups of 32 times a power of two)."""
    per_group = group // lowbit.QK
    if group % lowbit.QK or per_group & (per_group - 1):
        return False
    runs = cpu_paths().int4_kernel.ok
    timer = (lambda: lowbit_timing.time_int4(n, k, group, inner_k_tiles, dtype)) if runs else None
    fmt = f"int4-g{group} {str(dtype).removeprefix('torch.')}"
    return lowbit.chosen(fmt, n, k, timer, decode_step.slack())


def bf16_product(x: Tensor, packed: Tensor, scales_zeros: Tensor, group: int) -> Tensor:
    """``x [M, K]`` (bf16) times our INT4 weights (:func:`engine.formats.int4.pack_int4`)
    dequantized to bf16 a block of output rows at a time (:func:`in_row_blocks`), so that
    oneDNN's bf16 GEMM runs a prefill chunk's product."""
    n, k = packed.shape[0], 2 * packed.shape[1]
    return in_row_blocks(
        x, n, k,
        lambda xb, rows: F.linear(xb, lowbit.int4_dequantized(packed, scales_zeros, group, rows)),
    )  # fmt: skip


def time_prefill(out_features: int, in_features: int, group: int) -> lowbit.Timing:
    """:func:`bf16_product` against our INT4 kernel on a prefill chunk's rows of bf16
    activations (``torch_ms``: the kernel the layer runs otherwise; ms per call, the weights in
    cache: a prefill is bound by compute)."""
    gen = torch.Generator().manual_seed(0)
    q, scale, zero = quantize_int4(torch.randn(out_features, in_features, generator=gen), group)
    packed, sz = pack_int4(q), torch.stack([scale, zero], dim=2).contiguous()
    x = torch.randn(PREFILL_TIMED_ROWS, in_features, generator=gen).bfloat16()
    ours_ms, kernel_ms = measured.best_of_three(
        [lambda: bf16_product(x, packed, sz, group),
         lambda: lowbit.int4_linear(x, packed, sz, group, torch.bfloat16)], 1,
    )  # fmt: skip
    return lowbit.Timing(ours_ms=ours_ms, torch_ms=kernel_ms)


class Int4Linear(nn.Module):
    quantized = True
    weight: Tensor
    scales_and_zeros: Tensor
    bias: Tensor | None

    def __init__(
        self, weight: Tensor, bias: Tensor | None, group: int, dtype: torch.dtype = torch.bfloat16
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.group = group
        #: our Triton kernel (:func:`engine.kernels.triton_kernels.quant_gemm.int4_linear`) where
        #: it runs, else None: chosen once, at load
        self.triton = _triton_int4(weight.device, dtype)
        k = padded_width(self.in_features, group)
        self.padded_k = k - self.in_features
        self.on_cuda = weight.device.type == "cuda"
        tiles = self.inner_k_tiles = int4.inner_k_tiles(k)
        #: whether our C kernel runs this layer (on a CPU, where it measured faster than
        #: torch's for this shape: :func:`engine.kernels.lowbit.chosen`); it keeps its layout
        self.lowbit = (
            not self.on_cuda
            and self.triton is None
            and _lowbit_int4(self.out_features, k, group, tiles, dtype)
        )
        #: the layout the kernel that runs this layer reads (:mod:`engine.formats.int4`)
        self.packing: Packing = (
            int4.OURS if self.triton is not None or self.lowbit
            else int4.TORCH_CUDA if self.on_cuda
            else int4.torch_cpu(cpu_paths().int4_block_rows)
        )  # fmt: skip
        # torch's packings want N divisible by 16: extra zero rows, sliced off the output
        self.padded_n = self.packing.rows(self.out_features) - self.out_features
        #: whether prefill chunks (more than :data:`engine.kernels.gemv.MAX_ROWS` rows) take
        #: bf16 GEMMs on weights dequantized a block at a time (:func:`bf16_product`), where our
        #: kernel runs the layer of a bf16 model and that measured faster than it for this shape
        self.prefill_bf16 = self.lowbit and dtype == torch.bfloat16 and self._prefill(k)
        # torch's kernels take bf16 only; ours the model's compute dtype (fp16 below sm80)
        self.out_dtype = dtype if self.triton is not None or self.lowbit else torch.bfloat16
        packed, scale, zero = self.packing.pack(weight, group)
        # [K/group, N, 2]: (scale, zero) per group and output channel, as the kernels want;
        # for ours a view of [N, K/group, 2], each channel's groups together.
        sz = torch.stack([scale, zero], dim=2)
        sz = sz.contiguous().transpose(0, 1) if self.lowbit else sz.transpose(0, 1).contiguous()
        self.register_buffer("weight", packed)
        self.register_buffer("scales_and_zeros", sz)
        self.register_buffer("bias", None if bias is None else bias.detach().to(self.out_dtype))

    def _prefill(self, k: int) -> bool:
        mode = lowbit.requested()
        if mode == "torch":
            return False
        if mode == "ours":
            return True
        n, group = self.out_features, self.group
        key = lowbit.shape_key(f"prefill int4-g{group} bfloat16", n, k)
        found = lowbit.library()
        ours = f"bf16 GEMM, torch {torch.__version__}, {found.path.stem if found.path else ''}"
        return lowbit.faster(ours, key, lambda: time_prefill(n, k, group))

    def values(self, rows: Tensor) -> Tensor:
        """The 4-bit values (0..15) of rows ``rows``, int32 ``[T, K']``, read from the layer's
        packing (:meth:`engine.formats.int4.Packing.read_rows`)."""
        return self.packing.read_rows(self.weight, rows, self.in_features + self.padded_k)

    def unreadable(self) -> str:
        """Why this layer's rows cannot be read back ("" where they can)."""
        k, n = self.in_features + self.padded_k, self.out_features + self.padded_n
        return self.packing.unreadable(self.weight.device, k, n)

    def read_rows(self, rows: Tensor) -> Tensor:
        """Rows ``rows`` of the weight, dequantized in fp32 ``[T, in_features]``."""
        k = self.in_features + self.padded_k
        sz = self.scales_and_zeros[:, rows].transpose(0, 1).float()  # [T, K'/group, 2]
        full = dequantize_int4(self.values(rows), sz[..., 0], sz[..., 1], self.group)
        return full.reshape(len(rows), k)[:, : self.in_features]

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        if self.triton is not None:  # no padding of x, bias fused
            x2 = x.reshape(-1, shape[-1]).to(self.out_dtype)
            y = self.triton(x2, self.weight, self.scales_and_zeros, self.group, self.bias)
            return y.reshape(*shape[:-1], self.out_features)
        if self.lowbit:
            x2 = x.reshape(-1, shape[-1])
            if self.padded_k:
                x2 = F.pad(x2, (0, self.padded_k))
            sz = self.scales_and_zeros.transpose(0, 1)  # [N, K'/group, 2], contiguous
            if self.prefill_bf16 and x2.shape[0] > gemv.MAX_ROWS:
                y = bf16_product(x2.to(torch.bfloat16), self.weight, sz, self.group)
                y = y.to(self.out_dtype)
            else:
                y = lowbit.int4_linear(x2, self.weight, sz, self.group, self.out_dtype)
            if self.bias is not None:
                y = y + self.bias
            return y.reshape(*shape[:-1], self.out_features)
        x2 = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        if self.padded_k:
            x2 = F.pad(x2, (0, self.padded_k))
        if self.on_cuda:
            y = torch.ops.aten._weight_int4pack_mm(
                x2, self.weight, self.group, self.scales_and_zeros
            )
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2, self.weight, self.group, self.scales_and_zeros
            )
        if self.padded_n:
            y = y[:, : self.out_features]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def c_product(self, dtype: torch.dtype) -> decode_step.CProduct | str:
        """This layer in the C decode step (:mod:`engine.executor.c_step`), where our
        kernel runs it."""
        if not self.lowbit:
            return "runs torch's INT4 kernel" if self.triton is None else "runs Triton"
        if self.padded_k:
            return f"pads its {self.in_features} inputs to the group"
        if self.out_dtype != dtype:
            return f"gives {self.out_dtype}, the activations are {dtype}"
        return decode_step.product(
            decode_step.INT4, self.weight, self.scales_and_zeros.transpose(0, 1), self.bias,
            dtype, n=self.out_features, k=self.in_features, group=self.group,
        )  # fmt: skip

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scales_and_zeros))

    @property
    def kernel(self) -> str:
        """The path this layer runs, for the load report (without a kernel, INT4 is refused
        when the spec is parsed)."""
        if self.lowbit:
            if self.prefill_bf16:
                return f"{LOWBIT_KERNEL} (≤ {gemv.MAX_ROWS} rows), {PREFILL_BF16}"
            return LOWBIT_KERNEL
        return TRITON_KERNEL if self.triton is not None else "int4 kernel"

    def extra_repr(self) -> str:
        pad = f", K padded +{self.padded_k}" if self.padded_k else ""
        size = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{size}, int4 g{self.group}{pad}"
