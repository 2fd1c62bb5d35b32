"""Our low-bit CPU kernels (engine/kernels/lowbit.py, csrc/lowbit.c): each product against
float64 on the dequantized operands, at every CPU level this machine can build for, rows
independent of the rows beside them, the instruction sets this machine cannot run compiled and
read back, and the layers that run them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.errors import InfersightError
from engine.formats.int4 import pack_int4, quantize_int4, unpack_int4
from engine.formats.int8 import quantize_int8
from engine.hardware import measured
from engine.hardware.cpu_paths import forced_level
from engine.kernels import lowbit, lowbit_rows, native, verify
from tests.probed import X86, built_levels, cpu_flags, precisions

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C compiler")

BUILT = built_levels()


def expected_isa(level: str | None) -> str:
    """The instruction set a build at ``level`` (None: this CPU's own) must use, from what the
    CPU says it has."""
    level = level or forced_level()
    if level == "DEFAULT":
        return "portable"
    if level == "AVX2":
        return "avx2"
    flags = cpu_flags()
    if {"avx512_vnni", "avx512bw", "avx512vl"} <= flags:
        return "avx512-vnni"
    return "avx-vnni" if "avx_vnni" in flags else "avx2"


@pytest.fixture(scope="module", params=BUILT, ids=lambda level: level or "native")
def lib(request: pytest.FixtureRequest) -> lowbit.Library:
    built = lowbit.build(request.param)
    assert built.available, built.why
    if X86:
        assert built.isa == expected_isa(request.param)
    return built


def _dense_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int):
    n, k = q.shape
    groups = (q.double().view(n, -1, group) - 8) * scale.double()[..., None]
    return (groups + zero.double()[..., None]).view(n, k)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


SHAPES = [(1, 576, 1536), (2, 40, 7), (3, 100, 33), (4, 64, 17), (5, 200, 9), (8, 96, 100),
          (13, 130, 5), (16, 256, 48)]  # fmt: skip


@pytest.mark.parametrize(("m", "k0", "n"), SHAPES)
def test_each_product_matches_float64_on_the_dequantized_operands(lib, m, k0, n):
    """M = 1…16, K not a multiple of 32 (activations and weights padded with zeros, as the
    layers do) nor of INT8's int16 block, N not a multiple of any vector width; INT8 and INT4
    in three group sizes."""
    gen = torch.Generator().manual_seed(m * 1000 + k0 + n)
    x0 = torch.randn(m, k0, generator=gen) * 2
    x0[:, 3] = 40  # an outlier channel, as LLM activations have
    w0 = torch.randn(n, k0, generator=gen)
    for group in (32, 64, 128):
        k = -(-k0 // group) * group
        x, w = lowbit.padded(x0, k), F.pad(w0, (0, k - k0))
        qx = lowbit.quantize(lib, x)
        q4, scale, zero = quantize_int4(w, group)
        sz = torch.stack([scale, zero], dim=2).contiguous()
        got = lowbit.int4_gemm(lib, qx, pack_int4(q4), sz, group, 2)
        want = qx.dequantized() @ _dense_int4(q4, scale, zero, group).T
        assert _relative_error(got, want) < verify.tolerance(torch.float32, k)
    k = -(-k0 // 32) * 32  # INT8: int16 blocks of 128, the last one of 32, 64 or 96
    x, w = lowbit.padded(x0, k), F.pad(w0, (0, k - k0))
    qx = lowbit.quantize16(lib, x)
    wq, ws = quantize_int8(w)
    got = lowbit.int8_gemm(lib, qx, wq, ws, 2)
    want = qx.dequantized() @ (wq.double() * ws.double()[:, None]).T
    assert _relative_error(got, want) < verify.tolerance(torch.float32, k)


def test_activations_round_as_torch_does(lib):
    """Quantized exactly as torch's reference: ties to even, an all-zero block, huge and
    tiny values, and the blocks' sums."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, 256, generator=gen) * torch.logspace(-6, 4, 7)[:, None]
    x[0, :32] = 0
    x[1, :32] = torch.arange(32) - 15.5  # d = 16.5 / 127: many quotients near .5
    x[2, 32:64] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5] * 5 + [0.0, 1.0])
    got, want = lowbit.quantize(lib, x), lowbit.quantize_reference(x)
    assert torch.equal(got.q, want.q) and torch.equal(got.d, want.d)
    assert torch.equal(got.s, want.s)
    assert got.q.abs().max() <= 127
    x16 = x[:, :224].clone()  # int16 blocks of 128, the last of 96
    x16[4, :128] = 0
    got16, want16 = lowbit.quantize16(lib, x16), lowbit.quantize16_reference(x16)
    assert torch.equal(got16.q, want16.q) and torch.equal(got16.d, want16.d)
    assert got16.q.abs().max() == 32767 and got16.d.shape == (7, 2) and got16.d[4, 0] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_rows_quantize_and_scale_as_torch_does(lib, dtype):
    """W8A8's per-row quantization (per-row and static scales, ties to even, an all-zero row,
    values far past a static scale) and the scaling of its int32 sums, bit for bit against
    torch's operators, in one pass of C each."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, 100, generator=gen) * torch.logspace(-5, 5, 6)[:, None]
    x[0] = 0
    x[1, :6] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5])  # scale 1: quotients at .5
    x = x.to(dtype)
    for fixed in (None, 0.5):
        got, want = (
            lowbit_rows.quantize_rows(x, fixed, lib),
            lowbit_rows.quantize_rows_reference(x, fixed),
        )
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert lowbit_rows.quantize_rows(x, 0.5, lib)[0].abs().max() == 127  # saturated
    acc = torch.randint(-(2**24), 2**24, (6, 40), generator=gen, dtype=torch.int32)
    sx, sw = torch.rand(6, 1, generator=gen), torch.rand(40, generator=gen)
    for bias in (None, torch.randn(40, generator=gen)):
        got_y = lowbit_rows.scale_rows(acc, sx, sw, bias, dtype, lib)
        assert got_y.dtype == dtype
        assert torch.equal(got_y, lowbit_rows.scale_rows_reference(acc, sx, sw, bias, dtype))


@pytest.mark.parametrize("group", [32, 64])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(lib, group):
    """Each row of a 1…16-row product equals, bit for bit, the same row alone: a decode row
    computes the same in any batch, and a verify step the same as one token at a time (groups
    of 32 take a loop of their own)."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(16, 320, generator=gen)
    w = torch.randn(70, 320, generator=gen)
    q4, scale, zero = quantize_int4(w, group)
    packed, sz = pack_int4(q4), torch.stack([scale, zero], dim=2).contiguous()
    wq, ws = quantize_int8(w)
    alone4 = torch.cat([lowbit.int4_gemm(lib, lowbit.quantize(lib, x[i : i + 1].contiguous()),
                                         packed, sz, group, 1) for i in range(16)])  # fmt: skip
    alone8 = torch.cat([lowbit.int8_gemm(lib, lowbit.quantize16(lib, x[i : i + 1].contiguous()),
                                         wq, ws, 1) for i in range(16)])  # fmt: skip
    for m in (2, 3, 5, 16):
        part = lowbit.quantize(lib, x[:m].contiguous())
        assert torch.equal(lowbit.int4_gemm(lib, part, packed, sz, group, 2), alone4[:m])
        part16 = lowbit.quantize16(lib, x[:m].contiguous())
        assert torch.equal(lowbit.int8_gemm(lib, part16, wq, ws, 2), alone8[:m])
    assert torch.equal(lowbit.int8_gemm(lib, lowbit.quantize16(lib, x), wq, ws, 2), alone8)


