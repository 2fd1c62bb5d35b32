"""What a loaded model holds, counted by duck typing: its linears, parameters and weight bytes.

Nothing here knows the quantized or packed layers by class: a layer that stores its weight in
a form of its own says how many bytes it takes in an integer ``nbytes`` attribute
(``PackedLinear``, ``Int8Linear``, ``Int4Linear``), and that is all these helpers ask of it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def weight_bytes(model: nn.Module, device: torch.device | None = None) -> int:
    """Bytes the model's weights occupy in memory, packed and quantized forms included
    (each tensor once); with ``device``, only those on its kind of device (a GPU model's
    experts kept on the CPU, ``--cpu-experts``, are not the GPU's)."""
    seen: set[int] = set()
    total = 0

    def there(t: Tensor | None) -> bool:
        return device is None or t is None or t.device.type == device.type

    for module in model.modules():
        tensors: list[Tensor] = list(module.parameters(recurse=False))
        nbytes = getattr(module, "nbytes", None)
        if isinstance(nbytes, int):  # PackedLinear, Int8Linear, Int4Linear
            weight = getattr(module, "weight", None)
            total += nbytes if there(weight if isinstance(weight, Tensor) else None) else 0
            bias = getattr(module, "bias", None)
            tensors += [bias] if isinstance(bias, Tensor) else []
        for t in tensors:
            if id(t) not in seen and there(t):
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


def linear_modules(model: nn.Module) -> list[nn.Module]:
    """The model's linears in forward order (each layer's, then the LM head), whatever their
    form: ``nn.Linear``, oneDNN-packed, INT8, INT4."""
    return [
        m
        for m in model.modules()
        if isinstance(m, nn.Linear) or isinstance(getattr(m, "nbytes", None), int)
    ]


def parameter_count(model: nn.Module) -> int:
    """Distinct parameters (tied weights once), before any packing."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def decode_linears(model: nn.Module) -> list[nn.Module]:
    """The linears one token's decode step runs: :func:`linear_modules`, of a mixture of
    experts' routed experts only as many as a token chooses (the first ``k`` of each layer,
    alike in shape to any other ``k``)."""
    from engine.model.moe import MoE

    idle = {
        id(m)
        for moe in model.modules()
        if isinstance(moe, MoE)
        for expert in list(moe.experts)[moe.top_k :]
        for m in expert.modules()
    }
    return [m for m in linear_modules(model) if id(m) not in idle]
