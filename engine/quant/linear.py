"""The quantized layer one full-precision weight becomes, by the format the spec gives it."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from engine.quant.int4 import Int4Linear
from engine.quant.int8 import Int8Linear
from engine.quant.spec import QuantKind


def quantized_linear(weight: Tensor, bias: Tensor | None, kind: QuantKind) -> nn.Module:
    """Build the quantized module for one full-precision weight (any float dtype)."""
    if kind.bits == 8:
        return Int8Linear(weight, bias, torch.bfloat16)
    assert kind.group is not None
    return Int4Linear(weight, bias, kind.group)
