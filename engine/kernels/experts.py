"""A decode step's routed experts in one C call (``csrc/experts.h``, built into the low-bit
library): for one token, each expert it was routed to runs its gate_up product, the gate's
activation, its down product and its weighted share of the sum, the token's activations
quantized once for every expert. The layer by layer path makes two products and three torch
operators per expert, each with its dispatch; a Qwen3-30B-A3B decode step routes a token to 8
experts in each of 48 layers, so that is about 1,900 calls a token, not 48.

The weights are the experts' own (our INT4 layout, :func:`engine.formats.int4.pack_int4`, or
our INT8 matrices with their fp32 scales): nothing is copied. Which layers may take it, and
why the others do not, is :func:`engine.quant.experts.plan`'s.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.kernels import lowbit, native

#: the activations the kernel computes, by :attr:`engine.model.config.ModelConfig.activation`
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


@dataclass(frozen=True)
class ExpertWeights:
    """One expert's products as the kernel reads them: values and scales of its gate_up
    ``[2·inner, K]`` and its down ``[K, inner]``."""

    gate_up: Tensor
    gate_up_scales: Tensor
    down: Tensor
    down_scales: Tensor


class ExpertsKernel:
    """The routed experts of one layer in one call a token: ``kind`` 4 (INT4, ``group``) or 8
    (INT8), ``inner`` channels each, ``act`` their gate's activation
    (an :class:`engine.model.moe.ExpertKernel` of a decode token)."""

    name = "one C call"
    any_tokens = False

    def __init__(
        self, experts: list[ExpertWeights], *, kind: int, group: int, inner: int, act: str
    ) -> None:
        self.experts = experts  # held: the pointers below are theirs
        self.kind, self.group, self.inner, self.act = kind, group, inner, ACTIVATIONS[act]
        self._ptrs = [
            tuple(t.data_ptr() for t in (e.gate_up, e.gate_up_scales, e.down, e.down_scales))
            for e in experts
        ]

    def __call__(self, x: Tensor, chosen: Tensor, weights: Tensor) -> Tensor:
        """``x [1, K]`` through its experts ``chosen [1, k]``, weighted by ``weights [1, k]``
        and summed in ascending expert order (as the modules sum them): ``[1, K]`` in
        ``x``'s dtype."""
        routed = sorted(zip(chosen.flatten().tolist(), weights.flatten().tolist(), strict=True))
        return self.run(x, [e for e, _ in routed], [w for _, w in routed])

    def run(self, x: Tensor, chosen: list[int], weights: list[float]) -> Tensor:
        """``x [1, K]`` through the experts ``chosen`` (in the order to sum them), weighted by
        ``weights``: ``[1, K]`` in ``x``'s dtype."""
        lib = lowbit.library().lib
        x = x if x.dtype in (torch.float32, torch.bfloat16) else x.float()
        x = x.contiguous()
        n = len(chosen)
        arrays = [(ctypes.c_void_p * n)(*(self._ptrs[e][i] for e in chosen)) for i in range(4)]
        r = (ctypes.c_float * n)(*weights)
        y = torch.empty(1, x.shape[-1], dtype=torch.float32)
        rc = native.call(
            "infersight::experts", lib.infersight_experts,
            x.data_ptr(), int(x.dtype == torch.bfloat16), x.shape[-1], self.inner, self.kind,
            self.group, n, *(ctypes.addressof(a) for a in arrays), ctypes.addressof(r),
            self.act, y.data_ptr(), lowbit.threads(),
        )  # fmt: skip
        if rc:
            raise MemoryError("our experts kernel ran out of memory for its scratch space")
        return y if y.dtype == x.dtype else y.to(x.dtype)
