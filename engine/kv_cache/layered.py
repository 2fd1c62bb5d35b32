"""A KV pool per layer kind: the local layers' blocks kept apart from the full layers', so that
a sliding layer holds only its window.

Gemma's local layers see their last ``local_window`` keys (1024 tokens on Gemma 3, 4096 on
Gemma 2), its global layers every key. One block table for both would keep a local layer's
K/V for the whole context; with its own blocks (vLLM's "hybrid allocator" keeps a group of
blocks per kind of attention the same way), a local layer gives back the blocks that fell out
of its window as the sequence moves on, and at 32k tokens of context Gemma 3's five local
layers in six hold 1k tokens each where they held 32k.

:class:`LayeredBlockManager` is the full layers' :class:`BlockManager` (what the pool's
figures, the app's block map and every read are about) with the local layers' beside it
(:attr:`~LayeredBlockManager.local`): every change applies to both, a sequence fits only
where it fits in both, and a cached prefix is one both still hold (the local one needs only
its window's blocks at the prefix's end). How many blocks the local layers get
(:func:`local_pool_blocks`): as many bytes as the full layers' pool, within what one sequence
and what the whole running set hold in their windows. The two pools do not lend each other
blocks (vLLM's pages, shared by groups of as many layers, do): many short sequences find
the local pool full first, one long one the full pool.
"""

from __future__ import annotations

from engine.kv_cache.block_manager import BlockManager, TokenReader
from engine.kv_cache.window import CacheWindow


class LayeredHit(list[int]):
    """A cached prefix in both groups: the full layers' blocks (the list) and the local
    layers' (:attr:`local`), as long."""

    def __init__(self, full: list[int], local: list[int]) -> None:
        super().__init__(full)
        assert len(full) == len(local)
        self.local = local


