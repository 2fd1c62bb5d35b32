"""Weight-only quantized matrix products with the dequantization fused: ``y = x · dequant(W)ᵀ
(+ b)`` for fp16 or bf16 activations ``x [M, K]``, in our INT8 and INT4 formats
(:mod:`engine.formats`), accumulated in fp32 and written in ``x``'s dtype.

**Layouts.** Both keep ``nn.Linear``'s orientation, a row per output channel with K
contiguous (whole cache lines per row, and a tied head's embedding row is one row here too):

* INT8: ``weight`` int8 ``[N, K]`` and ``scales [N]`` in the activations' dtype, ``w = q · s``:
  what :func:`engine.formats.int8.quantize_int8` gives, unchanged.
* INT4: ``weight`` uint8 ``[N, Kp/2]`` in chunks of 32 columns (16 bytes), byte ``j`` of a chunk
  holding column ``j`` in its low nibble and ``16 + j`` in its high one, llama.cpp's Q4_0 order
  (:func:`engine.formats.int4.pack_int4` packs :func:`~engine.formats.int4.quantize_int4`'s
  values): each nibble's 16 columns of ``x`` are contiguous, so no kernel interleaves anything
  or loads ``x`` with a stride. ``scales_and_zeros`` bf16 ``[Kp/group, N, 2]``, ``w = (q − 8)·s
  + z``: group-major with N contiguous, so a tile's ``(s, z)`` of one group is one run of
  ``4·BLOCK_N`` bytes; they are the very values torch's INT4 kernels take, so both paths run the
  same quantization. ``Kp`` is K padded to a multiple of the group (32, 64 or 128); the kernels
  mask ``x`` at K, so the padding multiplies only zeros and ``x`` is never padded.

**Kernels** (:mod:`engine.kernels.triton_kernels.quant_gemm_kernels`): a GEMV for batch-1
decode, tensor-core tiles for M > 1, split-K for decode (fp32 partial sums that a second pass
adds up in a fixed order), 64-bit row offsets.

Grids: GEMV ``(⌈N/BLOCK_N⌉, splits, M)``; tiled ``(⌈M/BLOCK_M⌉·⌈N/BLOCK_N⌉, splits)``;
reduction ``⌈M·N/1024⌉``. Prefill tiles are the Triton tutorial's fp16 matmul configurations
(128×128×32 with 8 warps and 3 stages; 64×128×32 with 4 warps and 4 stages), which fit
sm_75's 64 KiB of shared memory; split-K aims at :data:`WAVES` programs per SM. bf16
configurations are built from sm_80 on (Turing has no bf16 MMA); below sm_80 the engine
computes in fp16.

**Below sm_80** Triton 3.9 compiles ``tl.dot`` to FMAs (its Turing MMA path is gone: "Dot op
using MMA for compute capability < 80 has been deprecated"). Decode is bound by the weights'
bytes and keeps our kernels; prefill (M > 16) there dequantizes the matrix a slice of rows
at a time (``_int4_dequantize``; INT8's ``q·s`` in the dtype) and multiplies with cuBLAS,
whose fp16 GEMM runs on Turing's tensor cores, as does bf16, which the engine never computes
in there (:func:`dense`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from engine.formats.int4 import unpack_int4
from engine.kernels import triton_support
from engine.kernels.triton_kernels.quant_gemm_kernels import (
    _int4_dequantize,
    _int4_gemv,
    _int4_mm,
    _int8_gemv,
    _int8_mm,
    _splitk_reduce,
)
from engine.kernels.triton_support import KernelConfig

#: the groups our INT4 format has (engine.quant.spec.INT4_GROUPS); each a multiple of 32
GROUPS = (32, 64, 128)
DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
#: the widest split: partial sums are ``splits · M · N`` fp32 values
MAX_SPLITS = 16
#: programs per SM that split-K aims for on a GPU: enough loads in flight to hide latency
WAVES = 4
REDUCE_BLOCK = 1024


# -- which kernel runs, with which tiles --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Tiles:
    """One launch shape: the kernel, its blocks, warps and stages, and whether it may split K."""

    kernel: str  # "gemv" or "mm"
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    may_split: bool


#: The most rows of activations the decode shapes serve (split-K, 16-row tiles)
DECODE_ROWS = 16
#: Per format, the launch shapes by the largest M each serves (the last serves any M).
TILES: dict[str, tuple[tuple[int, Tiles], ...]] = {
    "int8": (
        (1, Tiles("gemv", 1, 32, 128, 4, 1, True)),
        (DECODE_ROWS, Tiles("mm", 16, 64, 64, 4, 4, True)),
        (64, Tiles("mm", 64, 128, 32, 4, 4, False)),
        (2**31 - 1, Tiles("mm", 128, 128, 32, 8, 3, False)),
    ),
    "int4": (
        (1, Tiles("gemv", 1, 32, 256, 4, 1, True)),
        (DECODE_ROWS, Tiles("mm", 16, 64, 32, 4, 4, True)),
        (64, Tiles("mm", 64, 128, 32, 4, 4, False)),
        (2**31 - 1, Tiles("mm", 128, 128, 32, 8, 3, False)),
    ),
}
GROUP_M = 8
#: rows of a program of :func:`_int4_dequantize`
DEQUANTIZE_ROWS = 64
#: bytes of dequantized weights that exist at a time where cuBLAS multiplies them (:func:`dense`)
DENSE_BYTES = 64 * 2**20


def tiles_for(fmt: str, m: int) -> Tiles:
    """The launch shape ``fmt`` (``int8``/``int4``) uses for ``m`` rows of activations."""
    return next(tiles for most, tiles in TILES[fmt] if m <= most)


def splits_for(tiles: int, k_blocks: int, processors: int) -> int:
    """How many ways to split K so that ``tiles`` output tiles make about :data:`WAVES`
    programs per SM of ``processors``, each split at least two blocks of K, at most
    :data:`MAX_SPLITS` splits. No GPU (``processors == 0``: the interpreter runs programs one
    by one): one split."""
    return triton_support.split_k(
        tiles, k_blocks, processors, per_sm=WAVES, min_units=2, most=MAX_SPLITS
    )


@functools.cache
def tensor_cores(device: torch.device) -> bool:
    """Whether ``tl.dot`` runs on tensor cores on ``device``: from sm_80 (see the module's
    docstring). The interpreter stands for a GPU that has them."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 0)


