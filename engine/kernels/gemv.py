"""Products of a few rows with float activations, of our own on the CPU (``csrc/gemv.c``):
our INT8 weights (per-row scales), bf16 or fp32 weights, times fp32 or bf16 activations.

A decode step multiplies one row of activations by every weight of the model once: bound by
memory, not arithmetic. torch's INT8 kernel for one row (``_weight_int8pack_mm``) streams its
weights at about a third of the bandwidth the CPU has (``make bench-peers``, Llama-3.2-1B's
shapes), where llama.cpp's Q8_0 reaches 0.6. This kernel converts each weight to fp32 in
registers and multiplies it into fp32 sums, four output rows at a time: the activations stay
float, so nothing is approximated beyond the order of the sums (unlike
:mod:`engine.kernels.lowbit`, which quantizes them).

**A kernel per step shape.** The weights keep one layout, the one torch's kernel reads too, so
a layer takes ours for the shapes it is fastest at (one row, a verification's or a small
batch's few: up to :data:`MAX_ROWS`) and torch's for prefill chunks, each call by its row
count. Whether ours runs a layer's small shapes is timed once per machine and shape at load,
against torch's kernel at one row (``kernels.json``), under ``INFERSIGHT_LOWBIT``'s modes
(:func:`engine.kernels.lowbit.requested`): ``auto`` times, ``ours`` always, ``torch`` never.

Built once per machine and CPU level like the other kernels (:mod:`engine.kernels.native`),
first checked in a child process (:mod:`engine.hardware.isolated`).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from engine.hardware.verdicts import Allowance
from engine.kernels import lowbit, lowbit_timing, native, verify

log = logging.getLogger(__name__)

SOURCE = native.CSRC / "gemv.c"
#: rows of activations up to which a layer that chose ours takes it (decode, verification,
#: small batches); above, torch's kernel (prefill chunks)
MAX_ROWS = 16
#: weight types, as the C code numbers them
INT8, BF16, FP32 = 0, 1, 2


#: A loaded build of ``gemv.c``, or why there is none.
Library = native.Library


def load(path: Path) -> Library:
    """Load a build of ``gemv.c`` and declare its function."""

    def declare(lib: Any) -> None:
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.infersight_gemv.restype = ctypes.c_int
        lib.infersight_gemv.argtypes = [p, i32, i64, i64, p, i32, p, i64, p, i32, i32]

    return native.load(path, "infersight_gemv_isa", declare)


def build(level: str | None = None) -> Library:
    """Build (once per machine) and load the library for ``level``, without the child's
    check: for tests, which check each level themselves."""
    return native.build_library(SOURCE, "our GEMV kernel", level, load)


@cache
def library() -> Library:
    """This machine's build at the current CPU level, checked once in a child process."""
    return native.checked(build(), "GEMV kernel", PROBE)


_WIDTH = {torch.float32: 0, torch.bfloat16: 1}
_TYPES = {torch.int8: INT8, torch.bfloat16: BF16, torch.float32: FP32}


def product(
    lib: Library, x: Tensor, weight: Tensor, scales: Tensor | None, out: torch.dtype
) -> Tensor:
    """``x [M, K]`` (fp32 or bf16; others are converted) times ``weight [N, K]`` (int8 with
    float32 ``scales [N]``, bf16 or fp32): ``[M, N]`` in ``out`` (fp32 or bf16; others
    converted)."""
    # raw pointers cross into C: the layouts it assumes are checked here
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"GEMV: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not fit")
    if weight.dtype not in _TYPES or not weight.is_contiguous():
        raise ValueError("GEMV: the weight must be contiguous int8, bf16 or fp32")
    if weight.dtype == torch.int8 and (
        scales is None or scales.dtype != torch.float32 or not scales.is_contiguous()
        or scales.numel() != weight.shape[0]
    ):  # fmt: skip
        raise ValueError(f"GEMV: INT8 weights need {weight.shape[0]} contiguous float32 scales")
    if x.dtype not in _WIDTH:
        x = x.float()
    x = x.contiguous()
    y = torch.empty(x.shape[0], weight.shape[0], dtype=out if out in _WIDTH else torch.float32)
    rc = native.call(
        "infersight::gemv", lib.lib.infersight_gemv,
        x.data_ptr(), _WIDTH[x.dtype], x.shape[0], x.shape[1], weight.data_ptr(),
        _TYPES[weight.dtype], None if scales is None else scales.data_ptr(), weight.shape[0],
        y.data_ptr(), _WIDTH[y.dtype], lowbit.threads(),
    )  # fmt: skip
    if rc:
        raise MemoryError("our GEMV kernel ran out of memory for its scratch space")
    return y if y.dtype == out else y.to(out)


