"""How a layer's routed experts run, where not one expert module at a time, and why not:

* on the CPU, a decode token's experts in one C call (:mod:`engine.kernels.experts`): every
  routed expert's two products must be ours, all INT4 of one group or all INT8, without
  padding or bias, as the load chose their kernels (:attr:`Int4Linear.lowbit`,
  :attr:`Int8Linear.lowbit_scales`: ours where they measured faster than torch's for the
  shape). The kernel reads the very tensors those layers hold.
* on CUDA, every token of a step in two grouped launches
  (:mod:`engine.kernels.triton_kernels.grouped_gemm`): every expert's products on our Triton
  INT4 kernels, one group, no bias, a GPU with tensor cores. Their weights are stacked into
  one tensor per product (:func:`stack`), each expert module keeping views of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import Tensor, nn

from engine.kernels.experts import ACTIVATIONS, ExpertsKernel, ExpertWeights
from engine.model.mlp import ACTIVATIONS as ACTS
from engine.model.moe import MoE
from engine.quant.int4 import Int4Linear
from engine.quant.int8 import Int8Linear


def plan(moe: MoE, activation: str) -> ExpertsKernel | GroupedExperts | str:
    """The kernel of ``moe``'s routed experts, or why they run one module at a time."""
    first = moe.experts[0].gate_up_proj
    if isinstance(first, Int4Linear) and first.triton is not None:
        return grouped(moe, activation)
    if activation not in ACTIVATIONS:
        return f"the kernel has no {activation} activation"
    products = [(e.gate_up_proj, e.down_proj) for e in moe.experts]
    if all(isinstance(p, Int4Linear) for pair in products for p in pair):
        return _int4(products, activation)  # type: ignore[arg-type]
    if all(type(p) is Int8Linear for pair in products for p in pair):  # not W8A8's
        return _int8(products, activation)  # type: ignore[arg-type]
    return "the experts are not all INT4 or all INT8 (weights only)"


def _why_not(layer: nn.Module) -> str:
    if layer.weight.device.type != "cpu":
        return f"its weights are on {layer.weight.device}"
    if getattr(layer, "bias", None) is not None:
        return "it has a bias"
    return ""


def _int4(products: list[tuple[Int4Linear, Int4Linear]], activation: str) -> ExpertsKernel | str:
    groups = {p.group for pair in products for p in pair}
    if len(groups) != 1:
        return f"the experts' groups differ ({sorted(groups)})"
    for pair in products:
        for p in pair:
            if why := _why_not(p):
                return why
            if not p.lowbit:
                return "torch's INT4 kernel runs the experts (ours measured slower for them)"
            if p.padded_k:
                return "the experts' widths are not whole groups"
    weights = [ExpertWeights(g.weight, _sz(g), d.weight, _sz(d)) for g, d in products]
    if not all(w.gate_up_scales.is_contiguous() and w.down_scales.is_contiguous() for w in weights):
        return "the experts' scales are not laid out as ours"
    inner = products[0][1].in_features
    return ExpertsKernel(weights, kind=4, group=groups.pop(), inner=inner, act=activation)


def _sz(layer: Int4Linear) -> torch.Tensor:
    """The layer's (s, z) as our kernel reads them, ``[N, K/group, 2]`` (a view)."""
    return layer.scales_and_zeros.transpose(0, 1)


def _int8(products: list[tuple[Int8Linear, Int8Linear]], activation: str) -> ExpertsKernel | str:
    for pair in products:
        for p in pair:
            if why := _why_not(p):
                return why
            if p.lowbit_scales is None:
                return "torch's INT8 kernel runs the experts (ours measured slower for them)"
    weights = [
        ExpertWeights(g.weight, g.lowbit_scales, d.weight, d.lowbit_scales)  # type: ignore[arg-type]
        for g, d in products
    ]
    inner = products[0][1].in_features
    return ExpertsKernel(weights, kind=8, group=0, inner=inner, act=activation)


class GroupedExperts:
    """A layer's routed experts over a step's tokens in two grouped INT4 launches
    (:func:`~engine.kernels.triton_kernels.grouped_gemm.int4_grouped`): the pairs laid out by
    expert once, the gate_up products, the activation, the down products; each pair's output
    weighted and its token's ``k`` summed in the order routing gave them."""

    name = "grouped Triton GEMM"
    max_tokens: int | None = None

    def __init__(
        self, products: list[tuple[Int4Linear, Int4Linear]], act: Callable[[Tensor], Tensor]
    ) -> None:
        self.num_experts = len(products)
        self.inner = products[0][1].in_features
        self.act, self.group = act, products[0][0].group
        self.gate_up, self.gate_up_sz = stack([g for g, _ in products])
        self.down, self.down_sz = stack([d for _, d in products])

    def __call__(self, x: Tensor, chosen: Tensor, weights: Tensor) -> Tensor:
        from engine.kernels.triton_kernels.grouped_gemm import Layout, int4_grouped

        layout = Layout(chosen, self.num_experts)
        h = int4_grouped(x, layout.rows, layout.tile_expert, self.gate_up, self.gate_up_sz,
                         self.group)  # fmt: skip
        h = self.act(h[:, : self.inner]) * h[:, self.inner :]
        y = int4_grouped(h, layout.slots(), layout.tile_expert, self.down, self.down_sz,
                         self.group)  # fmt: skip
        pairs = y[layout.slot] * weights.flatten()[:, None].to(y.dtype)
        return pairs.view(*chosen.shape, -1).sum(dim=1)


def stack(layers: list[Int4Linear]) -> tuple[Tensor, Tensor]:
    """The layers' packed weights and (s, z) as one tensor each, ``[E, …]``; each layer's
    buffers become views of them (the separate tensors are freed)."""
    weight = torch.stack([layer.weight for layer in layers])
    sz = torch.stack([layer.scales_and_zeros for layer in layers])
    for i, layer in enumerate(layers):
        layer.weight, layer.scales_and_zeros = weight[i], sz[i]
    return weight, sz


def grouped(moe: MoE, activation: str) -> GroupedExperts | str:
    """The grouped launches of ``moe``'s experts on our Triton INT4 kernels, or why not."""
    from engine.kernels import triton_check
    from engine.kernels.triton_kernels.quant_gemm import tensor_cores

    products = [(e.gate_up_proj, e.down_proj) for e in moe.experts]
    layers = [p for pair in products for p in pair]
    if not all(isinstance(p, Int4Linear) and p.triton is not None for p in layers):
        return "the experts are not all INT4 on our Triton kernels"
    int4 = cast(list[tuple[Int4Linear, Int4Linear]], products)
    groups = {p.group for pair in int4 for p in pair}
    if len(groups) != 1:
        return f"the experts' groups differ ({sorted(groups)})"
    if any(p.bias is not None for pair in int4 for p in pair):
        return "the experts have a bias"
    device = int4[0][0].weight.device
    if not tensor_cores(device):
        return "the grouped GEMM runs on tensor cores (sm_80 or newer)"
    if failed := triton_check.grouped(device, int4[0][0].out_dtype):
        return failed
    return GroupedExperts(int4, ACTS[activation])
