"""KV cache storage: the paged block pool and its block manager.

The pool holds, for each layer, K and V for ``num_blocks × block_size`` token slots
(``[slots, kv_heads, head_dim]``, token-major), allocated once when the engine starts. A
sequence owns a *block table*: the list of blocks that hold its tokens, in order. Token ``p``
of a sequence lives in slot ``table[p // block_size] * block_size + p % block_size``.

The :class:`BlockManager` hands out blocks (free list), grows a table when a sequence crosses a
block boundary, frees tables on finish / cancel / preemption, and, for the *cache window*,
releases blocks that fell wholly between the ``sink`` first tokens and the last ``window``
tokens. It only does bookkeeping; :class:`PagedKVCache` owns the tensors and builds the
per-step :class:`~engine.attention.AttentionContext`.

A model with a sliding window of its own (Mistral's ``sliding_window``: query ``p`` sees keys
``> p - W``) is a hard limit under any cache window: both caches mask every key older than it,
whatever window a step asks for, and :func:`effective_window` is the window the engine runs
(and releases blocks) under.

:class:`ContiguousKVCache` (one contiguous buffer per sequence) is kept as the simplest possible
cache, for tests and for scoring a single long text.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from engine import paged_attention
from engine.attention import AttentionContext, grouped_attention, sequence_attention
from engine.config import ModelConfig
from engine.errors import InvalidRequestError

RELEASED = -1  # table entry of a block given back by the cache window


@dataclass(frozen=True, slots=True)
class CacheWindow:
    """Keep the ``sink`` first tokens and the last ``window`` tokens of each sequence."""

    sink: int = 4
    window: int = 256

    def __post_init__(self) -> None:
        if self.sink < 0 or self.window < 1:
            raise ValueError("cache window needs sink >= 0 and window >= 1")

    def visible(self, key_pos: Tensor, query_pos: Tensor) -> Tensor:
        """Mask ``[Q, K]``: key visible to query (causal, sink or within the window)."""
        causal = key_pos[None, :] <= query_pos[:, None]
        recent = key_pos[None, :] > query_pos[:, None] - self.window
        return causal & ((key_pos[None, :] < self.sink) | recent)


def effective_window(user: CacheWindow | None, sliding_window: int | None) -> CacheWindow | None:
    """The cache window a model with ``sliding_window`` (None: none) runs under when its user
    asks for ``user``: the user's, which must lie within the model's (no sink: a Mistral never
    sees its first tokens again; at most ``sliding_window`` recent tokens), or, with none, the
    model's own, ``CacheWindow(sink=0, window=sliding_window)``."""
    if sliding_window is None:
        return user
    if user is None:
        return CacheWindow(sink=0, window=sliding_window)
    if user.sink or user.window > sliding_window:
        raise InvalidRequestError(
            f"this model attends to its last {sliding_window} tokens only (its sliding window); "
            f"a cache window can only narrow that: use sink 0 and a window of at most "
            f"{sliding_window} tokens (not sink {user.sink}, window {user.window}), or none"
        )
    return user