def test_bf16_in_and_out_are_what_converting_around_an_fp32_call_gives():
    """The layers hand bf16 activations in and take bf16 out: the kernel widens and rounds
    them itself, bit for bit as ``.float()`` before and ``.to(bf16)`` after would."""
    if not lowbit.library().available:
        pytest.skip(lowbit.library().why)
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(3, 160, generator=gen) * 3).bfloat16()
    w = torch.randn(37, 160, generator=gen)
    wq, ws = quantize_int8(w)
    q4, scale, zero = quantize_int4(w, 32)
    packed, sz = pack_int4(q4), torch.stack([scale, zero], dim=2).contiguous()
    for out in (torch.float32, torch.bfloat16):
        got = lowbit.int8_linear(x, wq, ws.float(), out)
        assert got.dtype == out
        assert torch.equal(got, lowbit.int8_linear(x.float(), wq, ws.float()).to(out))
        got = lowbit.int4_linear(x, packed, sz, 32, out)
        assert torch.equal(got, lowbit.int4_linear(x.float(), packed, sz, 32).to(out))


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_dequantization_is_the_formula_in_fp32_rounded_to_bf16(lib, group):
    """A block of rows of our INT4 layout as bf16, bit for bit ``((q − 8)·s + z)`` computed in
    fp32 and rounded: what a prefill chunk's bf16 GEMM multiplies by."""
    gen = torch.Generator().manual_seed(group)
    w = torch.randn(37, 256, generator=gen) * 3
    q4, scale, zero = quantize_int4(w, group)
    packed, sz = pack_int4(q4), torch.stack([scale, zero], dim=2).contiguous()
    dense = (q4.float().view(37, -1, group) - 8) * scale.float()[..., None] + zero.float()[
        ..., None
    ]
    want = dense.view(37, 256).bfloat16()
    assert torch.equal(lowbit.int4_dequantized(packed, sz, group, slice(0, 37), lib), want)
    assert torch.equal(lowbit.int4_dequantized(packed, sz, group, slice(5, 21), lib), want[5:21])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tied_heads_embedding_rows_read_in_one_call_are_the_torch_codes(dtype):
    """The rows a tied INT4 head's embedding reads from our layout (``lowbit.int4_rows``): bit
    for bit ``((q − 8)·s + z)·inverse_scale`` in fp32 as the embedding's torch code computes
    it, the first columns of a K padded to the group, any ids in any order, repeated; an id
    outside the vocabulary is an IndexError, as torch's indexing gives."""
    if not lowbit.library().available:
        pytest.skip(lowbit.library().why)
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(41, 96, generator=gen) * 2
    q4, scale, zero = quantize_int4(w, 32)
    packed, sz = pack_int4(q4), torch.stack([scale, zero], dim=2).contiguous()
    inverse = torch.rand(90, generator=gen) + 0.5
    ids = torch.tensor([0, 40, 7, 7, 19])
    groups = (q4.float().view(41, -1, 32) - 8) * scale.float()[..., None] + zero.float()[..., None]
    want = (groups.view(41, 96)[ids][:, :90] * inverse).to(dtype)
    assert torch.equal(lowbit.int4_rows(packed, sz, 32, ids, inverse, 90, dtype), want)
    with pytest.raises(IndexError, match="outside the vocabulary"):
        lowbit.int4_rows(packed, sz, 32, torch.tensor([3, 41]), inverse, 90, dtype)


