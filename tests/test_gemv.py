"""Our float-activation GEMV (``engine/kernels/csrc/gemv.c``) at every CPU level this machine
builds, and the layers that take it for their small step shapes only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.formats.int8 import quantize_int8
from engine.hardware.cpu_paths import forced_level
from engine.kernels import gemv, lowbit, native, verify
from engine.kernels.packed_linear import GemvLinear
from engine.quant.int8 import Int8Linear
from tests.probed import X86, built_levels, cpu_flags

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C compiler")

BUILT = built_levels()


def expected_isa(level: str | None) -> str:
    """The vector code a build at ``level`` (None: this CPU's own) must use, from what the CPU
    says it has."""
    level = level or forced_level()
    if level == "DEFAULT":
        return "portable"
    if level == "AVX2":
        return "avx2"
    if not {"avx512f", "avx512bw"} <= cpu_flags():
        return "avx2"
    return "avx512-bf16" if "avx512_bf16" in cpu_flags() else "avx512"


@pytest.fixture(scope="module", params=BUILT, ids=lambda level: level or "native")
def lib(request: pytest.FixtureRequest) -> gemv.Library:
    built = gemv.build(request.param)
    assert built.available, built.why
    if X86:
        assert built.isa == expected_isa(request.param)
    return built


def _weights(n: int, k: int, gen: torch.Generator):
    """Each weight type with its dense float64 value."""
    w = torch.randn(n, k, generator=gen)
    q, scales = quantize_int8(w)
    scales = scales.float()
    return [
        (q, scales, q.double() * scales.double()[:, None]),
        (w.bfloat16(), None, w.bfloat16().double()),
        (w, None, w.double()),
    ]


@pytest.mark.parametrize(("m", "k", "n"), [(1, 576, 1536), (2, 40, 7), (3, 129, 33),
                                           (5, 8, 4), (16, 200, 17), (1, 4100, 9)])  # fmt: skip
def test_each_product_matches_float64(lib, m, k, n):
    """M = 1…16, K and N not multiples of any vector width or tile, every weight type, from
    fp32 and bf16 activations; a bf16 output is the fp32 one rounded as torch rounds."""
    gen = torch.Generator().manual_seed(m * 100 + k + n)
    x = torch.randn(m, k, generator=gen)
    x[:, 1] = 30  # an outlier channel
    for weight, scales, dense in _weights(n, k, gen):
        for x_dtype in (torch.float32, torch.bfloat16):
            xs = x.to(x_dtype)
            want = xs.double() @ dense.T
            got = gemv.product(lib, xs, weight, scales, torch.float32)
            err = ((got.double() - want).abs().max() / want.abs().max()).item()
            assert err < verify.tolerance(torch.float32, k), (weight.dtype, x_dtype, err)
            assert torch.equal(
                gemv.product(lib, xs, weight, scales, torch.bfloat16), got.bfloat16()
            )


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [300, 4100])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(lib, x_dtype, k):
    """One row of x (a decode step's own loop) against 2…16 (weight rows side by side), from
    fp32 and bf16 activations (bf16 weights: the bf16 pairs' path where the CPU has it; a bf16
    row of 4100 inputs alone is widened as it is read, several into scratch space)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(16, k, generator=gen).to(x_dtype)
    for weight, scales, _ in _weights(37, k, gen):
        alone = torch.cat([gemv.product(lib, x[i : i + 1], weight, scales, torch.float32)
                           for i in range(16)])  # fmt: skip
        for m in (2, 3, 5, 16):
            assert torch.equal(gemv.product(lib, x[:m], weight, scales, torch.float32), alone[:m])


def test_more_threads_than_output_rows_and_no_rows(lib, monkeypatch):
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(3, 64, generator=gen)
    for weight, scales, dense in _weights(3, 64, gen):
        monkeypatch.setattr(lowbit, "threads", lambda: 1)
        one = gemv.product(lib, x, weight, scales, torch.float32)
        monkeypatch.setattr(lowbit, "threads", lambda: 8)
        assert torch.equal(gemv.product(lib, x, weight, scales, torch.float32), one)
        torch.testing.assert_close(one.double(), x.double() @ dense.T, rtol=1e-5, atol=1e-5)
        empty = gemv.product(lib, x, weight[:0], None if scales is None else scales[:0],
                             torch.float32)  # fmt: skip
        assert empty.shape == (3, 0)


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows of each call of our kernel, from here on."""
    rows: list[int] = []
    product = gemv.product

    def counted(lib, x, *args):  # type: ignore[no-untyped-def]
        rows.append(x.shape[0])
        return product(lib, x, *args)

    monkeypatch.setattr(gemv, "product", counted)
    return rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_linear_takes_ours_up_to_16_rows_and_torchs_above(monkeypatch, dtype):
    gen = torch.Generator().manual_seed(1)
    linear = torch.nn.Linear(96, 40).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(40, 96, generator=gen))
    ours = GemvLinear.of(linear)
    assert ours.weight is linear.weight and ours.bias is linear.bias
    rows = _counting(monkeypatch)
    for m in (1, 5, 16, 17, 64):
        x = torch.randn(2, m, 96, generator=gen).to(dtype)[:1]  # a [1, m, K] step
        want = F.linear(x.double(), linear.weight.double(), linear.bias.double())
        got = ours(x)
        assert got.dtype == dtype and got.shape == (1, m, 40)
        torch.testing.assert_close(
            got.double(),
            want,
            rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
            atol=1e-2 if dtype == torch.bfloat16 else 1e-5,
        )
    assert rows == [1, 5, 16]  # 17 and 64 rows (a prefill chunk) went to F.linear


def test_an_int8_layer_takes_ours_for_small_steps_when_chosen(monkeypatch):
    """Where our GEMV is chosen and lowbit's INT8 kernel is not (both verdicts given here,
    not timed: a timing would make the test the machine's)."""
    monkeypatch.setattr(gemv, "chosen", lambda *args: True)
    monkeypatch.setattr(lowbit, "chosen", lambda *args: False)
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(48, 64, generator=gen)
    with lowbit.choosing("auto"):  # INT8 keeps float activations: our GEMV, not lowbit's
        layer = Int8Linear(w, None, torch.bfloat16)
    assert layer.lowbit_scales is None and layer.gemv_scales is not None
    assert "our GEMV" in layer.kernel
    rows = _counting(monkeypatch)
    dense = layer.weight.double() * layer.scales.double()[:, None]
    for m in (1, 16, 40):
        x = torch.randn(m, 64, generator=gen).bfloat16()
        y = layer(x)
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y.double(), x.double() @ dense.T, rtol=1e-2, atol=2e-2)
    assert rows == [1, 16]


def test_torch_mode_never_takes_ours(monkeypatch):
    monkeypatch.setenv(lowbit.ENV, "torch")
    assert not gemv.chosen("float32", 64, 64, None)
    layer = Int8Linear(torch.randn(16, 64), None, torch.bfloat16)
    assert layer.gemv_scales is None and "GEMV" not in layer.kernel


def test_a_model_loaded_with_ours_gives_the_plain_paths_tokens(tiny_model_dir, monkeypatch):
    from engine.core.sampling import SamplingParams
    from engine.loader.load import load_model

    folder, _ = tiny_model_dir("llama", True)
    plain = load_model(folder, precision="fp32")
    with lowbit.choosing("ours"):
        ours = load_model(folder, precision="fp32")
    linears = [m for m in ours.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(isinstance(m, GemvLinear) for m in linears)
    assert any("our GEMV" in group.form for group in ours.weight_groups)  # the load report
    rows = _counting(monkeypatch)
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = list(range(3, 40))  # 37 tokens: the prefill's rows go to torch
    got = [ours.generate(prompt, params), plain.generate(prompt, params)]
    for g in got:
        list(g)
    assert got[0].result.token_ids == got[1].result.token_ids
    assert rows and set(rows) == {1}  # only decode steps took ours
