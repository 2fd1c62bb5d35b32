"""The one tolerance policy of our kernels' load-time checks (engine/kernels/verify.py): it grows
with the reduction and the dtype's rounding, every check asks it with its own dtype and
reduction, none is tighter than the constant it replaced, and a broken kernel still fails each
comparison: a wrong row, a scale off by 1 %, a swapped group; a quantization one step off
only beside a tie."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from engine.kernels import lowbit_rows, native, verify

pytestmark = pytest.mark.no_engine_paths

FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16
needs_cc = pytest.mark.skipif(native.compiler() is None, reason="no C compiler")


# -- the policy ---------------------------------------------------------------------------------


def test_the_policy_grows_with_the_reduction_the_roundings_and_the_dtypes_rounding():
    lengths = [1, 2, 40, 64, 160, 576, 4096, 16384, 2**20]
    for dtype in (FP32, FP16, BF16):
        bounds = [verify.tolerance(dtype, k) for k in lengths]
        assert bounds == sorted(bounds) and bounds[-1] > bounds[0], dtype
        assert verify.tolerance(dtype, 64, roundings=4) > verify.tolerance(dtype, 64)
    for k in lengths:
        assert verify.tolerance(FP32, k) < verify.tolerance(FP16, k) < verify.tolerance(BF16, k)
    # fp32 grows past its floor (2^-16) from K = 64 on, as √K
    assert verify.tolerance(FP32, 40) == verify.FINEST
    assert verify.tolerance(FP32, 4 * 576) / verify.tolerance(FP32, 576) == pytest.approx(2, 0.01)
    # the formula: roundings · u(dtype) + 32 · √K · u(fp32), at least the floor
    assert verify.tolerance(BF16, 100, roundings=3) == 3 * 2**-8 + 32 * 10 * 2**-24
    assert verify.tolerance(FP16, 1, finest=0.5) == 0.5
    with pytest.raises(ValueError):
        verify.tolerance(FP32, 0)


#: Every check's (dtype, K, keyword arguments) as it asks the policy, and the constant it had
#: before (relative to the reference's largest magnitude): the shapes and dtypes each runs.
_TRITON = {"roundings": 4, "finest": 1e-4}
_TRITON_OLD = {FP32: 1e-4, FP16: 4 * 2**-11, BF16: 4 * 2**-8}
REPLACED: list[tuple[str, torch.dtype, int, dict[str, Any], float]] = [
    *[("gemv", FP32, k, {}, 1e-5) for k in (40, 64, 129)],
    *[("lowbit", FP32, k, {}, 1e-5) for k in (64, 96, 128, 160)],
    *[("layer_ops norms", FP32, h, {}, 1e-5) for h in (64, 100, 576)],
    *[("layer_ops norms", BF16, h, {}, 2**-7) for h in (64, 100, 576)],
    ("layer_ops / amx SiLU quantization", FP32, 1, {}, 1e-5),
    ("layer_ops / amx SiLU quantization", BF16, 1, {}, 2**-7),
    *[("paged_decode", d, 32 + t, {"roundings": 6}, old)
      for d, old in ((FP32, 1e-5), (BF16, 2e-2)) for t in (21, 45)],
    ("c_step logits", FP32, 1072, {"roundings": 18, "finest": 1e-4}, 1e-4),
    ("c_step logits", BF16, 1072, {"roundings": 18, "finest": 1e-4}, 0.05),
    # the Triton kernels at the heads, hidden sizes and K a GPU's loads check them at
    *[("triton attention", d, dim + t, _TRITON, _TRITON_OLD[d])
      for d in (FP32, FP16, BF16) for dim in (64, 128) for t in (35, 37)],
    *[("triton GEMMs", d, 160, _TRITON, _TRITON_OLD[d]) for d in (FP32, FP16, BF16)],
    *[("triton norms", d, h, _TRITON, _TRITON_OLD[d])
      for d in (FP32, FP16, BF16) for h in (576, 2048, 4096, 8192, 16384)],
    *[("triton RoPE / add", d, 2, _TRITON, _TRITON_OLD[d]) for d in (FP32, FP16, BF16)],
]  # fmt: skip


@pytest.mark.parametrize(("check", "dtype", "k", "asks", "old"), REPLACED)
def test_no_check_is_tighter_than_the_constant_it_replaced_nor_far_looser(
    check, dtype, k, asks, old
):
    """No GPU confirms a tighter bound: a kernel passing today would be switched off."""
    new = verify.tolerance(dtype, k, **asks)
    assert old <= new <= 8 * old, (check, dtype, k, new / old)


# -- each check asks it --------------------------------------------------------------------------


@pytest.fixture
def asked(monkeypatch) -> list[tuple[torch.dtype, int, dict[str, Any]]]:
    """The policy's questions while a test runs (its answers unchanged)."""
    seen: list[tuple[torch.dtype, int, dict[str, Any]]] = []
    policy = verify.tolerance

    def spy(dtype: torch.dtype, reduction: int, **kwargs: Any) -> float:
        seen.append((dtype, reduction, kwargs))
        return policy(dtype, reduction, **kwargs)

    monkeypatch.setattr(verify, "tolerance", spy)
    return seen


