"""The block manager: which pool blocks each sequence's tokens live in, and which it shares.

A sequence owns a *block table*: the list of blocks that hold its tokens, in order. Token ``p``
of a sequence lives in slot ``table[p // block_size] * block_size + p % block_size``.

The :class:`BlockManager` hands out blocks, grows a table when a sequence crosses a block
boundary, frees tables on finish / cancel / preemption, and, for the *cache window*, releases
blocks that fell wholly between the ``sink`` first tokens and the last ``window`` tokens. It
also shares the full blocks of common prefixes between sequences (*prefix caching*: a chat's
earlier turns, a shared system prompt, n candidates of one prompt), reference-counted and kept
after their sequences end until the pool needs them. The model never knows: a shared block is
just an entry in two block tables. The manager only does bookkeeping; the tensors are
:class:`~engine.kv_cache.paged.PagedKVCache`'s.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.kv_cache.window import CacheWindow

RELEASED = -1  # table entry of a block given back by the cache window


@dataclass(frozen=True, slots=True)
class Occupancy:
    total_blocks: int
    used_blocks: int
    tokens_stored: int  # live tokens held in used blocks
    waste_slots: int  # reserved slots holding no live token
    cached_blocks: int = 0  # free blocks keeping a reusable prefix
    shared_blocks: int = 0  # blocks held by two or more sequences

    @property
    def usage(self) -> float:
        return self.used_blocks / self.total_blocks if self.total_blocks else 0.0


@dataclass(slots=True)
class PrefixStats:
    """What the prefix cache saved since the engine started."""

    query_tokens: int = 0  # tokens of the sequences admitted while caching was on
    hit_tokens: int = 0  # of those, tokens found in the cache (not computed)
    evicted_blocks: int = 0  # cached blocks taken for new tokens

    @property
    def hit_rate(self) -> float | None:
        return self.hit_tokens / self.query_tokens if self.query_tokens else None


#: ``read(start, end)``: the token ids of positions ``[start, end)`` of a sequence
TokenReader = Callable[[int, int], Sequence[int]]


def _root_key(context: bytes) -> bytes:
    return hashlib.sha256(b"infersight-kv-prefix\0" + context).digest()


def _block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """A block's key: its tokens and, through ``parent``, every token before them. SHA-256,
    so that no crafted prompt can collide with another's prefix (the server's case)."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class BlockManager:
    """Hands out the pool's blocks, and shares the full blocks of common prefixes.

    **Prefix caching** (vLLM's automatic prefix caching; DESIGN.md): a block whose
    ``block_size`` tokens are all computed gets a *key*, the SHA-256 of the key before it, its
    tokens and the engine's :attr:`context` (what else decides its K/V: the cache window), so a
    key names a block's tokens *and everything before them*. A new sequence whose first blocks
    have keys already in the cache starts with those blocks in its table (read-only, reference
    counted) and computes only the rest; at least its last token is always computed, since the
    step needs its logits, and a partial block is never shared: the tokens a sequence writes
    always land in blocks of its own.

    A block is in exactly one state: *held* (reference count > 0, by one sequence or shared),
    *cached* (held by none but holding a keyed block: free, reusable until evicted) or *empty*.
    New blocks come from the empty ones first, then from the cached ones, least recently freed
    first (LRU); a sequence's blocks are freed last block first, so a prefix's tail is evicted
    before its head, which every longer match needs.
    """

    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV pool needs at least one block of at least one token")
        self.num_blocks = num_blocks
        #: blocks that may be in use at once (<= num_blocks): the KV-pool limit a user can
        #: lower on a live engine (the tuner's slider) without reallocating the tensors
        self.capacity = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.stats = PrefixStats()
        self._empty: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # free but keyed, LRU first
        self._refs = [0] * num_blocks
        self._key_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self.tables: dict[str, list[int]] = {}
        self.lengths: dict[str, int] = {}  # tokens whose slots exist (stored or being written)
        self.window: CacheWindow | None = None
        self._context = b"full"
        self._root = _root_key(self._context)
        self._chains: dict[str, list[bytes]] = {}  # keys of each sequence's full blocks
        self._committed: dict[str, int] = {}  # leading blocks of each table already keyed
        self._unkeyable: set[str] = set()  # computed under another context: never shared
        self._salts: dict[str, bytes] = {}  # what else keys a sequence's blocks (LongRoPE's)

    # -- questions ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can still be handed out under :attr:`capacity` (cached ones included:
        they are evicted when needed)."""
        return max(0, len(self._empty) + len(self._cached) - (self.num_blocks - self.capacity))

    @property
    def num_used(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - len(self._empty) - len(self._cached)

    @property
    def num_cached(self) -> int:
        """Free blocks still holding a reusable prefix."""
        return len(self._cached)

    @property
    def num_shared(self) -> int:
        return sum(1 for r in self._refs if r > 1)

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

    def chunk_limit(self) -> int | None:
        """The most tokens one sequence may compute in a step where a pool of the manager's
        bounds it (:class:`~engine.kv_cache.layered.LayeredBlockManager`'s local layers');
        None: only the step's budget does."""
        return None

    def can_grow(self, seq_id: str, new_length: int) -> bool:
        return self.blocks_needed(seq_id, new_length) <= self.num_free

    # -- prefix cache ------------------------------------------------------------------------
    def set_window(self, window: CacheWindow | None) -> None:
        """The cache window every sequence runs under, which decides a block's K/V besides its
        tokens (the model, precision and pool are fixed per engine). A new window forgets
        every cached block, and the blocks the running sequences compute from now on are never
        shared: their earlier tokens were computed under the old one."""
        self.window = window
        encoded = b"full" if window is None else f"sink={window.sink},{window.window}".encode()
        if encoded == self._context:
            return
        self._context = encoded
        self._root = _root_key(encoded)
        self.forget_keys()

    def forget_keys(self) -> None:
        """Forget every cached block, and never share the blocks the running sequences
        compute from now on: their earlier tokens were computed under what changed."""
        self.clear_cache()
        self._chains.clear()
        self._unkeyable = set(self.tables)

    def set_prefix_caching(self, on: bool) -> None:
        """Turn sharing on or off; off forgets every cached block (for measuring without)."""
        if not on:
            self.clear_cache()
        self.prefix_caching = on

    def clear_cache(self) -> None:
        """Forget every key: cached blocks become empty; held blocks stay with their owners but
        are no longer found by new sequences."""
        self._empty.extend(self._cached)
        self._cached.clear()
        self._key_of.clear()
        self._block_of.clear()

    def cached_prefix(
        self, seq_id: str, num_tokens: int, read: TokenReader, limit: int | None = None
    ) -> list[int]:
        """The cached blocks holding the longest cached prefix of the ``num_tokens`` tokens of
        ``seq_id`` (``read(start, end)`` gives them), leaving at least the last token to
        compute, at most ``limit`` blocks. Under a cache window, a prefix needs only the blocks
        the window keeps at its end: those it leaves out may be gone (``RELEASED`` in the hit),
        which is what lets a sliding layer's short-lived blocks be found again. Nothing is
        taken: :meth:`admit` does that."""
        if not self.prefix_caching:
            return []
        most = (num_tokens - 1) // self.block_size
        found = []
        for key in self._keys(seq_id, most if limit is None else min(most, limit), read):
            found.append(self._block_of.get(key, RELEASED))
            if self.window is None and found[-1] == RELEASED:
                break
        blocks = self._longest_hit(found)
        length = blocks * self.block_size
        return [
            RELEASED if self._outside_window(i, length) else b for i, b in enumerate(found[:blocks])
        ]

    def _longest_hit(self, found: list[int]) -> int:
        """The most leading blocks of ``found`` (cached blocks, ``RELEASED`` where missing)
        that make a hit: every block the window keeps at the hit's end is there (in one pass:
        a hit of ``h`` blocks keeps its sink blocks and those from ``(h·bs − window) // bs``)."""
        w, bs = self.window, self.block_size
        runs, run = [], 0  # found blocks in a row, ending at each index
        for b in found:
            run = run + 1 if b != RELEASED else 0
            runs.append(run)
        lead = next((i for i, b in enumerate(found) if b == RELEASED), len(found))
        sink_blocks = 0 if w is None else -(-w.sink // bs)
        for h in range(len(found), 0, -1):
            tail = 0 if w is None else max(0, (h * bs - w.window) // bs)
            if lead >= min(sink_blocks, h) and runs[h - 1] >= h - tail:
                return h
        return 0

    def computing(self, seq_id: str, after: int, read: TokenReader, num_tokens: int) -> bool:
        """Whether the block of ``seq_id`` after its first ``after`` is being computed by a
        sequence that holds it now: waiting a step or two for it beats computing it twice
        (the n candidates of one prompt, requests sharing a system prompt)."""
        if not self.prefix_caching or (after + 1) * self.block_size >= num_tokens:
            return False
        key = self._keys(seq_id, after + 1, read)[after]
        return any(
            after < len(chain) and chain[after] == key and self._committed.get(other, 0) <= after
            for other, chain in self._chains.items()
            if other in self.tables and other not in self._unkeyable
        )

    def commit(self, seq_id: str, computed: int, read: TokenReader) -> None:
        """The first ``computed`` tokens of ``seq_id`` are in the cache: key its newly full
        blocks, so that later sequences find them. A block whose key is cached already (two
        sequences computed the same prefix at once) stays private to its sequence."""
        full = computed // self.block_size
        done = self._committed.get(seq_id, 0)
        if not self.prefix_caching or full <= done or seq_id in self._unkeyable:
            return
        table = self.tables[seq_id]
        for index, key in enumerate(self._keys(seq_id, full, read)[done:full], done):
            block = table[index]
            if block != RELEASED and key not in self._block_of:
                self._block_of[key] = block
                self._key_of[block] = key
        self._committed[seq_id] = full

    def set_salt(self, seq_id: str, salt: bytes) -> None:
        """Key the blocks of ``seq_id`` apart from other sequences' of the same tokens: its
        K/V differ from theirs (a LongRoPE sequence past the pretraining context, rotated by
        the long factors). Asked before its blocks are looked up or keyed."""
        if self._salts.get(seq_id) != salt:
            self._salts[seq_id] = salt
            self._chains.pop(seq_id, None)

    def _keys(self, seq_id: str, blocks: int, read: TokenReader) -> list[bytes]:
        """The keys of the first ``blocks`` full blocks of ``seq_id`` (computed once)."""
        chain = self._chains.setdefault(seq_id, [])
        bs = self.block_size
        salt = self._salts.get(seq_id)
        root = self._root if salt is None else _root_key(self._context + b"\0" + salt)
        for index in range(len(chain), blocks):
            parent = chain[-1] if chain else root
            chain.append(_block_key(parent, read(index * bs, (index + 1) * bs)))
        return chain[:blocks]

    # -- changes -----------------------------------------------------------------------------
    def admit(self, seq_id: str, hit: list[int], num_tokens: int, *, first: bool = True) -> int:
        """Start the table of ``seq_id`` with the cached blocks ``hit`` (from
        :meth:`cached_prefix`, just before); returns the tokens they hold, which need no
        computing. Under a cache window, the blocks of the hit that the window leaves out are
        not taken at all (:meth:`_outside_window`). ``num_tokens`` (the sequence's) feeds the
        hit rate on its ``first`` admission (not again after a preemption)."""
        if seq_id in self.tables:
            raise ValueError(f"{seq_id} already holds blocks")
        cached = len(hit) * self.block_size
        table = [RELEASED if self._outside_window(i, cached) else b for i, b in enumerate(hit)]
        for block in table:
            if block != RELEASED:
                self._hold(block)
        self.tables[seq_id] = table
        self.lengths[seq_id] = cached
        self._committed[seq_id] = len(hit)
        if self.prefix_caching and first:
            self.stats.query_tokens += num_tokens
            self.stats.hit_tokens += cached
        return cached

    def blocks_to_admit(self, hit: list[int], new_length: int) -> int:
        """Free blocks that admitting a sequence with ``hit`` for ``new_length`` tokens takes:
        its new blocks, and the cached blocks of the hit that no one holds and the window
        keeps (they leave the free pool)."""
        cached = len(hit) * self.block_size
        kept = (b for i, b in enumerate(hit) if not self._outside_window(i, cached))
        taken = sum(1 for b in kept if not self._refs[b])
        return self.blocks_for(new_length) - len(hit) + taken

    def admits(self, hit: list[int], first: int, whole: int, reserve: int | None) -> bool:
        """Whether a sequence with ``hit`` can be admitted: its ``first`` chunk's tokens fit
        now and, with ``reserve`` blocks kept free for the running sequences' growth (None:
        none runs), its ``whole`` length does (the scheduler's rule)."""
        if self.blocks_to_admit(hit, first) > self.num_free:
            return False
        return reserve is None or self.blocks_to_admit(hit, whole) + reserve <= self.num_free

    def _outside_window(self, index: int, length: int, window: CacheWindow | None = None) -> bool:
        """Block ``index`` of a sequence of ``length`` tokens lies wholly after the sink and
        before the last ``window.window`` tokens of ``window`` (default: :attr:`window`)."""
        w, bs = window or self.window, self.block_size
        return w is not None and index * bs >= w.sink and (index + 1) * bs <= length - w.window

    def grow(self, seq_id: str, new_length: int) -> None:
        """Give ``seq_id`` slots for tokens ``[0, new_length)`` (allocates on admission too)."""
        needed = self.blocks_needed(seq_id, new_length)
        if needed > self.num_free:
            raise MemoryError(f"KV pool exhausted: {seq_id} needs {needed} more block(s)")
        table = self.tables.setdefault(seq_id, [])
        table.extend(self._take() for _ in range(needed))
        self.lengths[seq_id] = max(self.lengths.get(seq_id, 0), new_length)

    def free(self, seq_id: str, *, keep_keys: bool = False) -> int:
        """Give back every block of ``seq_id`` (finish, cancel, preemption); returns how many.
        Keyed blocks stay cached. ``keep_keys``: the sequence comes back (preemption), so
        its block keys are kept for its next lookup."""
        table = self.tables.pop(seq_id, [])
        self.lengths.pop(seq_id, None)
        self._committed.pop(seq_id, None)
        self._unkeyable.discard(seq_id)
        if not keep_keys:
            self._chains.pop(seq_id, None)
            self._salts.pop(seq_id, None)
        blocks = [b for b in reversed(table) if b != RELEASED]
        for block in blocks:
            self._drop(block)
        return len(blocks)

    def truncate(self, seq_id: str, length: int) -> int:
        """Keep slots for the first ``length`` tokens of ``seq_id`` only, freeing the blocks
        past them (speculative decoding's rollback of rejected drafts); returns how many.
        Those blocks were written past what is computed, so none of them is keyed."""
        table = self.tables.get(seq_id)
        if table is None:
            return 0
        keep = self.blocks_for(length)
        freed = 0
        while len(table) > keep:
            block = table.pop()
            if block != RELEASED:
                assert block not in self._key_of, "a block past the computed tokens is keyed"
                self._drop(block)
                freed += 1
        self.lengths[seq_id] = min(self.lengths[seq_id], length)
        return freed

    def release_outside_window(self, seq_id: str, window: CacheWindow | None) -> int:
        """Free the blocks of ``seq_id`` lying wholly after the sink and before the window
        (None: none is released)."""
        table = self.tables.get(seq_id)
        if not table or window is None:
            return 0
        length = self.lengths[seq_id]
        released = 0
        for index, block in enumerate(table):
            if block != RELEASED and self._outside_window(index, length, window):
                table[index] = RELEASED
                self._drop(block)
                released += 1
        return released

    def _take(self) -> int:
        """An unheld block for a sequence to write: an empty one, else the LRU cached one."""
        if self._empty:
            block = self._empty.popleft()
        else:
            block, _ = self._cached.popitem(last=False)
            del self._block_of[self._key_of.pop(block)]
            self.stats.evicted_blocks += 1
        self._refs[block] = 1
        return block

    def _hold(self, block: int) -> None:
        if not self._refs[block]:
            del self._cached[block]
        self._refs[block] += 1

    def _drop(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block]:
            return
        if block in self._key_of:
            self._cached[block] = None
        else:
            self._empty.append(block)

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
        count = -(-end // bs)
        table = self.tables[seq_id][:count]
        offsets = torch.arange(bs)
        if RELEASED not in table:  # no gap: every position below ``end``
            slots = torch.tensor(table, dtype=torch.long)[:, None] * bs + offsets
            return torch.arange(end), slots.view(-1)[:end]
        # A cache window's released blocks are the gaps; the block holding ``end - 1`` is
        # never released. Whole kept blocks, the last one cut at ``end``, and no boolean
        # mask over positions (a decode step builds this for every sequence).
        kept = [i for i, block in enumerate(table) if block != RELEASED]
        first = torch.tensor(kept, dtype=torch.long)[:, None] * bs
        slot0 = torch.tensor([table[i] for i in kept], dtype=torch.long)[:, None] * bs
        size = len(kept) * bs - (count * bs - end)
        return (first + offsets).view(-1)[:size], (slot0 + offsets).view(-1)[:size]

    def owners(self) -> list[tuple[str, ...]]:
        """The sequences holding each block of the pool (``()``: none; two or more: shared):
        what the app's block map draws."""
        out: list[tuple[str, ...]] = [()] * self.num_blocks
        for seq_id, table in self.tables.items():
            for block in table:
                if block != RELEASED:
                    out[block] += (seq_id,)
        return out

    def cached_blocks(self) -> list[bool]:
        """For each block: held by none but keeping a reusable prefix."""
        out = [False] * self.num_blocks
        for block in self._cached:
            out[block] = True
        return out

    def occupancy(self) -> Occupancy:
        bs = self.block_size
        filled: dict[int, int] = {}  # a shared block counts once, as full as its fullest holder
        for seq_id, table in self.tables.items():
            length = self.lengths[seq_id]
            for index, block in enumerate(table):
                if block != RELEASED:
                    filled[block] = max(filled.get(block, 0), min(bs, length - index * bs))
        used, stored = self.num_used, sum(filled.values())
        return Occupancy(
            self.capacity, used, stored, used * bs - stored, self.num_cached, self.num_shared
        )
