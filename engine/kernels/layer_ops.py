"""The decoder layer's fused operations: on a GPU our Triton kernels
(:mod:`engine.kernels.triton_kernels.fused`): RMSNorm, the residual add with the norm after
it, and RoPE with the K/V write, one pass each, in place of the model's torch code
(:class:`engine.model.transformer.LayerOps`, which stays the reference). A load that attends
through our kernels hands its layers these too, once they pass their check against the torch
code (:func:`engine.kernels.triton_check.fused`). On a CPU, the same three in C
(:func:`cpu_ops`): one call each where eager PyTorch dispatches a dozen operators. The same
library runs a whole decode step's layers in one call (:mod:`engine.executor.c_step`)."""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from engine.errors import InfersightError
from engine.formats import kv as kv_format
from engine.kernels import lowbit, lowbit_rows, native, verify
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


def _load(path: Path) -> native.Library:
    def declare(lib: Any) -> None:
        p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        lib.infersight_rms_norm.restype = None
        lib.infersight_rms_norm.argtypes = [p, p, i64, i64, f32, i32, p, i32]
        lib.infersight_add_rms_norm.restype = None
        lib.infersight_add_rms_norm.argtypes = [p, p, p, i64, i64, f32, i32, p, p, i32]
        lib.infersight_rope_store.restype = None
        lib.infersight_rope_store.argtypes = [p, i32, i64, i64, i64, i64, p, p, p, p, i32]
        lib.infersight_w8a8_norm_quantize.restype = None
        lib.infersight_w8a8_norm_quantize.argtypes = [p, p, i64, i64, f32, i32, f32, p, p, i32]
        lib.infersight_w8a8_add_norm_quantize.restype = None
        lib.infersight_w8a8_add_norm_quantize.argtypes = [
            p,
            p,
            p,
            p,
            p,
            p,
            i64,
            i64,
            f32,
            i32,
            f32,
            p,
            p,
            p,
            i32,
        ]
        lib.infersight_w8a8_silu_quantize.restype = None
        lib.infersight_w8a8_silu_quantize.argtypes = [p, p, p, i64, i64, i32, f32, p, p, i32]

    return native.load(path, "infersight_layer_ops_isa", declare)


def build(level: str | None = None) -> native.Library:
    """Build (once per machine) and load the norms for ``level``, without the child's check."""
    return native.build_library(SOURCE, "our C norms", level, _load)


@cache
def library() -> native.Library:
    """This machine's build, checked once in a child process."""
    return native.checked(build(), "C norms", PROBE)


#: the longest head the C RoPE takes (it rotates a head through a buffer of this many floats)
MAX_HEAD_DIM = 512


