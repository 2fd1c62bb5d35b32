"""A decode step's routed experts in one C call (``csrc/experts.h``, built into the low-bit
library): each expert any row was routed to runs once on the rows that chose it, its gate_up
product, the gate's activation, its down product and its weighted share of each row's sum,
the rows' activations quantized once for every expert; each row's result is the same alone or
beside others. The layer by layer path makes two products and three torch
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

from engine.kernels import gemv, lowbit, native

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
    """The routed experts of one layer in one call a decode step (up to
    :data:`~engine.kernels.gemv.MAX_ROWS` rows, where the modules' products too take our
    GEMV): ``kind`` 4 (INT4, ``group``) or 8 (INT8), ``inner`` channels each, ``act`` their
    gate's activation (an :class:`engine.model.moe.ExpertKernel`)."""

    name = "one C call"
    max_tokens: int | None = gemv.MAX_ROWS

    def __init__(
        self, experts: list[ExpertWeights], *, kind: int, group: int, inner: int, act: str
    ) -> None:
        self.experts = experts  # held: the pointers below are theirs
        self.kind, self.group, self.inner, self.act = kind, group, inner, ACTIVATIONS[act]
        n = len(experts)
        self._tables = [
            (ctypes.c_void_p * n)(*(getattr(e, part).data_ptr() for e in experts))
            for part in ("gate_up", "gate_up_scales", "down", "down_scales")
        ]

    def __call__(self, x: Tensor, chosen: Tensor, weights: Tensor) -> Tensor:
        """``x [M, K]`` through each row's experts ``chosen [M, k]``, weighted by ``weights
        [M, k]`` and summed in ascending expert order (as the modules sum them): ``[M, K]``
        in ``x``'s dtype."""
        dtype = x.dtype
        x = x if dtype in (torch.float32, torch.bfloat16) else x.float()
        x = x.contiguous()
        m, k = x.shape
        # the routing may be on another device (a GPU's, where the experts stay on the CPU)
        chosen = chosen.to("cpu", torch.int64).contiguous()
        weights = weights.to("cpu", torch.float32).contiguous()
        y = torch.empty(m, k, dtype=torch.float32)
        rc = native.call(
            "infersight::experts", lowbit.library().lib.infersight_experts,
            x.data_ptr(), int(x.dtype == torch.bfloat16), m, k, self.inner, self.kind,
            self.group, chosen.shape[1], chosen.data_ptr(), weights.data_ptr(),
            len(self.experts), *(ctypes.addressof(t) for t in self._tables), self.act,
            y.data_ptr(), lowbit.threads(),
        )  # fmt: skip
        if rc:
            raise MemoryError("our experts kernel ran out of memory for its scratch space")
        return y if y.dtype == dtype else y.to(dtype)
