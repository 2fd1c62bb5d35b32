"""Paged decode attention in Triton: one query per sequence over the keys its block table holds,
read in place from the KV pool (no gathered copy), for all the query heads of a GQA group at
once.

What it computes is :func:`engine.kernels.gather_attention.gather_attention` (its reference and
the torch fallback): for sequence ``b`` with ``L = seq_lens[b]`` keys at positions ``0 … L-1``
and its query at position ``L-1``, ``softmax(q·Kᵀ·scale)·V`` over the visible keys (the
scores soft-capped first where the model caps them: :mod:`.softcap`). Position
``p`` lives in pool slot ``block_tables[b, p // block_size] · block_size + p % block_size``; a
negative table entry is a block the cache window gave back, whose positions are not attended.
With ``window > 0``, key ``p`` is visible iff ``p < sink`` or ``p > L-1 - window``. A row with
``L = 0`` is batch padding (a CUDA-graph bucket's spare rows) and gives zeros.

Layout: ``q [B, H, D]`` (any batch and head strides, unit stride along ``D``); the pool
``[slots, 2·Hkv, D]`` holds each token's K heads then its V heads; query heads
``h·G … h·G+G-1`` (``G = H/Hkv``) share KV head ``h``, as in ``q.view(B, Hkv, G, D)``.

The visible keys of a sequence are walked as one run of ``n_vis`` *virtual* indices: the first
``n_sink`` (the sinks that lie before the window) are positions ``0 … n_sink-1``, the rest the
window ``lo … L-1``. A long context under a short window costs its window and sinks only,
split-K divides the work that is really there, and no tile is spent on the gap between them.

Kernels and grids:

- :func:`_attend`, grid ``(B, Hkv · ⌈G/16⌉, splits)``: one program takes one KV head of one
  sequence for its ``G`` query heads, as the ``BLOCK_H = 16`` rows of a ``tl.dot`` (padded;
  a group larger than 16 is taken 16 heads at a time). Each K/V row is read once for the whole
  group, not ``G`` times as one program per query head would, and the products run on the
  tensor cores (``mma.m16n8k16`` from sm_80). The kernel is bound by those reads, so the
  padded rows cost nothing there: the choice of vLLM's and SGLang's Triton decode kernels.
  Triton 3.9 lowers ``tl.dot`` to FMAs on sm_75 (Turing: there the 16 rows cost 8 FMAs per
  byte read, below but near a T4's balance of ≈ 12) and for fp32 inputs, which run in full
  IEEE precision (not TF32). Over tiles of ``BLOCK_N`` keys, each key's slot looked up
  through the block table, an online softmax keeps a running max, sum and accumulator in fp32
  (``exp2``, with ``log2 e`` folded into the scale). The probabilities are rounded to the K/V
  dtype for ``P·V``, as every flash-attention kernel does.
- Split-K (flash-decoding), for when ``B · Hkv`` programs would leave the GPU idle, as at
  batch 1 with a long context: program ``s`` of ``splits`` takes the ``s``-th equal share (in
  whole tiles) of its sequence's visible keys and writes its normalised partial output and
  log-sum-exp to an fp32 workspace; :func:`_combine`, grid ``(B, H)``, merges each row's
  partitions. With one split, :func:`_attend` writes the output itself: one launch, no
  workspace.

:func:`num_splits` chooses the number of partitions from shapes alone, never from the lengths
on the GPU (reading them back would stall the step and cannot be captured in a CUDA graph):
about ``PROGRAMS_PER_SM`` programs per SM, none over fewer than ``MIN_SPLIT_KEYS`` keys of the
table's capacity (or of the window), at most ``MAX_SPLITS``. A batch-1 decode of an 8-KV-head
model with a 4k-token table on a 28-SM RTX 3060 takes 14 splits (about 300 keys a program);
a batch that already fills the GPU, or a short context, one pass. Each sequence shares its
own keys out among the partitions; one with fewer tiles than partitions leaves the rest empty:
their programs return at once, and :func:`_combine` reads only the partitions that hold keys.

Tiles: ``BLOCK_N`` = 32 keys for fp16/bf16 and 16 for fp32 (the same bytes per tile), 4 warps,
2 stages, as SGLang's grouped decode kernel and vLLM's Triton attention use for decode; every
configuration needs under 26 KiB of shared memory, within Turing's 64 KiB.
"""

