"""Decode steps replayed as CUDA graphs over static buffers, one graph per batch-size bucket.

A decode step of a small model launches hundreds of kernels, each a few microseconds of work
behind a few microseconds of Python and launch overhead: on a GPU the host, not the device,
sets the pace. A CUDA graph records a step's launches once and replays them with one call. A
graph replays fixed addresses and shapes, so every tensor the step reads lives in a static
buffer: token ids, positions, the slots the step's K/V are written to, the block tables and
the lengths our Triton decode kernel reads K/V through
(:func:`engine.kernels.triton_kernels.decode_attention.paged_decode_attention`; the torch paths
gather into shapes that change every step, so graphs need our kernels). A step of ``n``
sequences is copied into the buffers' first ``n`` rows and runs the graph of the smallest
bucket ≥ ``n`` (1, 2, 4, 8, 16, 32 … up to the largest batch); the padding rows have length 0
(the kernel gives them zeros), write their K/V into the pool's pad slot, which nothing with a
length reads, and their logits are dropped.

On a CPU (Triton's interpreter, for the tests) the same buffers, padding and buckets run
eagerly: :meth:`StaticDecode.run` calls the model where a GPU replays the graph, so the logic
is checked for exactness everywhere. Prefill steps, steps that verify drafts, and batches
larger than the largest bucket run as before.

The mode is settled at load (``--cuda-graphs`` or ``INFERSIGHT_CUDA_GRAPHS``): ``off``;
``on`` (the static runner wherever our Triton kernels run: captured on a GPU, eager on a
CPU under the interpreter; elsewhere off, saying why); ``auto`` (the default: captured on a
GPU with our kernels, else off). A capture that fails leaves the eager step, with the reason
in the load report.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from engine.attention.triton import StaticContext
from engine.errors import InvalidRequestError
from engine.executor import table
from engine.hardware.transfer import upload
from engine.kv_cache.block_manager import RELEASED
from engine.kv_cache.paged import PagedKVCache, block_tables

if TYPE_CHECKING:
    from engine.core.runner import Batch
    from engine.model.transformer import Transformer

log = logging.getLogger(__name__)

ENV = "INFERSIGHT_CUDA_GRAPHS"
MODES = ("auto", "on", "off")


def requested_mode(mode: str | None) -> str:
    """The mode to use: the argument, else ``INFERSIGHT_CUDA_GRAPHS``, else ``auto``."""
    chosen = (mode or os.environ.get(ENV) or "auto").strip().lower()
    if chosen not in MODES:
        raise InvalidRequestError(
            f"the CUDA graphs mode must be one of {', '.join(MODES)}, not {chosen!r}"
        )
    return chosen


def buckets(max_batch: int) -> tuple[int, ...]:
    """The batch sizes graphs are captured for: powers of two below ``max_batch``, then
    ``max_batch`` itself."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return (*sizes, max_batch)


@dataclass(frozen=True, slots=True)
class GraphsChoice:
    """What the load settled: ``runner`` set where decode steps run over static buffers, and
    why (one line for the load report)."""

    runner: StaticDecode | None
    why: str

    def summary(self) -> str:
        return f"CUDA graphs: {self.why}"


def settle(mode: str | None, model: Transformer, kv: PagedKVCache, max_batch: int) -> GraphsChoice:
    """Build (and on a GPU capture) the static decode runner where ``mode`` asks for it and
    our Triton kernels run; otherwise say why not."""
    mode = requested_mode(mode)
    device = kv.device
    if mode == "off":
        return GraphsChoice(None, "off as asked")
    refused = table.refusal(
        "cuda-graphs", kv.backend, tensor_parallel=model.announce is not None,
        experts=model.cfg.num_experts > 0,
    )  # fmt: skip
    if refused:
        return GraphsChoice(None, f"off: {refused}")
    if device.type != "cuda" and mode == "auto":
        return GraphsChoice(None, "off on a CPU (auto; --cuda-graphs on runs the static steps)")
    runner = StaticDecode(model, kv, max_batch)
    if device.type != "cuda":
        return GraphsChoice(runner, f"static steps, eager on {device.type} ({runner.span()})")
    started = time.perf_counter()
    try:
        runner.capture()
    except Exception as exc:  # a capture failure: the eager step still works
        log.warning("capturing CUDA graphs failed, decode steps run eagerly: %s", exc)
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return GraphsChoice(None, f"capture failed ({first}); eager")
    took = time.perf_counter() - started
    return GraphsChoice(runner, f"captured {runner.span()} in {took:.1f} s")


