"""The layers' RMSNorms in C on a CPU (``engine/kernels/csrc/layer_ops.c``): what the model's
torch code computes, at every CPU level this machine builds, one call each."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import layer_ops, lowbit, native
from engine.model import transformer
from tests.probed import built_levels

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C compiler")


@pytest.fixture(scope="module", params=built_levels(), ids=lambda level: level or "native")
def ops(request: pytest.FixtureRequest) -> layer_ops.LayerOps:
    built = layer_ops.build(request.param)
    assert built.available, built.why
    assert layer_ops.check(built) == ""
    return layer_ops.c_ops(built)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between two bf16 tensors in units of their last place."""
    return int((a.view(torch.int16).int() - b.view(torch.int16).int()).abs().max())


@pytest.mark.parametrize(("rows", "h"), [(1, 576), (3, 64), (7, 100), (2, 2048)])
def test_the_norms_compute_what_the_torch_code_computes(ops, rows, h):
    gen = torch.Generator().manual_seed(rows * h)
    x = torch.randn(rows, h, generator=gen) * 4
    r = torch.randn(rows, h, generator=gen)
    w = torch.rand(h, generator=gen) + 0.5
    # fp32: the sum of squares in another order only
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), transformer.rms_norm(x, w, 1e-5),
                               rtol=1e-6, atol=1e-6)  # fmt: skip
    out, summed = ops.add_rms_norm(x, r, w, 1e-6)
    want, want_sum = transformer.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(summed, want_sum)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    # bf16: the same roundings as the torch code, at most one place apart
    xb, rb, wb = x.bfloat16(), r.bfloat16(), w.bfloat16()
    assert _ulps(ops.rms_norm(xb, wb, 1e-5), transformer.rms_norm(xb, wb, 1e-5)) <= 1
    out, summed = ops.add_rms_norm(xb, rb, wb, 1e-5)
    want, want_sum = transformer.add_rms_norm(xb, rb, wb, 1e-5)
    assert torch.equal(summed, want_sum) and _ulps(out, want) <= 1
    # and against float64
    exact = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5).double(), exact, rtol=1e-5, atol=1e-5)


def test_what_the_c_code_does_not_take_goes_to_torch(monkeypatch):
    norms = layer_ops.CNorms(layer_ops.build())
    calls: list[str] = []
    lib = norms.lib

    class Counting:
        def __getattr__(self, name: str) -> object:
            calls.append(name)
            return getattr(lib, name)

    monkeypatch.setattr(norms, "lib", Counting())
    x = torch.randn(4, 64)
    w = torch.rand(64) + 0.5
    cases = [
        (x.half(), w.half()),  # fp16
        (x[:, ::2], w[::2].contiguous()),  # a view that is not contiguous
        (x.bfloat16(), w),  # a weight of another dtype
    ]
    for xs, ws in cases:
        torch.testing.assert_close(norms.rms_norm(xs, ws, 1e-5), transformer.rms_norm(xs, ws, 1e-5))
    assert calls == []
    norms.rms_norm(x, w, 1e-5)
    norms.add_rms_norm(x, x, w, 1e-5)
    assert calls == ["infersight_rms_norm", "infersight_add_rms_norm"]


def test_a_cpu_load_takes_them_where_our_kernels_are_allowed(tiny_model_dir):
    from engine.core.sampling import SamplingParams
    from engine.loader.load import load_model

    folder, _ = tiny_model_dir("llama", True)
    plain = load_model(folder, precision="fp32")  # the tests pin INFERSIGHT_LOWBIT=torch
    assert "norms in torch (INFERSIGHT_LOWBIT=torch)" in plain.kernels
    with lowbit.choosing("auto"):
        ours = load_model(folder, precision="fp32")
    assert "C: RMSNorm, residual add + RMSNorm" in ours.kernels
    assert ours.model.ops.name.startswith("C:")
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    got = [e.generate(list(range(3, 30)), params) for e in (ours, plain)]
    for g in got:
        list(g)
    assert got[0].result.token_ids == got[1].result.token_ids