from __future__ import annotations

from functools import partial
from itertools import product

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine.formats import kv as kv_format
from engine.kernels import triton_support
from engine.kernels.triton_kernels.kv_rows import (
    ROW_NAMES,
    ROW_POINTERS,
    ROW_TARGETS,
    ROWS,
    row_scales,
    rows_of,
    scaled_values,
    widen,
)
from engine.kernels.triton_kernels.softcap import scores_base2
from engine.kernels.triton_support import GPU_DTYPES, KernelConfig

#: Head dimensions the kernels are built for (``HEAD_DIM`` is a compile-time constant).
HEAD_DIMS = triton_support.HEAD_DIMS
#: Query heads one program takes: the rows of its ``tl.dot`` (an MMA tile's 16 rows).
BLOCK_H = 16
#: Fewest keys (of a table's capacity) worth a partition of their own.
MIN_SPLIT_KEYS = 256
#: Most partitions one sequence's keys are split into.
MAX_SPLITS = 32
#: Programs per SM that split-K aims for: enough warps in flight to keep the loads streaming.
PROGRAMS_PER_SM = 4
#: The interpreter has no SMs: it splits as a small GPU with this many would, so that the
#: tests take the split path a GPU takes.
INTERPRETER_SMS = 8
NUM_WARPS = 4
NUM_STAGES = 2
_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
_LOG2E = 1.4426950408889634


def block_n(dtype: torch.dtype) -> int:
    """Keys per tile: 32 for 2-byte dtypes, 16 for fp32 (the same bytes per tile)."""
    return 16 if dtype == torch.float32 else 32


@triton.jit
def _visible_span(seq_len, sink, window):
    """For a sequence of ``seq_len`` keys: how many its query sees (``n_vis``), the first
    position of its window (``lo``) and the sinks before that (``n_sink``). Virtual index ``n``
    of ``0 … n_vis-1`` is position ``n`` below ``n_sink``, ``n + lo - n_sink`` from there."""
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    n_sink = tl.minimum(sink, lo)
    return n_sink + seq_len - lo, lo, n_sink


@triton.jit
def _share(n_vis, splits, BLOCK_N: tl.constexpr):
    """Keys in each partition of a sequence that sees ``n_vis`` keys: an equal share in whole
    tiles, at least one tile (so that a sequence with no keys has no partition)."""
    return tl.maximum(tl.cdiv(tl.cdiv(n_vis, splits), BLOCK_N) * BLOCK_N, BLOCK_N)


