"""Which layers of experts a decode step runs in one C call (:mod:`engine.kernels.experts`),
and why the others do not: every routed expert's two products must be ours on the CPU, all
INT4 of one group or all INT8, without padding or bias, as the load chose their kernels
(:attr:`Int4Linear.lowbit`, :attr:`Int8Linear.lowbit_scales`: ours where they measured faster
than torch's for the shape). The kernel then reads the very tensors those layers hold."""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.experts import ACTIVATIONS, ExpertsKernel, ExpertWeights
from engine.model.moe import MoE
from engine.quant.int4 import Int4Linear
from engine.quant.int8 import Int8Linear


def plan(moe: MoE, activation: str) -> ExpertsKernel | str:
    """The one-call kernel of ``moe``'s routed experts, or why it does not run them."""
    if activation not in ACTIVATIONS:
        return f"the kernel has no {activation} activation"
    products = [(e.gate_up_proj, e.down_proj) for e in moe.experts]
    if all(isinstance(p, Int4Linear) for pair in products for p in pair):
        return _int4(products, activation)  # type: ignore[arg-type]
    if all(isinstance(p, Int8Linear) for pair in products for p in pair):
        return _int8(products, activation)  # type: ignore[arg-type]
    return "the experts are not all INT4 or all INT8"


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