def int8_linear(x: Tensor, weight: Tensor, scales: Tensor, out: torch.dtype) -> Tensor:
    """This machine's kernel (:func:`library`) on INT8 weights with float32 ``scales``."""
    return product(library(), x, weight, scales, out)


# -- the check ---------------------------------------------------------------------------------

PROBE = f"{__name__}:_probe_build"


def _probe_build() -> str:
    found = build()
    return check(found) if found.available else found.why


def check(lib: Library) -> str:
    """Every weight type, from and to fp32 and bf16, on ragged shapes against float64, within
    the policy's bound for fp32 sums of K (:func:`engine.kernels.verify.tolerance`); a bf16
    output the fp32 one rounded as torch rounds: "" if all agree."""
    gen = torch.Generator().manual_seed(0)
    for m, k, n in ((1, 40, 7), (3, 129, 18), (6, 64, 33)):
        x = torch.randn(m, k, generator=gen)
        w = torch.randn(n, k, generator=gen)
        q = (w * 40).round().clamp(-127, 127).to(torch.int8)
        scales = torch.rand(n, generator=gen) + 0.5
        cases = [(q, scales, q.double() * scales.double()[:, None]),
                 (w.bfloat16(), None, w.bfloat16().double()), (w, None, w.double())]  # fmt: skip
        for weight, s, dense in cases:
            for x_dtype in (torch.float32, torch.bfloat16):
                xs = x.to(x_dtype)
                want = xs.double() @ dense.T
                got = product(lib, xs, weight, s, torch.float32)
                why = _compare(f"{weight.dtype} × {x_dtype}", got, want, k)
                if why:
                    return why
                if not torch.equal(product(lib, xs, weight, s, torch.bfloat16), got.bfloat16()):
                    return f"{weight.dtype} [{m}, {k}]: bf16 output rounds otherwise than torch"
    return ""


def _compare(name: str, got: Tensor, want: Tensor, k: int) -> str:
    """fp32 sums of ``k`` products in another order than float64's, rounded once to fp32."""
    return verify.differs(name, got, want, verify.tolerance(torch.float32, k))


# -- the choice, per layer shape -----------------------------------------------------------------


def chosen(
    fmt: str, out_features: int, in_features: int, timer: Callable[[], lowbit.Timing] | None,
    slack: float | Allowance = 1.0,
) -> bool:  # fmt: skip
    """Whether a CPU layer of this format (``int8 bfloat16``: weights and activations) and
    shape takes our kernel for its small step shapes: the library builds and passed its check,
    and (``auto``) it measured faster at one row than torch's kernel (or within ``slack`` × its
    time), timed once by ``timer`` and kept in ``kernels.json`` (no ``timer``: torch has no
    kernel here to time against)."""
    if lowbit.requested() == "torch":
        return False
    key = lowbit.shape_key(f"gemv {fmt}", out_features, in_features)
    return lowbit.decided(library, "gemv", key, timer, slack)


def time_int8(out_features: int, in_features: int, dtype: torch.dtype) -> lowbit.Timing:
    """Ours against ``torch._weight_int8pack_mm`` at one row of ``dtype`` activations."""
    return lowbit_timing.time_int8(out_features, in_features, dtype, kernel=int8_linear)
