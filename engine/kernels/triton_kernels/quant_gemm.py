"""Weight-only quantized matrix products with the dequantization fused: ``y = x · dequant(W)ᵀ
(+ b)`` for fp16 or bf16 activations ``x [M, K]``, in our INT8 and INT4 formats
(:mod:`engine.formats`), accumulated in fp32 and written in ``x``'s dtype.

**Layouts.** Both keep ``nn.Linear``'s orientation, a row per output channel with K
contiguous (whole cache lines per row, and a tied head's embedding row is one row here too):

* INT8: ``weight`` int8 ``[N, K]`` and ``scales [N]`` in the activations' dtype, ``w = q · s``:
  what :func:`engine.formats.quantize_int8` gives, unchanged.
* INT4: ``weight`` uint8 ``[N, Kp/2]`` in chunks of 32 columns (16 bytes), byte ``j`` of a
  chunk holding column ``j`` in its low nibble and ``16 + j`` in its high one, llama.cpp's
  Q4_0 order (:func:`pack_int4` converts :func:`engine.formats.quantize_int4`'s values): each
  nibble's 16 columns of ``x`` are contiguous, so no kernel interleaves anything or loads
  ``x`` with a stride. ``scales_and_zeros`` bf16 ``[Kp/group, N, 2]``, ``w = (q − 8)·s + z``:
  group-major with N contiguous, so a tile's ``(s, z)`` of one group is one run of
  ``4·BLOCK_N`` bytes; they are the very values torch's INT4 kernels take, so both paths run
  the same quantization. ``Kp`` is K padded to a multiple of the group (32, 64 or 128); the
  kernels mask ``x`` at K, so the padding multiplies only zeros and ``x`` is never padded.

**Kernels.** Decode has a split-K grid axis: with M tiny, N alone does not give every SM work,
so programs also split K and write fp32 partial sums ``[splits, M, N]`` that a second pass adds
up in a fixed order, adding the bias and casting (:func:`_splitk_reduce`). An atomic add would
need a zeroed fp32 output and a cast pass as well (three launches, not two) and would sum in a
different order on every run. With one split a kernel writes ``y`` itself, bias fused.

* ``_int8_gemv`` / ``_int4_gemv`` (M = 1, batch-1 decode): no tensor cores, as a GEMV is bound
  by the weights' bytes. A program streams ``BLOCK_N`` rows, 128 bytes of each per step (a
  cache line; 16 bytes per thread per load), multiplies in fp32 and reduces at the end. INT4
  takes each chunk's scale out of its sum, ``Σ((q−8)s+z)x = s·Σqx + (z−8s)·Σx``, so the inner
  loop is one multiply-add per weight.
* ``_int8_mm`` / ``_int4_mm`` (M > 1): tensor-core tiles (``tl.dot`` of fp16 or bf16, fp32
  accumulation) over weight tiles dequantized in registers, row tiles grouped for L2 reuse as
  in Triton's matmul tutorial. Batched decode (2 ≤ M ≤ 16) runs 16-row tiles with split-K,
  gemlite's and vLLM's choice for small M (the MMA's idle rows cost nothing when the weights'
  bytes bound the time); prefill runs 64- or 128-row tiles, which never split. INT4 steps one
  32-column chunk at a time, so a step never straddles a group (each group is whole chunks),
  takes one ``(s, z)`` per channel, and multiplies its two 16-column halves separately.

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

from engine.kernels import triton_support
from engine.kernels.triton_support import KernelConfig

#: the groups our INT4 format has (engine.quant.spec.INT4_GROUPS); each a multiple of 32
GROUPS = (32, 64, 128)
DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
#: the widest split: partial sums are ``splits · M · N`` fp32 values
MAX_SPLITS = 16
#: programs per SM that split-K aims for on a GPU: enough loads in flight to hide latency
WAVES = 4
REDUCE_BLOCK = 1024
#: Triton 3.9's interpreter rounds fp32 to bf16 toward zero (and its round-to-nearest mode
#: does not carry), so under it :func:`_cast` rounds to nearest even with integer ops, as a
#: GPU's conversion does; compiled kernels convert as usual.
_INTERPRETED = tl.constexpr(triton_support.interpreting())


# -- kernels ------------------------------------------------------------------------------------


@triton.jit
def _tile_of(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program ``pid``'s (row tile, column tile), GROUP_M row tiles sweeping the column tiles
    together so the weight tiles they share are still in L2."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % rows, (pid % per_group) // rows


@triton.jit
def _cast(x, dtype: tl.constexpr):
    """fp32 ``x`` rounded to nearest even in ``dtype`` (see :data:`_INTERPRETED`)."""
    if _INTERPRETED and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits += 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


@triton.jit
def _finish(
    acc, offs_m, offs_n, M, N, bias_ptr, y_ptr, part_ptr, split, has_bias, direct,
    MAY_SPLIT: tl.constexpr,
):  # fmt: skip
    """Store a fp32 tile ``acc [len(offs_m), len(offs_n)]``: into ``y`` (bias added, cast to
    ``y``'s dtype) when one split covers K, else as split ``split``'s partial sums (compiled
    only where the configuration may split: the fp32 store's layout change would otherwise
    set a prefill tile's shared memory)."""
    rows = offs_m[:, None]
    cols = offs_n[None, :]
    mask = (rows < M) & (cols < N)
    if MAY_SPLIT and direct == 0:
        tl.store(part_ptr + (split * M + rows) * N + cols, acc, mask=mask)
    else:
        if has_bias:
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows * N + cols, _cast(acc, y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _splitk_reduce(part_ptr, bias_ptr, y_ptr, M, N, splits, has_bias, BLOCK: tl.constexpr):
    """``y = Σ_splits part (+ bias)`` in a fixed order, cast to ``y``'s dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    total = M * N
    ok = offs < total
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for split in range(0, splits):
        acc += tl.load(part_ptr + split * total + offs, mask=ok, other=0.0)
    if has_bias:
        acc += tl.load(bias_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, _cast(acc, y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _int8_gemv(
    x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, part_ptr,
    M, N, K, stride_xm, k_per_split, has_bias, direct,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Row ``program_id(2)`` of ``x`` times ``BLOCK_N`` int8 rows, over one split of K."""
    split = tl.program_id(1)
    m = tl.program_id(2)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = w_ptr + offs_n[:, None].to(tl.int64) * K
    k_start = split * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # reduced once, after the loop
    for k0 in range(k_start, k_stop, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_stop
        w = tl.load(rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
        x = tl.load(x_ptr + m * stride_xm + offs_k, mask=k_ok, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    scale = tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    offs_m = m + tl.arange(0, 1)
    out = tl.sum(acc, axis=1)[None, :] * scale[None, :]
    _finish(out, offs_m, offs_n, M, N, bias_ptr, y_ptr, part_ptr, split, has_bias, direct, True)


@triton.jit
def _int8_mm(
    x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, part_ptr,
    M, N, K, stride_xm, k_per_split, has_bias, direct,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    MAY_SPLIT: tl.constexpr,
):  # fmt: skip
    """A ``BLOCK_M × BLOCK_N`` tile of ``y`` over one split of K, on tensor cores; the
    per-channel scale is applied once, to the fp32 sums."""
    pid_m, pid_n = _tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    split = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    rows = w_ptr + offs_n[:, None].to(tl.int64) * K
    dtype = x_ptr.dtype.element_ty
    k_start = split * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_stop
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
            mask=m_ok[:, None] & k_ok[None, :], other=0.0,
        )  # fmt: skip
        w = tl.load(rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
        # |q| ≤ 127: exact in fp16 and bf16. Through fp32, as the GPU converts s8 to bf16
        # anyway, and the interpreter's int-to-bf16 cast reinterprets bits.
        acc = tl.dot(x, tl.trans(w.to(tl.float32).to(dtype)), acc)
    acc *= tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    _finish(
        acc, offs_m, offs_n, M, N, bias_ptr, y_ptr, part_ptr, split, has_bias, direct, MAY_SPLIT
    )


@triton.jit
def _int4_gemv(
    x_ptr, w_ptr, sz_ptr, bias_ptr, y_ptr, part_ptr,
    M, N, K, row_bytes, stride_xm, group, k_per_split, has_bias, direct,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Row ``program_id(2)`` of ``x`` times ``BLOCK_N`` packed INT4 rows, over one split of
    the padded width, ``BLOCK_K / 32`` chunks (16 bytes each) a step. A step's products are
    summed per chunk (a reshape that moves no data: a thread holds whole chunks) before the
    chunk's scale and zero apply."""
    CHUNKS: tl.constexpr = BLOCK_K // 32
    split = tl.program_id(1)
    m = tl.program_id(2)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = w_ptr + offs_n[:, None].to(tl.int64) * row_bytes
    byte = tl.arange(0, BLOCK_K // 2)
    column = (byte // 16) * 32 + byte % 16  # of each byte's low nibble, from the step's start
    k_start = split * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, 2 * row_bytes)
    x_row = x_ptr + m * stride_xm
    acc = tl.zeros([BLOCK_N, CHUNKS], dtype=tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        b_ok = k0 + column < k_stop
        at = tl.multiple_of(k0 // 2, 16) + byte
        packed = tl.load(rows + at[None, :], mask=n_ok[:, None] & b_ok[None, :], other=0)
        col = k0 + column
        x_lo = tl.load(x_row + col, mask=col < K, other=0.0).to(tl.float32)
        x_hi = tl.load(x_row + col + 16, mask=col + 16 < K, other=0.0).to(tl.float32)
        lo = (packed & 15).to(tl.float32)
        hi = (packed >> 4).to(tl.float32)
        products = lo * x_lo[None, :] + hi * x_hi[None, :]  # [BLOCK_N, BLOCK_K / 2]
        qx = tl.sum(tl.reshape(products, [BLOCK_N, CHUNKS, 16]), axis=2)
        xs = tl.sum(tl.reshape(x_lo + x_hi, [CHUNKS, 16]), axis=1)
        chunk = k0 + tl.arange(0, CHUNKS) * 32
        sz = ((chunk // group)[None, :] * N + offs_n[:, None]) * 2
        ok = n_ok[:, None] & (chunk < k_stop)[None, :]
        s = tl.load(sz_ptr + sz, mask=ok, other=0.0).to(tl.float32)
        z = tl.load(sz_ptr + sz + 1, mask=ok, other=0.0).to(tl.float32)
        acc += s * qx + (z - 8.0 * s) * xs[None, :]
    offs_m = m + tl.arange(0, 1)
    out = tl.sum(acc, axis=1)[None, :]
    _finish(out, offs_m, offs_n, M, N, bias_ptr, y_ptr, part_ptr, split, has_bias, direct, True)


@triton.jit
def _int4_mm(
    x_ptr, w_ptr, sz_ptr, bias_ptr, y_ptr, part_ptr,
    M, N, K, row_bytes, stride_xm, group, k_per_split, has_bias, direct,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    MAY_SPLIT: tl.constexpr,
):  # fmt: skip
    """A ``BLOCK_M × BLOCK_N`` tile of ``y`` over one split of the padded width, on tensor
    cores, a 32-column chunk a step: its two 16-column halves (the low and the high nibbles)
    are dequantized in fp32 with the chunk's ``(s, z)``, rounded to ``x``'s dtype and
    multiplied by the matching 16 columns of ``x``."""
    tl.static_assert(BLOCK_K == 32, "INT4 tiles step one 32-column chunk at a time")
    pid_m, pid_n = _tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    split = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    rows = w_ptr + offs_n[:, None].to(tl.int64) * row_bytes
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    byte = tl.arange(0, 16)
    dtype = x_ptr.dtype.element_ty
    k_start = split * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, 2 * row_bytes)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        packed = tl.load(rows + tl.multiple_of(k0 // 2, 16) + byte[None, :], mask=n_ok[:, None])
        sz = ((k0 // group) * N + offs_n) * 2
        s = tl.load(sz_ptr + sz, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        z = tl.load(sz_ptr + sz + 1, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        lo = _cast(((packed & 15).to(tl.float32) - 8.0) * s + z, dtype)
        hi = _cast(((packed >> 4).to(tl.float32) - 8.0) * s + z, dtype)
        col = k0 + byte[None, :]
        x_lo = tl.load(x_rows + col, mask=m_ok[:, None] & (col < K), other=0.0)
        x_hi = tl.load(x_rows + col + 16, mask=m_ok[:, None] & (col + 16 < K), other=0.0)
        acc = tl.dot(x_lo, tl.trans(lo), acc)
        acc = tl.dot(x_hi, tl.trans(hi), acc)
    _finish(
        acc, offs_m, offs_n, M, N, bias_ptr, y_ptr, part_ptr, split, has_bias, direct, MAY_SPLIT
    )


@triton.jit
def _int4_dequantize(
    w_ptr, sz_ptr, out_ptr, N, K, row_bytes, sz_stride, group, BLOCK_N: tl.constexpr
):
    """``BLOCK_N`` rows of one 32-column chunk (``program_id(1)``) of the weights, dequantized
    into ``out [N, K]`` in its dtype (K unpadded), for a matrix product without our tiles.
    ``sz_stride``: elements from one group's scales and zeros to the next."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    k0 = tl.program_id(1) * 32
    byte = tl.arange(0, 16)[None, :]
    packed = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * row_bytes + k0 // 2 + byte,
                     mask=n_ok[:, None], other=0)  # fmt: skip
    sz = (k0 // group) * sz_stride + offs_n * 2
    s = tl.load(sz_ptr + sz, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    z = tl.load(sz_ptr + sz + 1, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    dtype = out_ptr.dtype.element_ty
    row = out_ptr + offs_n[:, None].to(tl.int64) * K
    col = k0 + byte
    lo = _cast(((packed & 15).to(tl.float32) - 8.0) * s + z, dtype)
    hi = _cast(((packed >> 4).to(tl.float32) - 8.0) * s + z, dtype)
    tl.store(row + col, lo, mask=n_ok[:, None] & (col < K))
    tl.store(row + col + 16, hi, mask=n_ok[:, None] & (col + 16 < K))


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
    if processors <= 0:
        return 1
    want = -(-WAVES * processors // tiles)
    return max(1, min(want, k_blocks // 2, MAX_SPLITS))


@functools.cache
def _processors(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


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
            f"{weight.dtype} {tuple(weight.shape)}; quantize with engine.formats.quantize_int8"
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
    ``[N, Kp/2]`` (:func:`pack_int4`), ``Kp`` the least multiple of ``group`` ≥ K;
    ``scales_and_zeros`` bf16 ``[Kp/group, N, 2]``; ``bias [N]`` in ``x``'s dtype. ``[M, N]``
    in ``x``'s dtype. ``splits`` as for :func:`int8_linear`."""
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
        splits = splits_for(programs, k_blocks, _processors(x.device))
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


# -- the INT4 layout --------------------------------------------------------------------------


def pack_int4(q: Tensor) -> Tensor:
    """Our INT4 layout of ``q`` (``[N, Kp]`` integers in 0..15, Kp a multiple of 32, as
    :func:`engine.formats.quantize_int4` gives them): uint8 ``[N, Kp/2]`` in chunks of 32
    columns, byte ``j`` of chunk ``c`` holding column ``32c + j`` in its low nibble and
    ``32c + 16 + j`` in its high one (llama.cpp's Q4_0 order): either nibble's 16 columns of
    ``x`` are then contiguous."""
    n, k = q.shape if q.dim() == 2 else (0, 1)
    if k % 32:
        raise ValueError(f"pack_int4 takes [N, K] values with K a multiple of 32, not {q.shape}")
    halves = q.to(torch.uint8).view(n, k // 32, 2, 16)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_int4(packed: Tensor) -> Tensor:
    """The values of rows packed by :func:`pack_int4`: int32 ``[T, Kp]`` in 0..15."""
    v = packed.to(torch.int32).view(packed.shape[0], -1, 1, 16)
    return torch.cat([v & 15, v >> 4], dim=2).reshape(packed.shape[0], -1)


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