@dataclass(frozen=True, slots=True)
class Occupancy:
    total_blocks: int
    used_blocks: int
    tokens_stored: int  # live tokens held in used blocks
    waste_slots: int  # reserved slots holding no live token

    @property
    def usage(self) -> float:
        return self.used_blocks / self.total_blocks if self.total_blocks else 0.0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV pool needs at least one block of at least one token")
        self.num_blocks = num_blocks
        #: blocks that may be in use at once (<= num_blocks): the KV-pool limit a user can
        #: lower on a live engine (the tuner's slider) without reallocating the tensors
        self.capacity = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self.tables: dict[str, list[int]] = {}
        self.lengths: dict[str, int] = {}  # tokens whose slots exist (stored or being written)
        self._released_tokens: dict[str, int] = {}

    # -- questions ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can still be handed out under :attr:`capacity`."""
        return max(0, len(self._free) - (self.num_blocks - self.capacity))

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def set_capacity(self, blocks: int) -> None:
        """Let at most ``blocks`` blocks be in use. Lowering it below what is in use takes
        nothing away: the scheduler preempts as sequences try to grow."""
        if not 1 <= blocks <= self.num_blocks:
            raise ValueError(f"the KV pool capacity must be in [1, {self.num_blocks}] blocks")
        self.capacity = blocks

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def blocks_needed(self, seq_id: str, new_length: int) -> int:
        """Blocks to allocate so that ``seq_id`` has slots for ``new_length`` tokens."""
        have = len(self.tables.get(seq_id, ()))
        return max(0, self.blocks_for(new_length) - have)

    def can_grow(self, seq_id: str, new_length: int) -> bool:
        return self.blocks_needed(seq_id, new_length) <= self.num_free

    # -- changes -----------------------------------------------------------------------------
    def grow(self, seq_id: str, new_length: int) -> None:
        """Give ``seq_id`` slots for tokens ``[0, new_length)`` (allocates on admission too)."""
        needed = self.blocks_needed(seq_id, new_length)
        if needed > self.num_free:
            raise MemoryError(f"KV pool exhausted: {seq_id} needs {needed} more block(s)")
        table = self.tables.setdefault(seq_id, [])
        table.extend(self._free.popleft() for _ in range(needed))
        self.lengths[seq_id] = max(self.lengths.get(seq_id, 0), new_length)

    def free(self, seq_id: str) -> int:
        """Return every block of ``seq_id`` to the pool (finish, cancel, preemption)."""
        table = self.tables.pop(seq_id, [])
        self.lengths.pop(seq_id, None)
        self._released_tokens.pop(seq_id, None)
        blocks = [b for b in table if b != RELEASED]
        self._free.extend(blocks)
        return len(blocks)

    def release_outside_window(self, seq_id: str, window: CacheWindow) -> int:
        """Free the blocks of ``seq_id`` lying wholly after the sink and before the window."""
        table = self.tables.get(seq_id)
        if not table:
            return 0
        length, bs = self.lengths[seq_id], self.block_size
        released = 0
        for index, block in enumerate(table):
            start, end = index * bs, (index + 1) * bs
            if block != RELEASED and start >= window.sink and end <= length - window.window:
                table[index] = RELEASED
                self._free.append(block)
                released += 1
        if released:
            self._released_tokens[seq_id] = self._released_tokens.get(seq_id, 0) + released * bs
        return released

    # -- reading -----------------------------------------------------------------------------
    def slots(self, seq_id: str, start: int, end: int) -> list[int]:
        """Slot ids of positions ``[start, end)`` of ``seq_id`` (all must be held)."""
        table, bs = self.tables[seq_id], self.block_size
        out = []
        for pos in range(start, end):
            block = table[pos // bs]
            if block == RELEASED:
                raise KeyError(f"position {pos} of {seq_id} was released by the cache window")
            out.append(block * bs + pos % bs)
        return out

    def held(self, seq_id: str, end: int) -> tuple[Tensor, Tensor]:
        """``(positions, slots)`` of the held positions ``< end`` of ``seq_id``."""
        bs = self.block_size
        table = torch.tensor(self.tables[seq_id], dtype=torch.long)
        positions = torch.arange(end)
        blocks = table[positions // bs]
        keep = blocks != RELEASED
        return positions[keep], (blocks * bs + positions % bs)[keep]

    def owners(self) -> list[str | None]:
        """The owner of each block of the pool (``None`` = free): what the app's block map draws."""
        out: list[str | None] = [None] * self.num_blocks
        for seq_id, table in self.tables.items():
            for block in table:
                if block != RELEASED:
                    out[block] = seq_id
        return out

    def occupancy(self) -> Occupancy:
        used = self.num_used
        stored = 0
        for seq_id, table in self.tables.items():
            held = sum(1 for b in table if b != RELEASED) * self.block_size
            partial = len(table) * self.block_size - self.lengths[seq_id]  # tail of last block
            stored += held - partial
        return Occupancy(self.capacity, used, stored, used * self.block_size - stored)


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """``length`` new tokens of sequence ``seq_id`` at positions ``start …`` in this step."""

    seq_id: str
    start: int
    length: int
    window: CacheWindow | None = None


class PagedKVCache:
    """The KV pool tensors and the block manager that shares them out.

    Each layer's pool is one ``[num_blocks*block_size + 1, 2·kv_heads, head_dim]`` tensor: a
    slot holds the token's K heads, then its V heads, so that storing a step's K/V is one
    write and gathering a sequence's is one read. ``k[layer]`` and ``v[layer]`` are views of
    the two halves. The extra last slot stays zero and pads gathers."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.manager = BlockManager(num_blocks, block_size)
        self.block_size = block_size
        #: the model's own sliding window, masked in every step whatever its chunks ask
        self.model_window = (
            None if cfg.sliding_window is None else CacheWindow(0, cfg.sliding_window)
        )
        slots = num_blocks * block_size + 1
        self.pad_slot = slots - 1
        self.kv_heads = heads = cfg.num_kv_heads
        shape = (slots, 2 * heads, cfg.head_dim)
        # Uninitialised: a slot is read only after it was written, except the pad slot, which
        # masked gathers read and which must hold zeros (0 × garbage may be NaN).
        self.kv = [torch.empty(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        for t in self.kv:
            t[self.pad_slot].zero_()
        self.k = [t[:, :heads] for t in self.kv]
        self.v = [t[:, heads:] for t in self.kv]
        self.device = torch.device(device)

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * itemsize

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv)

    def context(self, chunks: list[SeqChunk]) -> AttentionContext:
        """Per-step context. Chunks of one token (decode) must come first, in one run."""
        return _PagedContext(self, chunks)


class _PagedContext(AttentionContext):
    """Index tensors for one step, built once and shared by every layer.

    Decode chunks (one token each) are attended together: their keys are gathered into a
    padded ``[B, Tmax]`` slot matrix (pad = the zero slot, masked out). Longer chunks
    (prefill) are attended one sequence at a time with a causal mask.
    """

    def __init__(self, cache: PagedKVCache, chunks: list[SeqChunk]) -> None:
        self.cache = cache
        mgr, dev = cache.manager, cache.device
        write: list[int] = []
        for c in chunks:
            write += mgr.slots(c.seq_id, c.start, c.start + c.length)
        self.write_slots = torch.tensor(write, dtype=torch.long, device=dev)

        self.num_decode = 0
        while self.num_decode < len(chunks) and chunks[self.num_decode].length == 1:
            self.num_decode += 1
        if any(c.length == 1 for c in chunks[self.num_decode :]):
            raise ValueError("decode chunks must come first in a step")
        self.decode_slots: Tensor | None = None
        self.decode_lens: Tensor | None = None  # real (unpadded) columns of each slot row
        self.decode_mask: Tensor | None = None
        self.mask_needed = False
        if self.num_decode:
            slot_rows, mask_rows = [], []
            for c in chunks[: self.num_decode]:
                positions, slots = mgr.held(c.seq_id, c.start + 1)
                slot_rows.append(slots)
                mask_rows.append(
                    _visible(c, cache.model_window, positions, torch.tensor([c.start]))[0]
                )
            self.decode_slots = pad_sequence(
                slot_rows, batch_first=True, padding_value=cache.pad_slot
            ).to(dev)
            self.decode_lens = torch.tensor([len(r) for r in slot_rows], device=dev)
            mask = pad_sequence(mask_rows, batch_first=True, padding_value=False)
            # Additive (0 / -inf, what SDPA makes of a boolean mask in every call), built once
            # per step for every layer. Eager steps leave it out where every key is visible
            # (one sequence, no cache window); a compiled step always passes it, so that one
            # graph serves both cases.
            additive = torch.zeros(mask.shape, dtype=cache.kv[0].dtype)
            additive.masked_fill_(~mask, float("-inf"))
            self.decode_mask = additive[:, None, None, :].to(dev)
            self.mask_needed = not bool(mask.all())
        self.decode_only = self.num_decode == len(chunks)
        self.prefill: list[tuple[int, int, Tensor, Tensor]] = []  # (offset, length, slots, mask)
        offset = self.num_decode
        for c in chunks[self.num_decode :]:
            positions, slots = mgr.held(c.seq_id, c.start + c.length)
            queries = torch.arange(c.start, c.start + c.length)
            mask = _visible(c, cache.model_window, positions, queries)
            self.prefill.append((offset, c.length, slots.to(dev), mask.to(dev)))
            offset += c.length

    def attend(self, layer: int, q: Tensor, kv: Tensor) -> Tensor:
        pool = self.cache.kv[layer]
        tokens, heads, dim = q.shape
        kv_heads = self.cache.kv_heads
        if self.decode_only:
            assert self.decode_slots is not None
            assert self.decode_lens is not None
            if torch.compiler.is_compiling():  # one opaque op in a compiled decode step
                return paged_decode_attention(
                    q, kv, pool, self.write_slots, self.decode_slots, self.decode_lens,
                    self.decode_mask,
                )  # fmt: skip
            mask = self.decode_mask if self.mask_needed else None
            return _paged_decode_attention(
                q, kv, pool, self.write_slots, self.decode_slots, self.decode_lens, mask
            )
        pool.index_copy_(0, self.write_slots, kv)
        out = q.new_empty(tokens, heads * dim)
        if self.decode_slots is not None:
            assert self.decode_lens is not None
            mask = self.decode_mask if self.mask_needed else None
            out[: self.num_decode] = _decode_attention(
                q[: self.num_decode], pool, self.decode_slots, self.decode_lens, mask
            )
        for offset, length, slots, mask in self.prefill:
            rows = pool.index_select(0, slots).transpose(0, 1)  # [2·Hkv, T, D]
            out[offset : offset + length] = grouped_attention(
                q[offset : offset + length], rows[:kv_heads], rows[kv_heads:], mask
            )
        return out


def _decode_attention(
    q: Tensor, pool: Tensor, slots: Tensor, lens: Tensor, mask: Tensor | None
) -> Tensor:
    """One query per sequence (``q: [B, H, D]``) over the keys in the first ``lens[b]``
    columns of its row of ``slots: [B, W]`` (``mask: [B, 1, 1, W]``, additive, or None).
    Returns ``[B, H·D]``. On CPU the paged kernel reads K/V straight from the pool
    (:mod:`engine.paged_attention`); elsewhere, or where it is not available, one padded
    gather and one SDPA."""
    if paged_attention.usable(q, pool):
        return paged_attention.paged_attention(q, pool, slots, lens, mask)
    return _gather_attention(q, pool, slots, mask)


def _gather_attention(q: Tensor, pool: Tensor, slots: Tensor, mask: Tensor | None) -> Tensor:
    """The portable decode attention: one padded gather from ``pool``, one SDPA."""
    b, width = slots.shape
    _, heads, dim = q.shape
    kv_heads = pool.shape[1] // 2
    rows = pool.index_select(0, slots.view(-1))
    rows = rows.view(b, width, 2 * kv_heads, dim).transpose(1, 2)  # [B, 2·Hkv, W, D]
    att = torch.nn.functional.scaled_dot_product_attention(
        q.view(b, kv_heads, heads // kv_heads, dim),
        rows[:, :kv_heads],
        rows[:, kv_heads:],
        attn_mask=mask,
    )
    return att.reshape(b, heads * dim)


# The decode step's attention as one op of its own, so that a compiled graph calls it as an
# opaque kernel (TorchInductor never sees the pool's layout). Declared with the plain
# ``torch.library`` API: ``custom_op`` costs ~20 µs more per call for an op that mutates.
_LIB = torch.library.Library("infersight", "FRAGMENT")  # type: ignore[no-untyped-call]
_LIB.define(  # type: ignore[no-untyped-call]
    "paged_decode_attention(Tensor q, Tensor kv, Tensor(a!) pool, Tensor write_slots, "
    "Tensor slots, Tensor lens, Tensor? mask) -> Tensor"
)


def _paged_decode_attention(
    q: Tensor,
    kv: Tensor,
    pool: Tensor,
    write_slots: Tensor,
    slots: Tensor,
    lens: Tensor,
    mask: Tensor | None,
) -> Tensor:
    """Store ``kv`` at ``write_slots`` of ``pool``, then :func:`_decode_attention`."""
    pool.index_copy_(0, write_slots, kv)
    return _decode_attention(q, pool, slots, lens, mask)


_LIB.impl(  # type: ignore[no-untyped-call]
    "paged_decode_attention", _paged_decode_attention, "CompositeExplicitAutograd"
)


@torch.library.register_fake("infersight::paged_decode_attention", lib=_LIB)  # type: ignore[untyped-decorator]
def _(
    q: Tensor,
    kv: Tensor,
    pool: Tensor,
    write_slots: Tensor,
    slots: Tensor,
    lens: Tensor,
    mask: Tensor | None,
) -> Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


paged_decode_attention = torch.ops.infersight.paged_decode_attention


def _visible(
    chunk: SeqChunk, model_window: CacheWindow | None, key_pos: Tensor, query_pos: Tensor
) -> Tensor:
    """Mask ``[Q, K]``: causal, within the chunk's cache window and the model's own."""
    if chunk.window is None:
        mask = key_pos[None, :] <= query_pos[:, None]
    else:
        mask = chunk.window.visible(key_pos, query_pos)
    if model_window is not None and model_window != chunk.window:
        mask &= model_window.visible(key_pos, query_pos)
    return mask


class ContiguousKVCache:
    """One contiguous ``[kv_heads, capacity, head_dim]`` buffer per slot and layer: the
    simplest cache, for tests and single-sequence scoring. It keeps every token; attention
    honours the model's sliding window."""

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
        self.sliding_window = cfg.sliding_window
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
        k, v = kv.chunk(2, dim=1)
        window = self.cache.sliding_window
        outputs = []
        offset = 0
        for slot, start, length in zip(self.slots, self.starts, self.lengths, strict=True):
            end = start + length
            k_buf[slot, :, start:end] = k[offset : offset + length].transpose(0, 1)
            v_buf[slot, :, start:end] = v[offset : offset + length].transpose(0, 1)
            keys, values = k_buf[slot, :, :end], v_buf[slot, :, :end]
            outputs.append(
                sequence_attention(q[offset : offset + length], keys, values, start, window)
            )
            offset += length
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