def test_int4_prefill_chunks_run_bf16_gemms_and_decode_rows_our_kernel(
    monkeypatch, fresh_measurements
):
    """With ``ours``, an INT4 layer on our layout takes bf16 GEMMs on weights dequantized a
    block of rows at a time for more than 16 rows, the int8-activation kernel for fewer; the
    blocks give what one whole dequantized matrix gives."""
    from engine.quant import int4, int8

    monkeypatch.setenv(lowbit.ENV, "ours")
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(40, 64, generator=gen)
    layer = int4.Int4Linear(w, None, 32)
    assert layer.lowbit and layer.prefill_bf16 and "prefill in bf16 GEMMs" in layer.kernel
    x = torch.randn(20, 64, generator=gen).bfloat16()
    sz = layer.scales_and_zeros.transpose(0, 1)
    dense = lowbit.int4_dequantized(layer.weight, sz, 32, slice(0, 40))
    monkeypatch.setattr(int8, "PREFILL_CHUNK", 64 * 16)  # blocks of 16 rows
    assert torch.equal(layer(x), F.linear(x, dense))
    kernel_rows: list[int] = []
    real = lowbit.int4_linear
    monkeypatch.setattr(
        lowbit, "int4_linear", lambda x2, *a: kernel_rows.append(len(x2)) or real(x2, *a)
    )
    layer(x[:16])
    layer(x)
    assert kernel_rows == [16]


