"""W8A8's activations in our C (engine/quant/w8a8.py): per-row (per-token) INT8 quantization
and the int32 products scaled back, each beside the torch reference it must equal; the
reference runs where our build does not."""

from __future__ import annotations

import torch
from torch import Tensor

from engine.kernels import lowbit, native, verify
from engine.kernels.lowbit import _BF16, Library, library, threads


def quantize_rows_reference(x: Tensor, fixed: float | None = None) -> tuple[Tensor, Tensor]:
    """Per-row (per-token) symmetric INT8 in torch: ``(q int8 [M, K], scale fp32 [M, 1])``,
    ``scale = max|row| / 127`` floored at 1e-12 (or ``fixed`` for every row), ``q = round(x /
    scale)`` to nearest even, clamped to ±127."""
    xf = x.float()
    if fixed is None:
        scale = (xf.abs().amax(dim=1, keepdim=True) / 127).clamp_(min=1e-12)
    else:
        scale = xf.new_full((x.shape[0], 1), fixed)
    return torch.round(xf / scale).clamp_(-127, 127).to(torch.int8), scale


def quantize_rows(
    x: Tensor, fixed: float | None = None, lib: Library | None = None
) -> tuple[Tensor, Tensor]:
    """:func:`quantize_rows_reference`'s values in one pass of our C (``lib``, else this
    machine's build; the reference where it does not run)."""
    lib = lib or library()
    if not lib.available or x.device.type != "cpu" or x.dtype not in _BF16:
        return quantize_rows_reference(x, fixed)
    x = x.contiguous()
    rows, k = x.shape
    q = torch.empty(rows, k, dtype=torch.int8)
    scale = torch.empty(rows, 1, dtype=torch.float32)
    native.call(
        "infersight::quantize_rows", lib.lib.infersight_quantize_rows,
        x.data_ptr(), _BF16[x.dtype], rows, k, fixed or 0.0, q.data_ptr(), scale.data_ptr(),
        threads(),
    )  # fmt: skip
    return q, scale


def quantization_differs(
    name: str, got: tuple[Tensor, Tensor], values: Tensor, fixed: float | None = None
) -> str:
    """Why ``got`` (``q``, ``scale``) is not torch's quantization of ``values``
    (:func:`quantize_rows_reference`) within the tolerance of ``values``' dtype
    (:func:`engine.kernels.verify.quantized`): one rounding each side and no reduction, for
    values computed element by element from exact int32 sums, such as SiLU · up, whose ``exp``
    is ours where torch's is its own (a few fp32 ulps apart, under the policy's floor). ""
    where it is."""
    want = quantize_rows_reference(values, fixed)
    tolerance = verify.tolerance(values.dtype, 1)
    return verify.quantized(name, got, want, values, tolerance, "torch's")


def scale_rows_reference(
    acc: Tensor, x_scale: Tensor, w_scales: Tensor, bias: Tensor | None, out: torch.dtype,
    residual: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """``(acc · x_scale) · w_scales (+ bias)`` in fp32 (torch's operators), then ``out``; then
    ``+ residual`` in ``out`` where one is given (the residual add after the product)."""
    y = acc.float() * x_scale * w_scales
    if bias is not None:
        y += bias.float()
    y = y.to(out)
    return y if residual is None else residual + y


def scale_rows(
    acc: Tensor, x_scale: Tensor, w_scales: Tensor, bias: Tensor | None, out: torch.dtype,
    lib: Library | None = None, *, residual: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """:func:`scale_rows_reference`'s values in one pass of our C (fp32 ``x_scale [M, 1]``,
    ``w_scales [N]`` and ``bias``, ``residual [M, N]`` in ``out``; the reference where it does
    not run)."""
    lib = lib or library()
    fp32 = all(t is None or t.dtype == torch.float32 for t in (x_scale, w_scales, bias))
    fits = residual is None or (residual.dtype == out and residual.shape == acc.shape)
    if not lib.available or acc.device.type != "cpu" or out not in _BF16 or not fp32 or not fits:
        return scale_rows_reference(acc, x_scale, w_scales, bias, out, residual)
    acc, x_scale, w_scales = acc.contiguous(), x_scale.contiguous(), w_scales.contiguous()
    rows, n = acc.shape
    y = torch.empty(rows, n, dtype=out)
    native.call(
        "infersight::scale_rows", lib.lib.infersight_scale_rows,
        acc.data_ptr(), rows, n, x_scale.data_ptr(), w_scales.data_ptr(),
        None if bias is None else bias.contiguous().data_ptr(),
        None if residual is None else residual.contiguous().data_ptr(), y.data_ptr(),
        _BF16[out], threads(),
    )  # fmt: skip
    return y


def check_rows(lib: Library) -> str:
    """W8A8's row quantization and int32 scaling against their torch references, bit for bit
    (fp32 and bf16, per-row and static scales, with and without a bias)."""
    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(5, 70, generator=gen) * 3).to(dtype)
        x[1] = 0  # an all-zero row
        for fixed in (None, 0.02):
            got, want = quantize_rows(x, fixed, lib), quantize_rows_reference(x, fixed)
            if not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])):
                return f"quantizing {dtype} rows (static {fixed}) differs from torch's rounding"
        acc = torch.randint(-(2**20), 2**20, (5, 9), generator=gen, dtype=torch.int32)
        sx, sw = torch.rand(5, 1, generator=gen), torch.rand(9, generator=gen)
        residual = torch.randn(5, 9, generator=gen).to(dtype)
        for bias, res in ((None, None), (torch.randn(9, generator=gen), residual)):
            got_y = scale_rows(acc, sx, sw, bias, dtype, lib, residual=res)
            if not torch.equal(got_y, scale_rows_reference(acc, sx, sw, bias, dtype, res)):
                return f"scaling int32 rows to {dtype} differs from torch's"
    return ""


def probe_build() -> str:
    """The library's first check (run in the child by :func:`engine.kernels.lowbit.library`):
    its products, then the rows' operations; "" if the build agrees."""
    found = lowbit.build()
    if not found.available:
        return found.why
    return lowbit.check(found) or check_rows(found)