def _refusing(monkeypatch) -> None:
    """A policy that allows nothing, not even a difference of 0."""
    monkeypatch.setattr(verify, "tolerance", lambda *a, **k: -1.0)


def _questions(seen: list[tuple[torch.dtype, int, dict[str, Any]]]) -> set[tuple[Any, ...]]:
    return {(d, k, tuple(sorted(kw.items()))) for d, k, kw in seen}


@needs_cc
def test_the_gemv_and_lowbit_checks_ask_the_policy_for_fp32_sums_of_their_k(asked, monkeypatch):
    from engine.kernels import gemv, lowbit

    assert gemv.check(gemv.build()) == ""
    assert _questions(asked) == {(FP32, k, ()) for k in (40, 129, 64)}
    asked.clear()
    assert lowbit.check(lowbit.build()) == ""
    assert _questions(asked) == {(FP32, k, ()) for k in (64, 96, 128, 160)}
    _refusing(monkeypatch)
    assert "differs from its reference" in gemv.check(gemv.build())
    assert "differs from its reference" in lowbit.check(lowbit.build())


@needs_cc
def test_the_norms_and_their_quantizations_ask_the_policy(asked, monkeypatch):
    from engine.kernels import layer_ops

    lib = layer_ops.build()
    assert layer_ops.check(lib) == ""
    norms = {(d, h, ()) for d in (FP32, BF16) for h in (64, 100, 576)}
    assert _questions(asked) == norms | {(FP32, 1, ()), (BF16, 1, ())}
    _refusing(monkeypatch)
    assert "RMSNorm of torch.float32 differs from torch's" in layer_ops.check(lib)
    monkeypatch.setattr(layer_ops, "_check_rope_store", lambda ops: "")
    monkeypatch.setattr(layer_ops.verify, "differs", lambda *a, **k: "")  # past the norms
    assert "SiLU · up + quantization" in layer_ops._check_w8a8(lib)


@needs_cc
def test_the_paged_kernels_check_asks_the_policy_for_a_score_and_an_output(asked, monkeypatch):
    from engine.kernels import paged_decode

    kernel = paged_decode.kernel()
    if not kernel.available:
        pytest.skip(kernel.why)
    assert paged_decode._check(kernel) == ""
    want = {(d, 32 + t, (("roundings", 6),)) for d in paged_decode.DTYPES for t in (21, 45)}
    assert _questions(asked) == want
    _refusing(monkeypatch)
    assert "decode differs" in paged_decode._check(kernel)


def test_the_triton_checks_ask_the_policy_with_their_dtype_and_k(asked):
    from engine.kernels import triton_check

    x = torch.ones(2, 3)
    for dtype, k in ((FP32, 101), (FP16, 160), (BF16, 4096)):
        assert triton_check._verdict("k", x.to(dtype), x.to(dtype), k) == ""
    assert _questions(asked) == {
        (d, k, (("finest", 1e-4), ("roundings", 4)))
        for d, k in ((FP32, 101), (FP16, 160), (BF16, 4096))
    }


