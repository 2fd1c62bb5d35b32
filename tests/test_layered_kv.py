"""A KV pool per layer kind (:mod:`engine.kv_cache.layered`): Gemma's local layers keep only
their window, in a pool of their own far smaller than the full layers', and give the same
tokens and logits as transformers through the torch and Triton attention, static decode
steps, prefix caching, drafts and teacher-forced scoring; a cached prefix needs only the
blocks the window keeps; the plan spends the pool on context, not on windows."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from engine.core.config import EngineConfig, local_blocks, pool_bytes
from engine.core.scheduler import SchedulerLimits
from engine.evals.scoring import score
from engine.kv_cache.block_manager import RELEASED, BlockManager
from engine.kv_cache.layered import LayeredBlockManager
from engine.kv_cache.paged import PagedKVCache
from engine.kv_cache.window import CacheWindow
from engine.loader.load import load_model
from engine.loader.memory_plan import plan_memory
from engine.model.config import ModelConfig
from engine.store.synthetic_store import CONFIGS
from tests.conftest import WIDE_HEADS
from tests.test_exactness_tiny import hf_logits, tiny_prompt
from tests.test_phi3 import check_ragged_on_a_prefix, hf_steps, run_ragged

GiB = 2**30


def held_apart(engine) -> LayeredBlockManager:
    """The engine's manager, with the local layers' pool smaller than the full layers' and
    each layer's tensor as large as its own pool; nothing held once it is idle."""
    mgr = engine.kv.manager
    assert isinstance(mgr, LayeredBlockManager)
    assert mgr.local.num_blocks < mgr.num_blocks
    assert [g.manager for g in engine.kv.groups] == [mgr, mgr.local]  # the full layers' first
    for layer, kv in enumerate(engine.kv.kv):
        local = layer in engine.cfg.local_layers
        blocks = mgr.local.num_blocks if local else mgr.num_blocks
        assert kv.shape[0] == blocks * mgr.block_size + 1  # and the zero pad slot
    assert not engine.has_work() and mgr.num_used == 0 and mgr.local.num_used == 0
    return mgr


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "lookup-drafts"])
@pytest.mark.parametrize("arch", ["gemma3_text", "gemma2"])
def test_local_layers_keep_their_window_in_a_pool_of_their_own(tiny_model_dir, arch, speculative):
    """Two at a time, the local pool holds 14 blocks of 4 (the windows of 8 of two sequences
    and a step of 16), where four prompts of 13 to 40 tokens decode 20 more each: blocks
    fall out of the window and are written again while the full layers still read theirs."""
    folder, hf = tiny_model_dir(arch, False)
    engine = check_ragged_on_a_prefix(
        folder, hf, speculative=speculative, seed=7, steps=20, max_batch=2
    )
    mgr = held_apart(engine)
    assert mgr.local.num_blocks == 14 and mgr.num_blocks > 40 + 20


def test_triton_attention_and_static_steps_read_the_local_pool(tiny_model_dir, monkeypatch):
    """Our Triton kernels (interpreted, fp32) and the static decode steps (a CUDA graph's
    buffers, run eagerly here) over the two pools: each prompt's ids are transformers'."""
    monkeypatch.setenv("INFERSIGHT_KERNELS", "triton")
    folder, hf = tiny_model_dir("gemma3_text", True, **WIDE_HEADS)
    limits = SchedulerLimits(max_batch_size=2, max_tokens_per_step=8)
    config = EngineConfig(block_size=4, num_blocks=40, limits=limits, cuda_graphs="on")
    engine = load_model(folder, precision="fp32", config=config)
    assert engine.runner.static is not None and engine.attention.name == "triton"
    prompts = [tiny_prompt(hf), tiny_prompt(hf)[:5]]
    got = run_ragged(engine, [p.tolist() for p in prompts], 24)
    assert got == [hf_steps(hf, p, 24)[0] for p in prompts]
    assert held_apart(engine).local.num_blocks == 2 * 5 + 2


def test_scoring_runs_span_by_span_through_the_local_pool(tiny_model_dir):
    """Teacher-forced scoring (``eval compare``) of 61 tokens, longer than the local pool
    holds: each position's log-probabilities are transformers'."""
    folder, hf = tiny_model_dir("gemma2", True)
    limits = SchedulerLimits(max_batch_size=1, max_tokens_per_step=8)
    engine = load_model(folder, precision="fp32", config=EngineConfig(block_size=4, limits=limits))
    ids = torch.randint(0, hf.config.vocab_size, (62,), generator=torch.Generator().manual_seed(3))
    prompt, output = ids[:20].tolist(), ids[20:].tolist()
    ours = score(engine, prompt, output)
    ref = torch.log_softmax(hf_logits(hf, ids[:-1]), dim=-1)[19:]
    assert (ours - ref).abs().max().item() <= 1e-4
    mgr = held_apart(engine)
    assert mgr.local.num_blocks * mgr.block_size < len(ids)