def dense(x: Tensor) -> bool:
    """Whether ``x`` times the weights runs as cuBLAS on the dequantized matrix, not on our
    kernels: below sm_80, for prefill (no tensor cores for ``tl.dot``) and for bf16 (our bf16
    kernels are built from sm_80 on; the engine computes in fp16 there)."""
    return not tensor_cores(x.device) and (x.shape[0] > DECODE_ROWS or x.dtype == torch.bfloat16)


# -- launchers ------------------------------------------------------------------------------------


def int8_linear(
    x: Tensor, weight: Tensor, scales: Tensor, bias: Tensor | None = None, splits: int | None = None
) -> Tensor:
    """``x · (weight · scales[:, None])ᵀ (+ bias)``: ``x [M, K]`` fp16 or bf16, ``weight``
    int8 ``[N, K]``, ``scales [N]`` and ``bias [N]`` in ``x``'s dtype; ``[M, N]`` in that
    dtype. ``splits`` forces the split of K of a decode shape (M ≤ 16; tests); by default it
    is chosen for the GPU."""
    m, k = _check_x(x)
    n = weight.shape[0] if weight.dim() == 2 else 0
    if weight.dtype != torch.int8 or weight.shape != (n, k) or not weight.is_contiguous():
        raise ValueError(
            f"INT8 weights must be contiguous int8 [N, {k}] (x has K={k}), not "
            f"{weight.dtype} {tuple(weight.shape)}; quantize with engine.formats.int8.quantize_int8"
        )
    _check_vector("scales", scales, n, x.dtype)
    _check_vector("bias", bias, n, x.dtype)
    _check_device(x, weight, scales, bias)
    if dense(x):

        def rows(a: int, b: int) -> Tensor:  # q is exact in fp16 and bf16: one rounding, q·s
            w = weight[a:b].to(x.dtype) * scales[a:b, None]
            return F.linear(x, w, None if bias is None else bias[a:b])

        return _dense(x, n, rows)
    tiles = tiles_for("int8", m)
    y, part, split = _outputs(x, n, k, tiles, splits)
    args = (
        x, weight, scales, _or(bias, y), y, part, m, n, k, x.stride(0), split.k_per_split,
        int(bias is not None), int(split.count == 1),
    )  # fmt: skip
    kernel = _int8_gemv if tiles.kernel == "gemv" else _int8_mm
    return _run(kernel, args, tiles, y, part, bias, split.count)


