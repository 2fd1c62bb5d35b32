"""A mixture of experts' products in one launch per product on CUDA: the grouped INT4 GEMM.

A step routes each of its T tokens to k of E experts. Run one expert at a time, a layer is
2·E' launches (E' the experts any token chose: every one of them in a prefill chunk) and as
many Python round trips. Here the (token, expert) pairs are laid out once per layer, sorted
by expert, each expert's pairs padded to whole tiles of :data:`BLOCK_M` slots
(:class:`Layout`, vLLM's ``moe_align_block_size`` idea, done with torch operators and no
read back to the host); then one launch multiplies every tile by its expert's weights
(:func:`_int4_grouped`: a tile gathers its pairs' rows of ``x`` and steps through its
expert's INT4 rows a chunk at a time, as the GEMMs' tiles do:
:func:`~engine.kernels.triton_kernels.quant_gemm_kernels.int4_chunk_dot`).

The experts' weights are one tensor per product and layer, ``[E, N, Kp/2]`` in our INT4
layout (:func:`engine.formats.int4.pack_int4`) with bf16 ``(s, z)`` ``[E, Kp/group, N, 2]``:
each expert's module holds views of them (:func:`engine.quant.experts.stack`). The grid has a
program for every tile the padded layout *might* need (``P + min(E, P)·(BLOCK_M − 1)``
slots at most), so its size is known without reading the counts back; the tiles past the
last expert's exit at once.
"""

from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine.kernels.triton_kernels.quant_gemm import DTYPES, GROUPS
from engine.kernels.triton_kernels.quant_gemm_kernels import int4_chunk_dot
from engine.kernels.triton_kernels.rounding import round_to
from engine.kernels.triton_support import KernelConfig

#: slots of a tile (the tensor-core dot's rows); each expert's pairs are padded to whole tiles
BLOCK_M = 16
BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 3


