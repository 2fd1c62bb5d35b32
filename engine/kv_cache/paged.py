"""The paged KV cache: the block pool's tensors and each step's attention over them.

The pool holds, for each layer, K and V for ``num_blocks × block_size`` token slots
(``[slots, kv_heads, head_dim]``, token-major), allocated once when the engine starts. Which
blocks hold which sequence's tokens is the :class:`~engine.kv_cache.block_manager.BlockManager`'s
bookkeeping; :class:`PagedKVCache` owns the tensors and builds the per-step
:class:`~engine.model.attention.AttentionContext`. Decode steps attend through
:mod:`engine.kernels.decode_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from engine.hardware.transfer import to_device, upload
from engine.kernels import paged_decode
from engine.kernels.decode_attention import (
    decode_attention,
    paged_decode_attention,
)
from engine.kv_cache.block_manager import RELEASED, BlockManager
from engine.kv_cache.window import CacheWindow, _one_window, _visible
from engine.model.attention import AttentionContext, DecodeTables, grouped_attention
from engine.model.config import ModelConfig


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
        prefix_caching: bool = True,
        triton: bool = False,
    ) -> None:
        self.manager = BlockManager(num_blocks, block_size, prefix_caching=prefix_caching)
        #: steps attend through our Triton kernels, reading K/V in place through the block
        #: tables (:mod:`engine.kernels.triton_support` decides where they run)
        self.triton = triton
        self.block_size = block_size
        #: the model's own sliding window, masked in every step whatever its chunks ask
        self.model_window = (
            None if cfg.sliding_window is None else CacheWindow(0, cfg.sliding_window)
        )
        slots = num_blocks * block_size + 1
        self.pad_slot = slots - 1
        self.heads = cfg.num_heads
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
    def backend(self) -> str:
        """The attention backend this pool's steps run on, by the names of the executors'
        compatibility table (:mod:`engine.executor.table`): ``triton`` (our kernels, through
        the block tables), ``c`` (the paged C kernel over a CPU pool of a dtype it reads;
        switched off inside ``paged_decode.portable``) or ``torch`` (a padded gather, then
        SDPA)."""
        if self.triton:
            return "triton"
        return "c" if paged_decode.reads_pool(self.kv[0]) else "torch"

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
    (prefill) are attended one sequence at a time: on a CPU through the paged prefill kernel
    (:func:`engine.kernels.paged_decode.paged_prefill`, which masks as it goes), else with a
    causal (and window) mask.
    """

    def __init__(self, cache: PagedKVCache, chunks: list[SeqChunk]) -> None:
        self.cache = cache
        #: the step's chunks, as given (what a tensor-parallel step tells its other ranks)
        self.chunks = chunks
        mgr, dev = cache.manager, cache.device
        write: list[int] = []
        for c in chunks:
            write += mgr.slots(c.seq_id, c.start, c.start + c.length)
        self.write_slots = upload(write, dev)

        self.num_decode = 0
        while self.num_decode < len(chunks) and chunks[self.num_decode].length == 1:
            self.num_decode += 1
        if any(c.length == 1 for c in chunks[self.num_decode :]):
            raise ValueError("decode chunks must come first in a step")
        self.decode_only = self.num_decode == len(chunks)
        #: the step's block tables and lengths, where the Triton kernels attend
        self.tables = _BlockTables(cache, chunks, self.num_decode) if cache.triton else None
        if self.tables is not None:
            return
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
                    _visible(c.window, cache.model_window, positions, torch.tensor([c.start]))[0]
                )
            lens = [len(r) for r in slot_rows]
            self.decode_slots = to_device(
                pad_sequence(slot_rows, batch_first=True, padding_value=cache.pad_slot), dev
            )
            self.decode_lens = upload(lens, dev)
            mask = pad_sequence(mask_rows, batch_first=True, padding_value=False)
            # Additive (0 / -inf, what SDPA makes of a boolean mask in every call), built once
            # per step for every layer. Eager steps leave it out where every key is visible
            # by construction (rows of one length, no window: a decode query sees every key
            # its sequence holds), decided from lengths alone, as a GPU step must not read
            # a tensor back; a compiled step always passes it, so that one graph serves both.
            additive = torch.zeros(mask.shape, dtype=cache.kv[0].dtype)
            additive.masked_fill_(~mask, float("-inf"))
            self.decode_mask = to_device(additive[:, None, None, :], dev)
            windowed = cache.model_window is not None or any(
                c.window is not None for c in chunks[: self.num_decode]
            )
            self.mask_needed = windowed or min(lens) != max(lens)
        #: each prefill chunk: its query offset, and what the kernel or SDPA reads (None: a
        #: whole prompt, causal over its own keys)
        self.prefill: list[tuple[int, int, _Prefill | Tensor | None, Tensor]] = []
        offset = self.num_decode
        pool = cache.kv[0]
        kernel = (
            len(chunks) > self.num_decode
            and paged_decode.reads_pool(pool)
            and paged_decode.prefill_faster(pool.dtype, cache.heads, cache.kv_heads, pool.shape[2])
        )
        for c in chunks[self.num_decode :]:
            positions, slots = mgr.held(c.seq_id, c.start + c.length)
            one, window = _one_window(c.window, cache.model_window)
            if kernel and one:
                sink, width = (0, 0) if window is None else (window.sink, window.window)
                # the kernel masks as it goes: what it needs is the keys' positions
                read: _Prefill | Tensor | None = _Prefill(positions, c.start, sink, width)
            elif one and window is None and c.start == 0:
                read = None  # a whole prompt over its own keys: causal, no mask to build
            else:
                queries = torch.arange(c.start, c.start + c.length)
                read = to_device(_visible(c.window, cache.model_window, positions, queries), dev)
            self.prefill.append((offset, c.length, read, to_device(slots, dev)))
            offset += c.length

    def decode_tables(self) -> DecodeTables | None:
        if not self.decode_only or self.tables is not None:
            return None
        if not paged_decode.reads_pool(self.cache.kv[0]):
            return None
        assert self.decode_slots is not None and self.decode_lens is not None
        mask = None
        if self.mask_needed:
            assert self.decode_mask is not None
            mask = self.decode_mask.reshape(self.num_decode, -1).float().contiguous()
        return DecodeTables(
            self.cache, self.cache.kv, self.write_slots, self.decode_slots.contiguous(),
            self.decode_lens, mask,
        )  # fmt: skip

    def kv_target(self, layer: int) -> tuple[Tensor, Tensor] | None:
        """The pool and slots where a fused RoPE + K/V write stores this step's K/V (our
        Triton kernels' or our C one's); None in a compiled step, which stores them through
        its attention op."""
        if self.tables is None and torch.compiler.is_compiling():
            return None
        return self.cache.kv[layer], self.write_slots

    def attend_stored(self, layer: int, q: Tensor) -> Tensor:
        pool = self.cache.kv[layer]
        if self.tables is not None:
            return self.tables.attend(q, pool)
        return self._attend_pool(q, pool)

    def attend(self, layer: int, q: Tensor, kv: Tensor) -> Tensor:
        pool = self.cache.kv[layer]
        if self.tables is not None:
            pool.index_copy_(0, self.write_slots, kv)
            return self.tables.attend(q, pool)
        if self.decode_only:
            assert self.decode_slots is not None
            assert self.decode_lens is not None
            if torch.compiler.is_compiling():  # one opaque op in a compiled decode step
                return paged_decode_attention(
                    q, kv, pool, self.write_slots, self.decode_slots, self.decode_lens,
                    self.decode_mask,
                )  # fmt: skip
        pool.index_copy_(0, self.write_slots, kv)
        return self._attend_pool(q, pool)

    def _attend_pool(self, q: Tensor, pool: Tensor) -> Tensor:
        """The step's attention on the torch and C paths, its K/V already in ``pool``."""
        if self.decode_only:
            assert self.decode_slots is not None
            assert self.decode_lens is not None
            mask = self.decode_mask if self.mask_needed else None
            return decode_attention(q, pool, self.decode_slots, self.decode_lens, mask)
        tokens, heads, dim = q.shape
        kv_heads = self.cache.kv_heads
        out = q.new_empty(tokens, heads * dim)
        if self.decode_slots is not None:
            assert self.decode_lens is not None
            mask = self.decode_mask if self.mask_needed else None
            out[: self.num_decode] = decode_attention(
                q[: self.num_decode], pool, self.decode_slots, self.decode_lens, mask
            )
        for offset, length, read, slots in self.prefill:
            chunk = q[offset : offset + length]
            if isinstance(read, _Prefill):
                out[offset : offset + length] = paged_decode.paged_prefill(
                    chunk, pool, slots, read.positions, read.start, read.sink, read.window
                )
                continue
            rows = pool.index_select(0, slots).transpose(0, 1)  # [2·Hkv, T, D]
            out[offset : offset + length] = grouped_attention(
                chunk, rows[:kv_heads], rows[kv_heads:], read, causal=read is None
            )
        return out


