"""W8A8's int8 × int8 → int32 product on Intel AMX tiles, where the CPU has them.

``torch._int_mm`` reaches oneDNN's older s8s8s32 GEMM, which runs AVX-512 VNNI even on a CPU
with AMX (its bf16 matmul does use AMX): there a bf16 GEMM is as fast as the int8 one.
``csrc/amx_int8.c`` multiplies on AMX's tiles from weights packed once, at load, into the
tile layout: the same exact int32 sums as ``_int_mm``, about twice as fast at a prefill's
shapes on the Xeon it was written on (``infersight bench --prefill-table``).

Built with the machine's other kernels (:mod:`engine.kernels.native`); on a CPU without
AMX-INT8 (or where Linux refuses a process the tile state) the build reports ``none`` and
the products stay on ``torch._int_mm``. Where it runs, it is checked once per build in a
child process against ``_int_mm``, bit for bit, and a layer takes it where it also measured
faster for its shape (:func:`engine.quant.w8a8.W8A8Linear`).
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from engine.kernels import lowbit_rows, native

SOURCE = native.CSRC / "amx_int8.c"
#: what the packed layout takes: whole 32-column pairs of output blocks, whole 64s along k
COLUMNS, DEPTH = 32, 64


def _load(path: Path) -> native.Library:
    def declare(lib: Any) -> None:
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.infersight_amx_ready.restype = ctypes.c_int
        lib.infersight_amx_ready.argtypes = []
        lib.infersight_amx_pack.restype = None
        lib.infersight_amx_pack.argtypes = [p, i64, i64, p]
        lib.infersight_amx_gemm.restype = ctypes.c_int
        lib.infersight_amx_gemm.argtypes = [p, i64, i64, p, i64, p, ctypes.c_int]
        lib.infersight_amx_silu_quantize.restype = ctypes.c_int
        lib.infersight_amx_silu_quantize.argtypes = [
            p,
            i64,
            i64,
            p,
            i64,
            p,
            p,
            ctypes.c_int,
            ctypes.c_float,
            p,
            p,
            p,
            ctypes.c_int,
        ]
        lib.infersight_amx_gemm_scaled.restype = ctypes.c_int
        lib.infersight_amx_gemm_scaled.argtypes = [
            p,
            i64,
            i64,
            p,
            i64,
            p,
            p,
            p,
            p,
            p,
            ctypes.c_int,
            ctypes.c_int,
        ]

    found = native.load(path, "infersight_amx_isa", declare)
    if found.isa == "none":
        return native.Library(None, "no AMX-INT8 on this CPU (or in this build)")
    if found.lib.infersight_amx_ready() != 0:
        return native.Library(None, "Linux refused this process AMX's tile state")
    return found


def build(level: str | None = None) -> native.Library:
    """Build (once per machine) and load the kernel for ``level``, without the child's check."""
    return native.build_library(SOURCE, "our AMX int8 GEMM", level, _load)


@cache
def library() -> native.Library:
    """This machine's build, checked once in a child process against ``torch._int_mm``."""
    return native.checked(build(), "AMX int8 GEMM", PROBE)


def fits(out_features: int, in_features: int) -> bool:
    """Whether a weight of this shape packs into whole tiles."""
    return out_features % COLUMNS == 0 and in_features % DEPTH == 0


def pack(weight: Tensor, lib: native.Library | None = None) -> Tensor:
    """``weight [N, K]`` int8 in AMX's tile layout (``csrc/amx_int8.c``), as a flat int8
    tensor of the same size."""
    lib = lib or library()
    n, k = weight.shape
    weight = weight.contiguous()
    packed = torch.empty(n * k, dtype=torch.int8)
    lib.lib.infersight_amx_pack(weight.data_ptr(), n, k, packed.data_ptr())
    return packed


def _run(fn: Any, x: Tensor, packed: Tensor, n: int, *args: object) -> None:
    """One of the library's products on ``x [M, K]`` (contiguous) and a packed weight of
    ``n`` outputs, the rest of its arguments after them, on torch's thread count."""
    m, k = x.shape
    rc = native.call("infersight::amx_gemm", fn, x.data_ptr(), m, k, packed.data_ptr(), n,
                     *args, torch.get_num_threads())  # fmt: skip
    if rc != 0:
        raise MemoryError("the AMX int8 GEMM ran out of memory for its last rows")


def gemm(x: Tensor, packed: Tensor, out_features: int, lib: native.Library | None = None) -> Tensor:
    """``x [M, K] int8 · weightᵀ`` as int32 ``[M, N]``, exact (``torch._int_mm``'s sums),
    from the weight :func:`pack` made."""
    lib = lib or library()
    x = x.contiguous()
    y = torch.empty(x.shape[0], out_features, dtype=torch.int32)
    _run(lib.lib.infersight_amx_gemm, x, packed, out_features, y.data_ptr())
    return y


