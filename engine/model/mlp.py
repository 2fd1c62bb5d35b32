"""The gated MLP of a decoder layer (SwiGLU, GeGLU): a dense layer's, and each expert's of a
mixture (:mod:`engine.model.moe`)."""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor, nn

from engine.model.config import ModelConfig

#: the MLP's gate activations, by :attr:`ModelConfig.activation`
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class MLP(nn.Module):
    """The gated MLP (SwiGLU, GeGLU) of ``inner`` channels (the config's intermediate size
    unless given: an expert's, a shared expert's)."""

    def __init__(self, cfg: ModelConfig, inner: int | None = None) -> None:
        super().__init__()
        inner = inner or cfg.intermediate_size
        self.act = ACTIVATIONS[cfg.activation]
        self.intermediate_size = inner
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inner, bias=False)
        self.down_proj = nn.Linear(inner, cfg.hidden_size, bias=False)
        #: as :attr:`Attention.reduce`, for ``down_proj``
        self.reduce: Callable[[Tensor], Tensor] | None = None

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        out = self.down_proj(self.act(gate) * up)
        return out if self.reduce is None else self.reduce(out)

    def linears(self) -> list[nn.Module]:
        """Its products, in the order they run."""
        return [self.gate_up_proj, self.down_proj]