def test_prefill_products_run_their_gemms_at_few_row_counts(monkeypatch):
    """A prefill product pads its rows to :func:`bucket_rows` — at most eight shapes an octave,
    at most an eighth more rows — and answers the rows asked: the padded GEMM's first rows,
    over every block of output rows (oneDNN keeps memory per GEMM shape it meets; a server's
    chunks come in every length: docs/reliability.md)."""
    from engine.quant import int4, int8

    buckets = {m: int8.bucket_rows(m) for m in range(1, 4097)}
    assert all(m <= b <= 1.125 * m for m, b in buckets.items())
    assert all(buckets[2**j] == 2**j for j in range(13))
    for j in range(3, 12):
        assert len({buckets[m] for m in range(2**j + 1, 2 ** (j + 1) + 1)}) == 8
    assert len(set(buckets[m] for m in range(17, 4097))) == 64

    if not lowbit.library().available:
        pytest.skip(lowbit.library().why)
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(40, 64, generator=gen)
    q4, scale, zero = quantize_int4(w, 32)
    packed, sz = pack_int4(q4), torch.stack([scale, zero], dim=2).bfloat16().contiguous()
    dense = lowbit.int4_dequantized(packed, sz, 32, slice(0, 40))
    gemm_rows: list[int] = []
    real = F.linear
    monkeypatch.setattr(int4.F, "linear", lambda x, *a: gemm_rows.append(x.shape[0]) or real(x, *a))
    # the whole matrix in one block, then blocks of 16 output rows (16, 16, 8); the reference
    # runs the same GEMM shapes, so that it is bit for bit on every CPU kind
    for blocks in ([slice(0, 40)], [slice(0, 16), slice(16, 32), slice(32, 40)]):
        monkeypatch.setattr(int8, "PREFILL_CHUNK", 64 * blocks[0].stop)
        gemm_rows.clear()
        for m in (17, 33, 65, 100):
            x = torch.randn(m, 64, generator=gen).bfloat16()
            padded = F.pad(x, (0, 0, 0, buckets[m] - m))
            y = int4.bf16_product(x, packed, sz, 32)
            assert y.shape == (m, 40) and y.is_contiguous()
            assert torch.equal(y, torch.cat([real(padded, dense[b]) for b in blocks], 1)[:m])
        assert gemm_rows == [r for r in (18, 36, 72, 104) for _ in blocks]


def test_packing_round_trips():
    q = torch.randint(0, 16, (5, 96), generator=torch.Generator().manual_seed(3))
    packed = pack_int4(q)
    assert packed.shape == (5, 48) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q.int())
    assert packed[0, 0] == q[0, 0] | (q[0, 16] << 4)  # llama.cpp's order within a block


