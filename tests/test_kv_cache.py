"""The paged KV cache: block manager invariants and paged attention against the reference."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.attention import PagedBackend
from engine.kv_cache.block_manager import RELEASED, BlockManager
from engine.kv_cache.paged import PagedKVCache, SeqChunk
from engine.kv_cache.window import CacheWindow
from engine.model.attention import reference_attention
from engine.model.config import ModelConfig

CONTEXTS = (None, CacheWindow(sink=2, window=6))  # the windows the whole pool runs under
PREFIXES = ([1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9], [5, 5, 5, 5, 5, 5, 5, 5], [1, 2])
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.integers(0, 5), st.integers(0, len(PREFIXES) - 1)),
        st.tuples(st.just("compute"), st.integers(0, 5), st.integers(1, 12)),
        st.tuples(st.just("speculate"), st.integers(0, 5), st.integers(0, 35)),
        st.tuples(st.just("free"), st.integers(0, 5), st.just(0)),
        st.tuples(st.just("preempt"), st.integers(0, 5), st.just(0)),
        st.tuples(st.just("window"), st.integers(0, 5), st.integers(1, 16)),
        st.tuples(st.just("capacity"), st.just(0), st.integers(1, 24)),
        st.tuples(st.just("clear"), st.just(0), st.just(0)),
        st.tuples(st.just("caching"), st.just(0), st.booleans()),
        st.tuples(st.just("context"), st.just(0), st.integers(0, 1)),
    ),
    max_size=80,
)


def check_invariants(mgr: BlockManager) -> None:
    """Every block is held, cached or empty, exactly once; reference counts are the number of
    table entries naming the block; the key maps are each other's inverse; occupancy counts a
    shared block once."""
    refs = [0] * mgr.num_blocks
    for table in mgr.tables.values():
        for b in table:
            if b != RELEASED:
                refs[b] += 1
    assert refs == mgr._refs
    held = {b for b, r in enumerate(refs) if r}
    cached, empty = list(mgr._cached), list(mgr._empty)
    assert len(set(cached)) == len(cached) and len(set(empty)) == len(empty)
    assert not held & set(cached) and not held & set(empty) and not set(cached) & set(empty)
    assert len(held) + len(cached) + len(empty) == mgr.num_blocks
    assert set(cached) <= set(mgr._key_of), "a cached block has no key"
    assert {b: k for k, b in mgr._block_of.items()} == mgr._key_of
    assert not set(mgr._key_of) & set(empty), "an empty block still has a key"

    filled: dict[int, int] = {}
    for seq_id, table in mgr.tables.items():
        length = mgr.lengths[seq_id]
        assert len(table) == mgr.blocks_for(length)
        for index, block in enumerate(table):
            if block != RELEASED:
                tokens = min(mgr.block_size, length - index * mgr.block_size)
                filled[block] = max(filled.get(block, 0), tokens)
    occ = mgr.occupancy()
    assert occ.used_blocks == mgr.num_used == len(held)
    assert occ.tokens_stored == sum(filled.values())
    assert occ.waste_slots == len(held) * mgr.block_size - occ.tokens_stored
    assert occ.usage == len(held) / mgr.capacity
    assert occ.cached_blocks == len(cached)
    assert occ.shared_blocks == sum(1 for r in refs if r > 1)
    assert [bool(o) for o in mgr.owners()] == [b in held for b in range(mgr.num_blocks)]
    assert mgr.cached_blocks() == [b in cached for b in range(mgr.num_blocks)]


@settings(max_examples=300, deadline=None)
@given(ops=OPS, block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(1, 24))
def test_block_manager_shares_prefixes_without_losing_a_block(ops, block_size, num_blocks):
    """Sequences are admitted with the cached prefix the manager offers, compute tokens into their
    blocks, verify speculative drafts (slots for the last token and k drafts, of which some are
    accepted and the rest rolled back with :meth:`BlockManager.truncate`), are freed,
    preempted, windowed; the pool is capped, cleared, switched off and given a new context. A
    shadow of the pool records what each slot holds (the context it was computed under and
    every token up to it): a block offered to a new sequence must hold exactly that sequence's
    prefix, and no step ever writes into a block another sequence holds."""
    mgr = BlockManager(num_blocks, block_size)
    shadow: dict[int, tuple[object, ...]] = {}  # slot → (context, tokens up to and including it)
    tokens: dict[str, list[int]] = {}
    computed: dict[str, int] = {}
    context = 0
    born: dict[str, object] = {}  # the context each running sequence's K/V is computed under
    for op, seq, amount in ops:
        seq_id = f"s{seq}"
        if op == "admit" and seq_id not in mgr.tables:
            toks = tokens.setdefault(seq_id, [*PREFIXES[amount], seq])
            read = _reader(toks)
            hit = mgr.cached_prefix(seq_id, len(toks), read)
            assert len(hit) * block_size < len(toks), "the last token must be computed"
            for index, block in enumerate(hit):
                for offset in range(block_size):
                    pos = index * block_size + offset
                    expected = (context, tuple(toks[: pos + 1]))
                    assert shadow.get(block * block_size + offset) == expected
            if mgr.blocks_to_admit(hit, len(hit) * block_size + 1) <= mgr.num_free:
                computed[seq_id] = mgr.admit(seq_id, hit, len(toks))
                assert computed[seq_id] == len(hit) * block_size
                born[seq_id] = context
        elif op == "compute" and seq_id in mgr.tables:
            toks, start = tokens[seq_id], computed[seq_id]
            end = start + amount
            toks.extend([seq] * max(0, end - len(toks)))  # generated tokens
            if not mgr.can_grow(seq_id, end):
                with pytest.raises(MemoryError):
                    mgr.grow(seq_id, end)
                continue
            mgr.grow(seq_id, end)
            table = mgr.tables[seq_id]
            for pos in range(start, end):
                block = table[pos // block_size]
                assert block != RELEASED and mgr._refs[block] == 1, "wrote a shared block"
                assert block not in mgr._key_of, "wrote a keyed block"
                shadow[block * block_size + pos % block_size] = (
                    born[seq_id],
                    tuple(toks[: pos + 1]),
                )
            computed[seq_id] = end
            mgr.commit(seq_id, end, _reader(toks))
        elif op == "speculate" and seq_id in mgr.tables:
            toks, start = tokens[seq_id], computed[seq_id]
            k, accepted = 1 + amount % 6, amount // 6
            if len(toks) > start + 1:
                continue  # still prefilling: only a decoding sequence drafts
            toks.extend([seq] * (start + 1 - len(toks)))  # its last token
            accepted = min(accepted, k)
            drafts = [100 + seq + 7 * i for i in range(k)]  # rejected ones leave garbage
            end = start + 1 + k
            if not mgr.can_grow(seq_id, end):
                continue  # the scheduler reserves no draft slots then
            mgr.grow(seq_id, end)
            table = mgr.tables[seq_id]
            written = toks[: start + 1] + drafts
            for pos in range(start, end):
                block = table[pos // block_size]
                assert block != RELEASED and mgr._refs[block] == 1, "wrote a shared block"
                assert block not in mgr._key_of, "wrote a keyed block"
                shadow[block * block_size + pos % block_size] = (
                    born[seq_id],
                    tuple(written[: pos + 1]),
                )
            toks.extend(drafts[:accepted])  # the accepted drafts; the target's token is next
            computed[seq_id] = start + 1 + accepted
            mgr.truncate(seq_id, computed[seq_id])
            mgr.commit(seq_id, computed[seq_id], _reader(toks))
            assert mgr.lengths[seq_id] == computed[seq_id]
        elif op in ("free", "preempt"):
            mgr.free(seq_id, keep_keys=op == "preempt")
            if op == "free":
                tokens.pop(seq_id, None)
        elif op == "window" and seq_id in mgr.tables:
            mgr.release_outside_window(seq_id, CacheWindow(sink=2, window=amount))
        elif op == "capacity":
            mgr.set_capacity(min(amount, num_blocks))
        elif op == "clear":
            mgr.clear_cache()
        elif op == "caching":
            mgr.set_prefix_caching(bool(amount))
        elif op == "context" and amount != context:
            context = amount
            mgr.set_window(CONTEXTS[context])
            born = {s: ("mixed", s) for s in born}  # their later blocks mix two contexts
        check_invariants(mgr)
    for seq_id in list(mgr.tables):
        mgr.free(seq_id)
    check_invariants(mgr)
    mgr.set_capacity(num_blocks)
    mgr.grow("everything", num_blocks * block_size)  # every freed block is reusable
    check_invariants(mgr)
    assert mgr.num_free == 0 and not mgr._key_of


def _reader(tokens: list[int]):
    return lambda a, b: tokens[a:b]


def _run(mgr: BlockManager, seq_id: str, tokens: list[int]) -> int:
    """Admit ``seq_id`` with its cached prefix, compute the rest; returns the tokens reused."""
    read = _reader(tokens)
    cached = mgr.admit(seq_id, mgr.cached_prefix(seq_id, len(tokens), read), len(tokens))
    mgr.grow(seq_id, len(tokens))
    mgr.commit(seq_id, len(tokens), read)
    return cached


def test_prefix_cache_reuses_full_blocks_and_evicts_least_recent_first():
    mgr = BlockManager(8, 4)
    system = list(range(100, 108))  # two full blocks
    assert _run(mgr, "a", [*system, 1, 2, 3, 4]) == 0
    assert _run(mgr, "b", [*system, 4, 5]) == 8  # both blocks shared
    assert mgr.tables["a"][:2] == mgr.tables["b"][:2] and mgr.num_shared == 2
    # a prompt that is all cached still computes its last token, in a block of its own (which,
    # a duplicate of a's second block, is never keyed)
    assert _run(mgr, "c", system) == 4
    a, c = mgr.tables["a"], mgr.tables["c"]
    assert c[0] == a[0] and c[1] not in a
    assert mgr.stats.query_tokens == 12 + 10 + 8 and mgr.stats.hit_tokens == 12
    for seq_id in ("a", "b", "c"):
        mgr.free(seq_id)
    # a's three full blocks stay cached; b's partial block and c's duplicate do not
    assert mgr.num_used == 0 and mgr.num_cached == 3
    # a different prompt takes the empty blocks first, then evicts the LRU cached one: a's
    # last block (freed tail first), not the system prompt's blocks
    _run(mgr, "d", list(range(200, 200 + 4 * 6)))
    assert mgr.stats.evicted_blocks == 1
    mgr.free("d")
    assert _run(mgr, "e", [*system, 9]) == 8


def test_a_new_context_or_a_cleared_cache_shares_nothing():
    mgr = BlockManager(8, 4)
    prompt = list(range(9))
    _run(mgr, "a", prompt)
    mgr.set_window(CacheWindow(sink=4, window=8))
    assert _run(mgr, "b", prompt) == 0  # computed under the old window: not reusable
    mgr.commit("a", 9, _reader(prompt))
    mgr.free("b")
    mgr.clear_cache()
    assert mgr.num_cached == 0
    assert _run(mgr, "c", prompt) == 0
    mgr.set_prefix_caching(False)
    mgr.free("c")
    assert mgr.num_cached == 0 and _run(mgr, "d", prompt) == 0


def test_a_block_being_computed_is_waited_for_not_computed_twice():
    mgr = BlockManager(16, 4)
    prompt = list(range(20))
    read = _reader(prompt)
    mgr.admit("a", mgr.cached_prefix("a", 20, read), 20)
    mgr.grow("a", 8)  # a's first chunk: blocks 0 and 1
    assert mgr.computing("b", 0, read, 20)  # b would share a's first block: wait for it
    mgr.commit("a", 8, read)
    hit = mgr.cached_prefix("b", 20, read)
    assert len(hit) == 2
    assert mgr.computing("b", 2, read, 20)  # a is computing block 2 next
    assert not mgr.computing("b", 4, read, 20)  # block 4 holds b's last token: b computes it
    mgr.free("a")
    assert not mgr.computing("b", 2, read, 20)  # nobody computes it any more


def test_window_releases_only_blocks_wholly_outside():
    mgr = BlockManager(32, 4)
    mgr.grow("a", 40)  # 10 blocks: positions 0..39
    released = mgr.release_outside_window("a", CacheWindow(sink=5, window=10))
    # keep [0, 5) and [30, 40): blocks 2..6 (positions 8..27) lie wholly in between.
    assert released == 5
    assert [b == RELEASED for b in mgr.tables["a"]] == [False] * 2 + [True] * 5 + [False] * 3
    positions, _ = mgr.held("a", 40)
    assert positions.tolist() == list(range(8)) + list(range(28, 40))


TINY = ModelConfig(
    model_type="llama", vocab_size=10, hidden_size=64, intermediate_size=16, num_layers=1,
    num_heads=8, num_kv_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
    rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False,
)  # fmt: skip


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("window", [None, CacheWindow(sink=3, window=9)])
@pytest.mark.parametrize("sliding", [None, 6], ids=["full", "model-window-6"])
def test_paged_attention_equals_reference(seed, window, sliding):
    """With a model window of its own, keys older than it stay masked whatever window a
    chunk asks for (the intersection of the two)."""
    gen = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(
        replace(TINY, sliding_window=sliding), num_blocks=64, block_size=4,
        attention=PagedBackend(),
    )  # fmt: skip
    mgr = cache.manager
    n = 5
    # Ragged sequences: some decode one token, some prefill a chunk, each with history.
    history = [int(torch.randint(0, 40, (1,), generator=gen)) for _ in range(n)]
    new = [1, 1, 1, int(torch.randint(2, 12, (1,), generator=gen)), 7]
    full_k, full_v = [], []
    # Interleave growth so block tables are scattered through the pool.
    for step in range(max(history) + 1):
        for i in range(n):
            if step < history[i]:
                mgr.grow(f"s{i}", step + 1)
    for i in range(n):
        mgr.grow(f"s{i}", history[i] + new[i])
        total = history[i] + new[i]
        k = torch.randn(total, 2, 16, generator=gen)
        v = torch.randn(total, 2, 16, generator=gen)
        slots = torch.tensor(mgr.slots(f"s{i}", 0, history[i]), dtype=torch.long)
        cache.kv[0][slots] = torch.cat((k[: history[i]], v[: history[i]]), dim=1)
        full_k.append(k)
        full_v.append(v)

    chunks = [SeqChunk(f"s{i}", history[i], new[i], window) for i in range(n)]
    q = torch.randn(sum(new), 8, 16, generator=gen)
    k_new = torch.cat([full_k[i][history[i] :] for i in range(n)])
    v_new = torch.cat([full_v[i][history[i] :] for i in range(n)])
    out = cache.context(chunks).attend(0, q, torch.cat((k_new, v_new), dim=1))

    offset = 0
    for i in range(n):
        qi = q[offset : offset + new[i]]
        keys, values = full_k[i].transpose(0, 1), full_v[i].transpose(0, 1)
        windows = [w for w in (window, sliding and CacheWindow(0, sliding)) if w]
        if not windows:
            expected = reference_attention(qi, keys, values, history[i])
        else:
            expected = _windowed_reference(qi, keys, values, history[i], windows)
        assert (out[offset : offset + new[i]] - expected).abs().max().item() <= 1e-5
        offset += new[i]


def _windowed_reference(q, keys, values, start, windows):
    """Attention where a key is visible under every one of ``windows``."""
    length, heads, dim = q.shape
    group = heads // keys.shape[0]
    k = keys.repeat_interleave(group, dim=0)
    v = values.repeat_interleave(group, dim=0)
    scores = torch.einsum("lhd,htd->hlt", q, k) / dim**0.5
    key_pos, query_pos = torch.arange(keys.shape[1]), torch.arange(start, start + length)
    mask = torch.stack([w.visible(key_pos, query_pos) for w in windows]).all(0)
    out = torch.einsum("hlt,htd->lhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v)
    return out.reshape(length, heads * dim)
