"""Experts on the CPU, the rest on the GPU (``--cpu-experts N|auto``).

A mixture of experts holds most of its weights in experts of which a token uses a few: on a
12 GiB card the attention, the router, a shared expert and the KV cache fit where all the
experts do not. As llama.cpp's ``--n-cpu-moe`` does, the experts of the first ``N`` layers
of experts stay in host memory and run on the CPU kernels;
everything else stays on the device. ``auto``: the fewest layers that let the plan fit
(:func:`engine.loader.memory_plan.plan_memory` tries each count). On a CPU both sides are
the CPU: the same code runs, and nothing moves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.errors import InvalidRequestError
from engine.model.config import ModelConfig
from engine.quant.sizes import CPU, Backends, linear_bytes
from engine.quant.spec import PrecisionSpec

if TYPE_CHECKING:
    from engine.core.config import EngineConfig
    from engine.loader.memory_plan import MemoryPlan

#: ``--cpu-experts auto``
AUTO = "auto"


#: ``auto`` keeps on the CPU the fewest layers' experts that leave room for this much context
#: (or the model's own, if shorter); where none does, the fewest with which the plan fits
AUTO_CONTEXT = 4096


def fewest(plan: Callable[[int], MemoryPlan], cfg: ModelConfig) -> MemoryPlan:
    """``--cpu-experts auto``: the plan (``plan(count)``) of the fewest layers' experts on the
    CPU that reaches :data:`AUTO_CONTEXT`, else of the fewest that fits, else of them all."""
    fitting = None
    for count in range(len(expert_layers(cfg)) + 1):
        made = plan(count)
        if made.fits and made.max_context >= min(AUTO_CONTEXT, made.max_position):
            return made
        if made.fits and fitting is None:
            fitting = made
    return fitting or made


def parse(text: str | int | None) -> int | str:
    """``--cpu-experts``: a count of layers (0: none) or ``auto``."""
    if text is None:
        return 0
    if isinstance(text, int) or str(text).isdigit():
        return int(text)
    if str(text).strip().lower() == AUTO:
        return AUTO
    raise InvalidRequestError(
        f"--cpu-experts takes a number of layers whose experts stay on the CPU, or auto; "
        f"not {text!r}"
    )


def expert_layers(cfg: ModelConfig) -> list[int]:
    """The layers that route to experts, in order."""
    return [i for i in range(cfg.num_layers) if cfg.is_moe(i)]


def host_layers(cfg: ModelConfig, count: int) -> tuple[int, ...]:
    """The layers whose experts stay on the CPU for ``count`` (the first ``count`` layers of
    experts); refused where the model has fewer, or none."""
    layers = expert_layers(cfg)
    if count and not layers:
        raise InvalidRequestError(
            "--cpu-experts keeps a mixture of experts' experts on the CPU; this model has none"
        )
    if count > len(layers):
        raise InvalidRequestError(
            f"--cpu-experts {count}: this model has {len(layers)} layers of experts"
        )
    return tuple(layers[:count])


def experts_bytes(cfg: ModelConfig, spec: PrecisionSpec, layers: tuple[int, ...],
                  backends: Backends) -> int:  # fmt: skip
    """Bytes of the routed experts of ``layers`` (not the router nor a shared expert) stored
    at ``spec`` for ``backends``."""
    hidden, inner = cfg.hidden_size, cfg.expert_intermediate_size
    total = 0
    for layer in layers:
        kind = spec.block_kind("mlp", layer)
        one = linear_bytes(2 * inner, hidden, kind, spec.compute, backends) + linear_bytes(
            hidden, inner, kind, spec.compute, backends
        )
        total += cfg.num_experts * one
    return total


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a plan puts the experts: ``layers`` on the CPU, ``device_bytes`` they would
    take on the device, ``host_bytes`` they take in host memory (the CPU's formats)."""

    layers: tuple[int, ...] = ()
    device_bytes: int = 0
    host_bytes: int = 0


def place(
    cfg: ModelConfig, spec: PrecisionSpec, count: int, backends: Backends, device: torch.device
) -> Placement:
    """The placement of ``count`` layers' experts on the CPU, for ``device`` of ``backends``;
    none on a CPU, where host memory is the device's (the count is still checked)."""
    layers = host_layers(cfg, count)
    if not layers or device.type == "cpu":
        return Placement()
    return Placement(
        layers, experts_bytes(cfg, spec, layers, backends), experts_bytes(cfg, spec, layers, CPU)
    )


def resolve(
    cfg: ModelConfig, device: torch.device, config: EngineConfig, plan: Callable[[], MemoryPlan]
) -> tuple[int, ...]:
    """The layers whose experts a load keeps on the CPU: the count asked for, or ``auto``'s
    from the memory plan of the device (``plan()``); none on a CPU, where both sides are the
    CPU (a count is still checked against the model)."""
    asked = config.cpu_experts
    if asked == AUTO:
        return () if device.type == "cpu" else plan().cpu_expert_layers
    layers = host_layers(cfg, int(asked))
    return () if device.type == "cpu" else layers
