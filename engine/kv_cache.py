"""KV cache storage.

:class:`ContiguousKVCache` keeps, for each layer, one buffer per sequence slot of
``[kv_heads, capacity, head_dim]`` for K and for V, allocated once. It is the simple cache the
engine core needs for one conversation; the paged block pool (block tables, sliding window)
replaces it behind the same :class:`~engine.attention.AttentionContext` seam.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine.attention import AttentionContext, sequence_attention
from engine.config import ModelConfig


class ContiguousKVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        *,
        slots: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        if slots <= 0 or capacity <= 0:
            raise ValueError("a KV cache needs at least one slot and a positive capacity")
        shape = (slots, cfg.num_kv_heads, capacity, cfg.head_dim)
        self.capacity = capacity
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def context(self, slots: list[int], starts: list[int], lengths: list[int]) -> AttentionContext:
        """Context for one forward over ``lengths[i]`` new tokens of the sequence in ``slots[i]``,
        whose first new token sits at position ``starts[i]``."""
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

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        k_buf, v_buf = self.cache.k[layer], self.cache.v[layer]
        outputs = []
        offset = 0
        for slot, start, length in zip(self.slots, self.starts, self.lengths, strict=True):
            end = start + length
            k_buf[slot, :, start:end] = k[offset : offset + length].transpose(0, 1)
            v_buf[slot, :, start:end] = v[offset : offset + length].transpose(0, 1)
            outputs.append(
                sequence_attention(
                    q[offset : offset + length], k_buf[slot, :, :end], v_buf[slot, :, :end], start
                )
            )
            offset += length
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
