"""The quantized layer one full-precision weight becomes, by the format the spec gives it."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from engine.quant.int4 import Int4Linear
from engine.quant.int8 import Int8Linear
from engine.quant.spec import QuantKind
from engine.quant.w8a8 import W8A8Linear


def quantized_linear(
    weight: Tensor, bias: Tensor | None, kind: QuantKind, dtype: torch.dtype = torch.bfloat16
) -> nn.Module:
    """Build the quantized module for one full-precision weight (any float dtype). ``dtype``:
    the model's compute dtype, INT8's activations and scales (fp16 on a GPU older than compute
    capability 8.0), and INT4's activations where our Triton kernels run it (torch's INT4
    kernels take bf16 whatever it is)."""
    if kind.activations:
        return W8A8Linear(weight, bias, dtype)
    if kind.bits == 8:
        return Int8Linear(weight, bias, dtype)
    assert kind.group is not None
    return Int4Linear(weight, bias, kind.group, dtype)