def local_pool_blocks(
    window: int, block_size: int, num_blocks: int, *, max_batch: int, step_tokens: int,
    layers: tuple[int, int], sink: int = 0,
) -> int:  # fmt: skip
    """Blocks the local layers' pool gets beside ``num_blocks`` for the full layers
    (``layers``: how many full and local layers there are): as many bytes as the full layers'
    pool, so that a long context is not spent on windows, but at least what one sequence
    holds in a ``window`` with a step's ``step_tokens`` (prompt chunks and draft tokens: the
    scheduler's budget for both), and at most what ``max_batch`` running sequences hold at
    once; never more than the full layers' blocks (a local block holds a token that a full
    block holds too). Each sequence holds its window's blocks, one more where the window
    straddles a boundary, the block being written and one where the step's tokens straddle
    another, and the blocks of ``sink`` tokens a cache window keeps within it)."""
    per_seq = -(-window // block_size) + 3 + -(-sink // block_size)
    step = -(-step_tokens // block_size)
    full, local = layers
    same_bytes = -(-num_blocks * full // local)
    return min(num_blocks, max_batch * per_seq + step, max(per_seq + step, same_bytes))


def local_window_under(cache_window: CacheWindow | None, local_window: int) -> CacheWindow:
    """The window the local layers keep under the engine's ``cache_window``: their own, or
    what the cache window leaves of it (its sinks while they are within the local window,
    which are released only with the sequence)."""
    if cache_window is None or cache_window.window >= local_window:
        return CacheWindow(0, local_window)
    return CacheWindow(cache_window.sink, cache_window.window)


class LayeredBlockManager(BlockManager):
    """The full layers' block manager, with the local layers' (:attr:`local`) beside it."""

    def __init__(
        self, num_blocks: int, block_size: int, *, local_blocks: int, local_window: int,
        prefix_caching: bool = True,
    ) -> None:  # fmt: skip
        super().__init__(num_blocks, block_size, prefix_caching=prefix_caching)
        #: the local layers' blocks, released as they fall out of their window
        self.local = BlockManager(local_blocks, block_size, prefix_caching=prefix_caching)
        self.local_window = local_window
        self.local.set_window(CacheWindow(0, local_window))

    # -- settings ----------------------------------------------------------------------------
    def set_window(self, window: CacheWindow | None) -> None:
        """The cache window of both groups (the local layers' within their own). A local
        block's K/V depend on the full layers below it too: where the full layers' window
        changes, the local layers' keys go with theirs."""
        before = self.window
        super().set_window(window)
        self.local.set_window(local_window_under(window, self.local_window))
        if window != before:
            self.local.forget_keys()

    def chunk_limit(self) -> int:
        """The most tokens one sequence may compute in a step: what the local layers' pool
        holds beside its window (with its sinks), so that a sequence alone always
        progresses, however the step's budget is raised on a live engine (the pool was
        sized at load)."""
        assert self.local.window is not None
        return self._beside(self.local.window)

    def _beside(self, kept: CacheWindow) -> int:
        """Tokens of a chunk the local pool holds beside one sequence's window ``kept``: its
        window's blocks, one where the window straddles a boundary, the block being written,
        one where the chunk straddles another, and the sinks' blocks."""
        rest = self.blocks_for(kept.window) + 3 + self.blocks_for(kept.sink)
        return (self.local.num_blocks - rest) * self.block_size

    def one_sequence_refusal(self, window: CacheWindow | None) -> str:
        """Why the local layers' pool could not hold one sequence under the cache ``window``
        (its sinks too many blocks for the pool sized at load); "" where it can."""
        if self._beside(local_window_under(window, self.local_window)) >= 1:
            return ""
        return (
            f"the local layers' KV pool holds {self.local.num_blocks} blocks, too few for one "
            "sequence's window and sinks under this cache window: choose fewer sinks, or "
            "resize the pool (its local layers get their share when it is made)"
        )

    # -- prefix cache ------------------------------------------------------------------------
    def cached_prefix(
        self, seq_id: str, num_tokens: int, read: TokenReader, limit: int | None = None
    ) -> list[int]:
        """The longest prefix both groups hold (each lookup bounded by the other's)."""
        full = super().cached_prefix(seq_id, num_tokens, read, limit)
        local = self.local.cached_prefix(seq_id, num_tokens, read, len(full))
        while len(local) < len(full):
            full = super().cached_prefix(seq_id, num_tokens, read, len(local))
            local = self.local.cached_prefix(seq_id, num_tokens, read, len(full))
        return LayeredHit(full, local)

    def commit(self, seq_id: str, computed: int, read: TokenReader) -> None:
        super().commit(seq_id, computed, read)
        self.local.commit(seq_id, computed, read)

    # -- changes -----------------------------------------------------------------------------
    def admit(self, seq_id: str, hit: list[int], num_tokens: int, *, first: bool = True) -> int:
        cached = super().admit(seq_id, hit, num_tokens, first=first)
        self.local.admit(seq_id, _local(hit), num_tokens, first=False)
        return cached

    def admits(self, hit: list[int], first: int, whole: int, reserve: int | None) -> bool:
        """Where the full layers admit it and the local layers hold its first chunk: they
        never hold more of a sequence than its window and a chunk, which their pool always
        holds for one sequence (:meth:`chunk_limit`); where it is smaller than the running
        set's windows, a sequence that cannot grow there is preempted as in the full
        layers' pool."""
        return super().admits(hit, first, whole, reserve) and self.local.admits(
            _local(hit), first, first, None
        )

    def can_grow(self, seq_id: str, new_length: int) -> bool:
        return super().can_grow(seq_id, new_length) and self.local.can_grow(seq_id, new_length)

    def grow(self, seq_id: str, new_length: int) -> None:
        if not self.local.can_grow(seq_id, new_length):
            raise MemoryError(f"KV pool of the local layers exhausted: {seq_id} cannot grow")
        super().grow(seq_id, new_length)
        self.local.grow(seq_id, new_length)

    def free(self, seq_id: str, *, keep_keys: bool = False) -> int:
        self.local.free(seq_id, keep_keys=keep_keys)
        return super().free(seq_id, keep_keys=keep_keys)

    def truncate(self, seq_id: str, length: int) -> int:
        self.local.truncate(seq_id, length)
        return super().truncate(seq_id, length)

    def release_outside_window(self, seq_id: str, window: CacheWindow | None) -> int:
        """The full layers' blocks outside ``window``, and the local layers' outside theirs."""
        self.local.release_outside_window(seq_id, self.local.window)
        return super().release_outside_window(seq_id, window)


def _local(hit: list[int]) -> list[int]:
    """The local layers' part of a hit (none: nothing was cached)."""
    if isinstance(hit, LayeredHit):
        return hit.local
    assert not hit, "a hit for a layered pool comes from its cached_prefix"
    return []
