"""The paged KV cache: block manager invariants and paged attention against the reference."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.attention import reference_attention
from engine.config import ModelConfig
from engine.kv_cache import RELEASED, BlockManager, CacheWindow, PagedKVCache, SeqChunk

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("grow"), st.integers(0, 5), st.integers(1, 40)),
        st.tuples(st.just("free"), st.integers(0, 5), st.just(0)),
        st.tuples(st.just("window"), st.integers(0, 5), st.integers(1, 48)),
    ),
    max_size=80,
)


def check_invariants(mgr: BlockManager) -> None:
    owned = [b for table in mgr.tables.values() for b in table if b != RELEASED]
    free = list(mgr._free)
    assert len(owned) == len(set(owned)), "a block is owned twice"
    assert not set(owned) & set(free), "a block is both owned and free"
    assert len(owned) + len(free) == mgr.num_blocks
    assert len(set(free)) == len(free)

    stored = 0
    for seq_id, table in mgr.tables.items():
        length = mgr.lengths[seq_id]
        assert len(table) == mgr.blocks_for(length)
        for index, block in enumerate(table):
            if block != RELEASED:
                stored += min(mgr.block_size, length - index * mgr.block_size)
    occ = mgr.occupancy()
    assert occ.used_blocks == len(owned)
    assert occ.tokens_stored == stored
    assert occ.waste_slots == len(owned) * mgr.block_size - stored
    assert occ.usage == len(owned) / mgr.num_blocks


@settings(max_examples=300, deadline=None)
@given(ops=OPS, block_size=st.sampled_from([1, 4, 16]), num_blocks=st.integers(1, 24))
def test_block_manager_invariants(ops, block_size, num_blocks):
    mgr = BlockManager(num_blocks, block_size)
    for op, seq, amount in ops:
        seq_id = f"s{seq}"
        if op == "grow":
            new_length = mgr.lengths.get(seq_id, 0) + amount
            if mgr.can_grow(seq_id, new_length):
                mgr.grow(seq_id, new_length)
            else:
                with pytest.raises(MemoryError):
                    mgr.grow(seq_id, new_length)
        elif op == "free":  # finish, cancel and preemption all free the whole table
            mgr.free(seq_id)
        elif seq_id in mgr.tables:
            mgr.release_outside_window(seq_id, CacheWindow(sink=2, window=amount))
        check_invariants(mgr)
    for seq_id in list(mgr.tables):
        mgr.free(seq_id)
    check_invariants(mgr)
    mgr.grow("everything", num_blocks * block_size)  # every freed block is reusable
    check_invariants(mgr)
    assert mgr.num_free == 0


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
    cache = PagedKVCache(replace(TINY, sliding_window=sliding), num_blocks=64, block_size=4)
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
        cache.k[0][slots] = k[: history[i]]
        cache.v[0][slots] = v[: history[i]]
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