@triton.jit
def _attend(
    q_ptr, pool_ptr, tables_ptr, lens_ptr, out_ptr, lse_ptr,
    scale_log2,  # the softmax scale × log2(e): scores in base 2
    cap_log2, cap_scale,  # a soft cap × log2(e) (0: none), and the scale over the cap
    block_size, sink, window, kv_heads, group, head_chunks, max_blocks, splits,
    stride_qb, stride_qh, stride_slot, stride_head, stride_tb,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SPLIT: tl.constexpr,
    KV_ROWS: tl.constexpr,
):  # fmt: skip
    """One KV head of one sequence, for its group's query heads (``BLOCK_H`` rows), over one
    partition of the visible keys (all of them unless ``SPLIT``). Writes each head's output
    to ``out [B, H, D]``, or with ``SPLIT`` its normalised partial output and base-2
    log-sum-exp to ``out [B, H, splits, D]`` and ``lse [B, H, splits]``. ``KV_ROWS``: the
    pool's rows (:mod:`.kv_rows`: floats, or int8 / fp8 values each row followed by its
    scale, read as bytes)."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1) // head_chunks
    split = tl.program_id(2)
    rows = (tl.program_id(1) % head_chunks) * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = rows < group
    heads = kv_head * group + rows
    dims = tl.arange(0, HEAD_DIM)

    n_vis, lo, n_sink = _visible_span(tl.load(lens_ptr + b), sink, window)
    share = _share(n_vis, splits, BLOCK_N)
    start = split * share
    end = tl.minimum(start + share, n_vis)
    if SPLIT and start >= end:
        return  # an empty partition: _combine reads only those that hold keys

    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    table = tables_ptr + b.to(tl.int64) * stride_tb
    k_base = pool_ptr + kv_head * stride_head
    v_base = pool_ptr + (kv_heads + kv_head) * stride_head
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    for first in range(start, end, BLOCK_N):
        n = first + tl.arange(0, BLOCK_N)
        pos = tl.where(n < n_sink, n, n + (lo - n_sink))
        column = pos // block_size
        block = tl.load(table + column, mask=(n < end) & (column < max_blocks), other=-1)
        live = block >= 0  # in this partition, and not given back by the cache window
        at = block.to(tl.int64) * block_size + pos % block_size
        # masked rows load as 0, not as whatever the pool holds: 0 × NaN would poison P·V
        rows_at = at[:, None] * stride_slot + dims[None, :]
        k = tl.load(k_base + rows_at, mask=live[:, None], other=0)
        if KV_ROWS:  # the quantized keys widened, each key's products by its row's scale
            k_scale = row_scales(k_base + at * stride_slot, HEAD_DIM, live, KV_ROWS)
            dots = tl.dot(q, tl.trans(widen(k, KV_ROWS, q.dtype)), input_precision="ieee")
            dots = dots * k_scale[None, :]
        else:
            dots = tl.dot(q, tl.trans(k), input_precision="ieee")
        scores = scores_base2(dots, scale_log2, cap_log2, cap_scale)
        scores = tl.where(live[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        # while every key so far is masked, m stays -inf: subtract 0 there, not -inf
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        total = total * alpha + tl.sum(p, 1)
        v = tl.load(v_base + rows_at, mask=live[:, None], other=0)
        if KV_ROWS:  # each probability weighted by its value row's scale, then the values
            v_scale = row_scales(v_base + at * stride_slot, HEAD_DIM, live, KV_ROWS)
            pv = scaled_values(p, v, v_scale, q.dtype, KV_ROWS)
        else:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        acc = acc * alpha[:, None] + pv
        m = m_new

    some = total > 0  # else no key was seen (a padding row, an all-masked partition)
    total = tl.where(some, total, 1.0)
    out = acc / total[:, None]  # zeros where no key was seen
    row = b.to(tl.int64) * (kv_heads * group) + heads
    if SPLIT:
        row = row * splits + split
        tl.store(out_ptr + row[:, None] * HEAD_DIM + dims[None, :], out, mask=row_ok[:, None])
        tl.store(lse_ptr + row, tl.where(some, m + tl.log2(total), float("-inf")), mask=row_ok)
    else:
        out = out.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row[:, None] * HEAD_DIM + dims[None, :], out, mask=row_ok[:, None])


@triton.jit
def _combine(
    part_ptr, lse_ptr, lens_ptr, out_ptr,
    sink, window, splits, heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Query head ``h`` of sequence ``b``: its output from the partial outputs and log-sum-exps
    of the partitions that hold keys (the shares :func:`_attend` took)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    dims = tl.arange(0, HEAD_DIM)
    n_vis, _, _ = _visible_span(tl.load(lens_ptr + b), sink, window)
    parts = tl.cdiv(n_vis, _share(n_vis, splits, BLOCK_N))
    row = b.to(tl.int64) * heads + h
    m = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for s in range(0, parts):
        lse = tl.load(lse_ptr + row * splits + s)
        part = tl.load(part_ptr + (row * splits + s) * HEAD_DIM + dims)
        m_new = tl.maximum(m, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # every key so far masked
        alpha = tl.exp2(m - m_safe)
        weight = tl.exp2(lse - m_safe)
        total = total * alpha + weight
        acc = acc * alpha + weight * part
        m = m_new
    out = acc / tl.where(total > 0, total, 1.0)  # no partitions (a padding row): zeros
    tl.store(out_ptr + row * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty))


def num_splits(batch: int, kv_programs: int, keys: int, sms: int) -> int:
    """Partitions of each sequence's keys (split-K) for ``batch`` sequences of ``kv_programs``
    programs each (KV heads × head chunks) that see at most ``keys`` keys, on a GPU with
    ``sms`` SMs: enough for about :data:`PROGRAMS_PER_SM` programs per SM, none over fewer
    than :data:`MIN_SPLIT_KEYS` keys, at most :data:`MAX_SPLITS`. 1 (one pass) where the batch
    fills the GPU by itself or the context is short."""
    return triton_support.split_k(
        batch * kv_programs, keys, sms,
        per_sm=PROGRAMS_PER_SM, min_units=MIN_SPLIT_KEYS, most=MAX_SPLITS,
    )  # fmt: skip


def paged_decode_attention(
    q: Tensor,
    pool: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    *,
    block_size: int,
    sink: int = 0,
    window: int = 0,
    scale: float | None = None,
    splits: int | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Decode attention of ``q [B, H, D]`` over one layer's ``pool [slots, 2·Hkv, D]`` (or
    int8 / fp8 rows ``[slots, 2·Hkv, D + 4]``, each followed by its scale: :mod:`.kv_rows`), read
    through ``block_tables [B, M]`` (int32; negative: a released block) for ``seq_lens [B]``
    (int32; 0: a padding row, which gives zeros). ``window > 0`` hides the keys before the
    last ``window`` positions, except the first ``sink``. ``scale`` defaults to ``1/√D``;
    ``splits`` (None: :func:`num_splits`'s choice) sets the split-K partitions; ``softcap``
    caps the scores at ``softcap · tanh(s / softcap)`` (Gemma 2). Returns ``[B, H·D]`` in
    ``q``'s dtype."""
    _check(q, pool, block_tables, seq_lens, block_size, sink, window, splits)
    batch, heads, dim = q.shape
    kv_heads = pool.shape[1] // 2
    group = heads // kv_heads
    out = q.new_empty(batch, heads * dim)
    if batch == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    block_tables, seq_lens = block_tables.contiguous(), seq_lens.contiguous()
    head_chunks = -(-group // BLOCK_H)
    keys = block_tables.shape[1] * block_size
    if window > 0:
        keys = min(keys, sink + window)
    if splits is None:
        sms = triton_support.sm_count(q.device, INTERPRETER_SMS)
        splits = num_splits(batch, kv_heads * head_chunks, keys, sms)
    tile = block_n(q.dtype)
    grid = (batch, kv_heads * head_chunks, splits)
    scale = dim**-0.5 if scale is None else scale
    cap = (softcap * _LOG2E, scale / softcap) if softcap else (0.0, 0.0)
    args = (
        scale * _LOG2E, *cap, block_size, sink, window, kv_heads,
        group, head_chunks, block_tables.shape[1], splits, q.stride(0), q.stride(1),
        pool.stride(0), pool.stride(1), block_tables.stride(0),
    )  # fmt: skip
    meta = {"HEAD_DIM": dim, "BLOCK_N": tile, "num_warps": NUM_WARPS, "num_stages": NUM_STAGES}
    pool, rows = rows_of(pool)
    if splits == 1:
        _attend[grid](
            q, pool, block_tables, seq_lens, out, out, *args, BLOCK_H=BLOCK_H, SPLIT=False,
            KV_ROWS=rows, **meta,
        )  # fmt: skip
        return out
    part = torch.empty(batch, heads, splits, dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    _attend[grid](
        q, pool, block_tables, seq_lens, part, lse, *args, BLOCK_H=BLOCK_H, SPLIT=True,
        KV_ROWS=rows, **meta,
    )  # fmt: skip
    _combine[(batch, heads)](part, lse, seq_lens, out, sink, window, splits, heads, **meta)
    return out


def _check(
    q: Tensor,
    pool: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    block_size: int,
    sink: int,
    window: int,
    splits: int | None,
) -> None:
    """Raise ValueError, saying what to pass instead, for what the kernels cannot take."""
    if q.dim() != 3 or pool.dim() != 3 or block_tables.dim() != 2 or seq_lens.dim() != 1:
        raise ValueError(
            "paged decode attention takes q [B, H, D], pool [slots, 2·Hkv, D], block_tables "
            f"[B, M] and seq_lens [B]; got {list(q.shape)}, {list(pool.shape)}, "
            f"{list(block_tables.shape)} and {list(seq_lens.shape)}"
        )
    batch, heads, dim = q.shape
    if q.dtype not in _TYPES or pool.dtype not in (q.dtype, torch.int8, torch.float8_e4m3fn):
        raise ValueError(
            f"paged decode attention runs fp32, fp16 or bf16, with q in the pool's dtype or "
            f"over int8 or fp8 rows; got q {q.dtype} and pool {pool.dtype}"
        )
    if dim not in HEAD_DIMS or kv_format.head_dim(pool) != dim:
        raise ValueError(
            f"paged decode attention is built for head dims {HEAD_DIMS}, not q's {dim} and the "
            f"pool's {kv_format.head_dim(pool)}: run such a model on the torch path "
            "(gather_attention)"
        )
    kv_heads = pool.shape[1] // 2
    if pool.shape[1] % 2 or kv_heads == 0 or heads % kv_heads:
        raise ValueError(
            f"the pool's {pool.shape[1]} heads must be the K then the V heads of Hkv KV heads, "
            f"with Hkv dividing q's {heads} heads"
        )
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError(
            f"block_tables and seq_lens must be int32, not {block_tables.dtype} and "
            f"{seq_lens.dtype}: build them with dtype=torch.int32"
        )
    if block_tables.shape[0] != batch or seq_lens.shape[0] != batch:
        raise ValueError(
            f"block_tables {list(block_tables.shape)} and seq_lens {list(seq_lens.shape)} need "
            f"one row per query ({batch})"
        )
    devices = {t.device for t in (q, pool, block_tables, seq_lens)}
    if len(devices) != 1:
        raise ValueError(f"paged decode attention's tensors must share one device, not {devices}")
    if not triton_support.runs_on(q.device):
        raise ValueError(
            f"Triton kernels run on a CUDA GPU, or on the CPU under TRITON_INTERPRET=1, not on "
            f"{q.device} here: use the torch path (gather_attention)"
        )
    if pool.stride(2) != 1:
        raise ValueError("the pool must be contiguous along its head dim (it is never copied)")
    if block_size < 1 or sink < 0 or window < 0 or (splits is not None and splits < 1):
        raise ValueError(
            f"need block_size >= 1, sink >= 0, window >= 0 and splits >= 1; got block_size "
            f"{block_size}, sink {sink}, window {window}, splits {splits}"
        )


def configs() -> list[KernelConfig]:
    """Every configuration :func:`paged_decode_attention` launches on a GPU: for each of
    :data:`~engine.kernels.triton_support.GPU_DTYPES` from its oldest architecture on, and
    each head dim, :func:`_attend` in one pass and split, over a float pool and over int8
    rows, and :func:`_combine` (fp32 runs only under the interpreter)."""
    ints = [
        "block_size", "sink", "window", "kv_heads", "group", "head_chunks", "max_blocks",
        "splits", "stride_qb", "stride_qh", "stride_slot", "stride_head", "stride_tb",
    ]  # fmt: skip
    out: list[KernelConfig] = []
    for dtype, (name, min_target) in GPU_DTYPES.items():
        ty, tile = f"*{name}", block_n(dtype)
        for dim in HEAD_DIMS:
            build = partial(
                KernelConfig, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
                min_target=triton_support.head_target(dim, min_target),
            )  # fmt: skip
            for split, rows in product((False, True), ROWS):
                result = "*fp32" if split else ty
                signature = {
                    "q_ptr": ty, "pool_ptr": ROW_POINTERS.get(rows, ty), "tables_ptr": "*i32",
                    "lens_ptr": "*i32", "out_ptr": result, "lse_ptr": result,
                    "scale_log2": "fp32", "cap_log2": "fp32", "cap_scale": "fp32",
                    **dict.fromkeys(ints, "i32"), "HEAD_DIM": "constexpr",
                    "BLOCK_N": "constexpr", "BLOCK_H": "constexpr", "SPLIT": "constexpr",
                    "KV_ROWS": "constexpr",
                }  # fmt: skip
                constants = {"HEAD_DIM": dim, "BLOCK_N": tile, "BLOCK_H": BLOCK_H,
                             "SPLIT": split, "KV_ROWS": rows}  # fmt: skip
                kind = ("split" if split else "one_pass") + ROW_NAMES[rows]
                name_of = f"decode_attention_{kind}_{name}_d{dim}"
                oldest = max(triton_support.head_target(dim, min_target), ROW_TARGETS[rows])
                out.append(build(name_of, _attend, signature, constants, min_target=oldest))
            signature = {
                "part_ptr": "*fp32", "lse_ptr": "*fp32", "lens_ptr": "*i32", "out_ptr": ty,
                **dict.fromkeys(("sink", "window", "splits", "heads"), "i32"),
                "HEAD_DIM": "constexpr", "BLOCK_N": "constexpr",
            }  # fmt: skip
            constants = {"HEAD_DIM": dim, "BLOCK_N": tile}
            name_of = f"decode_attention_combine_{name}_d{dim}"
            out.append(build(name_of, _combine, signature, constants))
    return out
