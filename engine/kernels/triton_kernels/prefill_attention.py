"""Paged prefill/extend flash attention: the new tokens of each sequence's chunk attend, in
place in the KV pool, to the sequence's cached prefix and to the chunk itself.

What it computes: for chunk ``s`` (queries ``q[q_starts[s] : q_starts[s+1]]`` at positions
``first_positions[s] …``), each query head ``h`` at position ``i`` attends to its KV head
``h // G`` (``G = H / Hkv``) over the key positions ``p`` of its sequence that are visible:
``p <= i``, ``p`` still held (its block-table entry ``>= 0``) and, under a cache window,
``p < sink`` or ``p > i - window``. The output is ``softmax(q·kᵀ·scale)·v`` over those keys
(the scores soft-capped first where the model caps them: :mod:`.softcap`),
``[T, H·D]`` in q's dtype: what :func:`engine.model.attention.grouped_attention` gives for the
slots the chunk holds and :func:`engine.kv_cache.window._visible`'s mask (its reference; the
torch path of :class:`engine.attention.paged.PagedContext` gathers those slots instead).

Layout. ``pool: [slots, 2·Hkv, D]`` holds, for each token slot, its K heads then its V heads
(one layer of :class:`~engine.kv_cache.paged.PagedKVCache`); position ``p`` of sequence ``s``
sits at slot ``block_tables[s, p // block_size] · block_size + p % block_size``. Keys are read
through the block table, never gathered into a copy. Head dimensions are contiguous (stride
1) in q and the pool; any other strides are passed.

Algorithm (FlashAttention-2): one program owns one query tile and walks the key tiles once,
keeping a running row max and row sum in fp32 and rescaling its fp32 accumulator as the max
grows (exp2, with log2(e) folded into the scale), then divides once at the end. ``q·kᵀ`` and
``p·v`` are ``tl.dot`` s with fp32 accumulation: tensor cores for fp16 and bf16 (``p`` is
cast to v's dtype, as FlashAttention does), exact fp32 FMAs (``input_precision="ieee"``) for
fp32. Rows whose every key is masked (a padded row, a query whose keys were all released)
keep a zero accumulator and a zero sum: they come out as zeros, never NaN.

Tiles and GQA. A query tile stacks the ``G`` query heads of one KV head under each of
``BLOCK_M // G`` consecutive queries (row ``r``: query ``r // G``, head ``r % G``; vLLM's
unified Triton attention does the same), so each K/V tile is loaded once for the whole
group. For a long chunk this moves as many bytes as one tile per query head would (the tile
holds ``G`` times fewer queries), but an extend of a few tokens over a long cached prefix
(a short follow-up turn, a chunk's tail) fills ``G`` times more of each tile's rows and reads
the prefix ``G`` times less often. ``G`` may be any ratio up to ``BLOCK_M`` (3 wastes one row
of 64 or 128).

The key tiles a query tile walks: the sink tiles (under a window), then from the first key
its earliest query still sees up to its last query's own position. Tiles wholly above the
diagonal or wholly outside the window are never visited. Only the edge tiles (the sinks, the
window's lower edge, the diagonal) apply the causal and window mask; the tiles every row sees
whole mask only keys whose block was released, as the Triton tutorial's fused attention
splits its loop.

Grid: ``(cdiv(max_query_len, BLOCK_M // G), Hkv, S)``. Axis 0 runs the query tiles of one
(sequence, KV head) back to back, so that they share its K/V in L2, the last tile first: under
the causal mask the last tiles walk the most keys, and starting them first shortens the tail
of the launch. A program past its chunk's end returns at once.

Block sizes (:data:`_TILES`). Prefill is bound by the two matmuls, so the tiles are as large
as registers allow: ``BLOCK_M × BLOCK_N = 128 × 64`` up to head dim 64, ``64 × 64`` at 128
(FlashAttention-2's choice for causal head dim 128 on sm_86/89, "the fastest for causal
because it's square"), 8 warps (SGLang's extend kernel uses 8 above head dim 64; with 4,
ptxas spills 1.3-1.8 KB a thread on sm_86, with 8 at most 92 B), 2 stages (``cp.async``
gathers the next K/V tile during this one's math). The same tiles serve every architecture:
they need 25 KiB (head dim 64) and 41 KiB (128) of shared memory on sm_86/89, the 12 GB
consumer cards this engine targets, and 64 KiB, Turing's whole, on sm_75, where only fp16
runs (bf16 ``tl.dot`` needs sm_80; ptxas spills registers there for every tile tried, a plain
contiguous flash-attention loop included, so Turing's tiles are for a GPU to tune). Gemma 3's
head dim 256 takes ``32 × 32`` tiles, 4 warps and one stage: 34 KiB on sm_80 to sm_90,
unmeasured on a GPU yet; it is built from sm_80 on (:data:`~engine.kernels.triton_support.
WIDE_HEADS_FROM`). fp32 runs
only under the interpreter, as the exact check: on a GPU it has no tensor-core path, and the
torch path (SDPA) serves it. :func:`configs` lists each for the ahead-of-time build.
"""

