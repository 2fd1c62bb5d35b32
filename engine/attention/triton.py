"""Attention through our Triton kernels: the backend, a step's context and block tables,
and the static context a CUDA graph captures.

The kernels (:mod:`engine.kernels.triton_kernels`) read K and V in place through each
sequence's block table, so a step gathers nothing (no workspace per token of context) and its
inputs keep fixed shapes in a graph's static buffers (graph-safe). Where they run
(:mod:`engine.kernels.triton_support`): a CUDA GPU with Triton, or this CPU under Triton's
interpreter; for heads :data:`~engine.kernels.triton_support.HEAD_DIMS` wide; not fp32 on a
GPU nor bf16 below sm80 (the prefill kernel's refusals). A layer with a window of its own
(Gemma's local layers) attends under it, narrowed further by the step's cache window
(:func:`layer_span`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from engine.attention.context import FUSED_WRITES, PoolContext
from engine.formats import kv as kv_format
from engine.formats.kv import KVFormat
from engine.hardware.transfer import upload
from engine.kernels import triton_support
from engine.kv_cache.paged import KVGroup, PagedKVCache, SeqChunk, block_tables
from engine.model.attention import AttentionBackend, AttentionContext
from engine.model.config import ModelConfig


class TritonBackend(AttentionBackend):
    """Our Triton kernels: graph-safe, no gather."""

    name = "triton"
    graph_safe = True

    def context(self, cache: Any, chunks: list[Any]) -> AttentionContext:
        return TritonContext(cache, chunks)

    @staticmethod
    def model_refusal(cfg: Any) -> str:
        """Why the kernels cannot attend for the model of ``cfg`` whatever the device: ""
        where they can (what a plan checks, which sees no device)."""
        return ""

    def refusal(self, cfg: Any, dtype: torch.dtype, device: torch.device) -> str:
        if self.model_refusal(cfg):
            return self.model_refusal(cfg)
        if cfg.head_dim not in triton_support.HEAD_DIMS:
            built = triton_support.head_dims()
            return f"our attention kernels are built for heads {built} wide, not {cfg.head_dim}"
        from engine.kernels.triton_kernels import prefill_attention

        heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        return prefill_attention.unsupported(dtype, *heads, device) or ""

    @staticmethod
    def pool_refusal(kv: KVFormat | None) -> str:
        """Why the kernels cannot read a pool of format ``kv`` (None: the compute dtype's):
        "" for every format (float pools, int8 and fp8 rows:
        :mod:`engine.kernels.triton_kernels.kv_rows`)."""
        return ""

    def window_refusal(self, cfg: Any, window: Any) -> str:
        """A cache window with sinks on a model whose layers have windows of their own
        (Gemma's local layers): what a local layer then sees (the sinks still within its
        window, then its recent keys) is no one span the kernels take."""
        if window is not None and window.sink and cfg.window_count > 1:
            return (
                "our attention kernels keep no sinks on a model with local layers: use a "
                "cache window without sinks (sink 0), or the torch kernels "
                f"({triton_support.ENV}=torch)"
            )
        return ""

    def workspace_bytes_per_token(
        self, cfg: ModelConfig, dtype: torch.dtype, max_batch: int, chunk_tokens: int
    ) -> int:
        """None: the kernels read K and V through the block tables, in place (a step's tables
        are int32 a block, its split-K partials bounded by the batch, not the context)."""
        return 0


class TritonContext(PoolContext):
    """One step's attention through our Triton kernels: the step's :class:`BlockTables`, built
    once for every layer; K/V written into the pool (by the fused RoPE + K/V write where it
    runs), then read in place."""

    def __init__(self, cache: PagedKVCache, chunks: list[SeqChunk]) -> None:
        super().__init__(cache, chunks)
        self.tables = BlockTables(cache, chunks, self.num_decode)

    def kv_target(self, layer: int) -> tuple[Tensor, Tensor] | None:
        if self.cache.format.storage not in FUSED_WRITES:  # fp8: the step's store quantizes
            return None
        return self.cache.kv[layer], self.slots_of(layer)

    def attend(self, layer: int, q: Tensor, kv: Tensor) -> Tensor:
        pool = self.cache.kv[layer]
        kv_format.store(pool, self.slots_of(layer), kv)
        return self.tables.attend(q, pool, layer)

    def attend_stored(self, layer: int, q: Tensor) -> Tensor:
        return self.tables.attend(q, self.cache.kv[layer], layer)


def layer_span(cache: PagedKVCache, layer: int, sink: int, window: int) -> tuple[int, int]:
    """The ``(sink, window)`` the kernels take for ``layer`` under the step's cache window
    ``(sink, window)`` (0: none): narrowed to the layer's own window where it has one (a
    Gemma local layer's); sinks with one are refused before any step
    (:meth:`TritonBackend.window_refusal`)."""
    own = cache.layer_windows[layer]
    if own is None or own.window == window:
        return sink, window
    if window == 0:
        return 0, own.window
    if sink:
        raise ValueError("a cache window with sinks on a layer with a window of its own")
    return 0, min(window, own.window)


class BlockTables:
    """What our Triton kernels read for one step (:mod:`engine.kernels.triton_kernels`): each
    sequence's block table (``RELEASED`` where the cache window gave a block back), padded
    to the step's widest with ``RELEASED``; the decode sequences' lengths; the prefill
    chunks' query offsets and first positions; the step's one cache window. Built once per
    step for every layer, sent up in queued copies."""

    def __init__(self, cache: PagedKVCache, chunks: list[SeqChunk], num_decode: int) -> None:
        dev = cache.device
        self.cache = cache
        self.block_size = cache.block_size
        windows = {c.window if c.window is not None else cache.model_window for c in chunks}
        if len(windows) > 1:
            raise ValueError("the chunks of one step must share one cache window")
        (window,) = windows
        self.sink, self.window = (0, 0) if window is None else (window.sink, window.window)
        decode, prefill = chunks[:num_decode], chunks[num_decode:]
        groups = cache.groups
        #: each block group's decode and prefill tables (the local layers' where kept apart)
        self.decode: dict[KVGroup, Tensor] = {}
        self.prefill: dict[KVGroup, Tensor] = {}
        self.decode_lens = None
        if decode:
            self.decode = {g: block_tables(g.manager, decode, dev) for g in groups}
            self.decode_lens = upload([c.start + 1 for c in decode], dev, torch.int32)
        self.q_starts = self.first_positions = None
        self.max_query_len = max((c.length for c in prefill), default=0)
        if prefill:
            self.prefill = {g: block_tables(g.manager, prefill, dev) for g in groups}
            starts = [0]
            for c in prefill:
                starts.append(starts[-1] + c.length)
            self.q_starts = upload(starts, dev, torch.int32)
            self.first_positions = upload([c.start for c in prefill], dev, torch.int32)
        self.num_decode = num_decode

    def attend(self, q: Tensor, pool: Tensor, layer: int) -> Tensor:
        """The step's attention output ``[T, H·D]`` in ``layer`` (its K/V already in
        ``pool``)."""
        # imported where they run: Triton is not installed everywhere the engine is
        from engine.kernels.triton_kernels import decode_attention, prefill_attention

        sink, span = layer_span(self.cache, layer, self.sink, self.window)
        window: dict[str, Any] = {"block_size": self.block_size, "sink": sink, "window": span,
                                  "softcap": self.cache.softcap}  # fmt: skip
        n, group = self.num_decode, self.cache.layer_groups[layer]
        decoded = prefilled = None
        if self.decode:
            assert self.decode_lens is not None
            decoded = decode_attention.paged_decode_attention(
                q[:n], pool, self.decode[group], self.decode_lens, **window
            )
        if self.prefill:
            assert self.q_starts is not None and self.first_positions is not None
            prefilled = prefill_attention.paged_prefill_attention(
                q[n:], pool, self.prefill[group], self.q_starts, self.first_positions,
                max_query_len=self.max_query_len, **window,
            )  # fmt: skip
        if prefilled is None:
            assert decoded is not None
            return decoded
        return prefilled if decoded is None else torch.cat([decoded, prefilled])


class StaticContext(AttentionContext):
    """Attention of a static decode step: reads only the runner's buffers (for a bucket):
    each block group's write slots and block tables, and the rows' lengths."""

    def __init__(
        self, kv: PagedKVCache, slots: dict[KVGroup, Tensor], tables: dict[KVGroup, Tensor],
        lens: Tensor, window: tuple[int, int],
    ) -> None:  # fmt: skip
        self.cache, self.slots, self.tables, self.lens = kv, slots, tables, lens
        self.sink, self.window = window
        self.decode_only = True

    def kv_target(self, layer: int) -> tuple[Tensor, Tensor] | None:
        if self.cache.format.storage not in FUSED_WRITES:  # as TritonContext's
            return None
        return self.cache.kv[layer], self.slots[self.cache.layer_groups[layer]]

    def attend(self, layer: int, q: Tensor, kv: Tensor) -> Tensor:
        kv_format.store(self.cache.kv[layer], self.slots[self.cache.layer_groups[layer]], kv)
        return self.attend_stored(layer, q)

    def attend_stored(self, layer: int, q: Tensor) -> Tensor:
        from engine.kernels.triton_kernels import decode_attention

        pool = self.cache.kv[layer]
        sink, window = layer_span(self.cache, layer, self.sink, self.window)
        return decode_attention.paged_decode_attention(
            q, pool, self.tables[self.cache.layer_groups[layer]], self.lens,
            block_size=self.cache.block_size, sink=sink, window=window,
            softcap=self.cache.softcap,
        )  # fmt: skip
