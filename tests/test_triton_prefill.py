"""The paged prefill/extend flash attention kernel (Triton, run here by its interpreter on CPU
tensors) against its reference: for each chunk, the slots its sequence holds and the engine's
visibility mask, attended by :func:`engine.model.attention.grouped_attention`.

Tolerances follow from the dtype. fp32 is exact up to fp32 summation order (1e-5). In fp16 and
bf16 the scores are exact (products of 16-bit floats summed in fp32), so the error comes from
rounding ``p`` to the input dtype before ``p·v`` and rounding the output: at most one unit in
the last place each, relative to ``max |v|``; fp16 rounds to nearest (2⁻¹¹ each), the
interpreter's bf16 casts truncate (2⁻⁷ each, where a GPU rounds to nearest)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
from torch import Tensor

from engine.formats import kv as kv_format
from engine.kernels import triton_support
from engine.kv_cache.window import CacheWindow
from engine.model.attention import grouped_attention

pytestmark = pytest.mark.skipif(not triton_support.installed(), reason="Triton not installed")

if triton_support.installed():
    from engine.kernels.triton_kernels import prefill_attention as kernel
    from engine.kernels.triton_kernels.prefill_attention import paged_prefill_attention

BLOCK = 16
#: Largest error over max |v|, by dtype (module docstring).
ERROR = {torch.float32: 1e-5, torch.float16: 2 * 2**-11, torch.bfloat16: 2 * 2**-7}


@dataclass
class Case:
    """A step's chunks over a shuffled pool: what the kernel takes, and what the reference
    needs (each sequence's block table as a list)."""

    q: Tensor
    pool: Tensor
    tables: Tensor
    q_starts: Tensor
    firsts: Tensor
    lengths: list[int]
    kv_heads: int

    def run(self, **kw: object) -> Tensor:
        return paged_prefill_attention(
            self.q, self.pool, self.tables, self.q_starts, self.firsts,
            max_query_len=max(self.lengths), block_size=BLOCK, **kw,  # type: ignore[arg-type]
        )  # fmt: skip


def make_case(
    chunks: list[tuple[int, int]],
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    released: dict[int, list[int]] | None = None,
    seed: int = 0,
) -> Case:
    """Chunks ``(cached prefix, new tokens)``, one per sequence, with their blocks scattered
    over a pool in shuffled order. Every slot no sequence holds (free, released, or past a
    table's end) is NaN, so that reading one poisons the output."""
    gen = torch.Generator().manual_seed(seed)
    needed = [math.ceil((prefix + length) / BLOCK) for prefix, length in chunks]
    width = max(needed) + 1
    total = sum(needed) + 3  # spare blocks that stay free
    order = torch.randperm(total, generator=gen).tolist()
    pool = torch.randn(total * BLOCK, 2 * kv_heads, head_dim, generator=gen).to(dtype)
    tables = torch.full((len(chunks), width), -1, dtype=torch.int32)
    held = torch.zeros(total, dtype=torch.bool)
    for s, n in enumerate(needed):
        blocks = [order.pop() for _ in range(n)]
        for i in (released or {}).get(s, []):
            blocks[i] = -1
        tables[s, :n] = torch.tensor(blocks, dtype=torch.int32)
        tables[s, n] = order[0]  # past the sequence's end: a free block, never read
        for b in blocks:
            if b >= 0:
                held[b] = True
    pool.view(total, BLOCK, 2 * kv_heads, head_dim)[~held] = float("nan")
    lengths = [length for _, length in chunks]
    q = torch.randn(sum(lengths), heads, head_dim, generator=gen).to(dtype)
    starts = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    firsts = torch.tensor([prefix for prefix, _ in chunks], dtype=torch.int32)
    return Case(q, pool, tables, starts, firsts, lengths, kv_heads)


def reference(case: Case, sink: int = 0, window: int = 0) -> Tensor:
    """Each chunk over the slots its table holds (in position order) with the engine's mask
    (:class:`CacheWindow`), by :func:`grouped_attention` in fp32; rows that see no key are 0."""
    heads, head_dim = case.q.shape[1:]
    out = torch.zeros(case.q.shape[0], heads * head_dim)
    for s, length in enumerate(case.lengths):
        first, begin = int(case.firsts[s]), int(case.q_starts[s])
        positions = torch.arange(first + length)
        blocks = case.tables[s, positions // BLOCK].long()
        keep = blocks >= 0
        if not keep.any():
            continue
        positions, slots = positions[keep], (blocks * BLOCK + positions % BLOCK)[keep]
        rows = kv_format.gather(case.pool, slots, torch.float32).transpose(0, 1)
        queries = torch.arange(first, first + length)
        if window:
            mask = CacheWindow(sink, window).visible(positions, queries)
        else:
            mask = positions[None, :] <= queries[:, None]
        attended = grouped_attention(
            case.q[begin : begin + length].float(),
            rows[: case.kv_heads],
            rows[case.kv_heads :],
            mask,
        )
        out[begin : begin + length] = torch.where(mask.any(1, keepdim=True), attended, 0.0)
    return out


def assert_matches(case: Case, out: Tensor, ref: Tensor, values: Tensor | None = None) -> None:
    """Within :data:`ERROR` of the largest value held (``values``: the pool's where it holds
    int8 rows)."""
    assert out.dtype == case.q.dtype and out.shape == ref.shape
    assert torch.isfinite(out).all()
    pool = case.pool if values is None else values
    held = pool[~pool.isnan().any(2).any(1)]
    bound = ERROR[case.q.dtype] * float(held.float().abs().max())
    err = float((out.float() - ref).abs().max())
    assert err <= bound, f"max error {err:.3g} over the {bound:.3g} that {case.q.dtype} allows"


@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_ragged_chunks_over_cached_prefixes_in_fp32(group: int) -> None:
    """Four sequences at once, each with a different cached prefix (none, inside a block,
    block-aligned, long) and chunks of 1, 7, 64 and 33 tokens, for GQA ratios 1/3/4/8."""
    case = make_case(
        [(37, 1), (0, 7), (48, 64), (150, 33)], heads=2 * group, kv_heads=2, head_dim=64
    )
    assert_matches(case, case.run(), reference(case))


@pytest.mark.parametrize(
    ("dtype", "head_dim", "group"),
    [
        (torch.float16, 64, 4),
        (torch.float16, 128, 1),
        (torch.bfloat16, 64, 3),
        (torch.bfloat16, 128, 8),
        (torch.float16, 256, 2),  # Gemma 3's heads
        (torch.bfloat16, 256, 2),
    ],
)
def test_half_precision_head_dims_64_to_256(dtype: torch.dtype, head_dim: int, group: int):
    case = make_case(
        [(19, 7), (0, 70), (64, 1)], heads=group, kv_heads=1, head_dim=head_dim, dtype=dtype
    )
    assert_matches(case, case.run(), reference(case))


@pytest.mark.parametrize("rows", ["int8", "fp8"])
@pytest.mark.parametrize(
    ("dtype", "head_dim", "window"),
    [(torch.float32, 64, 0), (torch.float16, 128, 0), (torch.bfloat16, 64, 24)],
)
def test_quantized_rows_match_the_reference_over_them_dequantized(
    dtype, head_dim, window, rows
) -> None:
    """Ragged chunks over cached prefixes (one a window with a sink): the kernel over int8
    or fp8 rows (fp8 read as bytes) gives attention over the rows dequantized (the reference
    reads them so)."""
    case = make_case(
        [(37, 1), (0, 7), (48, 64), (150, 33)], heads=8, kv_heads=2, head_dim=head_dim,
        dtype=dtype, seed=9,
    )  # fmt: skip
    case = replace(case, pool=kv_format.quantize(case.pool, kv_format.named(rows)))
    values = kv_format.dequantize(case.pool)
    sink = 4 if window else 0
    assert_matches(case, case.run(sink=sink, window=window), reference(case, sink, window), values)


def test_a_1k_token_chunk_after_a_prefix_in_fp16() -> None:
    """A long prefill: 1,000 new tokens after 24 cached ones (tiles inside the causal
    triangle skip the mask; those on its diagonal apply it), beside a short chunk."""
    case = make_case([(24, 1000), (5, 3)], heads=2, kv_heads=1, head_dim=128, dtype=torch.float16)
    assert_matches(case, case.run(), reference(case))


def test_a_tiny_model_head_dim_is_padded_to_the_tile() -> None:
    """Head dim 8 (the tiny test models'): the tile is 16 wide, its upper half masked."""
    case = make_case([(3, 9), (20, 2)], heads=8, kv_heads=2, head_dim=8)
    assert_matches(case, case.run(), reference(case))


@pytest.mark.parametrize(
    ("sink", "window", "released"),
    [
        # a cache window: the sinks' block kept, the blocks wholly between given back
        (4, 40, {0: list(range(1, 11))}),
        # a sliding window narrower than a tile (Mistral's), all older blocks given back
        (0, 8, {0: list(range(13)), 1: [0]}),
        (16, 100, {}),  # a window wider than what the first query sees; sinks of a whole block
    ],
)
def test_windows_with_sinks_and_released_blocks(
    sink: int, window: int, released: dict[int, list[int]]
) -> None:
    """Queries see the sinks and their own last ``window`` positions; blocks the window gave
    back (table -1, their slots NaN here) are never read."""
    case = make_case([(230, 30), (40, 25)], heads=4, kv_heads=2, head_dim=64, released=released)
    out = case.run(sink=sink, window=window)
    assert_matches(case, out, reference(case, sink, window))
    plain = reference(case)  # the same chunks without the window: it must have mattered
    assert float((out - plain).abs().max()) > 0.1


def test_released_blocks_without_a_window_do_not_count() -> None:
    """Holes in the table (entries -1, their slots NaN) inside the causal triangle: only the
    keys still held are attended, in tiles that skip the causal mask too."""
    case = make_case([(200, 70)], heads=2, kv_heads=1, head_dim=64, released={0: [2, 5, 6, 9]})
    assert_matches(case, case.run(), reference(case))


def test_a_row_that_sees_no_key_is_zero_not_nan() -> None:
    """Two queries whose every key was released (their own block included): zeros, where a
    softmax over nothing would give NaN; the other chunk is attended as usual."""
    case = make_case([(40, 2), (10, 5)], heads=2, kv_heads=1, head_dim=64, released={0: [0, 1, 2]})
    out = case.run(sink=0, window=3)
    assert (out[:2] == 0).all()
    assert_matches(case, out, reference(case, 0, 3))


def test_a_query_never_sees_a_later_key() -> None:
    """Changing the K/V of the chunk's last token changes only the last query's output, bit
    for bit: every earlier query masks it out."""
    case = make_case([(30, 20)], heads=4, kv_heads=2, head_dim=64)
    before = case.run()
    last = 30 + 20 - 1
    slot = int(case.tables[0, last // BLOCK]) * BLOCK + last % BLOCK
    case.pool[slot] = 1e4
    after = case.run()
    assert torch.equal(before[:-1], after[:-1])
    assert not torch.equal(before[-1], after[-1])


def test_scale_defaults_to_one_over_sqrt_head_dim() -> None:
    case = make_case([(8, 12)], heads=2, kv_heads=1, head_dim=64)
    scaled = case.run(scale=0.5)
    case.q = case.q * (0.5 * math.sqrt(64))
    assert_matches(case, scaled, reference(case))


def test_rejects_what_it_cannot_run() -> None:
    case = make_case([(0, 4)], heads=4, kv_heads=2, head_dim=64)
    with pytest.raises(ValueError, match="block_tables must be int32"):
        paged_prefill_attention(
            case.q, case.pool, case.tables.long(), case.q_starts, case.firsts,
            max_query_len=4, block_size=BLOCK,
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"q_starts \[S\+1\]"):
        paged_prefill_attention(
            case.q, case.pool, case.tables, case.q_starts[:1], case.firsts,
            max_query_len=4, block_size=BLOCK,
        )  # fmt: skip
    with pytest.raises(ValueError, match="share one dtype"):
        paged_prefill_attention(
            case.q.half(), case.pool, case.tables, case.q_starts, case.firsts,
            max_query_len=4, block_size=BLOCK,
        )  # fmt: skip
    with pytest.raises(ValueError, match="do not split evenly"):
        paged_prefill_attention(
            case.q[:, :3], case.pool, case.tables, case.q_starts, case.firsts,
            max_query_len=4, block_size=BLOCK,
        )  # fmt: skip


def test_what_runs_on_which_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 from sm_80 on, fp16 everywhere, fp32 only under the interpreter; groups that fit
    a tile; head dims up to 256."""
    monkeypatch.setattr(triton_support, "runs_on", lambda device: True)
    cuda = torch.device("cuda")

    def why(dtype: torch.dtype, cap: tuple[int, int], heads: int = 8, head_dim: int = 128):
        monkeypatch.setattr(kernel.gpu, "capability", lambda device: cap)
        return kernel.unsupported(dtype, heads, 2, head_dim, cuda)

    assert why(torch.float16, (7, 5)) is None
    assert why(torch.bfloat16, (8, 6)) is None
    assert "8.0 or newer" in str(why(torch.bfloat16, (7, 5)))
    assert "torch path" in str(why(torch.float32, (8, 9)))
    assert "head dim 512" in str(why(torch.float16, (8, 9), head_dim=512))
    assert why(torch.bfloat16, (8, 6), heads=4, head_dim=256) is None  # Gemma 3's
    assert "from compute capability 8.0" in str(why(torch.float16, (7, 5), heads=4, head_dim=256))
    assert "do not fit" in str(why(torch.float16, (8, 9), heads=2 * 33, head_dim=256))
    assert "do not fit" in str(why(torch.float16, (8, 9), heads=2 * 65))  # 64 rows at d128
    assert why(torch.float16, (8, 9), heads=2 * 64) is None


def test_every_tile_the_launcher_picks_is_built_ahead_of_time() -> None:
    """configs(): fp16 for sm_75 on and bf16 for sm_80 on, the tiles the launcher picks for
    each built head dim, under unique names."""
    configs = kernel.configs()
    assert len({c.name for c in configs}) == len(configs)
    built = {
        (c.signature["q"], c.signature["pool"], c.constants["KV_ROWS"], c.constants["HEAD_DIM"],
         c.constants["BLOCK_M"], c.constants["BLOCK_N"], c.num_warps, c.num_stages,
         c.min_target)
        for c in configs
    }  # fmt: skip
    pools = {0: None, 1: "*i8", 2: "*u8"}  # KV_ROWS: floats, int8 rows, fp8 rows as bytes
    want = {
        (f"*{name}", pools[rows] or f"*{name}", rows, d, *kernel._tiles(d),
         89 if rows == 2 else triton_support.head_target(d, target))  # fp8 from sm_89
        for name, target in (("fp16", 75), ("bf16", 80))
        for d in kernel.BUILT_HEAD_DIMS
        for rows in pools
    }  # fmt: skip
    # no Turing build of head dim 256 (an fp8 cache's: sm_89 on)
    assert {t for _, _, rows, d, *_, t in built if d == 256 and rows != 2} == {80}
    assert built == want


def test_a_group_as_large_as_the_tile() -> None:
    """64 query heads on one KV head at head dim 128: each tile holds one query's 64 heads."""
    case = make_case([(5, 3), (0, 2)], heads=64, kv_heads=1, head_dim=128)
    assert_matches(case, case.run(), reference(case))
