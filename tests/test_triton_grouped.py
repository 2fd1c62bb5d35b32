"""The grouped INT4 GEMM of a mixture of experts (engine/kernels/triton_kernels/grouped_gemm.py)
in Triton's interpreter, on CPU tensors: the pairs' layout by expert (every pair a slot of its
own, in a tile of its expert; padding read as nothing), each slot's product against the
dequantize-then-multiply reference, K off the group (padded weights), N off the block; and a
tiny Qwen3-MoE on our Triton kernels whose experts run grouped, against the same layers one
expert module at a time."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.formats.int4 import pack_int4, padded_width, quantize_int4
from engine.kernels import triton_support, verify
from engine.model.moe import MoE
from tests.conftest import WIDE_HEADS

pytestmark = pytest.mark.skipif(not triton_support.installed(), reason="Triton not installed")

if triton_support.installed():
    from engine.kernels.triton_kernels import grouped_gemm as gg


def _experts(e: int, n: int, k: int, group: int, seed: int = 0):
    """``e`` random experts ``[N, K]`` in our INT4 layout (stacked) and their dequantized
    fp32 weights, K padded with zeros to whole groups."""
    gen = torch.Generator().manual_seed(seed)
    kp = padded_width(k, group)
    w = torch.zeros(e, n, kp)
    w[..., :k] = torch.randn(e, n, k, generator=gen) * 0.1
    packed, sz, dense = [], [], []
    for i in range(e):
        q, s, z = quantize_int4(w[i], group)
        packed.append(pack_int4(q))
        sz.append(torch.stack([s, z], dim=2).transpose(0, 1).contiguous())  # [Kp/g, N, 2]
        g = q.float().view(n, kp // group, group) - 8
        dense.append((g * s.float()[..., None] + z.float()[..., None]).view(n, kp)[:, :k])
    return torch.stack(packed), torch.stack(sz), torch.stack(dense)


def test_the_layout_gives_every_pair_a_slot_in_a_tile_of_its_expert():
    chosen = torch.tensor([[3, 0], [3, 1], [0, 3], [4, 3]])
    layout = gg.Layout(chosen, num_experts=6)
    flat = chosen.flatten()
    assert len(set(layout.slot.tolist())) == flat.numel()  # a slot each
    tokens = torch.arange(chosen.shape[0]).repeat_interleave(chosen.shape[1])
    assert torch.equal(layout.rows[layout.slot].long(), tokens)
    assert torch.equal(layout.tile_expert[layout.slot // gg.BLOCK_M].long(), flat)
    used = torch.zeros(layout.size, dtype=torch.bool)
    used[layout.slot] = True
    assert bool((layout.rows[~used] == -1).all())  # padding reads nothing
    # experts 0, 1, 3, 4 chosen: four tiles, the rest of the grid unused
    assert sorted(layout.tile_expert[layout.tile_expert >= 0].tolist()) == [0, 1, 3, 4]
    assert layout.size == gg.BLOCK_M * -(-(flat.numel() + 6 * (gg.BLOCK_M - 1)) // gg.BLOCK_M)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("k", "group", "e", "tokens"),
    [
        (96, 32, 5, 7),
        (200, 64, 5, 7),  # K = 200: weights padded to 256
        (64, 32, 3, 40),  # 3 experts for 80 pairs: each expert's slots span tiles
    ],
)
def test_each_slot_is_its_tokens_row_times_its_experts_weights(dtype, k, group, e, tokens):
    n, top_k = 70, 2  # N off the 64-column block
    packed, sz, dense = _experts(e, n, k, group)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, k, generator=gen).to(dtype)
    chosen = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(tokens)])
    layout = gg.Layout(chosen, e)
    y = gg.int4_grouped(x, layout.rows, layout.tile_expert, packed, sz, group)
    assert y.shape == (layout.size, n) and y.dtype == dtype
    flat = chosen.flatten()
    token = torch.arange(tokens).repeat_interleave(top_k)
    want = torch.einsum("pk,pnk->pn", x[token].float(), dense[flat])
    # the weights' dequantization rounded to x's dtype, and the output: two roundings
    bound = verify.tolerance(dtype, k, roundings=3)
    why = verify.differs("the grouped GEMM", y[layout.slot].float(), want, bound)
    assert not why, why
    padding = torch.ones(layout.size, dtype=torch.bool)
    padding[layout.slot] = False
    assert bool((y[padding] == 0).all())


def test_a_second_product_reads_each_slot_of_the_first():
    e, n, k, group = 3, 32, 64, 32
    packed, sz, dense = _experts(e, n, k, group, seed=2)
    chosen = torch.tensor([[2, 0], [0, 1]])
    layout = gg.Layout(chosen, e)
    h = torch.zeros(layout.size, k, dtype=torch.bfloat16)
    h[layout.slot] = torch.randn(4, k).to(torch.bfloat16)
    y = gg.int4_grouped(h, layout.slots(), layout.tile_expert, packed, sz, group)
    want = torch.einsum("pk,pnk->pn", h[layout.slot].float(), dense[chosen.flatten()])
    why = verify.differs("the second product", y[layout.slot].float(), want,
                         verify.tolerance(torch.bfloat16, k, roundings=3))  # fmt: skip
    assert not why, why


def test_a_mixture_of_experts_on_our_triton_kernels_runs_grouped(tiny_model_dir, monkeypatch):
    from engine.loader.load import load_model

    monkeypatch.setenv("INFERSIGHT_KERNELS", "triton")
    folder, _ = tiny_model_dir(
        "qwen3_moe", False, moe_intermediate_size=64, mlp_only_layers=[], **WIDE_HEADS
    )  # our attention kernels' head width
    engine = load_model(folder, precision="int4-g32")
    layers = engine.paths()["layers"]
    assert {layer["experts"] for layer in layers} == {"grouped Triton GEMM"}
    moe = engine.model.layers[0].mlp
    assert isinstance(moe, MoE) and moe.kernel is not None
    # the experts' modules hold views of the stacked weights, which they still run on
    first = moe.experts[0].gate_up_proj
    assert first.weight.data_ptr() == moe.kernel.gate_up.data_ptr()
    x = torch.randn(5, engine.model.cfg.hidden_size).to(torch.bfloat16)
    grouped = moe(x)
    kernel, moe.kernel = moe.kernel, None
    modules = moe(x)
    moe.kernel = kernel
    # bf16 roundings apart: each product's output, the activation, the share, the sum
    bound = verify.tolerance(torch.bfloat16, 64, roundings=6)
    why = verify.differs("the layer", grouped.float(), modules.float(), bound, "its modules")
    assert not why, why
    assert F.cosine_similarity(grouped.float().flatten(), modules.float().flatten(), dim=0) > 0.999


def test_a_grouped_gemm_that_fails_its_check_is_refused_with_the_reason(monkeypatch):
    from engine.kernels import triton_check

    real = gg.int4_grouped

    def swapped(x, rows, tile_expert, weight, sz, group):  # each tile on the wrong expert
        return real(x, rows, tile_expert.roll(1), weight, sz, group)

    monkeypatch.setattr(gg, "int4_grouped", swapped)
    triton_check._grouped_verdict.cache_clear()
    try:
        why = triton_check.grouped(torch.device("cpu"), torch.bfloat16)
    finally:
        triton_check._grouped_verdict.cache_clear()
    assert why.startswith("our grouped INT4 GEMM kernel differs from the torch path"), why
