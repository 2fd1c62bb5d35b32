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

from engine.attention.context import FUSED_WRITES, PoolContext
from engine.attention.ops import decode_attention, paged_decode_attention
from engine.formats import kv as kv_format
from engine.formats.kv import KVFormat
from engine.hardware.transfer import to_device, upload
from engine.kernels import native, paged_decode
from engine.kv_cache.paged import KVGroup, PagedKVCache, SeqChunk
from engine.kv_cache.window import CacheWindow, _one_window, _visible
from engine.model.attention import (
    AttentionBackend,
    AttentionContext,
    DecodeTables,
    capped_attention,
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

    def __init__(
        self, device: torch.device | str = "cpu", *, measure: bool = True,
        kv: KVFormat | None = None,
    ) -> None:  # fmt: skip
        self.device = torch.device(device)
        #: whether its terms may build the C kernel and time the prefill paths (a load's);
        #: a plan's (False) assumes the portable prefill, and the kernel where a C compiler is
        self.measure = measure
        #: the pool's format (None: the compute dtype's), whose rows a gather holds
        self.kv = kv

    def _row(self, cfg: ModelConfig, dtype: torch.dtype) -> int:
        """The bytes one head's row holds once gathered (:func:`kv_format.gathered_bytes`)."""
        fmt = self.kv or kv_format.float_format(dtype)
        return kv_format.gathered_bytes(fmt, cfg.head_dim, dtype)

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
        kernel = self.kernel(dtype)
        gathered = 0 if kernel else 2 * cfg.num_kv_heads * self._row(cfg, dtype)
        if cfg.attn_softcap is not None and not kernel:  # the textbook path (it caps)
            gathered = _capped_bytes(cfg, itemsize, 1, self._row(cfg, dtype))
        # a step keeps an additive mask per window its layers attend under (Gemma's two)
        masks = (cfg.window_count - 1) * itemsize
        return max_batch * (max(DECODE_ROWS_BYTES, gathered + itemsize + SLOT_BYTES) + masks)

    def prefill_bytes_per_token(self, cfg: ModelConfig, dtype: torch.dtype, chunk: int) -> int:
        """A prefill chunk of ``chunk`` queries: its keys' slots and positions (int64); through
        the paged C prefill kernel (where it measured faster, and always under a soft cap)
        nothing more, as it masks as it
        goes; on the portable path the token's K and V gathered, and its mask column: the
        boolean mask, its copy repeated over the query group, and SDPA's additive mask made of
        it in the compute dtype."""
        chunk = min(chunk, cfg.max_position_embeddings)
        heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        if cfg.attn_softcap is not None:  # the C kernel (it caps), else the textbook path
            if self.kernel(dtype):
                return 2 * SLOT_BYTES
            itemsize = torch.empty((), dtype=dtype).element_size()
            return SLOT_BYTES + _capped_bytes(cfg, itemsize, max(1, chunk), self._row(cfg, dtype))
        measured = chunk and self.measure and self.kernel(dtype)
        if measured and paged_decode.prefill_faster(dtype, *heads):
            return 2 * SLOT_BYTES
        itemsize = torch.empty((), dtype=dtype).element_size()
        row = 2 * cfg.num_kv_heads * self._row(cfg, dtype)
        group = cfg.num_heads // cfg.num_kv_heads
        negated = int(negates_mask(self.device))
        # the boolean mask is kept a step for each window the layers attend under
        return SLOT_BYTES + row + chunk * (cfg.window_count + group * (1 + negated + itemsize))


def _capped_bytes(cfg: ModelConfig, itemsize: int, queries: int, row: int) -> int:
    """Per token of context, what soft-capped attention of ``queries`` queries holds at once:
    the token's K and V gathered (``row`` bytes a head) and repeated over the query heads;
    per query its scores, their cap and fp32 softmax, and a mask per window the layers
    attend under."""
    heads, kv = cfg.num_heads, cfg.num_kv_heads
    per_query = heads * (2 * itemsize + 4) + cfg.window_count
    return 2 * kv * row + 2 * heads * cfg.head_dim * itemsize + queries * per_query


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
        pool = cache.kv[0]
        heads = (cache.heads, cache.kv_heads, cache.head_dim)
        self._kernel = (
            len(chunks) > self.num_decode
            and paged_decode.reads_pool(pool)
            # under a soft cap the kernel (which caps) beats the textbook path (which has no
            # flash kernel): taken without timing
            and (cache.softcap is not None or paged_decode.prefill_faster(cache.dtype, *heads))
        )
        # one set per block group and window the layers attend under (Gemma's two)
        layers = list(zip(cache.layer_groups, cache.layer_windows, strict=True))
        pairs = list(dict.fromkeys(layers))
        groups = [g for g, _ in pairs]
        #: the held positions and slots of the groups read under two windows, kept for the
        #: second (only then: they are the decode rows' largest temporaries)
        self._held: dict[tuple[KVGroup, str, int], tuple[Tensor, Tensor]] = {}
        self._shared = {g for g in groups if groups.count(g) > 1}
        built = {pair: self._build(*pair) for pair in pairs}
        self._held.clear()
        #: each layer's masks (a list indexed by the layer: what a compiled step reads)
        self._masks = [built[pair] for pair in layers]
        first = self._masks[cache.layer_groups.index(cache.groups[0])]
        # the first full layer's, for what reads one set (the C decode step: the models it
        # runs have one window and one block group)
        self.decode_slots, self.decode_lens = first.decode_slots, first.decode_lens
        self.decode_mask, self.mask_needed, self.prefill = (
            first.decode_mask, first.mask_needed, first.prefill
        )  # fmt: skip

    def _held_of(self, group: KVGroup, seq_id: str, end: int) -> tuple[Tensor, Tensor]:
        """``(positions, slots)`` of the held positions ``< end`` of ``seq_id`` in ``group``
        (once per step for every window its layers attend under)."""
        if group not in self._shared:
            return group.manager.held(seq_id, end)
        key = (group, seq_id, end)
        if key not in self._held:
            self._held[key] = group.manager.held(seq_id, end)
        return self._held[key]

    def _build(self, group: KVGroup, model_window: CacheWindow | None) -> _Masks:
        """What the layers of ``group`` whose own window is ``model_window`` read: the decode
        rows' slots and masks under it, and each prefill chunk's."""
        chunks, dev = self.chunks, self.cache.device
        decode_slots = decode_lens = decode_mask = None
        mask_needed = False
        if self.num_decode:
            slot_rows, mask_rows = [], []
            for c in chunks[: self.num_decode]:
                positions, slots = self._held_of(group, c.seq_id, c.start + 1)
                slot_rows.append(slots)
                mask_rows.append(
                    _visible(c.window, model_window, positions, torch.tensor([c.start]))[0]
                )
            lens = [len(r) for r in slot_rows]
            padded = pad_sequence(slot_rows, batch_first=True, padding_value=group.pad_slot)
            decode_slots, decode_lens = to_device(padded, dev), upload(lens, dev)
            mask = pad_sequence(mask_rows, batch_first=True, padding_value=False)
            # Additive (0 / -inf, what SDPA makes of a boolean mask in every call), built once
            # per step for every layer. Eager steps leave it out where every key is visible
            # by construction (rows of one length, no window: a decode query sees every key
            # its sequence holds), decided from lengths alone, as a GPU step must not read
            # a tensor back; a compiled step always passes it, so that one graph serves both.
            additive = torch.zeros(mask.shape, dtype=self.cache.dtype)
            additive.masked_fill_(~mask, float("-inf"))
            decode_mask = to_device(additive[:, None, None, :], dev)
            windowed = model_window is not None or any(
                c.window is not None for c in chunks[: self.num_decode]
            )
            mask_needed = windowed or min(lens) != max(lens)
        #: each prefill chunk: its query offset, and what the kernel or SDPA reads (None: a
        #: whole prompt, causal over its own keys)
        prefill: list[tuple[int, int, _Prefill | Tensor | None, Tensor]] = []
        offset = self.num_decode
        for c in chunks[self.num_decode :]:
            positions, slots = self._held_of(group, c.seq_id, c.start + c.length)
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
        return _Masks(decode_slots, decode_lens, decode_mask, mask_needed, prefill)

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
        one, or on a GPU our Triton one where an engine sharing the model set it); None in a
        compiled step, which stores them through its attention op, and for a pool the fused
        writes do not take (fp8 rows: they write floats and int8 rows)."""
        if torch.compiler.is_compiling() or self.cache.format.storage not in FUSED_WRITES:
            return None
        return self.cache.kv[layer], self.slots_of(layer)

    def attend_stored(self, layer: int, q: Tensor) -> Tensor:
        return self._attend_pool(q, self.cache.kv[layer], layer)

    def attend(self, layer: int, q: Tensor, kv: Tensor) -> Tensor:
        pool, masks = self.cache.kv[layer], self._masks[layer]
        if self.decode_only:
            assert masks.decode_slots is not None
            assert masks.decode_lens is not None
            if torch.compiler.is_compiling() and self.cache.softcap is None:  # one opaque op
                return paged_decode_attention(
                    q, kv, pool, self.slots_of(layer), masks.decode_slots, masks.decode_lens,
                    masks.decode_mask,
                )  # fmt: skip
        kv_format.store(pool, self.slots_of(layer), kv)
        return self._attend_pool(q, pool, layer)

    def _attend_pool(self, q: Tensor, pool: Tensor, layer: int) -> Tensor:
        """The step's attention on the torch and C paths, its K/V already in ``pool``; scores
        soft-capped where the model caps them (Gemma 2: in the C kernels, else the textbook
        computation, as SDPA has no cap)."""
        masks = self._masks[layer]
        cap = self.cache.softcap
        mask = masks.decode_mask if masks.mask_needed else None
        if self.decode_only:
            assert masks.decode_slots is not None
            assert masks.decode_lens is not None
            return decode_attention(q, pool, masks.decode_slots, masks.decode_lens, mask, cap)
        tokens, heads, dim = q.shape
        kv_heads = self.cache.kv_heads
        out = q.new_empty(tokens, heads * dim)
        if masks.decode_slots is not None:
            assert masks.decode_lens is not None
            out[: self.num_decode] = decode_attention(
                q[: self.num_decode], pool, masks.decode_slots, masks.decode_lens, mask, cap
            )
        for offset, length, read, slots in masks.prefill:
            chunk = q[offset : offset + length]
            if isinstance(read, _Prefill):
                out[offset : offset + length] = paged_decode.paged_prefill(
                    chunk, pool, slots, read.positions, read.start, read.sink, read.window,
                    cap or 0.0,
                )  # fmt: skip
                continue
            rows = kv_format.gather(pool, slots, q.dtype).transpose(0, 1)  # [2·Hkv, T, D]
            keys, values = rows[:kv_heads], rows[kv_heads:]
            if cap is not None:
                out[offset : offset + length] = capped_attention(chunk, keys, values, read, cap)
            else:
                out[offset : offset + length] = grouped_attention(
                    chunk, keys, values, read, causal=read is None
                )
        return out


@dataclass(frozen=True, slots=True)
class _Masks:
    """What a step's layers of one block group and window read: the decode rows' slots
    ``[B, W]`` (padded with the group's zero slot), their lengths and additive mask
    ``[B, 1, 1, W]`` (None without decode rows), whether an eager step needs it, and each
    prefill chunk's query offset, length, read (:class:`_Prefill`, a boolean mask, or None:
    causal over its own keys) and slots."""

    decode_slots: Tensor | None
    decode_lens: Tensor | None
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