def _assembly(command: list[str], out: Path) -> str:
    done = subprocess.run([*command, "-S", "-o", str(out), str(lowbit.SOURCE)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return out.read_text(errors="replace")


@pytest.mark.skipif(not X86, reason="x86-64 instruction sets")
def test_the_avx_vnni_path_compiles_to_vex_dot_products(tmp_path: Path):
    """AVX-VNNI (Alder Lake, Zen 5) is a path of its own, which CPUs with AVX-512 VNNI (and
    those without either) do not run: it is built and read back here."""
    cc = native.compiler()
    assert cc is not None
    code = _assembly([cc, "-O3", "-std=c11", "-mavx2", "-mfma", "-mavxvnni"], tmp_path / "s")
    assert '"avx-vnni"' in code and "{vex} vpdpbusd" in code


def test_the_neon_dot_product_path_compiles_for_arm64(tmp_path: Path):
    """The arm64 path, cross-compiled with Zig's clang (the ``ziglang`` wheel of the dev
    extras): ``sdot`` instructions and the ``neon-dotprod`` name. Running it needs arm64."""
    zig = [sys.executable, "-m", "ziglang", "cc", "-target", "aarch64-linux-gnu",
           "-mcpu=generic+dotprod", "-O3", "-std=c11"]  # fmt: skip
    code = _assembly(zig, tmp_path / "s")
    assert "neon-dotprod" in code and "sdot" in code


# -- the layers ------------------------------------------------------------------------------


def test_auto_hands_only_admitted_formats_and_ours_is_an_error_where_nothing_builds(
    monkeypatch, tmp_path
):
    """A format whose activations' quantization has not been measured below a tenth of its
    weights' own KL is never handed to ours by ``auto``, however fast; ``ours`` without a
    build says what to do."""
    monkeypatch.setenv("INFERSIGHT_HOME", str(tmp_path))
    monkeypatch.setenv(lowbit.ENV, "auto")
    assert lowbit.chosen("int8", 64, 64, lambda: lowbit.Timing(0.0, 1.0))
    monkeypatch.setattr(lowbit, "ADMITTED", frozenset({"int4"}))
    assert not lowbit.chosen("int8", 64, 64, lambda: lowbit.Timing(0.0, 1.0))
    monkeypatch.setenv(lowbit.ENV, "ours")
    broken = lowbit.Library(None, "the low-bit kernels: no C compiler found")
    monkeypatch.setattr(lowbit, "library", lambda: broken)
    refused = r"INFERSIGHT_LOWBIT=ours, but .*no C compiler found; unset it"
    with pytest.raises(InfersightError, match=refused):
        lowbit.chosen("int4-g32", 64, 64, None)
    monkeypatch.setenv(lowbit.ENV, "fastest")
    with pytest.raises(InfersightError, match="auto, ours, torch"):
        lowbit.requested()


def test_int8_prefill_chunks_run_bf16_gemms_on_weights_converted_block_by_block(
    monkeypatch, fresh_measurements
):
    """An INT8 layer takes the int16-activation kernel for up to 16 rows and, for a prefill
    chunk, bf16 GEMMs on its weights converted a block of rows at a time: the same values as
    converting the whole matrix (and within bf16's rounding of float64), the choice timed once
    per machine and shape."""
    from engine.kernels import gemv
    from engine.quant import int8

    gen = torch.Generator().manual_seed(6)
    w = torch.randn(70, 96, generator=gen)
    x = torch.randn(40, 96, generator=gen).bfloat16()
    q, scales = quantize_int8(w, torch.bfloat16)
    whole = F.linear(x, q.bfloat16()) * scales
    monkeypatch.setattr(int8, "PREFILL_CHUNK", 96 * 16)  # blocks of 16 rows: 5 of them
    blocks = int8.bf16_product(x, q, scales)
    assert torch.equal(blocks, whole)
    exact = x.double() @ (q.double() * scales.double()[:, None]).T
    assert ((blocks.double() - exact).abs() / exact.abs().max()).max() < 2**-7

    timings = []

    def timed(n: int, k: int) -> lowbit.Timing:
        timings.append((n, k))
        return lowbit.Timing(ours_ms=1.0, torch_ms=2.0)

    monkeypatch.setattr(int8, "time_prefill", timed)
    monkeypatch.setenv(lowbit.ENV, "auto")
    calls: list[int] = []
    real = int8.bf16_product
    monkeypatch.setattr(int8, "bf16_product", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    layers = [int8.Int8Linear(w, None, torch.bfloat16) for _ in range(2)]
    if not layers[0].use_kernel:  # no INT8 kernel in this torch: the converting path it is
        assert not layers[0].prefill_bf16
        return
    assert timings == [(70, 96)]  # once for the shape, kept in kernels.json
    layer = layers[0]
    assert layer.prefill_bf16 and "prefill in bf16 GEMMs" in layer.kernel
    assert torch.equal(layer(x), whole)
    layer(x[: gemv.MAX_ROWS])  # a decode or verify step: not a prefill chunk
    assert calls == [40]


def test_a_shape_is_timed_once_per_machine(monkeypatch, fresh_measurements):
    monkeypatch.setenv(lowbit.ENV, "auto")
    timings = []

    def timer() -> lowbit.Timing:
        timings.append(1)
        return lowbit.Timing(ours_ms=1.0, torch_ms=2.0)

    assert lowbit.chosen("int4-g32", 96, 64, timer)
    assert lowbit.chosen("int4-g32", 96, 64, timer)
    assert timings == [1]
    kept = measured.read(measured.KERNELS_FILE)
    assert any("lowbit int4-g32 96x64" in shapes for shapes in kept.values())


@pytest.mark.parametrize("precision", precisions("int4-g32+head", "int8"))
def test_a_model_on_our_kernels_gives_what_the_same_arithmetic_in_torch_gives(
    tiny_model_dir, monkeypatch, precision
):
    """A tiny Llama with every quantized linear on our kernels, and the tied head's rows
    read from our INT4 layout by the embedding: the embedding equal to the one read from
    torch's layout, and next-token distributions (a prefill, then a step per token) as the
    same model's whose products are computed in float64 from the quantized activations and
    dequantized weights. Not bit for bit: the model computes in bf16, and an output rounded
    one ulp apart can round a later activation to the next int8 (int16) step, so the bound is on KL
    (a nibble out of order, or a scale of the wrong group, gives KL above 0.1)."""
    from engine.core.sampling import SamplingParams
    from engine.evals.scoring import score
    from engine.loader.load import load_model

    folder, _ = tiny_model_dir("llama", True, hidden_size=128, intermediate_size=256)
    ids = torch.arange(3, 300, 7)
    monkeypatch.setenv(lowbit.ENV, "torch")
    embedded = load_model(folder, precision=precision).model.embed(ids)
    monkeypatch.setenv(lowbit.ENV, "ours")
    engine = load_model(folder, precision=precision)
    assert torch.equal(engine.model.embed(ids), embedded)
    kernels = {m.kernel for m in engine.model.modules() if hasattr(m, "quantized")}
    if precision.startswith("int4"):  # and bf16 GEMMs for prefill chunks
        assert len(kernels) == 1 and kernels.pop().startswith("our int8-activation kernel")
    else:  # INT8: int16 activations, for up to 16 rows (prefill chunks: torch's kernel)
        assert len(kernels) == 1 and kernels.pop().startswith("our int16-activation kernel")
    prompt = list(range(3, 40))
    generated = engine.generate(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))
    out = [e.token_id for e in generated if e.token_id is not None]
    ours = score(engine, prompt, out, decode_steps=True)

    def int8_reference(x, weight, scales, out=torch.float32):
        q = lowbit.quantize16_reference(x.float().contiguous())
        return (q.dequantized() @ (weight.double() * scales.double()[:, None]).T).float().to(out)

    def int4_reference(x, packed, sz, group, out=torch.float32):
        q = lowbit.quantize_reference(x.float().contiguous())
        dense = _dense_int4(unpack_int4(packed), sz[..., 0], sz[..., 1], group)
        return (q.dequantized() @ dense.T).float().to(out)

    monkeypatch.setattr(lowbit, "int8_linear", int8_reference)
    monkeypatch.setattr(lowbit, "int4_linear", int4_reference)
    reference = score(engine, prompt, out, decode_steps=True)
    assert len(out) == 12 and torch.equal(ours.argmax(dim=1), torch.tensor(out))
    kl = (reference.exp() * (reference - ours)).sum(dim=1)
    assert kl.max() < 1e-3, kl


@pytest.mark.parametrize("precision", precisions("int4-g32+head"))
def test_eval_compare_puts_our_kernels_beside_torchs_on_the_same_weights(
    tiny_model_dir, monkeypatch, capsys, precision
):
    """``eval compare --a-lowbit torch --b-lowbit ours``: the same weights, one side with float
    activations and one with our int8 ones, whatever ``INFERSIGHT_LOWBIT`` says; each side's
    layers run the kernels asked for, and the loads leave the environment's choice alone."""
    import json

    from app.cli.main import main
    from engine.loader import load

    folder, _ = tiny_model_dir("llama", True, hidden_size=128, intermediate_size=256)
    monkeypatch.setenv(lowbit.ENV, "auto")
    kernels: list[set[str]] = []
    real = load.load_model

    def recording(*args, **kwargs):
        engine = real(*args, **kwargs)
        kernels.append({m.kernel for m in engine.model.modules() if hasattr(m, "quantized")})
        return engine

    monkeypatch.setattr(load, "load_model", recording)
    argv = ["eval", "compare", "--model", str(folder), "--a", precision, "--a-lowbit", "torch",
            "--b", precision, "--b-lowbit", "ours", "--prompt", "t1 t7 t3", "--new-tokens",
            "6", "--no-noise", "--json"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)["comparisons"][0]
    assert len(kernels) == 2
    assert not any(k.startswith("our int8-activation kernel") for k in kernels[0])
    assert len(kernels[1]) == 1 and next(iter(kernels[1])).startswith("our int8-activation kernel")
    kl = report["summary"]["kl_mean"]
    assert 0 < kl < 0.05  # the activations' rounding: small, and not nothing
    assert (report["a"]["lowbit"], report["b"]["lowbit"]) == ("torch", "ours")
    assert lowbit.requested() == "auto"
    with pytest.raises(InfersightError, match="auto, ours, torch"), lowbit.choosing("fast"):
        pass
