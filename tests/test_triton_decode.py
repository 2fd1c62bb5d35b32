"""The Triton paged decode attention (engine/kernels/triton_kernels/decode_attention.py) under
Triton's interpreter, on CPU tensors, against the torch path it replaces: the same block tables
made into slots and a boolean mask for :func:`gather_attention`, computed in float64.

Every pool slot that a sequence's query must not see (past its length, in a released block,
outside its window) holds NaN, and the tables' columns past each length point at NaN blocks:
a kernel that reads or counts any of them gives NaN, not a small error."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from torch import Tensor

from engine.formats import kv as kv_format
from engine.kernels import triton_support
from engine.kernels.gather_attention import gather_attention
from engine.kv_cache.block_manager import RELEASED
from engine.kv_cache.window import CacheWindow

pytestmark = pytest.mark.skipif(not triton_support.installed(), reason="Triton is not installed")

if triton_support.installed():
    from engine.kernels.triton_kernels import decode_attention as dec
    from engine.kernels.triton_kernels.decode_attention import paged_decode_attention

BLOCK = 16
#: Unit roundoff of each dtype: half the distance from 1 to the next number.
ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


@dataclass
class Case:
    q: Tensor
    pool: Tensor  # NaN wherever a query must not look
    tables: Tensor
    lens: Tensor
    want: Tensor  # float64 reference, [B, H·D]
    sink: int = 0
    window: int = 0

    def run(self, **kw: object) -> Tensor:
        return paged_decode_attention(
            self.q, self.pool, self.tables, self.lens,
            block_size=BLOCK, sink=self.sink, window=self.window, **kw,  # type: ignore[arg-type]
        )  # fmt: skip


def make_case(
    lens: list[int],
    *,
    kv_heads: int,
    group: int,
    dim: int,
    dtype: torch.dtype = torch.float32,
    sink: int = 0,
    window: int = 0,
    seed: int = 0,
) -> Case:
    """A batch of sequences of ``lens`` keys in shuffled blocks of a shared pool, with the
    blocks wholly outside the cache window released (as the block manager gives them back)
    and each table one column wider than its sequence needs, pointing at a NaN block."""
    gen = torch.Generator().manual_seed(seed)
    cols = max(-(-n // BLOCK) for n in lens) + 1
    blocks = len(lens) * cols + 2
    order = torch.randperm(blocks, generator=gen)
    tables = torch.full((len(lens), cols), RELEASED, dtype=torch.int32)
    pool = torch.randn(blocks * BLOCK, 2 * kv_heads, dim, generator=gen).to(dtype)
    clean = pool.double()
    pool[:] = float("nan")
    hide = CacheWindow(sink, window) if window else None
    pos = torch.arange(cols * BLOCK)
    for b, n in enumerate(lens):
        tables[b] = order[b * cols : (b + 1) * cols].int()
        seen = pos < n
        if hide is not None:
            seen &= hide.visible(pos, torch.tensor([n - 1]))[0]
        for c in range(cols):
            if hide is not None and c * BLOCK >= sink and (c + 1) * BLOCK <= n - window:
                tables[b, c] = RELEASED
        slots = tables[b].long().clamp(min=0)[pos // BLOCK] * BLOCK + pos % BLOCK
        live = seen & (tables[b].long()[pos // BLOCK] >= 0)
        pool[slots[live]] = clean[slots[live]].to(dtype)
    q = torch.randn(len(lens), kv_heads * group, dim, generator=gen).to(dtype)
    return Case(q, pool, tables, torch.tensor(lens, dtype=torch.int32),
                reference(q, pool, tables, lens, sink, window), sink, window)  # fmt: skip


def reference(
    q: Tensor, pool: Tensor, tables: Tensor, lens: list[int], sink: int, window: int
) -> Tensor:
    """The torch path on the same tables: slots and a boolean mask (causal, not released,
    the engine's :class:`CacheWindow` rule) for :func:`gather_attention`, in float64; zeros
    for padding rows."""
    cols = tables.shape[1]
    pos = torch.arange(cols * BLOCK)
    block = tables.long()[:, pos // BLOCK]
    slots = block.clamp(min=0) * BLOCK + pos % BLOCK
    query = torch.tensor(lens)[:, None] - 1
    seen = pos[None, :] <= query
    if window:
        seen &= (pos[None, :] < sink) | (pos[None, :] > query - window)
    mask = seen & (block >= 0)
    want = gather_attention(q.double(), pool.double().nan_to_num(0.0), slots, mask[:, None, None])
    want[torch.tensor(lens) == 0] = 0.0
    return want


def assert_close(got: Tensor, case: Case, values: Tensor | None = None) -> None:
    """fp32 to 1e-5. fp16/bf16: the kernel rounds twice to the dtype, the probabilities
    before P·V and the output, each within one unit roundoff of max |V| (an output is an
    average of V rows): 2 u · max |V| (``values``: the pool's values where it holds int8
    rows)."""
    assert got.dtype == case.q.dtype and got.shape == case.want.shape
    assert not got.isnan().any()
    pool = case.pool if values is None else values
    if case.q.dtype == torch.float32:
        tol = 1e-5
    else:
        tol = 2 * ROUNDOFF[case.q.dtype] * pool.double().nan_to_num(0.0).abs().max().item()
    err = (got.double() - case.want).abs().max().item()
    assert err <= tol, f"max error {err:.3g} > {tol:.3g}"


RAGGED = [1, 17, 300, 0]  # one token, part of a block, several blocks, a padding row


@pytest.mark.parametrize(
    ("dtype", "kv_heads", "group", "dim"),
    [
        (torch.float32, 2, 1, 64),
        (torch.float32, 1, 3, 128),
        (torch.float32, 2, 4, 64),
        (torch.float32, 1, 8, 128),
        (torch.float16, 1, 4, 128),
        (torch.float16, 2, 3, 64),
        (torch.bfloat16, 1, 8, 64),
        (torch.bfloat16, 2, 1, 128),
        (torch.bfloat16, 2, 2, 256),  # Gemma 3's heads
        (torch.float32, 1, 2, 256),
    ],
)
def test_ragged_batch_matches_the_torch_path(
    dtype: torch.dtype, kv_heads: int, group: int, dim: int
) -> None:
    case = make_case(RAGGED, kv_heads=kv_heads, group=group, dim=dim, dtype=dtype)
    got = case.run()
    assert_close(got, case)
    assert torch.equal(got[-1], torch.zeros_like(got[-1]))  # the padding row: exactly zeros


@pytest.mark.parametrize(
    ("dtype", "group", "dim"), [(torch.float32, 4, 64), (torch.bfloat16, 8, 128)]
)
def test_a_4k_context_splits(dtype: torch.dtype, group: int, dim: int) -> None:
    """A 4k context in a ragged batch splits by default (the interpreter splits as an 8-SM
    GPU would: 4 sequences × 1 KV head → 8 partitions, 512 keys each for the long one)."""
    case = make_case([4096, 300, 1, 0], kv_heads=1, group=group, dim=dim, dtype=dtype, seed=1)
    assert dec.num_splits(4, 1, case.tables.shape[1] * BLOCK, dec.INTERPRETER_SMS) == 8
    assert_close(case.run(), case)


def test_split_k_matches_one_pass() -> None:
    """One pass, the default split and an odd split that leaves partitions empty agree."""
    case = make_case([1000, 300, 1, 0], kv_heads=1, group=4, dim=64, seed=6)
    outs = {splits: case.run(splits=splits) for splits in (None, 1, 7)}
    for got in outs.values():
        assert_close(got, case)
    assert (outs[None] - outs[1]).abs().max() <= 1e-6
    assert (outs[7] - outs[1]).abs().max() <= 1e-6


@pytest.mark.parametrize(
    ("sink", "window", "dtype"),
    [(4, 100, torch.float32), (0, 64, torch.float32), (20, 8, torch.float32),
     (4, 100, torch.float16)],
)  # fmt: skip
def test_window_with_sinks_and_released_blocks(sink: int, window: int, dtype: torch.dtype) -> None:
    lens = [1, 17, 300, 1000, 0]
    case = make_case(lens, kv_heads=1, group=4, dim=64, dtype=dtype, sink=sink, window=window)
    assert (case.tables[3] == RELEASED).sum() > 0  # the long one lost blocks to the window
    assert_close(case.run(), case)
    assert_close(case.run(splits=1), case)


def quantized_case(case: Case, name: str) -> tuple[Case, Tensor]:
    """``case`` over ``name`` rows of its pool (engine/formats/kv.py: int8 or fp8; a hidden
    slot's NaN values give it a NaN scale), its reference over those rows dequantized, and
    those values."""
    rows = kv_format.quantize(case.pool, kv_format.named(name))
    values = kv_format.dequantize(rows)
    want = reference(case.q, values, case.tables, case.lens.tolist(), case.sink, case.window)
    return replace(case, pool=rows, want=want), values


@pytest.mark.parametrize("rows", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantized_rows_match_the_torch_path_over_them_dequantized(
    dtype: torch.dtype, rows: str
) -> None:
    """Ragged rows with a padding row, and a window with sinks and released blocks, in one
    pass and split: the kernel over int8 or fp8 rows (fp8 read as bytes: each row's values
    widened, its products scaled by the row's scale) gives float64 attention over the rows
    dequantized."""
    cases = [
        make_case(RAGGED, kv_heads=2, group=4, dim=64, dtype=dtype, seed=7),
        make_case([1, 17, 300, 1000, 0], kv_heads=1, group=4, dim=128, dtype=dtype, sink=4,
                  window=100, seed=8),
    ]  # fmt: skip
    for plain in cases:
        case, values = quantized_case(plain, rows)
        assert case.pool.dtype == kv_format.named(rows).storage
        for splits in (1, 4):
            assert_close(case.run(splits=splits), case, values)


def test_released_blocks_are_not_attended_without_a_window() -> None:
    """A negative entry hides its positions whatever the window (here none) says: the
    reference leaves them out too, and their NaN slots must not leak in. With 4 splits, the
    second partition of the first sequence (positions 32-63) holds released blocks only."""
    case = make_case([100, 60], kv_heads=1, group=4, dim=64, seed=2)
    case.tables[0, 2:4] = RELEASED
    case.tables[1, 0] = RELEASED
    case.want = reference(case.q, case.pool, case.tables, [100, 60], 0, 0)
    assert_close(case.run(splits=1), case)
    assert_close(case.run(splits=4), case)
    plain = make_case([100, 60], kv_heads=1, group=4, dim=64, seed=2)
    assert (case.want - plain.want).abs().max() > 0.01  # the hidden keys did count before


def test_a_group_larger_than_one_program_is_taken_in_chunks() -> None:
    case = make_case([40, 5], kv_heads=1, group=20, dim=64, seed=3)
    assert_close(case.run(), case)


def test_queries_may_be_a_strided_view() -> None:
    """The engine's queries are a slice of the fused QKV projection: rows and heads strided."""
    case = make_case([33, 300, 2], kv_heads=2, group=3, dim=64, seed=4)
    qkv = torch.randn(3, 10, 64)
    qkv[:, :6] = case.q
    case.q = qkv[:, :6]
    assert not case.q.is_contiguous()
    assert_close(case.run(), case)


def test_scale() -> None:
    """SDPA scales by 1/√D: a query scaled by ``scale·√D`` gives softmax(q·Kᵀ·scale)."""
    case = make_case([50], kv_heads=1, group=2, dim=64, seed=5)
    pos = torch.arange(50)
    slots = (case.tables[0].long()[pos // BLOCK] * BLOCK + pos % BLOCK)[None]
    q = case.q.double() * 0.3 * 64**0.5
    case.want = gather_attention(q, case.pool.double(), slots, None)
    assert_close(case.run(scale=0.3), case)


def test_split_count_from_shapes() -> None:
    """Enough programs for four per SM, no partition under 256 keys, at most 32; one pass
    where the batch fills the GPU or the context is short."""
    assert dec.num_splits(1, 8, 4096, 28) == 14  # batch-1 4k, Llama-3-8B on an RTX 3060
    assert dec.num_splits(1, 8, 4096, 132) == 16  # an H100/H200: 256-key partitions
    assert dec.num_splits(1, 8, 32768, 132) == 32  # at most 32
    assert dec.num_splits(16, 8, 4096, 28) == 1  # 128 programs fill 28 SMs four times
    assert dec.num_splits(1, 8, 300, 28) == 1  # too short to split
    assert dec.num_splits(1, 8, 512, 28) == 2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tables": torch.zeros(2, 4, dtype=torch.int64)}, "must be int32"),
        ({"q": torch.zeros(2, 4, 96)}, "head dims"),
        ({"q": torch.zeros(2, 4, 64, dtype=torch.float16)}, "pool's dtype"),
        ({"q": torch.zeros(2, 3, 64)}, "dividing q's 3 heads"),
        ({"lens": torch.zeros(3, dtype=torch.int32)}, "one row per query"),
    ],
)
def test_refuses_what_it_cannot_run(change: dict[str, Tensor], message: str) -> None:
    args = {
        "q": torch.zeros(2, 4, 64),
        "pool": torch.zeros(64, 4, 64),
        "tables": torch.zeros(2, 4, dtype=torch.int32),
        "lens": torch.ones(2, dtype=torch.int32),
    } | change
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(
            args["q"], args["pool"], args["tables"], args["lens"], block_size=BLOCK
        )


def test_configs_cover_every_launch() -> None:
    """One configuration per dtype a GPU attends in, head dim and kind, with the tile the
    launcher picks; none for fp32, which attends through torch on a GPU."""
    configs = {c.name: c for c in dec.configs()}
    rows = {"": "", "_int8kv": "*i8", "_fp8kv": "*u8"}
    kinds = ("combine", *(k + r for k in ("one_pass", "split") for r in rows))
    for name, dtype, oldest in (("fp16", torch.float16, 75), ("bf16", torch.bfloat16, 80)):
        for dim in dec.HEAD_DIMS:
            for kind in kinds:
                config = configs.pop(f"decode_attention_{kind}_{name}_d{dim}")
                first = oldest if dim <= 128 else 80  # Ampere on; an fp8 cache from sm_89
                assert config.min_target == (89 if kind.endswith("fp8kv") else first)
                assert config.constants["HEAD_DIM"] == dim
                assert config.constants["BLOCK_N"] == dec.block_n(dtype)
                if kind != "combine":
                    assert config.constants["SPLIT"] == kind.startswith("split")
                    suffix = kind.removeprefix("split").removeprefix("one_pass")
                    assert config.constants["KV_ROWS"] == list(rows).index(suffix)
                    assert config.signature["q_ptr"] == f"*{name}"
                    assert config.signature["pool_ptr"] == (rows[suffix] or f"*{name}")
    assert not configs
