"""What every backend's step context over the paged pool holds, built once per step: the
cache, the step's chunks as given (what a tensor-parallel step tells its other ranks), where
their new K/V go, and how many decode chunks (one token each) lead the step."""

from __future__ import annotations

import torch
from torch import Tensor

from engine.hardware.transfer import upload
from engine.kv_cache.paged import KVGroup, PagedKVCache, SeqChunk
from engine.model.attention import AttentionContext

#: the pools the fused RoPE + K/V writes (C, Triton) store into: floats and int8 rows (an fp8
#: pool's rows are quantized in the step's own store)
FUSED_WRITES = (torch.float32, torch.float16, torch.bfloat16, torch.int8)


class PoolContext(AttentionContext):
    """The part of a step's context every paged backend shares (the module's docstring)."""

    def __init__(self, cache: PagedKVCache, chunks: list[SeqChunk]) -> None:
        self.cache = cache
        self.chunks = chunks
        #: where each block group's layers store the step's new K/V
        self.group_slots: dict[KVGroup, Tensor] = {}
        for group in cache.groups:
            write: list[int] = []
            for c in chunks:
                write += group.manager.slots(c.seq_id, c.start, c.start + c.length)
            self.group_slots[group] = upload(write, cache.device)
        self.write_slots = self.group_slots[cache.groups[0]]  # the full layers'
        num_decode = 0
        while num_decode < len(chunks) and chunks[num_decode].length == 1:
            num_decode += 1
        if any(c.length == 1 for c in chunks[num_decode:]):
            raise ValueError("decode chunks must come first in a step")
        self.num_decode = num_decode
        self.decode_only = num_decode == len(chunks)

    def lanes(self) -> tuple[AttentionContext, AttentionContext, int] | None:
        """A decode step of two or more rows as two: its first half's chunks and the rest's,
        each a context of this backend's."""
        if not self.decode_only or len(self.chunks) < 2:
            return None
        n = len(self.chunks) // 2
        return self.cache.context(self.chunks[:n]), self.cache.context(self.chunks[n:]), n

    def slots_of(self, layer: int) -> Tensor:
        """Where ``layer`` stores the step's new K/V (its block group's slots)."""
        return self.group_slots[self.cache.layer_groups[layer]]
