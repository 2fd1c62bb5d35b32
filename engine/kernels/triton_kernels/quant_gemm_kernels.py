"""The Triton kernels of :mod:`engine.kernels.triton_kernels.quant_gemm`, whose launchers
check the operands (in the layouts described there), pick the tiles and launch these.

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

**Offsets.** Rows of ``x`` and ``y`` and the partial sums are addressed with 64-bit offsets:
``M·N`` passes 2³¹ where a vocabulary's head (128,256 columns) multiplies 16,744 rows or
more (a perplexity pass over a long context), and ``M·stride_xm`` likewise; the weights' rows
(``N·K`` bytes) and INT4's scales and zeros are 64-bit too. Column, K and tile indices stay
32-bit.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine.kernels.triton_kernels.rounding import round_to
from engine.kernels.triton_support import KernelConfig


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
def _finish(
    acc, offs_m, offs_n, M, N, bias_ptr, y_ptr, part_ptr, split, has_bias, direct,
    MAY_SPLIT: tl.constexpr,
):  # fmt: skip
    """Store a fp32 tile ``acc [len(offs_m), len(offs_n)]``: into ``y`` (bias added, cast to
    ``y``'s dtype) when one split covers K, else as split ``split``'s partial sums (compiled
    only where the configuration may split: the fp32 store's layout change would otherwise
    set a prefill tile's shared memory). Offsets are 64-bit: ``M·N`` passes 2³¹ (a
    vocabulary's head over 16,744 rows of a long prompt)."""
    rows = offs_m[:, None].to(tl.int64)
    cols = offs_n[None, :]
    mask = (rows < M) & (cols < N)
    if MAY_SPLIT and direct == 0:
        tl.store(part_ptr + (split * M + rows) * N + cols, acc, mask=mask)
    else:
        if has_bias:
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows * N + cols, round_to(acc, y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _splitk_reduce(part_ptr, bias_ptr, y_ptr, M, N, splits, has_bias, BLOCK: tl.constexpr):
    """``y = Σ_splits part (+ bias)`` in a fixed order, cast to ``y``'s dtype; 64-bit offsets,
    as ``M·N`` may pass 2³¹."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    total = tl.cast(M, tl.int64) * N  # tl.cast: M = 1 is a compile-time constant on a GPU
    ok = offs < total
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for split in range(0, splits):
        acc += tl.load(part_ptr + split * total + offs, mask=ok, other=0.0)
    if has_bias:
        acc += tl.load(bias_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, round_to(acc, y_ptr.dtype.element_ty), mask=ok)


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
        x = tl.load(x_ptr + m.to(tl.int64) * stride_xm + offs_k, mask=k_ok, other=0.0)
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
            x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
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
    x_row = x_ptr + m.to(tl.int64) * stride_xm
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
        sz = ((chunk // group)[None, :].to(tl.int64) * N + offs_n[:, None]) * 2
        ok = n_ok[:, None] & (chunk < k_stop)[None, :]
        s = tl.load(sz_ptr + sz, mask=ok, other=0.0).to(tl.float32)
        z = tl.load(sz_ptr + sz + 1, mask=ok, other=0.0).to(tl.float32)
        acc += s * qx + (z - 8.0 * s) * xs[None, :]
    offs_m = m + tl.arange(0, 1)
    out = tl.sum(acc, axis=1)[None, :]
    _finish(out, offs_m, offs_n, M, N, bias_ptr, y_ptr, part_ptr, split, has_bias, direct, True)


@triton.jit
def int4_chunk_dot(acc, w_rows, sz_ptr, x_rows, k0, group, N, K, offs_n, n_ok, m_ok, dtype):
    """``acc`` plus the 32-column chunk at ``k0`` of ``x_rows`` times the packed INT4 rows
    ``w_rows`` (their ``(s, z)`` at ``sz_ptr``, ``[Kp/group, N, 2]``): the chunk's two 16-column
    halves (the low and the high nibbles) dequantized in fp32, rounded to ``dtype`` and
    multiplied on tensor cores by the matching columns of ``x``."""
    byte = tl.arange(0, 16)
    packed = tl.load(w_rows + tl.multiple_of(k0 // 2, 16) + byte[None, :], mask=n_ok[:, None])
    sz = ((k0 // group).to(tl.int64) * N + offs_n) * 2
    s = tl.load(sz_ptr + sz, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    z = tl.load(sz_ptr + sz + 1, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    lo = round_to(((packed & 15).to(tl.float32) - 8.0) * s + z, dtype)
    hi = round_to(((packed >> 4).to(tl.float32) - 8.0) * s + z, dtype)
    col = k0 + byte[None, :]
    x_lo = tl.load(x_rows + col, mask=m_ok[:, None] & (col < K), other=0.0)
    x_hi = tl.load(x_rows + col + 16, mask=m_ok[:, None] & (col + 16 < K), other=0.0)
    acc = tl.dot(x_lo, tl.trans(lo), acc)
    return tl.dot(x_hi, tl.trans(hi), acc)


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
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    dtype = x_ptr.dtype.element_ty
    k_start = split * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, 2 * row_bytes)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        acc = int4_chunk_dot(acc, rows, sz_ptr, x_rows, k0, group, N, K, offs_n, n_ok, m_ok, dtype)
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
    sz = (k0 // group).to(tl.int64) * sz_stride + offs_n * 2
    s = tl.load(sz_ptr + sz, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    z = tl.load(sz_ptr + sz + 1, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    dtype = out_ptr.dtype.element_ty
    row = out_ptr + offs_n[:, None].to(tl.int64) * K
    col = k0 + byte
    lo = round_to(((packed & 15).to(tl.float32) - 8.0) * s + z, dtype)
    hi = round_to(((packed >> 4).to(tl.float32) - 8.0) * s + z, dtype)
    tl.store(row + col, lo, mask=n_ok[:, None] & (col < K))
    tl.store(row + col + 16, hi, mask=n_ok[:, None] & (col + 16 < K))


def configs() -> list[KernelConfig]:
    """None of its own: :func:`engine.kernels.triton_kernels.quant_gemm.configs` lists these
    kernels in every configuration its launchers pick (the ahead-of-time build asks each
    module of the package)."""
    return []