def test_a_sequence_computes_in_chunks_the_local_pool_holds(tiny_model_dir):
    """The local pool is sized at load (two sequences' windows of 8 and a step of 16, in
    blocks of 4: 14 blocks). A step's budget raised on the live engine past it cuts each
    sequence's chunk to what it holds beside the window (36 tokens), to the same tokens; a
    cache window whose sinks leave it no room is refused by name. A new window forgets the
    local layers' cached blocks with the full layers' (their K/V depend on the layers
    below)."""
    from engine.errors import InvalidRequestError

    folder, hf = tiny_model_dir("gemma3_text", False)
    limits = SchedulerLimits(max_batch_size=2, max_tokens_per_step=16)
    engine = load_model(folder, precision="fp32", config=EngineConfig(block_size=4, limits=limits))
    mgr = engine.kv.manager
    assert mgr.local.num_blocks == 14 and mgr.chunk_limit() == (14 - 2 - 3) * 4
    engine.update_limits(max_tokens_per_step=128)
    prompt = torch.randint(
        0, hf.config.vocab_size, (80,), generator=torch.Generator().manual_seed(5)
    )
    chunks = []
    real = engine.scheduler.schedule

    def spy(now):
        out = real(now)
        chunks.extend(c.length for c in out.chunks)
        return out

    engine.scheduler.schedule = spy
    assert run_ragged(engine, [prompt.tolist()], 6) == [hf_steps(hf, prompt, 6)[0]]
    assert chunks[:3] == [36, 36, 8]  # the prompt's 80 tokens, then one a step
    with pytest.raises(InvalidRequestError, match="too few for one sequence's window and sinks"):
        engine.set_window(CacheWindow(sink=40, window=4))  # 10 sink blocks: 2 + 3 + 10 > 14
    assert mgr.local.num_cached > 0
    engine.set_window(CacheWindow(sink=0, window=16))
    assert mgr.local.num_cached == 0 and mgr.num_cached == 0


def _longest_by_definition(found: list[int], window: CacheWindow | None, bs: int) -> int:
    """The most leading blocks of ``found`` whose every block is cached or left out by the
    window at the hit's end."""
    mgr = BlockManager(1, bs)
    mgr.window = window
    return max(
        h
        for h in range(len(found) + 1)
        if all(b != RELEASED or mgr._outside_window(i, h * bs) for i, b in enumerate(found[:h]))
    )


@given(
    found=st.lists(st.sampled_from([RELEASED, 7]), max_size=24),
    sink=st.integers(0, 9),
    width=st.integers(1, 40),
    bs=st.sampled_from([1, 2, 4]),
    windowed=st.booleans(),
)
def test_a_cached_prefix_needs_only_the_blocks_its_window_keeps(found, sink, width, bs, windowed):
    mgr = BlockManager(1, bs)
    mgr.window = CacheWindow(sink, width) if windowed else None
    assert mgr._longest_hit(found) == _longest_by_definition(found, mgr.window, bs)


def test_the_pool_holds_context_not_windows_on_a_12_gib_card(monkeypatch):
    """Gemma-3-12B at int4 on a 12 GiB card, planned as on a GPU with our Triton kernels
    (no interpreter): the local layers' pool takes no more bytes than the full layers', and
    the context reaches three times what one block table for all 48 layers would (each
    local layer held every token)."""
    monkeypatch.delenv("TRITON_INTERPRET")
    cfg = ModelConfig.from_dict(json.loads((CONFIGS / "gemma-3-12b.json").read_text()))
    config = EngineConfig()
    plan = plan_memory(cfg, "int4-g32", "cuda", memory=12 * GiB, config=config, name="g")
    assert plan.fits, plan.lines()
    # one table: every token in all 48 layers' K/V (the local layers' 40 holding it too)
    one_table = plan.kv_room_bytes // PagedKVCache.bytes_per_block(cfg, 1, torch.bfloat16)
    # the full layers (8 of 48) get at least half the room: three times the context
    assert plan.max_context >= 3 * one_table
    blocks = plan.pool_tokens // config.block_size
    local = local_blocks(cfg, config, blocks)
    assert local is not None and local < blocks
    per_token, local_per_token = plan.kv_bytes_per_token, plan.kv_bytes_per_token * 40 // 8
    # each pool its blocks and a zero pad slot; the local one no more bytes than the full one
    # (rounded up to a whole block)
    assert plan.kv_local_bytes == local_per_token * (local * config.block_size + 1)
    assert plan.kv_pool_bytes == plan.kv_local_bytes + per_token * (blocks * config.block_size + 1)
    assert 0 <= (local - blocks * per_token / local_per_token) < 1
    assert plan.kv_pool_bytes == pool_bytes(cfg, config, torch.bfloat16, blocks) + per_token * (
        1 + 40 / 8
    )
