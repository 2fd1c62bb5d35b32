"""The INT8 KV cache (engine/formats/kv.py, engine/kernels/csrc/kv_rows.h): the format's
arithmetic; the C decode and prefill kernels over int8 rows against float64 attention over
the same rows dequantized, at every CPU level this machine builds for; the C RoPE + K/V write
quantizing to the bit as torch does; and an engine whose pool holds int8 keeping what every
holder of the cache promises (prefix sharing, preemption, cancellation, speculative
rollback, a cache window) while giving what its own scoring cache computes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine.core.config import EngineConfig
from engine.core.sampling import SamplingParams
from engine.core.scheduler import SchedulerLimits
from engine.errors import InvalidRequestError
from engine.formats import kv as kv_format
from engine.kernels import decode_step, layer_ops, lowbit, native, paged_decode, triton_support
from engine.kv_cache import dtypes
from engine.kv_cache.window import CacheWindow
from engine.loader.load import load_model
from engine.model import transformer
from tests.conftest import WIDE_HEADS
from tests.probed import built_levels
from tests.test_decode_step import PROMPTS, WIDE, _counting, _generate, _ours
from tests.test_paged_attention import (
    PREFILL_CASES,
    case,
    float64_attention,
    prefill_case,
)
from tests.test_triton_engine import generate as triton_generate
from tests.test_triton_engine import spy_kernels

INT8 = kv_format.INT8
GREEDY = SamplingParams(max_new_tokens=10, ignore_eos=True)


def quantized(pool: torch.Tensor) -> torch.Tensor:
    """``pool`` as int8 rows, its last slot (the pad) zero as a pool's is."""
    rows = kv_format.quantize(pool, INT8)
    rows[-1].view(torch.uint8).zero_()
    return rows


def test_a_row_holds_its_values_within_half_a_step_of_its_own_scale() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 6, 64, generator=gen) * torch.rand(50, 6, 1, generator=gen) * 10
    x[3, 2] = 0.0  # a row of zeros: scale 0, values 0
    rows = kv_format.quantize(x, INT8)
    assert rows.dtype == torch.int8 and rows.shape == (50, 6, 64 + kv_format.SCALE_BYTES)
    scale = rows[..., 64:].contiguous().view(torch.float32)
    torch.testing.assert_close(scale, x.abs().amax(-1, keepdim=True) / 127, rtol=0, atol=0)
    back = kv_format.dequantize(rows)
    assert (back - x).abs().le(scale / 2 * (1 + 1e-6)).all()
    assert back[3, 2].eq(0).all() and scale[3, 2].item() == 0.0
    # each row's largest magnitude is held exactly as ±127 steps
    assert rows[..., :64].abs().amax(-1)[scale[..., 0] > 0].eq(127).all()


def test_only_the_rows_read_are_dequantized_and_writes_quantize() -> None:
    pool = INT8.empty(9, 2, 8, "cpu")
    assert pool[-1].view(torch.uint8).eq(0).all()  # the pad slot reads as zeros
    kv = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(1))
    kv_format.store(pool, torch.tensor([0, 5, 2]), kv)
    got = kv_format.gather(pool, torch.tensor([[5, 8], [2, 0]]), torch.float32)
    assert got.shape == (2, 2, 4, 8) and got[0, 1].eq(0).all()
    torch.testing.assert_close(got[0, 0], kv_format.dequantize(kv_format.quantize(kv[1], INT8)))


def test_the_kv_dtype_names_and_their_refusals() -> None:
    assert dtypes.planned("auto", torch.bfloat16).name == "bf16"
    assert dtypes.planned("bf16", torch.bfloat16).storage == torch.bfloat16
    assert dtypes.planned("int8", torch.float32) is INT8
    with pytest.raises(InvalidRequestError, match="--precision bf16"):
        dtypes.planned("bf16", torch.float32)
    with pytest.raises(InvalidRequestError, match="choose one of"):
        EngineConfig(kv_dtype="int4")
    assert "sm_89" in dtypes.refusal(kv_format.FP8, 64, "cpu")
    assert "sm_86" in dtypes.refusal(kv_format.FP8, 64, "cuda", (8, 6))
    assert dtypes.refusal(kv_format.FP8, 128, "cuda", (9, 0)) == ""
    assert "multiple of 4" in dtypes.refusal(INT8, 18, "cpu")
    assert dtypes.refusal(INT8, 64, "cpu") == ""


