"""Our W8A16 and W4A16 Triton GEMMs (engine/kernels/triton_kernels/quant_gemm.py) in Triton's
interpreter, on CPU tensors: each kernel against the dequantize-then-multiply torch reference
in fp16 and bf16, for every M the launcher routes differently (GEMV, split-K tiles, prefill
tiles), N and K off the block sizes, INT4 groups 32/64/128, biases, forced splits of K; the
INT4 layout and its dequantization; and the quantized linears of a tiny model running them,
whose greedy ids equal the torch path's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from engine.core.sampling import SamplingParams
from engine.formats.int4 import dequantize_int4, pack_int4, quantize_int4, unpack_int4
from engine.formats.int8 import quantize_int8
from engine.kernels import triton_support
from engine.loader.load import load_model
from engine.quant.int4 import Int4Linear
from engine.quant.int8 import Int8Linear
from engine.quant.spec import INT4_GROUPS
from tests.conftest import WIDE_HEADS
from tests.probed import needs_int4

pytestmark = pytest.mark.skipif(not triton_support.installed(), reason="Triton not installed")

if triton_support.installed():
    from engine.kernels.triton_kernels import quant_gemm as qg
    from engine.kernels.triton_kernels import quant_gemm_kernels as qk

DTYPES = [torch.float16, torch.bfloat16]
ROWS = [1, 3, 16, 64, 200]  # the GEMV, 16-row split-K tiles (2), 64- and 128-row tiles
N, K = 100, 200  # neither a multiple of any block, nor K of any group


def inputs(m: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, K, generator=gen).to(dtype)
    bias = torch.randn(N, generator=gen).to(dtype)
    return x, bias


def weights(seed: int = 1) -> torch.Tensor:
    return torch.randn(N, K, generator=torch.Generator().manual_seed(seed))


def int4_weights(group: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our layout of :func:`weights` at ``group``, and their dequantized values ``[N, K]``."""
    padded = -(-K // group) * group
    q, scale, zero = quantize_int4(F.pad(weights(seed), (0, padded - K)), group)
    sz = torch.stack([scale, zero], dim=2).transpose(0, 1).contiguous()
    return pack_int4(q), sz, dequantize_int4(q, scale, zero, group)[:, :K]


def assert_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                 rounded_weights: bool) -> None:  # fmt: skip
    """``y`` is ``x · wᵀ + bias`` (``w`` fp32, dequantized) to the rounding of ``y``'s dtype:
    half an ulp of the result (bounded by ``eps · |exact|``), plus half an ulp of every weight
    where the kernel rounds dequantized weights to the dtype first (tensor-core tiles), plus
    fp32's summation order."""
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    magnitude = x.double().abs() @ w.double().abs().T
    eps = torch.finfo(y.dtype).eps
    bound = eps * exact.abs() + 1e-5 * magnitude + (eps / 2 * magnitude if rounded_weights else 0)
    error = (y.double() - exact).abs()
    assert y.dtype == x.dtype and y.shape == exact.shape
    assert bool((error <= bound).all()), f"worst excess {float((error - bound).max()):.3g}"


# -- INT8 -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", ROWS)
def test_int8_equals_the_dequantized_matmul(dtype, m):
    x, bias = inputs(m, dtype)
    q, scales = quantize_int8(weights(), dtype)
    w = q.float() * scales.float()[:, None]
    assert_close(qg.int8_linear(x, q, scales, bias), x, w, bias, rounded_weights=False)
    assert_close(qg.int8_linear(x, q, scales), x, w, None, rounded_weights=False)
    reference = qg.int8_reference(x, q, scales, bias)
    assert_close(reference, x, w, bias, rounded_weights=False)  # the reference, checked too


# -- INT4 -------------------------------------------------------------------------------------