class StaticDecode:
    """Decode steps over static buffers, a graph per bucket on a GPU (the module's
    docstring). Tied to one KV pool: its tensors are the graphs' addresses."""

    def __init__(self, model: Transformer, kv: PagedKVCache, max_batch: int) -> None:
        self.model, self.kv = model, kv
        self.buckets = buckets(max_batch)
        size, dev = self.buckets[-1], kv.device
        width = -(-model.cfg.max_position_embeddings // kv.block_size)
        self.ids = torch.zeros(size, dtype=torch.long, device=dev)
        self.positions = torch.zeros(size, dtype=torch.long, device=dev)
        #: each block group's write slots and block tables (the local layers' where kept
        #: apart: :mod:`engine.kv_cache.layered`)
        self.slots = {
            g: torch.full((size,), g.pad_slot, dtype=torch.long, device=dev) for g in kv.groups
        }
        self.tables = {
            g: torch.full((size, width), RELEASED, dtype=torch.int32, device=dev) for g in kv.groups
        }
        self.lens = torch.zeros(size, dtype=torch.int32, device=dev)
        self.rows = torch.arange(size, device=dev)
        #: bucket → (the graph, the logits it writes), once captured
        self.graphs: dict[int, tuple[Any, Tensor]] = {}
        #: the cache window the graphs were captured under: a graph keeps its kernels'
        #: arguments, so a step under another window (``LLMEngine.set_window``) runs eagerly
        self.window = _window(kv)

    def span(self) -> str:
        sizes = self.buckets
        return f"{len(sizes)} bucket{'s' * (len(sizes) > 1)} of batch {sizes[0]}…{sizes[-1]}"

    def fits(self, batch: Batch) -> bool:
        """Whether a step runs here: decode rows only (one token each, each sampled), at most
        the largest bucket."""
        n = len(batch.ids)
        decode = 0 < n <= self.buckets[-1] and len(batch.rows) == n and len(batch.order) == n
        return decode and _window(self.kv) == self.window

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def run(self, batch: Batch) -> Tensor:
        """The step's logits ``[n, V]``: its inputs copied into the buffers (queued), then its
        bucket's graph replayed, or the model called on the buffers where there is none."""
        n = len(batch.ids)
        size = self.bucket(n)
        self._load(batch, size)
        graph = self.graphs.get(size)
        if graph is None:
            return self._forward(size)[:n]
        graph[0].replay()
        return graph[1][:n]

    def capture(self) -> None:
        """Record a graph per bucket, largest first, in one memory pool (each after a warm-up
        run: Triton compiles its kernels outside the capture)."""
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.buckets):
            self._forward(size)
            torch.cuda.synchronize(self.kv.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(size)
            self.graphs[size] = (graph, logits)

    def _forward(self, size: int) -> Tensor:
        slots = {g: t[:size] for g, t in self.slots.items()}
        tables = {g: t[:size] for g, t in self.tables.items()}
        ctx = StaticContext(self.kv, slots, tables, self.lens[:size], self.window)
        return self.model(self.ids[:size], self.positions[:size], ctx, self.rows[:size])

    def _load(self, batch: Batch, size: int) -> None:
        """The step's rows into the buffers, padding rows after them (length 0, each group's
        pad slot); each sequence's block tables into their rows, as wide as the widest."""
        dev = self.kv.device
        n, pad = len(batch.ids), size - len(batch.ids)
        lens = [c.start + 1 for c in batch.chunks]
        zeros = [0] * pad
        host = [*batch.ids, *zeros, *batch.positions, *zeros, *lens, *zeros]
        for g in self.kv.groups:
            host += [g.manager.slots(c.seq_id, c.start, c.start + 1)[0] for c in batch.chunks]
            host += [g.pad_slot] * pad
        packed = upload(host, dev)
        self.ids[:size].copy_(packed[:size], non_blocking=True)
        self.positions[:size].copy_(packed[size : 2 * size], non_blocking=True)
        self.lens[:size].copy_(packed[2 * size : 3 * size], non_blocking=True)
        for i, g in enumerate(self.kv.groups, 3):
            self.slots[g][:size].copy_(packed[i * size : (i + 1) * size], non_blocking=True)
            tables = block_tables(g.manager, batch.chunks, dev)
            self.tables[g][:n, : tables.shape[1]].copy_(tables, non_blocking=True)


#: ``(sink, window)`` as the decode kernel takes them (``(0, 0)``: none)
Window = tuple[int, int]


def _window(kv: PagedKVCache) -> Window:
    """The cache window steps run under now (the block manager's: the user's within the
    model's own)."""
    window = kv.manager.window
    return (0, 0) if window is None else (window.sink, window.window)
