"""The paged attention of the torch paths and the paged C kernel: one step's context over the
pool, and the backend that builds it.

Decode chunks (one token each) are attended together: their keys' slots are laid out in a
padded ``[B, Tmax]`` matrix (pad = the zero slot, masked out), which the paged C kernel reads
in place on a CPU (:mod:`engine.kernels.paged_decode`) and the torch path gathers
(:func:`engine.kernels.gather_attention.gather_attention`, one padded gather and one SDPA).
Longer chunks (prefill) are attended one sequence at a time: on a CPU through the paged
prefill kernel where it measured faster (it masks as it goes), else with a causal (and
window) mask and SDPA. The backend is ``c`` where the C kernel reads the pool, else ``torch``
(:meth:`PagedBackend.runs_on`: ``paged_decode.portable`` switches the kernel off).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from engine.attention.context import PoolContext
from engine.attention.ops import decode_attention, paged_decode_attention
from engine.hardware.transfer import to_device, upload
from engine.kernels import native, paged_decode
from engine.kv_cache.paged import PagedKVCache, SeqChunk
from engine.kv_cache.window import CacheWindow, _one_window, _visible
from engine.model.attention import (
    AttentionBackend,
    AttentionContext,
    DecodeTables,
    capped_attention,
    capped_decode_attention,
    grouped_attention,
)
from engine.model.config import ModelConfig

#: a slot's or a position's index (int64)
SLOT_BYTES = 8
#: what building a decode step's context holds at once per token of a row (its slot and
#: position, its mask row, the padded copies): measured (tests/test_attention_workspace.py)
DECODE_ROWS_BYTES = 24


def negates_mask(device: torch.device) -> bool:
    """Whether SDPA on ``device`` may hold the boolean mask negated beside the additive mask
    it makes of it: not on a CPU (measured: tests/test_attention_workspace.py); counted on a
    GPU, whose allocator is not measured here (a byte a query of the group, conservative)."""
    return device.type != "cpu"


class PagedBackend(AttentionBackend):
    """The torch paths, with the paged C kernels wherever they read the pool (a CPU pool of
    a dtype they take). Any head size and dtype; not graph-safe (its slot rows change shape
    every step)."""

    name = "torch"
    graph_safe = False

    def __init__(self, device: torch.device | str = "cpu", *, measure: bool = True) -> None:
        self.device = torch.device(device)
        #: whether its terms may build the C kernel and time the prefill paths (a load's);
        #: a plan's (False) assumes the portable prefill, and the kernel where a C compiler is
        self.measure = measure

    def context(self, cache: Any, chunks: list[Any]) -> AttentionContext:
        return PagedContext(cache, chunks)

    def refusal(self, cfg: Any, dtype: torch.dtype, device: torch.device) -> str:
        return ""

    def runs_on(self, pool: Tensor) -> str:
        return "c" if paged_decode.reads_pool(pool) else "torch"

    def kernel(self, dtype: torch.dtype) -> bool:
        """Whether the paged C kernels attend for a pool of ``dtype`` on this device."""
        if self.device.type != "cpu" or dtype not in paged_decode.DTYPES:
            return False
        if not self.measure:  # a plan builds nothing
            return paged_decode.requested() != "gather" and native.compiler() is not None
        return paged_decode.kernel().available

    def workspace_bytes_per_token(
        self, cfg: ModelConfig, dtype: torch.dtype, max_batch: int, chunk_tokens: int
    ) -> int:
        """The larger of a decode step's (:meth:`decode_bytes_per_token`) and a prefill
        chunk's (:meth:`prefill_bytes_per_token`)."""
        return max(
            self.decode_bytes_per_token(cfg, dtype, max_batch),
            self.prefill_bytes_per_token(cfg, dtype, chunk_tokens),
        )

    def decode_bytes_per_token(self, cfg: ModelConfig, dtype: torch.dtype, max_batch: int) -> int:
        """A decode step of ``max_batch`` rows, the larger of its context's construction (each
        row's slots and positions, its mask row, their padded copies: :data:`DECODE_ROWS_BYTES`)
        and its attention: each row's slot (int64) and additive mask element, and where the
        torch path gathers (the C kernel reads the pool in place) the token's K and V."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        gathered = 0 if self.kernel(dtype) else 2 * cfg.num_kv_heads * cfg.head_dim * itemsize
        if cfg.attn_softcap is not None:  # the textbook path (capped_decode_attention)
            gathered = _capped_bytes(cfg, itemsize, 1)
        # a step keeps an additive mask per window its layers attend under (Gemma's two)
        masks = (cfg.window_count - 1) * itemsize
        return max_batch * (max(DECODE_ROWS_BYTES, gathered + itemsize + SLOT_BYTES) + masks)

    def prefill_bytes_per_token(self, cfg: ModelConfig, dtype: torch.dtype, chunk: int) -> int:
        """A prefill chunk of ``chunk`` queries: its keys' slots and positions (int64); through
        the paged C prefill kernel (where it measured faster) nothing more, as it masks as it
        goes; on the portable path the token's K and V gathered, and its mask column: the
        boolean mask, its copy repeated over the query group, and SDPA's additive mask made of
        it in the compute dtype."""
        chunk = min(chunk, cfg.max_position_embeddings)
        if cfg.attn_softcap is not None:  # the textbook path, a chunk's scores at once
            itemsize = torch.empty((), dtype=dtype).element_size()
            return SLOT_BYTES + _capped_bytes(cfg, itemsize, max(1, chunk))
        heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        measured = chunk and self.measure and self.kernel(dtype)
        if measured and paged_decode.prefill_faster(dtype, *heads):
            return 2 * SLOT_BYTES
        itemsize = torch.empty((), dtype=dtype).element_size()
        row = 2 * cfg.num_kv_heads * cfg.head_dim * itemsize
        group = cfg.num_heads // cfg.num_kv_heads
        negated = int(negates_mask(self.device))
        # the boolean mask is kept a step for each window the layers attend under
        return SLOT_BYTES + row + chunk * (cfg.window_count + group * (1 + negated + itemsize))


def _capped_bytes(cfg: ModelConfig, itemsize: int, queries: int) -> int:
    """Per token of context, what soft-capped attention of ``queries`` queries holds at once:
    the token's K and V gathered and repeated over the query heads; per query its scores,
    their cap and fp32 softmax, and a mask per window the layers attend under."""
    heads, kv = cfg.num_heads, cfg.num_kv_heads
    per_query = heads * (2 * itemsize + 4) + cfg.window_count
    return (2 * kv + 2 * heads) * cfg.head_dim * itemsize + queries * per_query


class PagedContext(PoolContext):
    """Index tensors for one step, built once and shared by every layer.

    Decode chunks (one token each) are attended together: their keys are gathered into a
    padded ``[B, Tmax]`` slot matrix (pad = the zero slot, masked out). Longer chunks
    (prefill) are attended one sequence at a time: on a CPU through the paged prefill kernel
    (:func:`engine.kernels.paged_decode.paged_prefill`, which masks as it goes), else with a
    causal (and window) mask. What the masks hold depends on the layer's window
    (:attr:`PagedKVCache.layer_windows`: Gemma's local layers see less than its global
    ones): one :class:`_Masks` per window the layers have.
    """

    def __init__(self, cache: PagedKVCache, chunks: list[SeqChunk]) -> None:
        super().__init__(cache, chunks)
        mgr, dev = cache.manager, cache.device
        self.decode_slots: Tensor | None = None
        self.decode_lens: Tensor | None = None  # real (unpadded) columns of each slot row
        windows = list(dict.fromkeys(cache.layer_windows))
        mask_rows: dict[CacheWindow | None, list[Tensor]] = {w: [] for w in windows}
        self._lens: list[int] = []
        if self.num_decode:
            slot_rows = []
            for c in chunks[: self.num_decode]:
                positions, slots = mgr.held(c.seq_id, c.start + 1)
                slot_rows.append(slots)
                for w in windows:
                    mask_rows[w].append(
                        _visible(c.window, w, positions, torch.tensor([c.start]))[0]
                    )
            self._lens = [len(r) for r in slot_rows]
            self.decode_slots = to_device(
                pad_sequence(slot_rows, batch_first=True, padding_value=cache.pad_slot), dev
            )
            self.decode_lens = upload(self._lens, dev)
        held = [mgr.held(c.seq_id, c.start + c.length) for c in chunks[self.num_decode :]]
        pool = cache.kv[0]
        self._kernel = (
            len(chunks) > self.num_decode
            and cache.softcap is None  # the kernel does not cap scores
            and paged_decode.reads_pool(pool)
            and paged_decode.prefill_faster(pool.dtype, cache.heads, cache.kv_heads, pool.shape[2])
        )
        built = {w: self._build(w, mask_rows[w], held) for w in windows}
        #: each layer's masks (a list indexed by the layer: what a compiled step reads)
        self._masks = [built[w] for w in cache.layer_windows]
        first = self._masks[0]
        # the first layer's, for what reads one set (the C decode step: the models it runs
        # have one window)
        self.decode_mask, self.mask_needed, self.prefill = (
            first.decode_mask, first.mask_needed, first.prefill
        )  # fmt: skip

    def _build(
        self, model_window: CacheWindow | None, mask_rows: list[Tensor],
        held: list[tuple[Tensor, Tensor]],
    ) -> _Masks:  # fmt: skip
        """The masks of the layers whose own window is ``model_window``, from the decode
        rows' boolean masks under it and each prefill chunk's held positions and slots."""
        chunks, dev = self.chunks, self.cache.device
        decode_mask, mask_needed = None, False
        if self.num_decode:
            mask = pad_sequence(mask_rows, batch_first=True, padding_value=False)
            # Additive (0 / -inf, what SDPA makes of a boolean mask in every call), built once
            # per step for every layer. Eager steps leave it out where every key is visible
            # by construction (rows of one length, no window: a decode query sees every key
            # its sequence holds), decided from lengths alone, as a GPU step must not read
            # a tensor back; a compiled step always passes it, so that one graph serves both.
            additive = torch.zeros(mask.shape, dtype=self.cache.kv[0].dtype)
            additive.masked_fill_(~mask, float("-inf"))
            decode_mask = to_device(additive[:, None, None, :], dev)
            windowed = model_window is not None or any(
                c.window is not None for c in chunks[: self.num_decode]
            )
            mask_needed = windowed or min(self._lens) != max(self._lens)
        #: each prefill chunk: its query offset, and what the kernel or SDPA reads (None: a
        #: whole prompt, causal over its own keys)
        prefill: list[tuple[int, int, _Prefill | Tensor | None, Tensor]] = []
        offset = self.num_decode
        for c, (positions, slots) in zip(chunks[self.num_decode :], held, strict=True):
            one, window = _one_window(c.window, model_window)
            if self._kernel and one:
                sink, width = (0, 0) if window is None else (window.sink, window.window)
                # the kernel masks as it goes: what it needs is the keys' positions
                read: _Prefill | Tensor | None = _Prefill(positions, c.start, sink, width)
            elif one and window is None and c.start == 0:
                read = None  # a whole prompt over its own keys: causal, no mask to build
            else:
                queries = torch.arange(c.start, c.start + c.length)
                read = to_device(_visible(c.window, model_window, positions, queries), dev)
            prefill.append((offset, c.length, read, to_device(slots, dev)))
            offset += c.length
        return _Masks(decode_mask, mask_needed, prefill)

    def decode_tables(self) -> DecodeTables | None:
        if not self.decode_only:
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
        """The pool and slots where a fused RoPE + K/V write stores this step's K/V (our C
        one); None in a compiled step, which stores them through its attention op."""
        if torch.compiler.is_compiling():
            return None
        return self.cache.kv[layer], self.write_slots

    def attend_stored(self, layer: int, q: Tensor) -> Tensor:
        return self._attend_pool(q, self.cache.kv[layer], layer)

    def attend(self, layer: int, q: Tensor, kv: Tensor) -> Tensor:
        pool = self.cache.kv[layer]
        if self.decode_only:
            assert self.decode_slots is not None
            assert self.decode_lens is not None
            if torch.compiler.is_compiling() and self.cache.softcap is None:  # one opaque op
                return paged_decode_attention(
                    q, kv, pool, self.write_slots, self.decode_slots, self.decode_lens,
                    self._masks[layer].decode_mask,
                )  # fmt: skip
        pool.index_copy_(0, self.write_slots, kv)
        return self._attend_pool(q, pool, layer)

    def _attend_pool(self, q: Tensor, pool: Tensor, layer: int) -> Tensor:
        """The step's attention on the torch and C paths, its K/V already in ``pool``."""
        masks = self._masks[layer]
        cap = self.cache.softcap
        if cap is not None:
            return self._capped(q, pool, masks, cap)
        if self.decode_only:
            assert self.decode_slots is not None
            assert self.decode_lens is not None
            mask = masks.decode_mask if masks.mask_needed else None
            return decode_attention(q, pool, self.decode_slots, self.decode_lens, mask)
        tokens, heads, dim = q.shape
        kv_heads = self.cache.kv_heads
        out = q.new_empty(tokens, heads * dim)
        if self.decode_slots is not None:
            assert self.decode_lens is not None
            mask = masks.decode_mask if masks.mask_needed else None
            out[: self.num_decode] = decode_attention(
                q[: self.num_decode], pool, self.decode_slots, self.decode_lens, mask
            )
        for offset, length, read, slots in masks.prefill:
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

    def _capped(self, q: Tensor, pool: Tensor, masks: _Masks, cap: float) -> Tensor:
        """The step's attention with soft-capped scores (Gemma 2), on the torch path."""
        tokens, heads, dim = q.shape
        kv_heads = self.cache.kv_heads
        out = q.new_empty(tokens, heads * dim)
        if self.decode_slots is not None:
            mask = masks.decode_mask if masks.mask_needed else None
            out[: self.num_decode] = capped_decode_attention(
                q[: self.num_decode], pool, self.decode_slots, mask, cap
            )
        for offset, length, read, slots in masks.prefill:
            assert not isinstance(read, _Prefill)  # no kernel path under a cap
            rows = pool.index_select(0, slots).transpose(0, 1)  # [2·Hkv, T, D]
            out[offset : offset + length] = capped_attention(
                q[offset : offset + length], rows[:kv_heads], rows[kv_heads:], read, cap
            )
        return out


@dataclass(frozen=True, slots=True)
class _Masks:
    """What a step's layers of one window read: the decode rows' additive mask
    ``[B, 1, 1, W]`` (None without decode rows), whether an eager step needs it, and each
    prefill chunk's query offset, length, read (:class:`_Prefill`, a boolean mask, or None:
    causal over its own keys) and slots."""

    decode_mask: Tensor | None
    mask_needed: bool
    prefill: list[tuple[int, int, _Prefill | Tensor | None, Tensor]]


@dataclass(frozen=True, slots=True)
class _Prefill:
    """A prefill chunk as the paged prefill kernel reads it: its keys' positions, its first
    query's, and the one cache window over it (``window == 0``: none)."""

    positions: Tensor
    start: int
    sink: int
    window: int
