"""The contiguous KV cache: one buffer per sequence, the simplest possible cache, kept for tests
and for scoring a single long text."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine.formats import kv as kv_format
from engine.formats.kv import KVFormat
from engine.kernels import paged_decode
from engine.kv_cache.window import CacheWindow, _visible
from engine.model.attention import AttentionContext, capped_attention, sequence_attention
from engine.model.config import ModelConfig


class ContiguousKVCache:
    """One contiguous ``[kv_heads, capacity, head_dim]`` buffer per slot and layer: the
    simplest cache, for tests and single-sequence scoring. It keeps every token; attention
    honours the model's sliding window. With a quantized ``kv_format`` it holds what a pool of
    that format would hand back (each row quantized and dequantized as it is stored), so that
    scoring measures the format's cost."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        slots: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        kv_format: KVFormat | None = None,
    ) -> None:
        if slots <= 0 or capacity <= 0:
            raise ValueError("a KV cache needs at least one slot and a positive capacity")
        shape = (slots, cfg.num_kv_heads, capacity, cfg.head_dim)
        self.capacity = capacity
        self.sliding_window = cfg.sliding_window
        self.softcap = cfg.attn_softcap
        #: each layer's window: the model's, or a local layer's own (Gemma's)
        self.layer_windows = [
            cfg.layer_window(i) or cfg.sliding_window for i in range(cfg.num_layers)
        ]
        #: a quantized pool's format whose round trip K/V take as they are stored (they read
        #: back as the paged pool would hand them back); None: kept as computed
        self.quantized = kv_format if kv_format is not None and kv_format.quantized else None
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def context(self, slots: list[int], starts: list[int], lengths: list[int]) -> AttentionContext:
        for start, length in zip(starts, lengths, strict=True):
            if start + length > self.capacity:
                raise ValueError(
                    f"sequence of {start + length} tokens exceeds the KV cache capacity "
                    f"of {self.capacity}"
                )
        return _ContiguousContext(self, slots, starts, lengths)


@dataclass(slots=True)
class _ContiguousContext(AttentionContext):
    cache: ContiguousKVCache
    slots: list[int]
    starts: list[int]
    lengths: list[int]

    def attend(self, layer: int, q: Tensor, kv: Tensor) -> Tensor:
        k_buf, v_buf = self.cache.k[layer], self.cache.v[layer]
        if self.cache.quantized is not None:
            kv = kv_format.dequantize(kv_format.quantize(kv, self.cache.quantized), kv.dtype)
        k, v = kv.chunk(2, dim=1)
        window = self.cache.layer_windows[layer]
        outputs = []
        offset = 0
        for slot, start, length in zip(self.slots, self.starts, self.lengths, strict=True):
            end = start + length
            k_buf[slot, :, start:end] = k[offset : offset + length].transpose(0, 1)
            v_buf[slot, :, start:end] = v[offset : offset + length].transpose(0, 1)
            keys, values = k_buf[slot, :, :end], v_buf[slot, :, :end]
            chunk = q[offset : offset + length]
            if self.cache.softcap is not None:  # scores soft-capped (Gemma 2)
                limit = None if window is None else CacheWindow(0, window)
                queries = torch.arange(start, end, device=q.device)
                visible = _visible(None, limit, torch.arange(end, device=q.device), queries)
                outputs.append(capped_attention(chunk, keys, values, visible, self.cache.softcap))
            elif paged_decode.reads_pool(k_buf):
                # The paged cache's prefill kernel, over this sequence's K/V laid out as a
                # pool: the same arithmetic as the engine's own steps, so that scoring a text
                # here and through the engine agree to the bit.
                pool = torch.cat((keys, values)).transpose(0, 1).contiguous()
                held = torch.arange(end, device=pool.device)
                outputs.append(
                    paged_decode.paged_prefill(chunk, pool, held, held, start, 0, window or 0)
                )
            else:
                outputs.append(sequence_attention(chunk, keys, values, start, window))
            offset += length
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