@triton.jit
def _int4_grouped(
    x_ptr, w_ptr, sz_ptr, rows_ptr, tile_expert_ptr, y_ptr,
    N, K, row_bytes, stride_xm, group, groups,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Slots ``BLOCK_M·t`` … of tile ``t`` (``program_id(0)``) times its expert's columns
    ``BLOCK_N·program_id(1)`` …: ``y[slot] = x[rows[slot]] · dequant(w[e])ᵀ`` for each slot
    whose row is not −1 (the rest stay as they are)."""
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:  # past the last expert's tiles
        return
    slots = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(rows_ptr + slots)
    m_ok = rows >= 0
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    e = expert.to(tl.int64)
    w_rows = w_ptr + (e * N + offs_n[:, None].to(tl.int64)) * row_bytes
    sz_base = sz_ptr + e * groups * N * 2
    x_rows = x_ptr + tl.where(m_ok, rows, 0)[:, None].to(tl.int64) * stride_xm
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, 2 * row_bytes, 32):  # a chunk a step, as the GEMMs' tiles
        acc = int4_chunk_dot(acc, w_rows, sz_base, x_rows, k0, group, N, K, offs_n, n_ok, m_ok,
                             dtype)  # fmt: skip
    out = y_ptr + slots[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out, round_to(acc, y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


class Layout:
    """A step's (token, expert) pairs laid out for the grouped products: ``rows [S]`` the
    token each slot reads (−1: padding), ``tile_expert [S / BLOCK_M]`` each tile's expert
    (−1: unused), ``slot [T·k]`` each pair's slot (pairs as ``chosen.flatten()`` orders
    them)."""

    def __init__(self, chosen: Tensor, num_experts: int) -> None:
        flat = chosen.flatten()
        pairs, top_k = flat.numel(), chosen.shape[-1]
        size = pairs + min(num_experts, pairs) * (BLOCK_M - 1)
        size = -(-size // BLOCK_M) * BLOCK_M
        order = torch.argsort(flat, stable=True)  # the pairs by expert
        by_expert = flat[order]
        counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
        counts.index_add_(0, flat, torch.ones_like(flat))  # bincount would read its max back
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        starts = torch.cumsum(padded, 0) - padded  # each expert's first slot
        firsts = torch.cumsum(counts, 0) - counts  # its first pair in ``order``
        rank = torch.arange(pairs, device=flat.device) - firsts[by_expert]
        slot_sorted = starts[by_expert] + rank
        self.slot = torch.empty_like(slot_sorted)
        self.slot[order] = slot_sorted
        device = flat.device
        self.rows = torch.full((size,), -1, dtype=torch.int32, device=device)
        self.rows[slot_sorted] = (order // top_k).to(torch.int32)
        self.tile_expert = torch.full((size // BLOCK_M,), -1, dtype=torch.int32, device=device)
        self.tile_expert[slot_sorted // BLOCK_M] = by_expert.to(torch.int32)
        self.size = size

    def slots(self) -> Tensor:
        """Each slot reading its own row (a second product over the first's output)."""
        mine = torch.arange(self.size, dtype=torch.int32, device=self.rows.device)
        return torch.where(self.rows >= 0, mine, -1)


def int4_grouped(
    x: Tensor, rows: Tensor, tile_expert: Tensor, weight: Tensor, sz: Tensor, group: int
) -> Tensor:
    """``y [S, N]`` in ``x``'s dtype: slot ``s`` holds ``x[rows[s]] · dequant(weight[e])ᵀ``
    (``e`` its tile's expert), zero where ``rows[s]`` is −1. ``x [T, K]`` fp16 or bf16,
    ``weight`` uint8 ``[E, N, Kp/2]``, ``sz`` bf16 ``[E, Kp/group, N, 2]``."""
    if x.dtype not in DTYPES or x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be fp16 or bf16 [T, K] with unit column stride, not {x.dtype}")
    if group not in GROUPS:
        raise ValueError(f"INT4 group {group} is not one of ours; use one of {GROUPS}")
    experts, n, half = weight.shape
    k = x.shape[1]
    if weight.dtype != torch.uint8 or half * 2 != -(-k // group) * group:
        raise ValueError(
            f"INT4 weights for K={k} must be uint8 [E, N, {-(-k // group) * group // 2}]"
        )
    if tuple(sz.shape) != (experts, 2 * half // group, n, 2) or sz.dtype != torch.bfloat16:
        raise ValueError(
            f"INT4 scales_and_zeros must be bf16 [E, Kp/group, N, 2], not {tuple(sz.shape)}"
        )
    if not (weight.is_contiguous() and sz.is_contiguous()):
        raise ValueError("the experts' weights and scales must be contiguous (stacked)")
    y = torch.zeros((rows.numel(), n), dtype=x.dtype, device=x.device)
    grid = (tile_expert.numel(), triton.cdiv(n, BLOCK_N))
    _int4_grouped[grid](
        x, weight, sz, rows, tile_expert, y, n, k, half, x.stride(0), group, 2 * half // group,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )  # fmt: skip
    return y


def configs() -> list[KernelConfig]:
    """The grouped product in fp16 and bf16 (bf16 from sm_80), the tiles its launcher uses."""
    params = inspect.signature(_int4_grouped.fn).parameters.values()
    pointers = {"w_ptr": "*u8", "sz_ptr": "*bf16", "rows_ptr": "*i32", "tile_expert_ptr": "*i32"}
    out = []
    for dtype in DTYPES.values():
        signature = {
            p.name: "constexpr" if p.annotation in (tl.constexpr, "tl.constexpr")
            else pointers.get(p.name, f"*{dtype}") if p.name.endswith("_ptr") else "i32"
            for p in params
        }  # fmt: skip
        out.append(
            KernelConfig(
                f"grouped_gemm.int4[{dtype}]", _int4_grouped, signature,
                {"BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N}, NUM_WARPS, NUM_STAGES,
                min_target=80,
            )
        )  # fmt: skip
    return out
