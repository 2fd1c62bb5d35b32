"""A decode token's routed experts in one C call (``engine/kernels/experts.py``,
``csrc/experts.h``): the same products, activation and weighted sum the expert modules make,
for INT4 and INT8 experts of each family's activation, and chosen (or refused, with the
reason in the paths report) by what the load chose for the experts' products."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import lowbit, verify
from engine.loader.load import load_model
from engine.model.mlp import ACTIVATIONS
from engine.model.moe import MoE
from engine.quant import experts


@pytest.fixture(autouse=True)
def _built():
    if not lowbit.library().available:
        pytest.skip(lowbit.library().why)


def _moes(engine):
    return [m.mlp for m in engine.model.layers if isinstance(m.mlp, MoE)]


def _load(tiny_model_dir, arch, precision, mode="ours", **overrides):
    folder, _ = tiny_model_dir(arch, False, **overrides)
    with lowbit.choosing(mode):
        return load_model(folder, precision=precision)


def _reference(moe, x, ids, shares, act):
    """The experts' products as our kernels give them one at a time, all in fp32."""
    out = torch.zeros(1, x.shape[-1], dtype=torch.float64)
    for e, share in zip(ids, shares, strict=True):
        expert = moe.experts[e]
        h = _product(expert.gate_up_proj, x)
        gate, up = h.split(expert.intermediate_size, dim=-1)
        out += share * _product(expert.down_proj, act(gate) * up).double()
    return out.float()


def _product(layer, x):
    if hasattr(layer, "scales_and_zeros"):
        sz = layer.scales_and_zeros.transpose(0, 1)
        return lowbit.int4_linear(x, layer.weight, sz, layer.group, torch.float32)
    return lowbit.int8_linear(x, layer.weight, layer.lowbit_scales, torch.float32)


@pytest.mark.parametrize(
    ("arch", "precision", "act"),
    [
        ("qwen3_moe", "int4-g32", "silu"),
        ("qwen3_moe", "int4-g32", "gelu_tanh"),  # no family pairs it with experts yet
        ("qwen3_moe", "int8", "silu"),
        ("mixtral", "int4-g32", "silu"),
    ],
)
def test_the_kernel_is_the_expert_modules_products(tiny_model_dir, arch, precision, act):
    overrides = {"moe_intermediate_size": 64, "mlp_only_layers": []} if arch == "qwen3_moe" else {
        "intermediate_size": 64}  # fmt: skip
    engine = _load(tiny_model_dir, arch, precision, **overrides)
    moe = _moes(engine)[0]
    kernel = experts.plan(moe, act)
    assert not isinstance(kernel, str), kernel
    torch.manual_seed(0)
    for _ in range(4):
        x = torch.randn(1, engine.model.cfg.hidden_size)
        ids = sorted(torch.randperm(moe.num_experts)[: moe.top_k].tolist())
        shares = torch.rand(len(ids))
        got = kernel(x, torch.tensor([ids]), shares[None])
        want = _reference(moe, x, ids, shares.tolist(), ACTIVATIONS[act])
        # fp32 throughout on both sides: they differ in the order of the sum over experts'
        # shares and in the activation's exp (libm's against torch's)
        bound = verify.tolerance(torch.float32, moe.experts[0].intermediate_size)
        why = verify.differs("the experts kernel", got, want, bound)
        assert not why, why


def test_a_row_is_the_same_alone_or_beside_others(tiny_model_dir):
    # batch invariance: each expert runs once on the rows that chose it, and a row's products
    # and its sum over experts do not depend on those rows
    engine = _load(tiny_model_dir, "qwen3_moe", "int4-g32", moe_intermediate_size=64,
                   mlp_only_layers=[])  # fmt: skip
    moe = _moes(engine)[0]
    torch.manual_seed(1)
    x = torch.randn(7, engine.model.cfg.hidden_size, dtype=torch.bfloat16)
    chosen, weights = moe.route(x)
    together = moe.kernel(x, chosen, weights)
    for r in range(7):
        alone = moe.kernel(x[r : r + 1], chosen[r : r + 1], weights[r : r + 1])
        assert torch.equal(alone, together[r : r + 1]), r
    assert together.dtype == torch.bfloat16
    assert moe.kernel(x.half(), chosen, weights).dtype == torch.float16


def test_a_decode_step_runs_the_kernel_and_agrees_with_the_modules(tiny_model_dir):
    # the whole layer: routing, the kernel, the sum back in the model's dtype (bf16), against
    # the same decode row through the expert modules (each product's output rounded to bf16)
    engine = _load(tiny_model_dir, "qwen3_moe", "int4-g32", moe_intermediate_size=64,
                   mlp_only_layers=[])  # fmt: skip
    moe = _moes(engine)[0]
    x = torch.randn(1, engine.model.cfg.hidden_size, dtype=torch.bfloat16)
    with_kernel = moe(x)
    kernel, moe.kernel = moe.kernel, None
    modules = moe(x)
    moe.kernel = kernel
    # bf16 roundings apart: the modules' gate_up, activation, product, down, share and sum
    bound = verify.tolerance(torch.bfloat16, 64, roundings=6)
    why = verify.differs("the layer", with_kernel.float(), modules.float(), bound, "its modules")
    assert not why, why
    paths = engine.paths()["layers"]
    assert {layer["experts"] for layer in paths} == {"one C call"}


def test_experts_on_torchs_kernels_are_refused_by_name(tiny_model_dir):
    engine = _load(tiny_model_dir, "qwen3_moe", "int4-g32", mode="torch",
                   moe_intermediate_size=64, mlp_only_layers=[])  # fmt: skip
    reasons = {layer["experts"] for layer in engine.paths()["layers"]}
    assert reasons == {"torch's INT4 kernel runs the experts (ours measured slower for them)"}
    fp32 = _load(tiny_model_dir, "qwen3_moe", "fp32", moe_intermediate_size=64,
                 mlp_only_layers=[])  # fmt: skip
    assert {m.kernel_refusal for m in _moes(fp32)} == {"the experts are not quantized"}
    w8a8 = _load(tiny_model_dir, "qwen3_moe", "w8a8", moe_intermediate_size=64,
                 mlp_only_layers=[])  # fmt: skip
    assert {m.kernel_refusal for m in _moes(w8a8)} == {
        "the experts are not all INT4 or all INT8 (weights only)"}  # fmt: skip