def test_the_c_steps_bound_is_the_policys_at_the_depths_reduction():
    from engine.executor import c_step_check
    from engine.model.config import ModelConfig

    cfg = ModelConfig(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=128,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                      max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                      tie_word_embeddings=False, attention_bias=False)  # fmt: skip
    # per layer 4 · 64 + (16 + 8 + 64) + 128 = 472, two layers, the final norm and the head
    for dtype in (FP32, BF16):
        want = verify.tolerance(dtype, 2 * 472 + 128, roundings=18, finest=1e-4)
        assert c_step_check.tolerance(cfg, dtype, 8) == want
    deeper = dataclasses.replace(cfg, num_layers=4)
    assert c_step_check.tolerance(deeper, BF16, 8) > c_step_check.tolerance(cfg, BF16, 8)


# -- a broken kernel fails ----------------------------------------------------------------------


def _wrong_row(y: Tensor) -> Tensor:
    return y.roll(1, dims=0) if y.shape[0] > 1 else -y


def _product(
    k: int, dtype: torch.dtype, *, swap_groups: bool = False, scale: float = 1.0
) -> Tensor:
    """A random ``[16, 96] = [16, k] · [k, 96]ᵀ`` in ``dtype``, the weights' first two groups
    of 32 columns swapped or the result scaled where asked."""
    gen = torch.Generator().manual_seed(k)
    x, w = torch.randn(16, k, generator=gen), torch.randn(96, k, generator=gen)
    if swap_groups:
        w = torch.cat([w[:, 32:64], w[:, :32], w[:, 64:]], dim=1)
    return (x @ w.T * scale).to(dtype)


@pytest.mark.parametrize(("dtype", "k", "roundings"),
                         [(FP32, 40, 2), (FP32, 4096, 2), (FP16, 160, 4), (BF16, 576, 2),
                          (FP32, 1072, 18)])  # fmt: skip
def test_a_wrong_row_a_scale_off_by_one_percent_and_a_swapped_group_fail(dtype, k, roundings):
    """At the policy's bound for the dtype and K. (bf16 rounds by 0.4 %: four roundings and
    more, the Triton and paged attention checks' bf16, let a 1 % scale through, as their
    constants did.)"""
    tolerance = verify.tolerance(dtype, k, roundings=roundings, finest=1e-4)
    want = _product(k, dtype)
    assert verify.differs("k", _product(k, dtype), want, tolerance) == ""
    assert verify.differs("k", _wrong_row(want), want, tolerance) != ""
    assert verify.differs("k", _product(k, dtype, swap_groups=True), want, tolerance) != ""
    if dtype != BF16 or roundings <= 2:
        assert verify.differs("k", _product(k, dtype, scale=1.01), want, tolerance) != ""


def _patched(monkeypatch, module: Any, name: str, broken: Callable[[Tensor], Tensor]) -> None:
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: broken(real(*a, **k)))


@needs_cc
@pytest.mark.parametrize("broken", [_wrong_row, lambda y: y * 1.01])
def test_a_broken_gemv_paged_kernel_or_norm_fails_its_check(monkeypatch, broken):
    from engine.kernels import gemv, layer_ops, paged_decode

    _patched(monkeypatch, gemv, "product", broken)
    assert "differs from its reference" in gemv.check(gemv.build())
    kernel = paged_decode.kernel()
    if kernel.available:
        _patched(monkeypatch, paged_decode, "_call", broken)
        assert "fp32 decode differs" in paged_decode._check(kernel)
    _patched(monkeypatch, layer_ops.CNorms, "rms_norm", broken)
    assert "RMSNorm of torch.float32 differs" in layer_ops.check(layer_ops.build())


@needs_cc
def test_lowbit_with_two_groups_swapped_fails_its_check(monkeypatch):
    from engine.kernels import lowbit

    real = lowbit.int4_gemm

    def swapped(lib: Any, x: Any, packed: Tensor, sz: Tensor, group: int, threads: int) -> Tensor:
        return real(lib, x, packed, sz[:, [1, 0, *range(2, sz.shape[1])]].contiguous(), group,
                    threads)  # fmt: skip

    monkeypatch.setattr(lowbit, "int4_gemm", swapped)
    assert "int4 g32 differs from its reference" in lowbit.check(lowbit.build())


# -- a quantization --------------------------------------------------------------------------