def gemm_scaled(
    x: Tensor, packed: Tensor, out_features: int, x_scale: Tensor, w_scales: Tensor,
    bias: Tensor | None, dtype: torch.dtype, residual: Tensor | None = None,
    lib: native.Library | None = None,
) -> Tensor:  # fmt: skip
    """:func:`gemm`'s sums scaled as each block leaves the tiles, in ``dtype`` (fp32 or bf16):
    :func:`engine.kernels.lowbit_rows.scale_rows`'s values (``x_scale [M, 1]``, ``w_scales [N]``
    and ``bias`` fp32; ``residual [M, N]`` in ``dtype``, added after), with no int32 sums in
    memory."""
    lib = lib or library()
    x = x.contiguous()
    y = torch.empty(x.shape[0], out_features, dtype=dtype)
    _run(
        lib.lib.infersight_amx_gemm_scaled, x, packed, out_features,
        x_scale.contiguous().data_ptr(), w_scales.contiguous().data_ptr(),
        None if bias is None else bias.contiguous().data_ptr(),
        None if residual is None else residual.contiguous().data_ptr(), y.data_ptr(),
        int(dtype == torch.bfloat16),
    )  # fmt: skip
    return y


def silu_quantize(
    x: Tensor, packed: Tensor, inter: int, x_scale: Tensor, w_scales: Tensor,
    dtype: torch.dtype, fixed: float | None, lib: native.Library | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """W8A8's gate/up product (``packed``: the ``[2·inter, K]`` weight, gate rows first) and
    what follows it: ``quantize_rows(silu(gate) · up)`` of its scaled sums in ``dtype``, the
    SiLU made as the tiles are stored: ``(q int8 [M, inter], scale fp32 [M, 1])``, what
    :func:`engine.kernels.layer_ops.w8a8_silu_quantize` gives on the int32 sums."""
    lib = lib or library()
    x = x.contiguous()
    m = x.shape[0]
    act = torch.empty(m, inter, dtype=torch.float32)
    q = torch.empty(m, inter, dtype=torch.int8)
    scale = torch.empty(m, 1, dtype=torch.float32)
    _run(
        lib.lib.infersight_amx_silu_quantize, x, packed, inter,
        x_scale.contiguous().data_ptr(), w_scales.contiguous().data_ptr(),
        int(dtype == torch.bfloat16), 0.0 if fixed is None else fixed, act.data_ptr(),
        q.data_ptr(), scale.data_ptr(),
    )  # fmt: skip
    return q, scale


# -- the check -----------------------------------------------------------------------------------

PROBE = f"{__name__}:_probe_build"


def _probe_build() -> str:
    found = build()
    return check(found) if found.available else found.why


def check(lib: native.Library) -> str:
    """A few shapes (rows in whole 32s and not; the extremes of int8) against
    ``torch._int_mm``, bit for bit, the scaled sums too; SiLU · up's quantization within a
    rounding (:func:`engine.kernels.lowbit_rows.quantization_differs`): "" if they agree."""
    gen = torch.Generator().manual_seed(3)
    for m, n, k in ((64, 32, 64), (77, 96, 192), (17, 64, 128)):
        x = torch.randint(-128, 128, (m, k), generator=gen, dtype=torch.int8)
        w = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
        x[0], w[0] = -128, -128  # the largest products
        packed, want = pack(w, lib), torch._int_mm(x, w.t())
        if not torch.equal(gemm(x, packed, n, lib), want):
            return f"[{m}, {k}] × [{k}, {n}] differs from torch._int_mm"
        sx, sw = torch.rand(m, 1, generator=gen) * 1e-3, torch.rand(n, generator=gen) * 1e-2
        bias = torch.randn(n, generator=gen)
        for dtype in (torch.float32, torch.bfloat16):
            residual = torch.randn(m, n, generator=gen).to(dtype)
            for b, res in ((None, None), (bias, residual)):
                got = gemm_scaled(x, packed, n, sx, sw, b, dtype, res, lib)
                if not torch.equal(
                    got, lowbit_rows.scale_rows_reference(want, sx, sw, b, dtype, res)
                ):
                    return f"[{m}, {k}] × [{k}, {n}] scaled to {dtype} differs from scale_rows"
            # SiLU · up and its quantization: torch's within a rounding (the exp is ours)
            gate, up = lowbit_rows.scale_rows_reference(want, sx, sw, None, dtype).chunk(2, dim=1)
            why = lowbit_rows.quantization_differs(
                f"[{m}, {k}] × [{k}, {n}]'s SiLU · up in {dtype}",
                silu_quantize(x, packed, n // 2, sx, sw, dtype, None, lib),
                torch.nn.functional.silu(gate) * up,
            )
            if why:
                return why
    return ""
