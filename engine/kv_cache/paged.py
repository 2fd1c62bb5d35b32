"""The paged KV cache: the block pool's tensors and the block manager that shares them out.

The pool holds, for each layer, K and V for ``num_blocks × block_size`` token slots
(``[slots, kv_heads, head_dim]``, token-major), allocated once when the engine starts. Which
blocks hold which sequence's tokens is the :class:`~engine.kv_cache.block_manager.BlockManager`'s
bookkeeping; :class:`PagedKVCache` owns the tensors, and its attention backend
(:mod:`engine.attention`) builds each step's :class:`~engine.model.attention.AttentionContext`
over them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine.formats.kv import KVFormat, float_format
from engine.hardware.transfer import upload
from engine.kv_cache.block_manager import RELEASED, BlockManager
from engine.kv_cache.layered import LayeredBlockManager
from engine.kv_cache.window import CacheWindow
from engine.model.attention import AttentionBackend, AttentionContext
from engine.model.config import ModelConfig


@dataclass(frozen=True, eq=False)
class KVGroup:
    """Layers whose blocks one manager shares out: its tables address their tensors, whose
    last slot (``pad_slot``) stays zero and pads gathers."""

    manager: BlockManager
    pad_slot: int


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
    write and gathering a sequence's is one read; in ``kv_format`` (:mod:`engine.formats.kv`:
    the compute dtype by default, or int8 / fp8 rows each followed by its scale, written
    through :func:`~engine.formats.kv.store`). The extra last slot stays zero and pads
    gathers. With ``local_blocks``, a
    model's local layers (Gemma's sliding ones) get a pool of that many blocks of their own,
    shared out by the full layers' manager's partner (:mod:`engine.kv_cache.layered`)."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        prefix_caching: bool = True,
        attention: AttentionBackend,
        local_blocks: int | None = None,
        kv_format: KVFormat | None = None,
    ) -> None:
        window = cfg.local_window if cfg.local_layers else None
        if window is None or local_blocks is None:
            self.manager = BlockManager(num_blocks, block_size, prefix_caching=prefix_caching)
        else:
            self.manager = LayeredBlockManager(
                num_blocks, block_size, local_blocks=local_blocks, local_window=window,
                prefix_caching=prefix_caching,
            )  # fmt: skip
        #: what each step's attention runs on, and what builds its context
        #: (:mod:`engine.attention`: the engine's load chooses it)
        self.attention = attention
        self.block_size = block_size
        #: the model's own sliding window, masked in every step whatever its chunks ask
        self.model_window = (
            None if cfg.sliding_window is None else CacheWindow(0, cfg.sliding_window)
        )
        #: attention scores soft-capped (Gemma 2's ``attn_logit_softcapping``); None: not
        self.softcap = cfg.attn_softcap
        #: each layer's own window, masked in its attention: the model's, or a local layer's
        #: (Gemma's sliding layers, whose keys stay held for its global ones)
        self.layer_windows: list[CacheWindow | None] = [
            self.model_window if w is None else CacheWindow(0, w)
            for w in map(cfg.layer_window, range(cfg.num_layers))
        ]
        full = KVGroup(self.manager, num_blocks * block_size)
        groups = [full]
        if isinstance(self.manager, LayeredBlockManager):
            groups.append(KVGroup(self.manager.local, self.manager.local.num_blocks * block_size))
        #: the block groups: the full layers', then the local layers' where kept apart
        self.groups = groups
        #: each layer's blocks: the full layers', or a local layer's own where they are kept
        #: apart (:mod:`engine.kv_cache.layered`)
        self.layer_groups = [
            groups[-1] if i in cfg.local_layers else full for i in range(cfg.num_layers)
        ]
        self.pad_slot = full.pad_slot
        self.heads = cfg.num_heads
        self.kv_heads = heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        #: the dtype the model computes in (what attention returns)
        self.dtype = dtype
        #: what a slot holds (:mod:`engine.formats.kv`): the compute dtype's floats by default
        self.format = kv_format or float_format(dtype)
        # Uninitialised: a slot is read only after it was written, except the pad slot, which
        # masked gathers read and which must hold zeros (0 × garbage may be NaN).
        self.kv = [
            self.format.empty(g.pad_slot + 1, heads, cfg.head_dim, device)
            for g in self.layer_groups
        ]
        self.device = torch.device(device)

    @staticmethod
    def bytes_per_block(
        cfg: ModelConfig, block_size: int, kv: torch.dtype | KVFormat, layers: int | None = None
    ) -> int:
        """A block's bytes over ``layers`` layers (default: every layer) in a pool of format
        ``kv`` (a dtype: its float pool)."""
        fmt = kv if isinstance(kv, KVFormat) else float_format(kv)
        layers = cfg.num_layers if layers is None else layers
        return 2 * layers * block_size * cfg.num_kv_heads * fmt.bytes_per_head(cfg.head_dim)

    @property
    def backend(self) -> str:
        """The name of the attention backend this pool's steps run on now, by the names of the
        executors' compatibility table (:mod:`engine.executor.table`)."""
        return self.attention.runs_on(self.kv[0])

    @property
    def triton(self) -> bool:
        """Whether steps attend through our Triton kernels (block tables, in place)."""
        return self.attention.name == "triton"

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv)

    def context(self, chunks: list[SeqChunk]) -> AttentionContext:
        """Per-step context, built once for every layer by the attention backend. Chunks of
        one token (decode) must come first, in one run."""
        return self.attention.context(self, chunks)


def block_tables(mgr: BlockManager, chunks: list[SeqChunk], device: torch.device) -> Tensor:
    """The block tables of ``chunks``' sequences, ``[len(chunks), widest]`` int32, padded with
    ``RELEASED``."""
    rows = [mgr.tables[c.seq_id] for c in chunks]
    width = max(len(r) for r in rows)
    flat = [b for r in rows for b in (*r, *[RELEASED] * (width - len(r)))]
    return upload(flat, device, torch.int32).view(len(rows), width)