def _rows(values: list[list[float]], scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """Values, and a reference quantization of them with a fixed ``scale``."""
    v = torch.tensor(values)
    q, s = lowbit_rows.quantize_rows_reference(v, scale)
    return v, q, s


def test_a_quantization_may_be_one_step_off_beside_a_tie_only():
    tolerance = verify.tolerance(FP32, 1)
    # 2.5 + 2^-21 rounds to 3; a kernel a rounding away gives 2: beside the tie, accepted
    v, q, s = _rows([[2.5 + 2**-21, 10.0, -7.0]], 1.0)
    assert q.tolist() == [[3, 10, -7]]
    flipped = q.clone()
    flipped[0, 0] = 2
    assert verify.quantized("k", (flipped, s), (q, s), v, tolerance) == ""
    # 2.3 is 0.2 of a step from the tie: a step off there is a wrong value
    v, q, s = _rows([[2.3, 10.0, -7.0]], 1.0)
    flipped = q.clone()
    flipped[0, 0] = 3
    why = verify.quantized("k", (flipped, s), (q, s), v, tolerance)
    assert "a step from its reference's 1 times away from a tie" in why
    # two steps, a scale 1 % off, a wrong row: refused; the reference itself: accepted
    two = q.clone()
    two[0, 1] = 12
    assert "up to 2 steps" in verify.quantized("k", (two, s), (q, s), v, tolerance)
    assert "scales differ" in verify.quantized("k", (q, s * 1.01), (q, s), v, tolerance)
    assert verify.quantized("k", (q, s), (q, s), v, tolerance) == ""
    # a row of zeros has a zero scale on both sides: no difference, not a NaN
    zeros, zero_scale = torch.zeros(1, 3, dtype=torch.int8), torch.zeros(1, 1)
    same = verify.quantized("k", (zeros, zero_scale), (zeros, zero_scale), zeros.float(), tolerance)
    assert same == ""


def test_a_broken_silu_quantization_fails_on_synthetic_rows():
    """What the C fused row operation (layer_ops) and the AMX one (amx) are compared with."""
    gen = torch.Generator().manual_seed(0)
    for dtype in (FP32, BF16):
        values = (torch.randn(17, 48, generator=gen) * 5).to(dtype)
        for fixed in (None, 0.05):
            q, s = lowbit_rows.quantize_rows_reference(values, fixed)
            assert lowbit_rows.quantization_differs("k", (q, s), values, fixed) == ""
            assert lowbit_rows.quantization_differs("k", (q, s * 1.01), values, fixed) != ""
            assert lowbit_rows.quantization_differs("k", (q.roll(1, 0), s), values, fixed) != ""
        # the tolerance of values' dtype, not a constant: bf16's lets any one step through
        q, s = lowbit_rows.quantize_rows_reference(values)
        off = q.clone()
        off[0, (q[0].abs() < 127).nonzero()[0]] += 1
        verdict = lowbit_rows.quantization_differs("k", (off, s), values)
        assert (verdict == "") == (dtype == BF16), verdict


def test_the_amx_check_fails_a_broken_silu_quantization(monkeypatch):
    """amx.check on this CPU, its products torch's (no AMX needed): the SiLU's quantization is
    compared through the harness, and a wrong row or a 1 % scale fails it."""
    from engine.kernels import amx, layer_ops

    def silu_quantize(x, packed, inter, x_scale, w_scales, dtype, fixed, lib=None):  # type: ignore[no-untyped-def]
        acc = torch._int_mm(x, packed.t())
        return layer_ops.w8a8_silu_quantize_reference(acc, x_scale, w_scales, dtype, fixed)

    monkeypatch.setattr(amx, "pack", lambda w, lib=None: w)
    monkeypatch.setattr(amx, "gemm", lambda x, packed, n, lib=None: torch._int_mm(x, packed.t()))
    monkeypatch.setattr(
        amx, "gemm_scaled",
        lambda x, packed, n, sx, sw, b, dtype, res=None, lib=None: lowbit_rows.scale_rows_reference(
            torch._int_mm(x, packed.t()), sx, sw, b, dtype, res),
    )  # fmt: skip
    monkeypatch.setattr(amx, "silu_quantize", silu_quantize)
    lib = native.Library(None, "no AMX here")
    assert amx.check(lib) == ""
    for broken in (lambda q, s: (q.roll(1, 0), s), lambda q, s: (q, s * 1.01)):
        monkeypatch.setattr(
            amx, "silu_quantize", lambda *a, b=broken, **k: b(*silu_quantize(*a, **k))
        )
        assert "SiLU · up in torch.float32" in amx.check(lib)
