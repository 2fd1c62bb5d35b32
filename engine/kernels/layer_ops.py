"""The decoder layer's fused operations: on a GPU our Triton kernels
(:mod:`engine.kernels.triton_kernels.fused`): RMSNorm, the residual add with the norm after
it, and RoPE with the K/V write, one pass each, in place of the model's torch code
(:class:`engine.model.transformer.LayerOps`, which stays the reference). A load that attends
through our kernels hands its layers these too, once they pass their check against the torch
code (:func:`engine.kernels.triton_check.fused`). On a CPU, the norms in C (:func:`cpu_ops`):
one call each where eager PyTorch dispatches a dozen operators."""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from engine.errors import InfersightError
from engine.kernels import native
from engine.model import transformer
from engine.model.transformer import LayerOps


def triton_ops() -> LayerOps:
    """Our fused kernels as the layers' operations."""
    from engine.kernels.triton_kernels import fused

    return LayerOps(
        rms_norm=fused.rms_norm,
        add_rms_norm=fused.add_rms_norm,
        rope_store=fused.rope_store,
        name="Triton: RMSNorm, residual add + RMSNorm, RoPE + KV write",
    )


# -- on a CPU: the norms in C (csrc/layer_ops.c) ------------------------------------------------

SOURCE = native.CSRC / "layer_ops.c"
#: Relative error a norm may have against float64 in fp32 (the sum of squares in another order)
TOLERANCE = 1e-5


def _load(path: Path) -> native.Library:
    def declare(lib: Any) -> None:
        p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        lib.infersight_rms_norm.restype = None
        lib.infersight_rms_norm.argtypes = [p, p, i64, i64, f32, i32, p]
        lib.infersight_add_rms_norm.restype = None
        lib.infersight_add_rms_norm.argtypes = [p, p, p, i64, i64, f32, i32, p, p]

    return native.load(path, "infersight_layer_ops_isa", declare)


def build(level: str | None = None) -> native.Library:
    """Build (once per machine) and load the norms for ``level``, without the child's check."""
    return native.build_library(SOURCE, "our C norms", level, _load)


@cache
def library() -> native.Library:
    """This machine's build, checked once in a child process."""
    return native.checked(build(), "C norms", PROBE)


class CNorms:
    """The layers' RMSNorm and residual add + RMSNorm on one C call each, for contiguous fp32
    and bf16 rows with a weight of their dtype; anything else (and a compiled graph, which
    cannot trace a C call) takes the torch code."""

    def __init__(self, lib: native.Library) -> None:
        self.lib = lib.lib

    @staticmethod
    def _ours(x: Tensor, weight: Tensor) -> bool:
        return (
            x.dtype in (torch.float32, torch.bfloat16)
            and weight.dtype == x.dtype
            and x.is_contiguous()
            and x.device.type == "cpu"
            and not torch.compiler.is_compiling()
        )

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        if not self._ours(x, weight):
            return transformer.rms_norm(x, weight, eps)
        h = x.shape[-1]
        out = torch.empty_like(x)
        self.lib.infersight_rms_norm(
            x.data_ptr(), weight.data_ptr(), x.numel() // h, h, eps,
            int(x.dtype == torch.bfloat16), out.data_ptr(),
        )  # fmt: skip
        return out

    def add_rms_norm(
        self, x: Tensor, residual: Tensor, weight: Tensor, eps: float
    ) -> tuple[Tensor, Tensor]:
        if not (self._ours(x, weight) and residual.dtype == x.dtype
                and residual.is_contiguous() and residual.shape == x.shape):  # fmt: skip
            return transformer.add_rms_norm(x, residual, weight, eps)
        h = x.shape[-1]
        out, summed = torch.empty_like(x), torch.empty_like(x)
        self.lib.infersight_add_rms_norm(
            x.data_ptr(), residual.data_ptr(), weight.data_ptr(), x.numel() // h, h, eps,
            int(x.dtype == torch.bfloat16), out.data_ptr(), summed.data_ptr(),
        )  # fmt: skip
        return out, summed


def c_ops(lib: native.Library) -> LayerOps:
    """The norms of ``lib`` as the layers' operations (RoPE and the K/V write stay torch's)."""
    norms = CNorms(lib)
    return LayerOps(
        rms_norm=norms.rms_norm,
        add_rms_norm=norms.add_rms_norm,
        name="C: RMSNorm, residual add + RMSNorm",
    )


def cpu_ops() -> tuple[LayerOps | None, str]:
    """Our C norms for a CPU load where ``INFERSIGHT_LOWBIT`` allows our CPU kernels
    (:func:`engine.kernels.lowbit.requested`: ``auto`` and ``ours``) and the build passed its
    check; else None and why (a line of the load report)."""
    from engine.kernels import lowbit

    mode = lowbit.requested()
    if mode == "torch":
        return None, f"norms in torch ({lowbit.ENV}=torch)"
    found = library()
    if not found.available:
        if mode == "ours":
            raise InfersightError(f"{lowbit.ENV}=ours, but {found.why}; unset it to fall back")
        return None, f"norms in torch ({found.why})"
    ops = c_ops(found)
    return ops, ops.name


# -- the check -----------------------------------------------------------------------------------

PROBE = f"{__name__}:_probe_build"


def _probe_build() -> str:
    found = build()
    return check(found) if found.available else found.why


def check(lib: native.Library) -> str:
    """Both norms in fp32 and bf16, on a few rows, against the torch code: within
    :data:`TOLERANCE` in fp32, within one bf16 rounding in bf16. "" if all agree."""
    ops = c_ops(lib)
    gen = torch.Generator().manual_seed(0)
    for rows, h in ((1, 64), (3, 100), (5, 576)):
        x = torch.randn(rows, h, generator=gen) * 3
        r = torch.randn(rows, h, generator=gen)
        w = torch.rand(h, generator=gen) + 0.5
        for dtype in (torch.float32, torch.bfloat16):
            xs, rs, ws = x.to(dtype), r.to(dtype), w.to(dtype)
            pairs = [(ops.rms_norm(xs, ws, 1e-5), transformer.rms_norm(xs, ws, 1e-5))]
            got, got_sum = ops.add_rms_norm(xs, rs, ws, 1e-5)
            want, want_sum = transformer.add_rms_norm(xs, rs, ws, 1e-5)
            if not torch.equal(got_sum, want_sum):
                return f"the residual add of [{rows}, {h}] {dtype} differs from torch's"
            pairs.append((got, want))
            tolerance = TOLERANCE if dtype == torch.float32 else 2.0**-7
            for g, wnt in pairs:
                err = (g.double() - wnt.double()).abs() / wnt.double().abs().clamp_min(1e-3)
                if err.max().item() > tolerance:
                    return f"RMSNorm of [{rows}, {h}] {dtype}: {err.max().item():.3g} from torch's"
    return ""