@pytest.mark.parametrize("group", INT4_GROUPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", ROWS)
def test_int4_equals_the_dequantized_matmul(dtype, m, group):
    x, bias = inputs(m, dtype)
    packed, sz, w = int4_weights(group)
    tiles = qg.tiles_for("int4", m)
    y = qg.int4_linear(x, packed, sz, group, bias)
    assert_close(y, x, w, bias, rounded_weights=tiles.kernel == "mm")
    reference = qg.int4_reference(x, packed, sz, group, bias)
    assert_close(reference, x, w, bias, rounded_weights=False)


def test_the_launcher_routes_by_rows():
    want = [("gemv", 1, True), ("mm", 16, True), ("mm", 16, True), ("mm", 64, False),
            ("mm", 64, False), ("mm", 128, False), ("mm", 128, False)]  # fmt: skip
    for fmt in ("int8", "int4"):
        shapes = [qg.tiles_for(fmt, m) for m in (1, 2, 16, 17, 64, 65, 5000)]
        assert [(t.kernel, t.block_m, t.may_split) for t in shapes] == want


# -- split-K ----------------------------------------------------------------------------------


@pytest.mark.parametrize("m", [1, 5])
def test_any_split_of_k_sums_to_the_same_product(m):
    """K split 1 to 4 ways (as many as it has blocks), partial sums added by a second pass
    that adds the bias too; K = 1000 ends short of a block."""
    k = 1000
    gen = torch.Generator().manual_seed(3)
    x, bias = torch.randn(m, k, generator=gen).half(), torch.randn(70, generator=gen).half()
    w = torch.randn(70, k, generator=gen)
    q, scales = quantize_int8(w, torch.float16)
    w8 = q.float() * scales.float()[:, None]
    q4, scale, zero = quantize_int4(F.pad(w, (0, 24)), 32)
    packed = pack_int4(q4)
    sz = torch.stack([scale, zero], dim=2).transpose(0, 1).contiguous()
    w4 = dequantize_int4(q4, scale, zero, 32)[:, :k]
    counts: dict[str, list[int]] = {"int8": [], "int4": []}
    for splits in (1, 2, 3, 7):
        y8 = qg.int8_linear(x, q, scales, bias, splits=splits)
        assert_close(y8, x, w8, bias, rounded_weights=False)
        y4 = qg.int4_linear(x, packed, sz, 32, bias, splits=splits)
        assert_close(y4, x, w4, bias, rounded_weights=m > 1)
        for fmt, width in (("int8", k), ("int4", 1024)):
            counts[fmt].append(qg._outputs(x, 70, width, qg.tiles_for(fmt, m), splits)[2].count)
    # as asked, but whole blocks a split (128 and 256 columns for the GEMVs, 64 and 32 for
    # the tiles) and none left empty
    want = {1: {"int8": [1, 2, 3, 4], "int4": [1, 2, 2, 4]},
            5: {"int8": [1, 2, 3, 6], "int4": [1, 2, 3, 7]}}  # fmt: skip
    assert counts == want[m]


def test_a_split_covers_k_once_with_no_empty_split():
    x = torch.zeros(2, K, dtype=torch.float16)
    tiles = qg.tiles_for("int4", 2)
    for width in (32, 224, 4096):
        for asked in range(1, 20):
            _, part, split = qg._outputs(x, N, width, tiles, asked)
            assert split.k_per_split % tiles.block_k == 0
            assert (split.count - 1) * split.k_per_split < width <= split.count * split.k_per_split
            assert split.count <= asked
            assert part.shape == ((2, N) if split.count == 1 else (split.count, 2, N))


def test_split_k_fills_the_gpu_only_when_n_does_not():
    assert qg.splits_for(tiles=64, k_blocks=16, processors=46) == 3  # 4 programs per SM
    assert qg.splits_for(tiles=900, k_blocks=16, processors=46) == 1  # N alone fills it
    assert qg.splits_for(tiles=1, k_blocks=6, processors=132) == 3  # two blocks a split
    assert qg.splits_for(tiles=1, k_blocks=512, processors=132) == qg.MAX_SPLITS
    assert qg.splits_for(tiles=1, k_blocks=512, processors=0) == 1  # the interpreter


# -- what a wrong kernel would get wrong ------------------------------------------------------


def test_columns_past_k_never_count():
    """``x`` a view whose rows run on into huge values: a kernel reading past K (INT4's padded
    width, or a block's tail) or ignoring the row stride would add them."""
    wide = torch.full((16, K + 40), 3e4, dtype=torch.float16)
    x = wide[:, :K]
    x.copy_(inputs(16, torch.float16)[0])
    packed, sz, w4 = int4_weights(128)  # 256 columns packed, 200 real
    q, scales = quantize_int8(weights(), torch.float16)
    for m in (1, 16):
        assert_close(qg.int4_linear(x[:m], packed, sz, 128), x[:m], w4, None, m > 1)
        y8 = qg.int8_linear(x[:m], q, scales)
        assert_close(y8, x[:m], q.float() * scales.float()[:, None], None, False)


def test_each_nibble_and_group_lands_on_its_own_column():
    """One weight set at a time (the others 0), its group's scale telling the groups apart:
    the product reads it off exactly, through the tiles and through the GEMV."""
    group, k = 32, 96
    x = torch.eye(k, dtype=torch.float16)  # row j picks column j of W
    scale = torch.tensor([[1.0, 2.0, 4.0]] * 3, dtype=torch.bfloat16)  # per group
    sz = torch.stack([scale, torch.zeros_like(scale)], dim=2).transpose(0, 1).contiguous()
    for col in (0, 15, 16, 31, 32, 63, 64, 95):
        q = torch.full((3, k), 8, dtype=torch.int32)  # (8 − 8)·s + 0: zero
        q[1, col] = 13
        packed = pack_int4(q)
        want = torch.zeros(k, 3)
        want[col, 1] = 5.0 * float(scale[0, col // group])
        assert torch.equal(qg.int4_linear(x, packed, sz, group).float(), want), col  # [k, 3]
        gemv = qg.int4_linear(x[col : col + 1], packed, sz, group)
        assert torch.equal(gemv.float(), want[col : col + 1]), col


# -- offsets past 2³¹ -------------------------------------------------------------------------

VOCAB = 128_256  # Llama 3's: a quantized head's N


@pytest.fixture
def last_programs(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """``last_programs(n)``: from then on the interpreter runs only the last ``n`` programs
    of each launch's first grid axis, with their own program ids and the grid's true size,
    as if a GPU ran the others too: a grid far too large to interpret whole (a vocabulary's
    head over 33,892 rows: 265,530 programs) still computes its last tiles, where the offsets
    are largest. The kernels and the launchers run unchanged."""
    from triton.runtime import interpreter

    builder, call = interpreter.interpreter_builder, interpreter.GridExecutor.__call__
    set_dim, set_idx = builder.set_grid_dim, builder.set_grid_idx
    skipped = [0]

    def start(count: int) -> None:
        def shortened(executor: Any, *args: object, **kwargs: object) -> None:
            grid = tuple(executor.grid)
            skipped[0] = max(0, grid[0] - count)
            executor.grid = (grid[0] - skipped[0], *grid[1:])
            call(executor, *args, **kwargs)

        monkeypatch.setattr(interpreter.GridExecutor, "__call__", shortened)
        monkeypatch.setattr(builder, "set_grid_dim", lambda x, y, z: set_dim(x + skipped[0], y, z))
        monkeypatch.setattr(builder, "set_grid_idx", lambda x, y, z: set_idx(x + skipped[0], y, z))

    return start


@pytest.mark.parametrize("x_stride", ["contiguous", "vocabulary-wide"])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_rows_past_2_31_elements_land_where_they_belong(fmt, x_stride, last_programs):
    """A quantized head over 33,892 rows (a long context's perplexity pass): ``y`` has
    ``M·N ≥ 2³²`` elements, a virtual allocation whose untouched pages cost no memory, and
    so has ``x`` where its rows are columns of a vocabulary-wide tensor. The last program's
    tile (the last row tile, 128 rows from 33,792, and the last 128 columns) is checked. Its
    offsets into ``y`` (and the wide ``x``) are in [2³², 2³² + 2³¹): 32-bit offsets wrap to
    rows near 300 of the same tensors (inside them: no crash), read and written instead."""
    k, group, m = 40, 32, 264 * 128 + 100  # 265 row tiles: the last is a group of GROUP_M alone
    first = 264 * 128
    tiles = qg.tiles_for(fmt, m)
    assert (tiles.block_m, tiles.block_n, -(-m // tiles.block_m) % qg.GROUP_M) == (128, 128, 1)
    assert 2**32 <= first * VOCAB < (m + 1) * VOCAB <= 2**32 + 2**31
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(VOCAB, k, generator=gen)
    bias = torch.randn(VOCAB, generator=gen).half()
    x = torch.empty((m, k) if x_stride == "contiguous" else (m, VOCAB), dtype=torch.float16)
    x = x[:, :k]
    x[first:] = torch.randn(m - first, k, generator=gen).half()
    last_programs(1)
    if fmt == "int8":
        q, scales = quantize_int8(w, torch.float16)
        y = qg.int8_linear(x, q, scales, bias)
        w = q.float() * scales.float()[:, None]
    else:
        q4, scale, zero = quantize_int4(F.pad(w, (0, 64 - k)), group)
        sz = torch.stack([scale, zero], dim=2).transpose(0, 1).contiguous()
        y = qg.int4_linear(x, pack_int4(q4), sz, group, bias)
        w = dequantize_int4(q4, scale, zero, group)[:, :k]
    assert y.shape == (m, VOCAB)
    cols = slice(VOCAB - 128, VOCAB)
    assert_close(y[first:, cols], x[first:], w[cols], bias[cols], rounded_weights=fmt == "int4")


def test_the_split_k_reduction_past_2_31_elements(last_programs):
    """The second pass of split-K over ``M·N ≥ 2³¹`` (16,744 rows of a vocabulary), on
    virtual allocations (one split: 8 GiB of partial sums): its first block (a grid of one
    program), which a 32-bit ``M·N`` leaves unwritten, and the last block of the real grid,
    whose offsets pass 2³¹."""
    m, splits = 16_744, 1
    total = m * VOCAB
    assert 2**31 <= total < 2**32
    part = torch.empty((splits, m, VOCAB), dtype=torch.float32)
    y = torch.empty((m, VOCAB), dtype=torch.float16)
    bias = torch.randn(VOCAB, generator=torch.Generator().manual_seed(5)).half()
    flat, out = part.view(splits, total), y.view(total)
    block = qg.REDUCE_BLOCK
    blocks = -(-total // block)
    last_programs(1)
    for at, grid in ((slice(0, block), 1), (slice((blocks - 1) * block, total), blocks)):
        values = torch.randn(splits, at.stop - at.start, generator=torch.Generator().manual_seed(6))
        flat[:, at] = values
        out[at] = float("nan")
        qk._splitk_reduce[(grid,)](part, bias, y, m, VOCAB, splits, 1, BLOCK=block)
        cols = torch.arange(at.start, at.stop) % VOCAB
        want = (values.sum(0) + bias[cols].float()).half()
        assert torch.equal(out[at], want), at


# -- the INT4 layout --------------------------------------------------------------------------


def test_the_int4_layout_is_q4_0_order_and_round_trips():
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (5, 96), generator=gen, dtype=torch.int32)
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 48)
    assert int(packed[2, 16 + 3]) == int(q[2, 32 + 3]) | int(q[2, 32 + 16 + 3]) << 4
    assert torch.equal(unpack_int4(packed), q)
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_int4(q[:, :40])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dequantization_rounds_each_weight_as_torch_does(dtype):
    packed, sz, w = int4_weights(64)
    assert torch.equal(qg.int4_dequantize(packed, sz, 64, K, dtype), w.to(dtype))


def test_without_tensor_cores_prefill_multiplies_the_dequantized_matrix(monkeypatch):
    """Below sm_80 ``tl.dot`` has no tensor cores: prefill (M > 16) runs cuBLAS on the
    dequantized matrix, and so does bf16 (our bf16 kernels are built from sm_80); fp16 decode
    stays on our kernels."""
    launched: list[str] = []
    real = qg._run

    def run(kernel: object, *args: object) -> torch.Tensor:
        launched.append(kernel.__name__)  # type: ignore[attr-defined]
        return real(kernel, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(qg, "_run", run)
    monkeypatch.setattr(qg, "tensor_cores", lambda device: False)
    x, bias = inputs(64, torch.float16)
    packed, sz, _ = int4_weights(32)
    y4 = qg.int4_linear(x, packed, sz, 32, bias)
    assert torch.equal(y4, F.linear(x, qg.int4_dequantize(packed, sz, 32, K, x.dtype), bias))
    q, scales = quantize_int8(weights(), torch.float16)
    y8 = qg.int8_linear(x, q, scales, bias)
    assert torch.equal(y8, F.linear(x, q.to(x.dtype) * scales[:, None], bias))
    one, one_bias = x[:1].bfloat16(), bias.bfloat16()
    y = qg.int4_linear(one, packed, sz, 32, one_bias)
    assert torch.equal(y, F.linear(one, qg.int4_dequantize(packed, sz, 32, K, y.dtype), one_bias))
    assert launched == []
    qg.int4_linear(x[:16], packed, sz, 32, bias)
    qg.int8_linear(x[:1], q, scales, bias)
    assert launched == ["_int4_mm", "_int8_gemv"]


def test_the_dequantized_matrix_exists_a_slice_at_a_time(monkeypatch):
    monkeypatch.setattr(qg, "tensor_cores", lambda device: False)
    monkeypatch.setattr(qg, "DENSE_BYTES", 30 * K * 2)  # 30 of the 100 rows in fp16
    slices: list[int] = []
    real = qg.int4_dequantize

    def dequantize(weight: torch.Tensor, *args: object) -> torch.Tensor:
        slices.append(weight.shape[0])
        return real(weight, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(qg, "int4_dequantize", dequantize)
    x, bias = inputs(64, torch.float16)
    packed, sz, w4 = int4_weights(64)
    assert_close(qg.int4_linear(x, packed, sz, 64, bias), x, w4, bias, rounded_weights=True)
    assert slices == [30, 30, 30, 10]
    q, scales = quantize_int8(weights(), torch.float16)
    w8 = q.float() * scales.float()[:, None]
    assert_close(qg.int8_linear(x, q, scales, bias), x, w8, bias, rounded_weights=True)


# -- what the launchers refuse ----------------------------------------------------------------


def test_the_launchers_say_what_is_wrong():
    x, bias = inputs(3, torch.float16)
    q, scales = quantize_int8(weights(), torch.float16)
    packed, sz, _ = int4_weights(64)
    with pytest.raises(ValueError, match="fp16 or bf16"):
        qg.int8_linear(x.float(), q, scales)
    with pytest.raises(ValueError, match="K contiguous"):
        qg.int8_linear(x.T.contiguous().T, q, scales)
    with pytest.raises(ValueError, match=r"int8 \[N, 200\]"):
        qg.int8_linear(x, q[:, :100], scales)
    with pytest.raises(ValueError, match=r"bias must be a contiguous torch\.float16"):
        qg.int8_linear(x, q, scales, bias.bfloat16())
    with pytest.raises(ValueError, match="group 48"):
        qg.int4_linear(x, packed, sz, 48)
    with pytest.raises(ValueError, match=r"uint8 \[N, 128\]"):
        qg.int4_linear(x, packed[:, :64], sz, 64)
    with pytest.raises(ValueError, match=r"bf16 \(4, 100, 2\)"):
        qg.int4_linear(x, packed, sz.half(), 64)
    with pytest.raises(
        ValueError, match="activations are on cpu but weights, scales or bias on meta"
    ):
        qg.int4_linear(x, packed, sz, 64, bias.to("meta"))


# -- the quantized linears and a model --------------------------------------------------------


@pytest.fixture
def triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERSIGHT_KERNELS", "triton")


def test_the_linears_hold_our_layout_where_our_kernels_run(triton):
    w, bias = weights(), torch.randn(N)
    int8 = Int8Linear(w, bias, torch.bfloat16)
    int4 = Int4Linear(w, bias, 32, torch.float16)
    assert int8.kernel == int4.kernel == "Triton GEMM"
    assert int4.weight.dtype == torch.uint8 and int4.weight.shape == (N, 224 // 2)
    assert int4.padded_k == 24 and int4.padded_n == 0 and int4.bias.dtype == torch.float16
    x = torch.randn(2, 3, K)
    assert_close(int8(x.bfloat16()).view(6, N), x.view(6, K).bfloat16(),
                 int8.weight.float() * int8.scales.float()[:, None], int8.bias, False)  # fmt: skip
    y4 = int4(x)  # cast to the layer's dtype, as torch's INT4 path casts to bf16
    assert y4.shape == (2, 3, N) and y4.dtype == torch.float16
    _, _, w4 = int4_weights(32)
    assert_close(y4.view(6, N), x.view(6, K).half(), w4, int4.bias, True)
    q = quantize_int4(F.pad(w, (0, 24)), 32)[0]
    assert torch.equal(int4.values(torch.tensor([4, 0])), q[[4, 0]])  # a tied head's rows


def generate(engine, prompt: list[int], steps: int = 4) -> list[int]:
    run = engine.generate(prompt, SamplingParams(max_new_tokens=steps, ignore_eos=True))
    list(run)
    return run.result.token_ids


def gemm_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    calls = {"int8": 0, "int4": 0}
    for fmt in calls:
        real = getattr(qg, f"{fmt}_linear")

        def counted(*a: object, _real: object = real, _fmt: str = fmt, **k: object) -> object:
            calls[_fmt] += 1
            return _real(*a, **k)  # type: ignore[operator]

        monkeypatch.setattr(qg, f"{fmt}_linear", counted)
    return calls


@pytest.mark.parametrize(
    "precision", ["int8+head", pytest.param("int4-g32+head", marks=needs_int4)]
)
def test_a_quantized_model_on_our_gemms_gives_the_torch_paths_greedy_ids(
    tiny_model_dir, monkeypatch, precision
):
    """A tied head, quantized: its embedding rows read from our layout too."""
    folder, _ = tiny_model_dir("qwen2", True, **WIDE_HEADS)  # q/k/v biases
    prompt = [5, 17, 3, 99, 42, 8, 61]
    plain = load_model(folder, precision=precision, pack=False)
    assert not any("Triton" in g.form for g in plain.weight_groups)
    want = generate(plain, prompt)
    monkeypatch.setenv("INFERSIGHT_KERNELS", "triton")
    calls = gemm_calls(monkeypatch)
    ours = load_model(folder, precision=precision, pack=False)
    fmt = precision[:4]
    quantized = {(g.kind, g.form) for g in ours.weight_groups if g.form.startswith(fmt)}
    name = "int8" if fmt == "int8" else "int4-g32"
    assert {kind for kind, _ in quantized} == {"attention", "mlp", "lm_head"}
    assert all(form.startswith(f"{name} (Triton GEMM)") for _, form in quantized), quantized
    assert generate(ours, prompt) == want
    assert calls[fmt] > 0