# -- the C kernels over int8 rows, at every level this machine builds for ---------------------


@pytest.fixture(scope="module", params=built_levels(), ids=lambda level: level or "native")
def kernel_at(request: pytest.FixtureRequest) -> paged_decode.Kernel:
    if native.compiler() is None:
        pytest.skip("no C compiler: the portable path runs")
    path, why = native.built(paged_decode.SOURCE, native.isa_flags(request.param))
    assert path is not None, why
    return paged_decode._load(path)


@pytest.mark.no_engine_paths
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("b", "width", "kv_heads", "group", "dim", "window"),
    [
        (5, 70, 3, 3, 64, None),  # SmolLM2's heads, ragged rows
        (7, 40, 2, 4, 128, 9),  # a cache window: keys in the middle masked out
        (1, 4096, 3, 3, 64, None),  # one 4k-token context: its heads split over threads
        (3, 33, 4, 1, 48, None),  # no GQA, 48 dimensions (eight at a time, then none left)
    ],
)
def test_decode_over_int8_rows_matches_float64_over_them_dequantized(
    kernel_at, b, width, kv_heads, group, dim, window, dtype
) -> None:
    q, pool, slots, lens, mask = case(b, width, kv_heads, group, dim, torch.float32, seed=3,
                                      window=window)  # fmt: skip
    rows, q = quantized(pool), q.to(dtype)
    got = paged_decode._call(kernel_at, q, rows, slots, lens, mask)
    values = kv_format.dequantize(rows).double()
    for i in range(b):  # each row's held keys, as a one-query prefill over them
        n = int(lens[i])
        seen = mask[i, :n] == 0
        held, positions = slots[i, :n][seen], torch.arange(n)[seen]
        want = float64_attention(q[i : i + 1].double(), values, held, positions, n - 1, 0, 0)
        tol = 2e-6 if dtype == torch.float32 else 8e-3
        torch.testing.assert_close(got[i : i + 1].double(), want.to(dtype).double(), atol=tol,
                                   rtol=tol)  # fmt: skip


@pytest.mark.no_engine_paths
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("length", "start", "kv_heads", "group", "dim", "sink", "window"),
                         [PREFILL_CASES[i] for i in (1, 2, 3, 4, 5, 6)])  # fmt: skip
def test_prefill_over_int8_rows_matches_float64_over_them_dequantized(
    kernel_at, length, start, kv_heads, group, dim, sink, window, dtype
) -> None:
    q, pool, slots, positions = prefill_case(length, start, kv_heads, group, dim,
                                             torch.float32, sink, window, seed=7)  # fmt: skip
    rows, q = quantized(pool), q.to(dtype)
    got = paged_decode._call_prefill(kernel_at, q, rows, slots, positions, start, sink, window)
    want = float64_attention(q, kv_format.dequantize(rows).double(), slots, positions, start,
                             sink, window)  # fmt: skip
    tol = 2e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got.double(), want.to(dtype).double(), atol=tol, rtol=tol)


@pytest.fixture(scope="module", params=built_levels(), ids=lambda level: level or "native")
def c_ops(request: pytest.FixtureRequest) -> layer_ops.LayerOps:
    if native.compiler() is None:
        pytest.skip("no C compiler")
    built = layer_ops.build(request.param)
    assert built.available, built.why
    return layer_ops.c_ops(built)


@pytest.mark.no_engine_paths
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_rope_and_kv_write_quantize_to_the_bit_as_torch_does(c_ops, dtype) -> None:
    gen = torch.Generator().manual_seed(8)
    heads, kv_heads, dim, tokens = 9, 3, 64, 5
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen) * 4).to(dtype)
    angles = torch.rand(tokens, 1, dim, generator=gen) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    slots = torch.tensor([7, 0, 3, 12, 5])
    pools = []
    for fn in (c_ops.rope_store, transformer.rope_store):
        pool = INT8.empty(14, kv_heads, dim, "cpu").view(torch.uint8).zero_().view(torch.int8)
        fn(qkv.clone(), cos, sin, pool, slots, num_heads=heads, num_kv_heads=kv_heads,
           head_dim=dim)  # fmt: skip
        pools.append(pool)
    assert torch.equal(pools[0], pools[1])
    assert pools[0][slots].ne(0).any()