class CNorms:
    """The layers' RMSNorm, residual add + RMSNorm, and RoPE + K/V write on one C call each,
    for contiguous fp32 and bf16 rows with weights (angles, a pool) of their dtype; anything
    else (and a compiled graph, which cannot trace a C call) takes the torch code."""

    def __init__(self, lib: native.Library) -> None:
        self.lib = lib.lib

    @staticmethod
    def _ours(x: Tensor, weight: Tensor) -> bool:
        return (
            x.dtype in (torch.float32, torch.bfloat16)
            and weight.dtype == x.dtype
            and x.is_contiguous()
            and x.dim() >= 1
            and weight.shape == (x.shape[-1],)  # C reads one weight a column, no more
            and weight.is_contiguous()
            and x.device.type == "cpu"
            and not torch.compiler.is_compiling()
        )

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        if not self._ours(x, weight):
            return transformer.rms_norm(x, weight, eps)
        h = x.shape[-1]
        out = torch.empty_like(x)
        native.call(
            "infersight::rms_norm", self.lib.infersight_rms_norm,
            x.data_ptr(), weight.data_ptr(), x.numel() // h, h, eps,
            int(x.dtype == torch.bfloat16), out.data_ptr(), _threads(x.numel() // h),
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
        native.call(
            "infersight::add_rms_norm", self.lib.infersight_add_rms_norm,
            x.data_ptr(), residual.data_ptr(), weight.data_ptr(), x.numel() // h, h, eps,
            int(x.dtype == torch.bfloat16), out.data_ptr(), summed.data_ptr(),
            _threads(x.numel() // h),
        )  # fmt: skip
        return out, summed

    def rope_store(
        self, qkv: Tensor, cos: Tensor, sin: Tensor, pool: Tensor, write_slots: Tensor, *,
        num_heads: int, num_kv_heads: int, head_dim: int,
    ) -> Tensor:  # fmt: skip
        """:func:`engine.model.transformer.rope_store` in one C call."""
        tokens = qkv.shape[0]
        dtype = qkv.dtype
        int8 = pool.dtype == torch.int8  # rows quantized as they are written (csrc/kv_rows.h)
        ours = (
            dtype in (torch.float32, torch.bfloat16)
            and cos.dtype == sin.dtype == dtype and pool.dtype in (dtype, torch.int8)
            and qkv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()
            and pool.is_contiguous() and pool.dim() == 3
            and pool.shape[1:] == (2 * num_kv_heads, head_dim + 4 * int8)
            and write_slots.dtype == torch.int64
            and write_slots.is_contiguous() and write_slots.numel() == tokens
            and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim
            and cos.numel() == sin.numel() == tokens * head_dim
            and head_dim % 2 == 0 and head_dim <= MAX_HEAD_DIM
            and qkv.device.type == "cpu" and not torch.compiler.is_compiling()
        )  # fmt: skip
        if not ours:
            return transformer.rope_store(
                qkv, cos, sin, pool, write_slots, num_heads=num_heads,
                num_kv_heads=num_kv_heads, head_dim=head_dim,
            )  # fmt: skip
        native.call(
            "infersight::rope_store", self.lib.infersight_rope_store,
            qkv.data_ptr(), int(dtype == torch.bfloat16) | int8 << 1, tokens, num_heads,
            num_kv_heads, head_dim, cos.data_ptr(), sin.data_ptr(), pool.data_ptr(),
            write_slots.data_ptr(),
            _threads(tokens),
        )  # fmt: skip
        return qkv[:, : num_heads * head_dim].view(tokens, num_heads, head_dim)


#: rows below which the norms run on one thread (a decode step's: waking a second costs more)
THREADED_ROWS = 32


def _threads(rows: int) -> int:
    return torch.get_num_threads() if rows >= THREADED_ROWS else 1


def c_ops(lib: native.Library) -> LayerOps:
    """The kernels of ``lib`` as the layers' operations."""
    norms = CNorms(lib)
    return LayerOps(
        rms_norm=norms.rms_norm,
        add_rms_norm=norms.add_rms_norm,
        rope_store=norms.rope_store,
        name="C: RMSNorm, residual add + RMSNorm, RoPE + KV write",
    )


def cpu_ops() -> tuple[LayerOps | None, str]:
    """Our C norms for a CPU load where ``INFERSIGHT_LOWBIT`` allows our CPU kernels
    (:func:`engine.kernels.lowbit.requested`: ``auto`` and ``ours``) and the build passed its
    check; else None and why (a line of the load report)."""
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


# -- W8A8's row operations fused on a prefill's rows (csrc/layer_ops.c; engine/quant/w8a8.py) ---
# Each is the composition of calls it replaces, value for value: the C norm (above), then the
# quantization (lowbit_rows.quantize_rows); the int32 scaling (lowbit_rows.scale_rows), the
# residual add, the norm, the quantization; the scaling, SiLU · up (the C decode step's), the
# quantization.
# The references below are those compositions in torch's code (the checks' and tests' oracle).


def _flag(x: Tensor) -> int:
    return int(x.dtype == torch.bfloat16)


def _fixed(value: float | None) -> float:
    return 0.0 if value is None else value


def w8a8_norm_quantize(
    lib: native.Library, x: Tensor, weight: Tensor, eps: float, fixed: float | None
) -> tuple[Tensor, Tensor]:
    """``quantize_rows(rms_norm(x) · weight)``: ``(q int8 [M, H], scale fp32 [M, 1])``, for
    contiguous fp32 or bf16 ``x [M, H]`` and ``weight`` of its dtype."""
    rows, h = x.shape
    q = torch.empty(rows, h, dtype=torch.int8)
    scale = torch.empty(rows, 1, dtype=torch.float32)
    native.call(
        "infersight::w8a8_norm_quantize", lib.lib.infersight_w8a8_norm_quantize,
        x.data_ptr(), weight.data_ptr(), rows, h, eps, _flag(x), _fixed(fixed), q.data_ptr(),
        scale.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return q, scale


def w8a8_add_norm_quantize(
    lib: native.Library, acc: Tensor, x_scale: Tensor, w_scales: Tensor, bias: Tensor | None,
    residual: Tensor, weight: Tensor, eps: float, fixed: float | None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``summed = residual + scale_rows(acc)`` (in ``residual``'s dtype), then
    ``quantize_rows(rms_norm(summed) · weight)``: ``(summed, q, scale)``. ``acc [M, H]``
    int32, ``x_scale [M, 1]``, ``w_scales [H]`` and ``bias`` fp32, all contiguous."""
    rows, h = acc.shape
    summed = torch.empty_like(residual)
    q = torch.empty(rows, h, dtype=torch.int8)
    scale = torch.empty(rows, 1, dtype=torch.float32)
    native.call(
        "infersight::w8a8_add_norm_quantize", lib.lib.infersight_w8a8_add_norm_quantize,
        acc.data_ptr(), x_scale.data_ptr(), w_scales.data_ptr(),
        None if bias is None else bias.data_ptr(), residual.data_ptr(), weight.data_ptr(),
        rows, h, eps, _flag(residual), _fixed(fixed), summed.data_ptr(), q.data_ptr(),
        scale.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return summed, q, scale


def w8a8_silu_quantize(
    lib: native.Library, acc: Tensor, x_scale: Tensor, w_scales: Tensor, dtype: torch.dtype,
    fixed: float | None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``quantize_rows(silu(gate) · up)`` of ``scale_rows(acc)`` in ``dtype`` (``acc [M, 2I]``
    int32, gate first): the down product's activations."""
    rows, n = acc.shape
    inter = n // 2
    q = torch.empty(rows, inter, dtype=torch.int8)
    scale = torch.empty(rows, 1, dtype=torch.float32)
    native.call(
        "infersight::w8a8_silu_quantize", lib.lib.infersight_w8a8_silu_quantize,
        acc.data_ptr(), x_scale.data_ptr(), w_scales.data_ptr(), rows, inter,
        int(dtype == torch.bfloat16), _fixed(fixed), q.data_ptr(), scale.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return q, scale


def w8a8_norm_quantize_reference(
    x: Tensor, weight: Tensor, eps: float, fixed: float | None
) -> tuple[Tensor, Tensor]:
    return lowbit_rows.quantize_rows_reference(transformer.rms_norm(x, weight, eps), fixed)


def w8a8_add_norm_quantize_reference(
    acc: Tensor, x_scale: Tensor, w_scales: Tensor, bias: Tensor | None, residual: Tensor,
    weight: Tensor, eps: float, fixed: float | None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    y = lowbit_rows.scale_rows_reference(acc, x_scale, w_scales, bias, residual.dtype)
    normed, summed = transformer.add_rms_norm(y, residual, weight, eps)
    return (summed, *lowbit_rows.quantize_rows_reference(normed, fixed))


def w8a8_silu_quantize_reference(
    acc: Tensor, x_scale: Tensor, w_scales: Tensor, dtype: torch.dtype, fixed: float | None
) -> tuple[Tensor, Tensor]:
    values = w8a8_silu_reference(acc, x_scale, w_scales, dtype)
    return lowbit_rows.quantize_rows_reference(values, fixed)


def w8a8_silu_reference(
    acc: Tensor, x_scale: Tensor, w_scales: Tensor, dtype: torch.dtype
) -> Tensor:
    """``silu(gate) · up`` of ``scale_rows(acc)`` in ``dtype``: what the fused SiLU quantizes."""
    gate, up = lowbit_rows.scale_rows_reference(acc, x_scale, w_scales, None, dtype).chunk(2, dim=1)
    return torch.nn.functional.silu(gate) * up


# -- the check -----------------------------------------------------------------------------------

PROBE = f"{__name__}:_probe_build"


def _probe_build() -> str:
    found = build()
    return check(found) if found.available else found.why


def check(lib: native.Library) -> str:
    """Both norms in fp32 and bf16, on a few rows, against the torch code, within the policy's
    bound for a sum of ``h`` squares (:func:`engine.kernels.verify.tolerance`): the C rounds
    where torch rounds, so in bf16 only a sum of squares in another order may move a value
    across one rounding, on either side; the residual add bit for bit. "" if all agree."""
    ops = c_ops(lib)
    gen = torch.Generator().manual_seed(0)
    for rows, h in ((1, 64), (3, 100), (5, 576)):
        x = torch.randn(rows, h, generator=gen) * 3
        r = torch.randn(rows, h, generator=gen)
        w = torch.rand(h, generator=gen) + 0.5
        for dtype in (torch.float32, torch.bfloat16):
            xs, rs, ws = x.to(dtype), r.to(dtype), w.to(dtype)
            pairs = [("RMSNorm", ops.rms_norm(xs, ws, 1e-5), transformer.rms_norm(xs, ws, 1e-5))]
            got, got_sum = ops.add_rms_norm(xs, rs, ws, 1e-5)
            want, want_sum = transformer.add_rms_norm(xs, rs, ws, 1e-5)
            if not torch.equal(got_sum, want_sum):
                return f"the residual add of [{rows}, {h}] {dtype} differs from torch's"
            pairs.append(("residual add + RMSNorm", got, want))
            tolerance = verify.tolerance(dtype, h)
            for name, g, wnt in pairs:
                why = verify.differs(f"{name} of {dtype}", g, wnt, tolerance, "torch's")
                if why:
                    return why
    return _check_rope_store(ops) or _check_w8a8(lib)


def _check_rope_store(ops: LayerOps) -> str:
    """RoPE + the K/V write against the torch code, bit for bit, fp32 and bf16, GQA, into a
    float pool and into int8 rows (quantized as written)."""
    assert ops.rope_store is not None
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, tokens = 4, 2, 16, 3
    angles = torch.rand(tokens, 1, dim, generator=gen) * 6
    for dtype in (torch.float32, torch.bfloat16):
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        slots = torch.tensor([5, 0, 2])
        for fmt in (kv_format.float_format(dtype), kv_format.INT8):
            results = []
            for fn in (ops.rope_store, transformer.rope_store):
                pool = (
                    fmt.empty(6, kv_heads, dim, "cpu").view(torch.uint8).zero_().view(fmt.storage)
                )
                q = fn(qkv.clone(), cos, sin, pool, slots, num_heads=heads,
                       num_kv_heads=kv_heads, head_dim=dim)  # fmt: skip
                results.append((q, pool))
            (q, pool), (want_q, want_pool) = results
            if not (torch.equal(q, want_q) and torch.equal(pool, want_pool)):
                return f"RoPE + the K/V write in {dtype} into a {fmt.name} pool differ from torch's"
    return ""


def _check_w8a8(lib: native.Library) -> str:
    """W8A8's fused row operations against the calls they fuse: the norms' bit for bit
    (our C norm, then torch's quantization, which ours equals); SiLU · up, whose exp is ours,
    against torch's within a rounding of the dtype
    (:func:`engine.kernels.lowbit_rows.quantization_differs`: an int8 value one step off
    only beside a tie)."""
    gen = torch.Generator().manual_seed(2)
    norms = CNorms(lib)
    rows, h, inter, eps = 37, 70, 44, 1e-5
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(rows, h, generator=gen) * 3).to(dtype)
        w = (torch.rand(h, generator=gen) + 0.5).to(dtype)
        acc = torch.randint(-(2**16), 2**16, (rows, h), generator=gen, dtype=torch.int32)
        sx, sw = torch.rand(rows, 1, generator=gen) * 1e-3, torch.rand(h, generator=gen) * 1e-2
        bias = torch.randn(h, generator=gen)
        for fixed in (None, 0.05):
            got = w8a8_norm_quantize(lib, x, w, eps, fixed)
            want = lowbit_rows.quantize_rows_reference(norms.rms_norm(x, w, eps), fixed)
            if not all(map(torch.equal, got, want)):
                return f"the fused norm + quantization ({dtype}) differs from the two calls"
            got3 = w8a8_add_norm_quantize(lib, acc, sx, sw, bias, x, w, eps, fixed)
            y = lowbit_rows.scale_rows_reference(acc, sx, sw, bias, dtype)
            normed, summed = norms.add_rms_norm(y, x, w, eps)
            want3 = (summed, *lowbit_rows.quantize_rows_reference(normed, fixed))
            if not all(map(torch.equal, got3, want3)):
                return f"the fused add + norm + quantization ({dtype}) differs from the calls"
            acc2 = torch.randint(-(2**16), 2**16, (rows, 2 * inter), generator=gen,
                                 dtype=torch.int32)  # fmt: skip
            sw2 = torch.rand(2 * inter, generator=gen) * 1e-2
            why = lowbit_rows.quantization_differs(
                f"the fused SiLU · up + quantization ({dtype}, static {fixed})",
                w8a8_silu_quantize(lib, acc2, sx, sw2, dtype, fixed),
                w8a8_silu_reference(acc2, sx, sw2, dtype),
                fixed,
            )
            if why:
                return why
    return ""