def int4_linear(
    x: Tensor,
    weight: Tensor,
    scales_and_zeros: Tensor,
    group: int,
    bias: Tensor | None = None,
    splits: int | None = None,
) -> Tensor:
    """``x · dequant(weight)ᵀ (+ bias)``: ``x [M, K]`` fp16 or bf16; ``weight`` uint8
    ``[N, Kp/2]`` (:func:`engine.formats.int4.pack_int4`), ``Kp`` the least multiple of
    ``group`` ≥ K; ``scales_and_zeros`` bf16 ``[Kp/group, N, 2]``; ``bias [N]`` in ``x``'s
    dtype. ``[M, N]`` in ``x``'s dtype. ``splits`` as for :func:`int8_linear`."""
    m, k = _check_x(x)
    if group not in GROUPS:
        raise ValueError(f"INT4 group {group} is not one of ours; use one of {GROUPS}")
    n, half = weight.shape if weight.dim() == 2 else (0, 0)
    padded = -(-k // group) * group
    if weight.dtype != torch.uint8 or half * 2 != padded or not weight.is_contiguous():
        raise ValueError(
            f"INT4 weights for K={k} in groups of {group} must be contiguous uint8 "
            f"[N, {padded // 2}], not {weight.dtype} {tuple(weight.shape)}; pack them with "
            "pack_int4 from values padded to a whole group"
        )
    want = (padded // group, n, 2)
    sz = scales_and_zeros
    if sz.dtype != torch.bfloat16 or tuple(sz.shape) != want or not sz.is_contiguous():
        raise ValueError(
            f"INT4 scales_and_zeros must be contiguous bf16 {want} (groups, channels, scale "
            f"and zero), not {sz.dtype} {tuple(sz.shape)}"
        )
    _check_vector("bias", bias, n, x.dtype)
    _check_device(x, weight, sz, bias)
    if dense(x):

        def rows(a: int, b: int) -> Tensor:
            w = int4_dequantize(weight[a:b], sz[:, a:b], group, k, x.dtype)
            return F.linear(x, w, None if bias is None else bias[a:b])

        return _dense(x, n, rows)
    tiles = tiles_for("int4", m)
    y, part, split = _outputs(x, n, padded, tiles, splits)
    args = (
        x, weight, sz, _or(bias, y), y, part, m, n, k, half, x.stride(0), group,
        split.k_per_split, int(bias is not None), int(split.count == 1),
    )  # fmt: skip
    kernel = _int4_gemv if tiles.kernel == "gemv" else _int4_mm
    return _run(kernel, args, tiles, y, part, bias, split.count)


def int4_dequantize(
    weight: Tensor, scales_and_zeros: Tensor, group: int, k: int, dtype: torch.dtype
) -> Tensor:
    """The first ``k`` columns of the weights :func:`int4_linear` takes, dequantized:
    ``[N, k]`` in ``dtype`` (fp16 or bf16). ``scales_and_zeros`` may be a slice of channels
    (``[:, a:b]``) of a larger one."""
    n, half = weight.shape
    if scales_and_zeros.stride()[1:] != (2, 1):
        raise ValueError("scales_and_zeros must hold each channel's (scale, zero) contiguously")
    out = torch.empty((n, k), dtype=dtype, device=weight.device)
    if n and k:
        grid = (triton.cdiv(n, DEQUANTIZE_ROWS), triton.cdiv(k, 32))
        stride = scales_and_zeros.stride(0)
        _int4_dequantize[grid](
            weight, scales_and_zeros, out, n, k, half, stride, group, BLOCK_N=DEQUANTIZE_ROWS
        )
    return out


def _dense(x: Tensor, n: int, rows: Callable[[int, int], Tensor]) -> Tensor:
    """``[M, n]`` from ``rows(a, b)``, the product's columns ``a:b`` by cuBLAS on as many
    dequantized rows of the matrix, taken :data:`DENSE_BYTES` of them at a time: the whole
    dequantized matrix (a vocabulary's head: a GiB) never exists at once."""
    step = max(1, DENSE_BYTES // (x.shape[1] * x.element_size()))
    if step >= n:
        return rows(0, n)
    y = x.new_empty((x.shape[0], n))
    for start in range(0, n, step):
        y[:, start : start + step] = rows(start, min(n, start + step))
    return y


def _check_x(x: Tensor) -> tuple[int, int]:
    if x.dtype not in DTYPES:
        raise ValueError(f"activations must be fp16 or bf16, not {x.dtype}; cast them first")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(
            f"activations must be [M, K] with K contiguous, not {tuple(x.shape)} strided "
            f"{x.stride()}; reshape them to (-1, K), contiguous"
        )
    return x.shape[0], x.shape[1]


def _check_vector(name: str, t: Tensor | None, n: int, dtype: torch.dtype) -> None:
    if t is not None and (t.shape != (n,) or t.dtype != dtype or not t.is_contiguous()):
        raise ValueError(
            f"{name} must be a contiguous {dtype} [{n}] (the activations' dtype), not "
            f"{t.dtype} {tuple(t.shape)}"
        )


def _check_device(x: Tensor, *tensors: Tensor | None) -> None:
    elsewhere = {str(t.device) for t in tensors if t is not None and t.device != x.device}
    if elsewhere:
        raise ValueError(
            f"the activations are on {x.device} but weights, scales or bias on "
            f"{', '.join(sorted(elsewhere))}; move the layer or its input to one device"
        )


def _or(t: Tensor | None, stand_in: Tensor) -> Tensor:
    """``t``, or a tensor of its dtype to pass in its place (a kernel told ``has_bias = 0``
    never reads it)."""
    return stand_in if t is None else t


@dataclass(frozen=True, slots=True)
class _Split:
    count: int
    k_per_split: int  # a multiple of the tiles' block_k


def _outputs(
    x: Tensor, n: int, width: int, tiles: Tiles, splits: int | None
) -> tuple[Tensor, Tensor, _Split]:
    """``y``, the partial sums' buffer (``y`` itself when K is not split) and the split of
    ``width`` columns of K (Kp for INT4)."""
    m = x.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    k_blocks = max(1, triton.cdiv(width, tiles.block_k))
    if not tiles.may_split:
        splits = 1
    elif splits is None:
        programs = max(1, triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n))
        splits = splits_for(programs, k_blocks, triton_support.sm_count(x.device, 0))
    k_per_split = triton.cdiv(k_blocks, max(1, min(splits, k_blocks))) * tiles.block_k
    count = max(1, triton.cdiv(width, k_per_split))  # no split left empty
    part = y if count == 1 else x.new_empty((count, m, n), dtype=torch.float32)
    return y, part, _Split(count, k_per_split)


def _run(
    kernel: triton.JITFunction,
    args: tuple[object, ...],
    tiles: Tiles,
    y: Tensor,
    part: Tensor,
    bias: Tensor | None,
    splits: int,
) -> Tensor:
    """Launch ``kernel`` on ``args`` with ``tiles``, then the reduction of its partial sums
    when K is split."""
    m, n = y.shape
    if m == 0 or n == 0:
        return y
    launch = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    if tiles.kernel == "gemv":
        rows = (triton.cdiv(n, tiles.block_n), splits, m)
        kernel[rows](*args, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, **launch)
    else:
        tiled = (triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n), splits)
        kernel[tiled](
            *args, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
            GROUP_M=GROUP_M, MAY_SPLIT=tiles.may_split, **launch,
        )  # fmt: skip
    if splits > 1:
        flat = (triton.cdiv(m * n, REDUCE_BLOCK),)
        has_bias = int(bias is not None)
        _splitk_reduce[flat](part, _or(bias, y), y, m, n, splits, has_bias, BLOCK=REDUCE_BLOCK)
    return y


# -- the torch references -------------------------------------------------------------------


def int8_reference(x: Tensor, weight: Tensor, scales: Tensor, bias: Tensor | None) -> Tensor:
    """What :func:`int8_linear` computes, by dequantizing then multiplying in fp32."""
    w = weight.float() * scales.float()[:, None]
    y = x.float() @ w.T
    return (y if bias is None else y + bias.float()).to(x.dtype)


def int4_reference(
    x: Tensor, weight: Tensor, scales_and_zeros: Tensor, group: int, bias: Tensor | None
) -> Tensor:
    """What :func:`int4_linear` computes, by dequantizing then multiplying in fp32."""
    q = unpack_int4(weight).float() - 8
    n, padded = q.shape
    sz = scales_and_zeros.float().transpose(0, 1)  # [N, Kp/group, 2]
    w = q.view(n, padded // group, group) * sz[..., :1] + sz[..., 1:]
    y = x.float() @ w.reshape(n, padded)[:, : x.shape[1]].T
    return (y if bias is None else y + bias.float()).to(x.dtype)


# -- the ahead-of-time build ----------------------------------------------------------------


def configs() -> list[KernelConfig]:
    """Every configuration the launchers pick: each format's tiles × fp16 and bf16 and the
    split-K reduction (bf16 from sm_80 on: Turing has no bf16 MMA, and the engine computes in
    fp16 there), and INT4's dequantization for cuBLAS below sm_80 (:func:`dense`)."""
    kernels = {
        ("int8", "gemv"): _int8_gemv, ("int8", "mm"): _int8_mm,
        ("int4", "gemv"): _int4_gemv, ("int4", "mm"): _int4_mm,
    }  # fmt: skip
    out: list[KernelConfig] = []
    for dtype in DTYPES.values():
        min_target = 80 if dtype == "bf16" else 75
        for fmt, table in TILES.items():
            for _, tiles in table:
                constants = {"BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k}
                if tiles.kernel == "mm":
                    constants |= {
                        "BLOCK_M": tiles.block_m, "GROUP_M": GROUP_M, "MAY_SPLIT": tiles.may_split
                    }  # fmt: skip
                blocks = "x".join(str(b) for b in (tiles.block_m, tiles.block_n, tiles.block_k))
                fn = kernels[fmt, tiles.kernel]
                out.append(
                    KernelConfig(
                        f"quant_gemm.{fmt}_{tiles.kernel}[{dtype},{blocks}]", fn,
                        _signature(fn, dtype), constants, tiles.num_warps, tiles.num_stages,
                        min_target,
                    )
                )  # fmt: skip
        out.append(
            KernelConfig(
                f"quant_gemm.splitk_reduce[{dtype}]", _splitk_reduce,
                _signature(_splitk_reduce, dtype), {"BLOCK": REDUCE_BLOCK}, num_warps=4,
                num_stages=1, min_target=min_target,
            )
        )  # fmt: skip
        out.append(  # no tl.dot: both dtypes from sm_75
            KernelConfig(
                f"quant_gemm.int4_dequantize[{dtype}]", _int4_dequantize,
                _signature(_int4_dequantize, dtype), {"BLOCK_N": DEQUANTIZE_ROWS}, num_warps=4,
                num_stages=1,
            )
        )  # fmt: skip
    return out


def _signature(fn: triton.JITFunction, dtype: str) -> dict[str, str]:
    """Each argument's Triton type, by its name: pointers to the activations' dtype but for
    the weights (int8, or packed uint8), INT4's bf16 scales and zeros and the fp32 partial
    sums; 32-bit integers; the compile-time constants."""
    pointers = {"w_ptr": "*i8", "sz_ptr": "*bf16", "part_ptr": "*fp32"}
    if fn in (_int4_gemv, _int4_mm, _int4_dequantize):
        pointers["w_ptr"] = "*u8"
    # the Python function's own parameters: a JITFunction and the interpreter's stand-in both
    # hold it as ``fn`` (only the first has ``params``)
    params = inspect.signature(fn.fn).parameters.values()
    return {
        p.name: "constexpr" if p.annotation in (tl.constexpr, "tl.constexpr")
        else pointers.get(p.name, f"*{dtype}") if p.name.endswith("_ptr") else "i32"
        for p in params
    }  # fmt: skip