from __future__ import annotations

import math
from itertools import product

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine.formats import kv as kv_format
from engine.hardware import gpu
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
from engine.kernels.triton_support import KernelConfig

#: The widest head dimension the launcher's tiles are sized for.
MAX_HEAD_DIM = 256
#: Head dimensions :func:`configs` builds ahead of time: those of the supported model families
#: (Llama, Qwen, Mistral: 64 and 128; Gemma 3: 256). Any other up to 256 runs the tiles of the
#: next power of two (at least 16) with its tail masked: no more shared memory than the one
#: built.
BUILT_HEAD_DIMS = (64, 128, 256)
#: "No window": a window wider than any position, so ``p > i - window`` always holds.
_NO_WINDOW = 2**31 - 1


@triton.jit
def _attend_tile(
    acc, l_i, m_i, q, pool, table_row, start, key_end, q_pos,
    k_head, v_head, block_size, sink, window, stride_slot, qk_scale, cap_log2, cap_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    EDGE: tl.constexpr, KV_ROWS: tl.constexpr,
):  # fmt: skip
    """One key tile ``start … start+BLOCK_N-1`` of the online softmax: gather K and V
    through the block table, score, mask, rescale. ``EDGE``: apply the causal and window
    mask (else only keys past ``key_end`` or in released blocks are masked). ``KV_ROWS``: the
    pool's rows (:mod:`.kv_rows`: floats, or int8 / fp8 values each row followed by its
    scale, read as bytes)."""
    keys = start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    in_range = keys < key_end
    block = tl.load(table_row + keys // block_size, mask=in_range, other=-1)
    held = in_range & (block >= 0)
    slot = block.to(tl.int64) * block_size + keys % block_size
    rows = pool + slot[:, None] * stride_slot + offs_d[None, :]
    kv_mask = held[:, None] & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(rows + k_head, mask=kv_mask, other=0)
    if KV_ROWS:  # the quantized keys widened, each key's products by its row's scale
        starts = pool + slot * stride_slot
        dots = tl.dot(q, tl.trans(widen(k, KV_ROWS, q.dtype)), input_precision="ieee")
        dots = dots * row_scales(starts + k_head, HEAD_DIM, held, KV_ROWS)[None, :]
    else:
        dots = tl.dot(q, tl.trans(k), input_precision="ieee")
    scores = scores_base2(dots, qk_scale, cap_log2, cap_scale)
    if EDGE:
        seen = (keys[None, :] <= q_pos[:, None]) & (
            (keys[None, :] < sink) | (keys[None, :] > q_pos[:, None] - window)
        )
        scores = tl.where(held[None, :] & seen, scores, float("-inf"))
    else:
        scores = tl.where(held[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    # A row that has seen no key yet keeps -inf: subtract 0 there, not -inf - -inf = NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(scores - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(rows + v_head, mask=kv_mask, other=0)
    if KV_ROWS:  # each probability weighted by its value row's scale, then the values
        v_scale = row_scales(starts + v_head, HEAD_DIM, held, KV_ROWS)
        pv = scaled_values(p, v, v_scale, q.dtype, KV_ROWS)
    else:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    acc = acc * alpha[:, None] + pv
    return acc, l_i, m_new


@triton.jit
def _prefill_kernel(
    q, pool, out, block_tables, q_starts, first_positions, scale, cap_log2, cap_scale,
    stride_qt, stride_qh, stride_slot, stride_head, stride_table, stride_ot,
    kv_heads, group, queries_per_tile, block_size, sink, window,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, KV_ROWS: tl.constexpr,
):  # fmt: skip
    """One query tile of one chunk and one KV head (the module docstring's grid)."""
    seq = tl.program_id(2)
    kv_head = tl.program_id(1)
    q_tile = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest tiles first
    q_begin = tl.load(q_starts + seq)
    chunk = tl.load(q_starts + seq + 1) - q_begin
    first_query = q_tile * queries_per_tile
    if first_query >= chunk:
        return
    first = tl.load(first_positions + seq)
    last_query = tl.minimum(chunk, first_query + queries_per_tile) - 1

    # Row r of the tile: query first_query + r // group, query head r % group of the KV head.
    rows = tl.arange(0, BLOCK_M)
    query = first_query + rows // group
    head = kv_head * group + rows % group
    row_ok = (rows < queries_per_tile * group) & (query < chunk)
    q_pos = first + query
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_rows = (q_begin + query).to(tl.int64) * stride_qt + head * stride_qh
    q_tile_values = tl.load(
        q + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0
    )

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    qk_scale = scale * 1.4426950408889634  # log2(e): the softmax runs on exp2
    table_row = block_tables + seq.to(tl.int64) * stride_table
    k_head = kv_head * stride_head
    v_head = (kv_heads + kv_head) * stride_head

    # Keys the tile's rows may see: [0, sink) and [lo, hi). hi: past the last query's own
    # position; lo: the first key the earliest query's window still holds.
    hi = first + last_query + 1
    lo = tl.maximum(first + first_query - window + 1, 0)
    window_start = (lo // BLOCK_N) * BLOCK_N
    # Tiles every row sees whole: from the first tile past every row's window edge up to
    # the last tile below the earliest query's position.
    inner_lo = tl.maximum(first + last_query - window + 1, 0)
    inner_start = tl.maximum(tl.cdiv(inner_lo, BLOCK_N) * BLOCK_N, window_start)
    inner_end = tl.maximum(((first + first_query + 1) // BLOCK_N) * BLOCK_N, inner_start)

    for start in range(0, tl.minimum(sink, window_start), BLOCK_N):  # the sinks
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q_tile_values, pool, table_row, start, hi, q_pos,
            k_head, v_head, block_size, sink, window, stride_slot, qk_scale, cap_log2,
            cap_scale, HEAD_DIM, BLOCK_D, BLOCK_N, True, KV_ROWS,
        )  # fmt: skip
    for start in range(window_start, tl.minimum(inner_start, hi), BLOCK_N):  # window edge
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q_tile_values, pool, table_row, start, hi, q_pos,
            k_head, v_head, block_size, sink, window, stride_slot, qk_scale, cap_log2,
            cap_scale, HEAD_DIM, BLOCK_D, BLOCK_N, True, KV_ROWS,
        )  # fmt: skip
    for start in range(inner_start, inner_end, BLOCK_N):  # seen whole by every row
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q_tile_values, pool, table_row, start, hi, q_pos,
            k_head, v_head, block_size, sink, window, stride_slot, qk_scale, cap_log2,
            cap_scale, HEAD_DIM, BLOCK_D, BLOCK_N, False, KV_ROWS,
        )  # fmt: skip
    for start in range(inner_end, hi, BLOCK_N):  # the diagonal
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q_tile_values, pool, table_row, start, hi, q_pos,
            k_head, v_head, block_size, sink, window, stride_slot, qk_scale, cap_log2,
            cap_scale, HEAD_DIM, BLOCK_D, BLOCK_N, True, KV_ROWS,
        )  # fmt: skip

    result = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_rows = (q_begin + query).to(tl.int64) * stride_ot + head * HEAD_DIM
    tl.store(
        out + o_rows[:, None] + offs_d[None, :],
        result.to(out.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


def paged_prefill_attention(
    q: Tensor,
    pool: Tensor,
    block_tables: Tensor,
    q_starts: Tensor,
    first_positions: Tensor,
    *,
    max_query_len: int,
    block_size: int,
    sink: int = 0,
    window: int = 0,
    scale: float | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Attention of the chunks' queries ``q: [T, H, D]`` over their sequences' keys in
    ``pool: [slots, 2·Hkv, D]`` (the chunks' own K/V already written), read through
    ``block_tables: [S, M]`` (int32; entries < 0: released, not attended). Chunk ``s`` is
    ``q[q_starts[s] : q_starts[s+1]]`` (``q_starts: [S+1]``, int32) at positions
    ``first_positions[s] …`` (``[S]``, int32). ``max_query_len`` must be at least the longest
    chunk, and each table row must cover its sequence's last query position (neither is
    checked: that would cost a host sync). ``window`` 0 is plain causal attention; else key
    ``p`` is seen by query ``i`` iff ``p <= i`` and (``p < sink`` or ``p > i - window``).
    ``scale`` defaults to ``1/sqrt(D)``; ``softcap`` caps the scores at
    ``softcap · tanh(s / softcap)`` (Gemma 2). Returns ``[T, H·D]`` in q's dtype."""
    _check(q, pool, block_tables, q_starts, first_positions)
    if min(max_query_len, block_size - 1, sink, window) < 0:
        raise ValueError(
            f"paged_prefill_attention needs max_query_len >= 0, block_size >= 1, sink >= 0 "
            f"and window >= 0 (0: none), not {max_query_len}, {block_size}, {sink}, {window}"
        )
    tokens, heads, head_dim = q.shape
    kv_heads = pool.shape[1] // 2
    group = heads // kv_heads
    out = q.new_empty(tokens, heads * head_dim)
    if tokens == 0 or max_query_len == 0:
        return out
    block_m, block_n, warps, stages = _tiles(head_dim)
    queries_per_tile = block_m // group
    pool, rows = rows_of(pool)
    grid = (triton.cdiv(max_query_len, queries_per_tile), kv_heads, block_tables.shape[0])
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    cap = (softcap * 1.4426950408889634, scale / softcap) if softcap else (0.0, 0.0)
    _prefill_kernel[grid](
        q, pool, out, block_tables, q_starts, first_positions, scale, *cap,
        q.stride(0), q.stride(1), pool.stride(0), pool.stride(1), block_tables.stride(0),
        out.stride(0), kv_heads, group, queries_per_tile, block_size, sink,
        window or _NO_WINDOW,
        HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim), BLOCK_M=block_m, BLOCK_N=block_n,
        KV_ROWS=rows, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def unsupported(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, device: torch.device
) -> str | None:
    """Why this kernel does not run attention of this shape on ``device``, or None where it
    does: one line for the load report, so that the engine picks the torch path there."""
    if not triton_support.runs_on(device):
        return (
            f"Triton kernels run on a CUDA GPU, or on a CPU only under TRITON_INTERPRET=1, "
            f"not on {device}"
        )
    if dtype not in _DTYPES:
        return f"this kernel attends in fp16, bf16 or fp32 (the interpreter's), not {dtype}"
    cap = gpu.capability(device)
    if cap is not None and dtype == torch.float32:
        return (
            "fp32 attention has no tensor-core path: on a GPU it runs the torch path (SDPA); "
            "this kernel computes fp32 only under the interpreter, as the reference checks"
        )
    if dtype == torch.bfloat16 and not gpu.runs_bf16(cap):
        return (
            "bf16 attention needs compute capability 8.0 or newer (tl.dot has no bf16 "
            "tensor-core path below): run the model in fp16 on this GPU"
        )
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        return f"head dim {head_dim} is outside this kernel's 1 … {MAX_HEAD_DIM}"
    if cap is not None and triton_support.head_target(head_dim, 0) > cap[0] * 10 + cap[1]:
        return (
            f"heads {head_dim} wide run our attention kernels from compute capability 8.0 "
            "(below it they compute in fp16, where Gemma 3's activations overflow)"
        )
    if kv_heads < 1 or heads % kv_heads:
        return f"{heads} query heads do not split evenly over {kv_heads} KV heads"
    if heads // kv_heads > _tiles(head_dim)[0]:
        return (
            f"{heads // kv_heads} query heads per KV head do not fit one tile's "
            f"{_tiles(head_dim)[0]} rows"
        )
    return None


def _check(
    q: Tensor, pool: Tensor, block_tables: Tensor, q_starts: Tensor, first_positions: Tensor
) -> None:
    """Validate what the host knows without a sync: shapes, dtypes, devices, strides."""
    if (
        q.dim() != 3 or pool.dim() != 3 or pool.shape[1] % 2
        or kv_format.head_dim(pool) != q.shape[2]
    ):  # fmt: skip
        raise ValueError(
            f"q must be [T, H, D] and pool [slots, 2·Hkv, D] (or int8 rows [slots, 2·Hkv, "
            f"D + 4]), not {tuple(q.shape)} and {tuple(pool.shape)}"
        )
    if pool.dtype not in (q.dtype, torch.int8, torch.float8_e4m3fn):
        raise ValueError(
            f"q and pool must share one dtype (or the pool hold int8 or fp8 rows), not "
            f"{q.dtype} and {pool.dtype}"
        )
    why = unsupported(q.dtype, q.shape[1], pool.shape[1] // 2, q.shape[2], q.device)
    if why is not None:
        raise ValueError(f"{why}; attend with the torch path (grouped_attention) instead")
    if q.stride(2) != 1 or pool.stride(2) != 1:
        raise ValueError("q and pool must be contiguous along the head dimension (stride 1)")
    seqs = block_tables.shape[0] if block_tables.dim() == 2 else -1
    shapes = [tuple(t.shape) for t in (block_tables, q_starts, first_positions)]
    if seqs < 0 or shapes[1:] != [(seqs + 1,), (seqs,)]:
        raise ValueError(
            f"block_tables must be [S, M], q_starts [S+1] and first_positions [S], not "
            f"{', '.join(map(str, shapes))}"
        )
    for name, t in (("block_tables", block_tables), ("q_starts", q_starts),
                    ("first_positions", first_positions)):  # fmt: skip
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, not {t.dtype}")
        if t.device != q.device or pool.device != q.device:
            raise ValueError(
                f"q, pool and the index tensors must be on one device; {name} is on "
                f"{t.device}, pool on {pool.device}, q on {q.device}"
            )


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: (BLOCK_M, BLOCK_N, num_warps, num_stages) by BLOCK_D (see the module docstring).
_TILES = {16: (128, 64, 8, 2), 32: (128, 64, 8, 2), 64: (128, 64, 8, 2), 128: (64, 64, 8, 2),
          256: (32, 32, 4, 1)}  # fmt: skip


def _block_d(head_dim: int) -> int:
    """The tile's head-dimension width: a power of two, and at least 16 (``tl.dot``'s least)."""
    return max(16, triton.next_power_of_2(head_dim))


def _tiles(head_dim: int) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` for this head dimension."""
    return _TILES[_block_d(head_dim)]


def configs() -> list[KernelConfig]:
    """Every tile configuration the launcher picks on a GPU, for the ahead-of-time build: fp16
    (sm_75 on) and bf16 (sm_80 on), for each head dimension of :data:`BUILT_HEAD_DIMS`, over a
    float pool and over int8 and fp8 rows."""
    out = []
    for (dtype, min_target), rows in product((("fp16", 75), ("bf16", 80)), ROWS):
        for head_dim in BUILT_HEAD_DIMS:
            block_m, block_n, warps, stages = _tiles(head_dim)
            signature = {
                "q": f"*{dtype}", "pool": ROW_POINTERS.get(rows, f"*{dtype}"), "out": f"*{dtype}",
                "block_tables": "*i32", "q_starts": "*i32", "first_positions": "*i32",
                "scale": "fp32", "cap_log2": "fp32", "cap_scale": "fp32",
                **dict.fromkeys(
                    ("stride_qt", "stride_qh", "stride_slot", "stride_head", "stride_table",
                     "stride_ot", "kv_heads", "group", "queries_per_tile", "block_size",
                     "sink", "window"),
                    "i32",
                ),
                **dict.fromkeys(
                    ("HEAD_DIM", "BLOCK_D", "BLOCK_M", "BLOCK_N", "KV_ROWS"), "constexpr"
                ),
            }  # fmt: skip
            constants = {
                "HEAD_DIM": head_dim, "BLOCK_D": _block_d(head_dim), "BLOCK_M": block_m,
                "BLOCK_N": block_n, "KV_ROWS": rows,
            }  # fmt: skip
            kv = ROW_NAMES[rows]
            oldest = max(triton_support.head_target(head_dim, min_target), ROW_TARGETS[rows])
            config = KernelConfig(
                name=f"prefill_attention_{dtype}{kv}_d{head_dim}_m{block_m}_n{block_n}",
                fn=_prefill_kernel, signature=signature, constants=constants,
                num_warps=warps, num_stages=stages,
                min_target=oldest,
            )  # fmt: skip
            out.append(config)
    return out
