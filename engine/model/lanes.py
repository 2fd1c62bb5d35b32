"""A decode step of a model whose experts live in host memory (``--cpu-experts``), in two
lanes: the GPU attends for one while the CPU runs the other's experts.

Within one sequence nothing overlaps: a layer's experts need its attention's output, and the
next layer's attention needs theirs. A decode step of several sequences is split in two
micro-batches (the first half of its rows, the rest), each with an attention context of its
own (:meth:`~engine.model.attention.AttentionContext.lanes`), and the layers are walked with
the two interleaved (SGLang's two-batch overlap, for the host-GPU split). For each layer and
each lane in turn, the host

1. finishes that lane's experts of the layer before (:meth:`MoE.finish
   <engine.model.moe.MoE.finish>`: the CPU runs them while the GPU runs what was queued
   last: the other lane's attention and routing);
2. queues the lane's attention of this layer, then, where its experts are on the host, its
   routing and its rows' crossing (:meth:`MoE.begin <engine.model.moe.MoE.begin>`), else
   its whole MLP.

So while the CPU runs one lane's experts, the GPU attends for the other. Each lane crosses
through buffers of its own (:class:`~engine.model.host_crossing.HostCrossing`). The lanes'
rows are the step's in order, and each row's arithmetic is its own (attention per sequence;
a product's row does not depend on the others'), up to the rounding of a product's blocking
by its row count.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor

from engine.model.attention import AttentionContext
from engine.model.moe import HostExperts, MoE

if TYPE_CHECKING:
    from engine.model.transformer import DecoderLayer, Transformer


def hosted(layer: DecoderLayer) -> MoE | None:
    """``layer``'s mixture of experts where its routed experts live in host memory."""
    mlp = layer.mlp
    return mlp if isinstance(mlp, MoE) and mlp.crossing is not None else None


def decoder_layers(model: Transformer) -> list[DecoderLayer]:
    return cast("list[DecoderLayer]", list(model.layers))


_ONE_LANE = [False]


@contextmanager
def one_lane() -> Iterator[None]:
    """Every step in one lane inside this block (the GPU check's side-by-side measure)."""
    _ONE_LANE[0] = True
    try:
        yield
    finally:
        _ONE_LANE[0] = False


def applies(model: Transformer) -> bool:
    """Whether ``model``'s decode steps may run in two lanes: a layer's experts are in host
    memory, and no layer runs fused (and not inside :func:`one_lane`)."""
    if _ONE_LANE[0] or not model.cfg.num_experts:  # (every step asks: a dense model at once)
        return False
    layers = decoder_layers(model)
    return any(hosted(layer) for layer in layers) and all(layer.fused is None for layer in layers)


def body(model: Transformer, x: Tensor, positions: Tensor, ctx: AttentionContext) -> Tensor | None:
    """The hidden states after the last layer of the rows ``x`` at ``positions``, the step's
    rows in two lanes (the module's docstring); None where the step does not split (fewer
    than two decode rows), and the caller runs it in one."""
    split = ctx.lanes()
    if split is None:
        return None
    first, second, n = split
    model.laned_steps += 1
    rows, contexts = [x[:n], x[n:]], (first, second)
    angles = (model.angles(positions[:n], x.dtype), model.angles(positions[n:], x.dtype))
    pending: list[tuple[DecoderLayer, HostExperts, Tensor] | None] = [None, None]

    def settle(lane: int) -> None:
        waiting = pending[lane]
        if waiting is not None:
            layer, experts, residual = waiting
            moe = hosted(layer)
            assert moe is not None
            rows[lane] = layer.add_mlp(residual, moe.finish(experts))
            pending[lane] = None

    for i, layer in enumerate(decoder_layers(model)):
        for lane in (0, 1):
            settle(lane)
            h, residual = layer.attend(rows[lane], *angles[lane][i], contexts[lane])
            moe = hosted(layer)
            if moe is not None:
                pending[lane] = (layer, moe.begin(h, lane), residual)
            else:
                rows[lane] = layer.add_mlp(residual, layer.mlp(h))
    settle(0)
    settle(1)
    return torch.cat(rows)
