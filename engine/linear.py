"""Linear layers laid out for the device they run on, chosen once at load.

On a CPU, decode is a chain of matrix-vector products that stream every weight from memory
once per token. oneDNN's blocked weight layout streams about 1.7× faster than the row-major
``nn.Linear`` weight through MKL's GEMV here (measured: 40 vs 23 GB/s on a 2-core AMD EPYC), so
the engine repacks fp32/bf16 weights into it at load time, where :func:`engine.hardware.cpu_paths`
found that this CPU runs the packed op for that dtype (bf16 needs AVX-512 or AVX-NE-CONVERT).
Elsewhere, and on other devices, the module stays ``nn.Linear``. The packed path uses
``torch.ops.mkldnn``, the same private ops TorchInductor emits for CPU linears.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

from engine.hardware import cpu_paths

log = logging.getLogger(__name__)

# oneDNN picks the blocked layout for this batch size. 16 measured faster than 1 for both
# decode at batch 1 (10.7 vs 13.5 ms for SmolLM2's 30 layers) and batch 16 (15.4 vs 20.7 ms).
PACK_BATCH_HINT = 16


@torch.library.custom_op("infersight::packed_linear", mutates_args=())
def packed_linear(x: Tensor, weight: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    """oneDNN's packed linear as one opaque op for compiled graphs."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@packed_linear.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


class PackedLinear(nn.Module):
    """``y = x Wᵀ + b`` with ``W`` held in oneDNN's blocked layout (CPU only)."""

    weight: Tensor
    bias: Tensor | None

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        dense = linear.weight.detach()
        self.dtype = dense.dtype
        self.nbytes = dense.numel() * dense.element_size()
        packed = torch.ops.mkldnn._reorder_linear_weight(dense, batch_size=PACK_BATCH_HINT)
        self.register_buffer("weight", packed, persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling():  # opaque to TorchInductor, which cannot lower it
            return packed_linear(x, self.weight, self.bias, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=onednn"


def pack_linears(model: nn.Module) -> int:
    """Swap every CPU ``nn.Linear`` in ``model`` whose dtype this CPU packs for a
    :class:`PackedLinear`. Returns the number of modules swapped (0 where packing does not
    apply)."""
    paths = cpu_paths()
    swaps = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is nn.Linear
        and module.weight.device.type == "cpu"
        and paths.packed(module.weight.dtype).ok
    ]
    for name, module in swaps:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, PackedLinear(module))
    return len(swaps)
