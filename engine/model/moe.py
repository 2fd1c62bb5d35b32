"""A mixture of experts in place of a layer's MLP (Qwen3-MoE, Qwen2-MoE, Mixtral).

A router (a linear of ``hidden → experts``, kept in the compute dtype, never quantized) scores
each token; the softmax of its scores, in fp32, picks the token's ``k`` best experts, whose
weights are renormalised to sum to 1 where the model says (Mixtral always, Qwen's
``norm_topk_prob``). Each expert is a gated MLP of its own (:class:`~engine.model.mlp.MLP`,
``experts.E.gate_up_proj`` / ``down_proj``), so that every format quantizes it as any other
linear. The tokens run grouped by expert: one sort of the (token, expert) pairs, then each
expert that any token chose runs once on all of its tokens, and its weighted output is added
back at their rows (no loop over tokens). Qwen2-MoE adds a shared expert on every token,
gated by a sigmoid of its own linear.

Where the experts are quantized, a kernel of their own may run them instead of the modules
(:attr:`MoE.kernel`, an :class:`ExpertKernel` chosen at load by :mod:`engine.quant.experts`:
a decode batch's experts in one C call on a CPU, every step's in two grouped Triton launches
on CUDA); :attr:`MoE.kernel_refusal` says why not where none does.

:attr:`MoE.load` counts, per expert, the tokens routed to it since the load; the
instruments draw what changed between two snapshots (the expert heat map).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.model.config import ModelConfig
from engine.model.host_crossing import HostCrossing
from engine.model.mlp import MLP


class ExpertKernel(Protocol):
    """The routed experts of a layer in a kernel of their own (:mod:`engine.quant.experts`):
    ``kernel(x [T, K], chosen [T, k], weights [T, k]) → [T, K]``."""

    #: what runs them, as the paths report names it
    name: str
    #: the most tokens a step may have for it to run them (None: any)
    max_tokens: int | None

    def __call__(self, x: Tensor, chosen: Tensor, weights: Tensor) -> Tensor: ...


@dataclass(frozen=True, slots=True)
class HostExperts:
    """Rows on their way to a layer's experts in host memory (:meth:`MoE.begin`): the rows,
    chosen experts, weights and per-expert counts on the host (their copies queued), the
    shared expert's output on the model's device (None: none), and the lane."""

    host: list[Tensor]
    shared: Tensor | None
    lane: int


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts = cfg.num_experts
        self.top_k = cfg.experts_per_token
        self.normalize = cfg.normalize_expert_weights
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(
            MLP(cfg, cfg.expert_intermediate_size) for _ in range(cfg.num_experts)
        )
        size = cfg.shared_expert_size
        self.shared = MLP(cfg, size) if size else None
        self.shared_gate = nn.Linear(cfg.hidden_size, 1, bias=False) if size else None
        #: tokens routed to each expert since the load (int64 ``[E]``; None before the first
        #: step): the instruments draw what changed between two reads
        self.load: Tensor | None = None
        #: where the routed experts live and run where it is not the rest's (``--cpu-experts``:
        #: the CPU); None: beside the rest. :meth:`keep_on_host` sets it.
        self.expert_device: torch.device | None = None
        #: the rows' way to those experts and back (:mod:`engine.model.host_crossing`)
        self.crossing: HostCrossing | None = None
        #: as :attr:`MLP.reduce` (tensor parallelism does not split experts yet: always None)
        self.reduce: Callable[[Tensor], Tensor] | None = None
        #: the routed experts in a kernel of their own (:mod:`engine.quant.experts`), or
        #: None: one module at a time; :attr:`kernel_refusal` says why not
        self.kernel: ExpertKernel | None = None
        self.kernel_refusal = "the experts are not quantized"

    def keep_on_host(self, device: torch.device) -> None:
        """The routed experts live and run in host memory, beside a model on ``device``: each
        step's rows cross to them and back (:class:`HostCrossing`)."""
        self.expert_device = torch.device("cpu")
        self.crossing = HostCrossing(device)

    def set_kernel(self, kernel: ExpertKernel | str) -> None:
        """Run the routed experts in ``kernel``, or (a reason) one module at a time."""
        if isinstance(kernel, str):
            self.kernel, self.kernel_refusal = None, kernel
        else:
            self.kernel, self.kernel_refusal = kernel, ""

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Each token's ``k`` experts ``[T, k]`` (int64) and their weights ``[T, k]`` in
        ``x``'s dtype, as transformers picks them."""
        probs = F.softmax(self.router(x), dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return chosen, weights.to(x.dtype)

    def forward(self, x: Tensor) -> Tensor:
        if self.crossing is not None:  # the experts in host memory
            return self.finish(self.begin(x))
        chosen, weights, counts = self._route_and_count(x)
        out = self._routed(x, chosen, weights, counts)
        shared = self._shared(x)
        return out if shared is None else out + shared

    def _route_and_count(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Each token's experts and weights (:meth:`route`), and the tokens each expert got,
        added to :attr:`load`."""
        chosen, weights = self.route(x)
        flat = chosen.flatten()
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=flat.device)
        counts.index_add_(0, flat, torch.ones_like(flat))  # no read back, as bincount's
        self.load = counts if self.load is None else self.load + counts
        return chosen, weights, counts

    def begin(self, x: Tensor, lane: int = 0) -> HostExperts:
        """A step's rows on their way to the experts in host memory (:meth:`keep_on_host`):
        routed, their crossing queued, the shared expert queued on the GPU. :meth:`finish`
        waits for them and runs the experts; in between, the GPU may be given more work
        (another lane's attention: :mod:`engine.model.lanes`)."""
        assert self.crossing is not None
        host = self.crossing.down(x, *self._route_and_count(x), lane=lane)
        # queued on the GPU after the copies: it runs while the host runs the routed experts
        return HostExperts(host, self._shared(x), lane)

    def finish(self, pending: HostExperts) -> Tensor:
        """The experts' sum of :meth:`begin`'s rows, on the model's device (its upload
        queued), with the shared expert's."""
        assert self.crossing is not None
        self.crossing.wait(pending.lane)
        out = self.crossing.up(self._routed(*pending.host), pending.lane)
        return out if pending.shared is None else out + pending.shared

    def _shared(self, x: Tensor) -> Tensor | None:
        """Qwen2-MoE's shared expert on every token, gated by a sigmoid (None: none)."""
        if self.shared is None or self.shared_gate is None:
            return None
        return torch.sigmoid(self.shared_gate(x)) * self.shared(x)

    def _routed(self, x: Tensor, chosen: Tensor, weights: Tensor, counts: Tensor) -> Tensor:
        """The routed experts' weighted sum, on the device where ``x`` and the experts are:
        their kernel, or one module at a time."""
        kernel = self.kernel
        if kernel is not None and (kernel.max_tokens is None or x.shape[0] <= kernel.max_tokens):
            return kernel(x, chosen, weights)
        if x.shape[0] == 1:
            return self._one_token(x, chosen.flatten(), weights)
        return self._grouped(x, chosen.flatten(), weights, counts)

    def _one_token(self, x: Tensor, chosen: Tensor, weights: Tensor) -> Tensor:
        """A decode row: its ``k`` experts run on it in ascending order (the grouped path's
        order of the sums), without sorting or gathering rows."""
        pairs = sorted(zip(chosen.tolist(), weights.flatten(), strict=True))
        out = torch.zeros_like(x)
        for expert, weight in pairs:
            out += (self.experts[expert](x) * weight).to(out.dtype)
        return out

    def _grouped(self, x: Tensor, flat: Tensor, weights: Tensor, counts: Tensor) -> Tensor:
        """Every expert that a token chose, once over all of its tokens."""
        order = torch.argsort(flat, stable=True)  # the (token, expert) pairs by expert
        rows = order // self.top_k  # each pair's token
        pair_weights = weights.flatten()[order, None]
        out = torch.zeros_like(x)
        start = 0
        for expert, n in enumerate(counts.tolist()):
            if not n:
                continue
            tokens = rows[start : start + n]
            ran = self.experts[expert](x[tokens]) * pair_weights[start : start + n]
            out.index_add_(0, tokens, ran.to(out.dtype))  # a host INT4 expert's may be bf16
            start += n
        return out

    def linears(self) -> list[nn.Module]:
        """Its products: each expert's, then the shared expert's (the router and the shared
        expert's gate stay in the compute dtype)."""
        experts = [p for e in self.experts for p in e.linears()]  # type: ignore[operator]
        return experts + (self.shared.linears() if self.shared is not None else [])

    def routed(self) -> tuple[int, ...]:
        """The tokens routed to each expert since the load."""
        return (0,) * self.num_experts if self.load is None else tuple(self.load.tolist())


def expert_load(model: nn.Module) -> dict[str, Any]:
    """A snapshot's expert fields (:class:`engine.core.metrics.MetricsSnapshot`): the layers
    of experts and, for each, the tokens routed to each expert since the load; empty for a
    dense model."""
    decoders = cast(nn.ModuleList, model.layers)
    layers = [(i, m.mlp) for i, m in enumerate(decoders) if isinstance(m.mlp, MoE)]
    return {
        "expert_layers": tuple(i for i, _ in layers),
        "expert_tokens": tuple(moe.routed() for _, moe in layers),
    }