@dataclass(frozen=True, slots=True)
class _Prefill:
    """A prefill chunk as the paged prefill kernel reads it: its keys' positions, its first
    query's, and the one cache window over it (``window == 0``: none)."""

    positions: Tensor
    start: int
    sink: int
    window: int


class _BlockTables:
    """What our Triton kernels read for one step (:mod:`engine.kernels.triton_kernels`): each
    sequence's block table (``RELEASED`` where the cache window gave a block back), padded
    to the step's widest with ``RELEASED``; the decode sequences' lengths; the prefill
    chunks' query offsets and first positions; the step's one cache window. Built once per
    step for every layer, sent up in queued copies."""

    def __init__(self, cache: PagedKVCache, chunks: list[SeqChunk], num_decode: int) -> None:
        mgr, dev = cache.manager, cache.device
        self.block_size = cache.block_size
        windows = {c.window if c.window is not None else cache.model_window for c in chunks}
        if len(windows) > 1:
            raise ValueError("the chunks of one step must share one cache window")
        (window,) = windows
        self.sink, self.window = (0, 0) if window is None else (window.sink, window.window)
        decode, prefill = chunks[:num_decode], chunks[num_decode:]
        self.decode = self.decode_lens = None
        if decode:
            self.decode = block_tables(mgr, decode, dev)
            self.decode_lens = upload([c.start + 1 for c in decode], dev, torch.int32)
        self.prefill = self.q_starts = self.first_positions = None
        self.max_query_len = max((c.length for c in prefill), default=0)
        if prefill:
            self.prefill = block_tables(mgr, prefill, dev)
            starts = [0]
            for c in prefill:
                starts.append(starts[-1] + c.length)
            self.q_starts = upload(starts, dev, torch.int32)
            self.first_positions = upload([c.start for c in prefill], dev, torch.int32)
        self.num_decode = num_decode

    def attend(self, q: Tensor, pool: Tensor) -> Tensor:
        """The step's attention output ``[T, H·D]`` (its K/V already in ``pool``)."""
        from engine.kernels.triton_kernels.decode_attention import paged_decode_attention
        from engine.kernels.triton_kernels.prefill_attention import paged_prefill_attention

        window = {"block_size": self.block_size, "sink": self.sink, "window": self.window}
        n = self.num_decode
        decoded = prefilled = None
        if self.decode is not None:
            assert self.decode_lens is not None
            decoded = paged_decode_attention(q[:n], pool, self.decode, self.decode_lens, **window)
        if self.prefill is not None:
            assert self.q_starts is not None and self.first_positions is not None
            prefilled = paged_prefill_attention(
                q[n:], pool, self.prefill, self.q_starts, self.first_positions,
                max_query_len=self.max_query_len, **window,
            )  # fmt: skip
        if prefilled is None:
            assert decoded is not None
            return decoded
        return prefilled if decoded is None else torch.cat([decoded, prefilled])


def block_tables(mgr: BlockManager, chunks: list[SeqChunk], device: torch.device) -> Tensor:
    """The block tables of ``chunks``' sequences, ``[len(chunks), widest]`` int32, padded with
    ``RELEASED``."""
    rows = [mgr.tables[c.seq_id] for c in chunks]
    width = max(len(r) for r in rows)
    flat = [b for r in rows for b in (*r, *[RELEASED] * (width - len(r)))]
    return upload(flat, device, torch.int32).view(len(rows), width)