# -- an engine whose pool holds int8 --------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_model_dir) -> Path:
    return tiny_model_dir("llama", False)[0]


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 320, (int(k),), generator=gen).tolist()
            for k in torch.randint(4, 40, (n,), generator=gen)]  # fmt: skip


def alone(engine, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    gen = engine.generate(prompt, params)
    list(gen)
    return gen.result.token_ids


def together(engine, batch: list[list[int]]) -> list[list[int]]:
    ids = {engine.add_request(p, GREEDY): i for i, p in enumerate(batch)}
    out: list[list[int]] = [[] for _ in batch]
    while engine.has_work():
        for event in engine.step():
            if event.token_id is not None:
                out[ids[event.request_id]].append(event.token_id)
    return out


def test_the_engine_holds_int8_rows_and_says_so(tiny) -> None:
    float_kv = load_model(tiny, config=EngineConfig(num_blocks=64))
    engine = float_kv.sibling(EngineConfig(num_blocks=64, kv_dtype="int8"))
    assert engine.kv.kv[0].dtype == torch.int8
    snap = engine.metrics()
    assert snap.kv_dtype == "int8" and float_kv.metrics().kv_dtype == "fp32"
    dim, heads, layers = engine.cfg.head_dim, engine.cfg.num_kv_heads, engine.cfg.num_layers
    assert snap.kv_block_bytes == 2 * layers * 16 * heads * (dim + 4)
    assert engine.kv.nbytes == layers * (64 * 16 + 1) * 2 * heads * (dim + 4)


def test_greedy_tokens_are_what_scoring_through_int8_rows_picks(tiny) -> None:
    """The engine's paged steps (a prefill, then decode steps over int8 rows) pick each next
    token as the whole sequence scored at once through the scoring cache that holds the same
    rows (the oracle: runner.forward_logits over a contiguous cache in the same format)."""
    engine = load_model(tiny, config=EngineConfig(num_blocks=64, kv_dtype="int8"))
    for prompt in prompts(3, seed=1):
        got = alone(engine, prompt)
        ids = prompt + got
        cache = engine.runner.new_cache(len(ids), engine.kv.format)
        logits = engine.runner.forward_logits(ids, cache, 0)
        assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == got


def test_batching_and_preemption_keep_each_requests_tokens(tiny) -> None:
    """A pool too small for everyone preempts; each request's tokens equal its tokens alone."""
    engine = load_model(tiny, config=EngineConfig(num_blocks=64, kv_dtype="int8"))
    batch = prompts(8, seed=2)
    want = [alone(engine, p) for p in batch]
    limits = SchedulerLimits(max_tokens_per_step=24)
    small = engine.sibling(EngineConfig(block_size=4, num_blocks=40, kv_dtype="int8",
                                        limits=limits))  # fmt: skip
    assert together(small, batch) == want
    assert small.collector.total_preemptions > 0, "the pool was meant to preempt"
    assert small.kv.manager.num_free == small.kv.manager.num_blocks


def test_a_shared_prefix_is_read_from_the_same_int8_blocks(tiny) -> None:
    engine = load_model(tiny, config=EngineConfig(num_blocks=64, kv_dtype="int8"))
    prefix = prompts(1, seed=3)[0] + list(range(50, 90))
    first = alone(engine, [*prefix, 7, 8])
    hits = engine.kv.manager.stats.hit_tokens
    second = alone(engine, [*prefix, 7, 8])
    assert engine.kv.manager.stats.hit_tokens - hits >= 32  # two whole blocks shared
    assert second == first
    cold = engine.sibling(EngineConfig(num_blocks=64, kv_dtype="int8", prefix_caching=False))
    assert alone(cold, [*prefix, 7, 8]) == first


def test_speculative_rollback_over_int8_rows_keeps_greedy_output(tiny) -> None:
    from engine.speculative.config import parse_speculative

    engine = load_model(tiny, config=EngineConfig(num_blocks=64, kv_dtype="int8"))
    batch = [p + p[:6] + p for p in prompts(3, seed=4)]  # repeats: prompt lookup drafts
    want = [alone(engine, p) for p in batch]
    for drafter in ("lookup", "self:int8"):  # the draft model's own pool: int8 rows too
        fast = engine.sibling(EngineConfig(num_blocks=64, kv_dtype="int8"))
        fast.set_speculation(parse_speculative(drafter, 4, adaptive=False))
        assert [alone(fast, p) for p in batch] == want, drafter
        stats = fast.speculator.stats
        assert stats.num_draft_tokens > stats.num_accepted_tokens, "no draft was rolled back"
    assert fast.speculator.drafter.kv.format.name == "int8"


def test_a_cache_window_over_int8_rows_gives_each_request_its_tokens_alone(tiny) -> None:
    """Under a window with sinks, blocks leave the pool as tokens fall out of it: in a batch,
    each request still gets the tokens it gets alone, and every block comes back."""
    window = CacheWindow(sink=4, window=24)
    config = EngineConfig(num_blocks=64, kv_dtype="int8", window=window)
    engine = load_model(tiny, config=config)
    batch = prompts(4, seed=5)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    want = [alone(engine, p, params) for p in batch]
    other = engine.sibling(config)
    ids = {other.add_request(p, params): i for i, p in enumerate(batch)}
    out: list[list[int]] = [[] for _ in batch]
    while other.has_work():
        for event in other.step():
            if event.token_id is not None:
                out[ids[event.request_id]].append(event.token_id)
    assert out == want
    assert engine.kv.manager.num_free == engine.kv.manager.num_blocks


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int4-g32"])
def test_the_c_decode_step_over_int8_rows_gives_the_eager_steps_tokens(
    tiny_model_dir, precision
) -> None:
    """Every decode step in one C call (RoPE, the quantizing write, attention over int8 rows)
    gives the eager step's tokens and logits; a float engine and an int8 one sharing the model
    interleave their steps, each in its own pool's format."""
    folder, _ = tiny_model_dir("llama", False, **WIDE)
    engine = _ours(folder, precision, config=EngineConfig(kv_dtype="int8"))
    assert engine.kernels.endswith("decode steps in one C call"), engine.kernels
    with _counting(engine) as calls:
        ours, ours_logits = _generate(engine, PROMPTS, 10)
    assert len(calls) == 9 and all(calls)
    with decode_step.eager():
        eager, eager_logits = _generate(engine, PROMPTS, 10)
    assert ours == eager
    tol = 1e-5 if engine.dtype == torch.float32 else 2**-6
    torch.testing.assert_close(torch.cat(ours_logits), torch.cat(eager_logits), rtol=tol,
                               atol=tol)  # fmt: skip
    with lowbit.choosing("ours"):
        float_kv = engine.sibling(EngineConfig())
    want_float, _ = _generate(float_kv, PROMPTS, 10)
    sampling = SamplingParams(max_new_tokens=10, ignore_eos=True)
    got: dict[str, list[int]] = {}
    rids = [(e, e.add_request(p, sampling)) for p in PROMPTS for e in (engine, float_kv)]
    while engine.has_work() or float_kv.has_work():
        for e in (engine, float_kv):
            for event in e.step():
                if event.token_id is not None:
                    got.setdefault(event.request_id, []).append(event.token_id)
    assert [got[rid] for owner, rid in rids if owner is engine] == ours
    assert [got[rid] for owner, rid in rids if owner is float_kv] == want_float


@pytest.mark.skipif(not triton_support.installed(), reason="Triton not installed")
def test_our_triton_kernels_and_static_steps_read_int8_rows_as_the_c_paths_do(
    tiny_model_dir, monkeypatch
) -> None:
    """Through our Triton kernels (Triton's interpreter here) and the static decode steps a
    GPU replays as CUDA graphs, an int8 pool gives the torch and C paths' tokens: prefill and
    decode read the rows through the block tables, in place."""
    folder, _ = tiny_model_dir("llama", False, **WIDE_HEADS)
    config = EngineConfig(block_size=4, num_blocks=96, kv_dtype="int8")
    batch = [[5, 17, 33, 8], [9, 9, 41, 2, 77, 3, 12], [100, 4, 4]]
    want = triton_generate(load_model(folder, config=config), batch)
    monkeypatch.setenv("INFERSIGHT_KERNELS", "triton")
    calls = spy_kernels(monkeypatch)
    engine = load_model(folder, config=config)
    assert engine.triton and engine.kv.kv[0].dtype == torch.int8, engine.kernels
    assert triton_generate(engine, batch) == want
    assert calls["decode"] and calls["prefill"]
    static = engine.sibling(replace(config, cuda_graphs="on"))
    static.settle_cuda_graphs()
    assert static.runner.static is not None, static.graphs
    assert triton_generate(static, batch) == want


def test_two_ranks_hold_their_heads_int8_rows_as_one_process_holds_them(tiny_model_dir) -> None:
    """Tensor parallelism: each rank's pool (and scoring cache) holds its own KV heads as int8
    rows, each scaled alone, so two ranks give one process's greedy tokens and, through the
    scoring cache, its logits: within 1e-4 (the order of the all-reduce's sums) but where
    that order moves a K or V value across a rounding boundary of its row, one int8 step
    (1/127 of the row's largest) apart, which a logit feels in its fourth decimal."""
    folder, _ = tiny_model_dir("llama", False)
    config = EngineConfig(num_blocks=64, kv_dtype="int8")
    one = load_model(folder, config=config)
    two = load_model(folder, config=config, tensor_parallel=2)
    try:
        prompt = [(7 * i + 3) % 300 for i in range(40)]
        want = one.runner.forward_logits(prompt, one.runner.new_cache(40, one.kv.format), 0)
        got = two.runner.forward_logits(prompt, two.runner.new_cache(40, two.kv.format), 0)
        close = (got - want).abs() <= 1e-4
        assert close.float().mean() > 0.9  # most logits: the sums' order alone
        torch.testing.assert_close(got, want, rtol=0, atol=1e-3)
        assert alone(two, prompt) == alone(one, prompt)
        assert two.kv.kv[0].dtype == torch.int8
    finally:
        two.parallel.close()


def test_fp8_rows_hold_e4m3_values_and_the_torch_path_reads_them() -> None:
    """FP8 rows (a GPU's, sm_89+; their arithmetic is torch's anywhere): each value within
    e4m3's half step of its row's scale; the torch path's decode attention over them is
    the attention over the rows dequantized; no fused write is handed an fp8 pool (they write
    floats and int8 rows), so the step quantizes as it stores."""
    from engine.attention.paged import PagedBackend
    from engine.kv_cache.paged import PagedKVCache, SeqChunk
    from engine.model.config import ModelConfig

    fp8 = kv_format.FP8
    x = torch.randn(40, 4, 32, generator=torch.Generator().manual_seed(12)) * 3
    rows = kv_format.quantize(x, fp8)
    assert rows.dtype == torch.float8_e4m3fn and rows.shape == (40, 4, 36)
    scale = rows[..., 32:].contiguous().view(torch.float32)
    back = kv_format.dequantize(rows)
    assert (back - x).abs().le(x.abs() * 2**-4 + scale * 2**-9).all()  # 3 mantissa bits
    cfg = ModelConfig(
        model_type="llama", vocab_size=16, hidden_size=64, intermediate_size=16, num_layers=1,
        num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=256,
        rms_norm_eps=1e-6, rope_theta=1e4, tie_word_embeddings=False, attention_bias=False,
    )  # fmt: skip
    cache = PagedKVCache(cfg, num_blocks=8, block_size=4, attention=PagedBackend(), kv_format=fp8)
    cache.manager.grow("s", 9)
    ctx = cache.context([SeqChunk("s", 0, 9)])
    assert ctx.kv_target(0) is None
    q, kv = torch.randn(9, 4, 32), torch.randn(9, 4, 32)
    out = ctx.attend(0, q, kv)
    stored = kv_format.gather(cache.kv[0], torch.tensor(cache.manager.slots("s", 0, 9)),
                              torch.float32)  # fmt: skip
    torch.testing.assert_close(stored, kv_format.dequantize(kv_format.quantize(kv, fp8)))
    want = float64_attention(q.double(), stored.double(), torch.arange(9), torch.arange(9), 0,
                             0, 0)  # fmt: skip
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
