"""The paged attention kernels (engine/kernels/paged_decode.py, engine/kernels/csrc/paged_decode.c):
decode, the same attention as the portable gather + SDPA path for every shape the engine
makes, batch-invariant to the bit, used by the engine's decode steps; prefill chunks, against
a float64 reference at every CPU level this machine can build for, used by the engine's
prefill steps with the same tokens; and a clear fallback where they cannot run."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch

from engine.hardware.cpu_paths import LEVELS, forced_level, native_level
from engine.kernels import native, paged_decode
from engine.kernels.gather_attention import gather_attention
from engine.loader.load import load_model

needs_compiler = pytest.mark.skipif(
    native.compiler() is None, reason="no C compiler: the portable path runs"
)
#: Where the engine takes the kernels: a compiler, and a level above DEFAULT (the level this
#: process is held to, if any: the kernels are off at DEFAULT).
needs_kernel = pytest.mark.skipif(
    native.compiler() is None or forced_level() == "DEFAULT",
    reason="no C compiler, or held to DEFAULT: the portable path runs",
)


@pytest.fixture(autouse=True)
def fresh_kernel(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(paged_decode.ENV, raising=False)
    paged_decode.kernel.cache_clear()
    yield
    paged_decode.kernel.cache_clear()


def case(b: int, width: int, kv_heads: int, group: int, dim: int, dtype, seed: int = 0,
         window: int | None = None):  # fmt: skip
    """A pool with scattered slots, rows of different lengths (padded with the zero slot)
    and, with ``window``, keys in the middle of a row masked out as the cache window does."""
    gen = torch.Generator().manual_seed(seed)
    slots_total = b * width + 40
    pool = torch.randn(slots_total + 1, 2 * kv_heads, dim, generator=gen).to(dtype)
    pool[slots_total].zero_()
    order = torch.randperm(slots_total, generator=gen)
    lens = torch.randint(1, width + 1, (b,), generator=gen)
    lens[0] = width
    slots = torch.full((b, width), slots_total)
    mask = torch.zeros(b, width)
    for i, n in enumerate(lens.tolist()):
        slots[i, :n] = order[i * width : i * width + n]
        mask[i, n:] = float("-inf")
        if window is not None and n > window + 4:
            mask[i, 4 : n - window] = float("-inf")
    q = torch.randn(b, kv_heads * group, dim, generator=gen).to(dtype)
    return q, pool, slots, lens, mask


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("b", "width", "kv_heads", "group", "dim", "window"),
    [
        (1, 1, 1, 1, 64, None),  # a first decode step: one key
        (1, 300, 3, 3, 64, None),  # one sequence: its heads split over the threads
        (5, 70, 3, 3, 64, None),  # SmolLM2's heads, rows of different lengths
        (7, 40, 2, 4, 128, 9),  # cache window: keys in the middle masked out
        (3, 33, 4, 1, 48, None),  # no GQA, a head size that is not a multiple of 32
    ],
)
def test_matches_gather_and_sdpa(b, width, kv_heads, group, dim, window, dtype) -> None:
    assert paged_decode.kernel().available, paged_decode.status()
    q, pool, slots, lens, mask = case(b, width, kv_heads, group, dim, dtype, window=window)
    got = paged_decode.paged_attention(q, pool, slots, lens, mask)
    want = gather_attention(q, pool, slots, mask[:, None, None, :].to(dtype))
    assert got.dtype == dtype and got.shape == (b, kv_heads * group * dim)
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@needs_kernel
def test_a_sequence_gets_the_same_bits_alone_or_in_any_batch() -> None:
    q, pool, slots, lens, mask = case(6, 90, 3, 3, 64, torch.float32, seed=1)
    together = paged_decode.paged_attention(q, pool, slots, lens, mask)
    for i in range(6):
        n = int(lens[i])
        alone = paged_decode.paged_attention(
            q[i : i + 1], pool, slots[i : i + 1, :n], lens[i : i + 1], mask[i : i + 1, :n]
        )
        assert torch.equal(alone[0], together[i])
    for threads in (1, 3):
        torch.set_num_threads(threads)
        try:
            assert torch.equal(paged_decode.paged_attention(q, pool, slots, lens, mask),
                               together)  # fmt: skip
        finally:
            torch.set_num_threads(int(os.environ["INFERSIGHT_THREADS"]))


@needs_kernel
def test_the_engine_decodes_through_the_kernel(tiny_model_dir, monkeypatch) -> None:
    from engine.core.sampling import SamplingParams

    folder, _ = tiny_model_dir("llama", False)
    engine = load_model(folder)
    assert paged_decode.kernel().available  # built and checked before counting
    calls = []
    real = paged_decode._call
    monkeypatch.setattr(paged_decode, "_call", lambda *a: calls.append(a[1].shape[0]) or real(*a))
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    fast = [list(engine.generate([5, 6, 7, 8], params)) for _ in range(2)]
    assert calls and set(calls) == {1}  # batch-1 decode steps, one call per layer
    assert len(calls) == 5 * engine.cfg.num_layers * 2
    with paged_decode.portable():
        calls.clear()
        slow = list(engine.generate([5, 6, 7, 8], params))
    assert not calls
    assert [e.token_id for e in slow] == [e.token_id for e in fast[0]]


def test_gather_by_request_and_a_machine_without_a_compiler(monkeypatch) -> None:
    from engine.hardware.cpu_paths import FORCE_ENV

    monkeypatch.delenv(FORCE_ENV, raising=False)  # the reasons below come before the level's
    monkeypatch.setenv(paged_decode.ENV, "gather")
    assert not paged_decode.kernel().available
    assert "INFERSIGHT_ATTENTION=gather" in paged_decode.status()
    paged_decode.kernel.cache_clear()
    monkeypatch.setenv(paged_decode.ENV, "fast")
    with pytest.raises(ValueError, match="paged, gather"):
        paged_decode.kernel()
    paged_decode.kernel.cache_clear()
    monkeypatch.delenv(paged_decode.ENV)
    monkeypatch.setattr(native, "compiler", lambda: None)
    assert "no C compiler" in paged_decode.status()
    q, pool, *_ = case(2, 10, 1, 2, 16, torch.float32)
    assert not paged_decode.usable(q, pool)


@needs_kernel
def test_built_once_per_machine(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("INFERSIGHT_HOME", str(tmp_path))
    assert paged_decode.kernel().available
    (built,) = (tmp_path / "kernels").iterdir()
    stamp = built.stat().st_mtime_ns
    paged_decode.kernel.cache_clear()
    assert paged_decode.kernel().available
    assert built.stat().st_mtime_ns == stamp


@needs_compiler
def test_the_forced_cpu_level_decides_the_build(tmp_path: Path, monkeypatch) -> None:
    from engine.hardware.cpu_paths import FORCE_ENV

    monkeypatch.setenv("INFERSIGHT_HOME", str(tmp_path))
    monkeypatch.setenv(FORCE_ENV, "DEFAULT")
    assert "DEFAULT" in paged_decode.status() and not paged_decode.kernel().available
    paged_decode.kernel.cache_clear()
    monkeypatch.setenv(FORCE_ENV, "AVX2")
    if native.isa_flags():  # x86-64: an AVX2 build, apart from the native one
        assert native.isa_flags() == ["-mavx2", "-mfma"]
    assert paged_decode.kernel().available
    q, pool, slots, lens, mask = case(4, 50, 3, 3, 64, torch.float32, seed=2)
    want = gather_attention(q, pool, slots, mask[:, None, None, :])
    torch.testing.assert_close(paged_decode.paged_attention(q, pool, slots, lens, mask), want,
                               atol=2e-6, rtol=2e-6)  # fmt: skip


# -- prefill chunks ------------------------------------------------------------------------

#: The builds this machine makes: its own (None) and, on x86-64, each level below it that
#: ``INFERSIGHT_CPU_CAPABILITY`` can force (DEFAULT: the portable C, no vector extensions).
OWN = forced_level() or native_level()
LOWER = [lvl for lvl in LEVELS if native.isa_flags() and LEVELS.index(lvl) < LEVELS.index(OWN)]


@pytest.fixture(scope="module", params=[None, *LOWER], ids=lambda level: level or "native")
def built_at(request: pytest.FixtureRequest) -> paged_decode.Kernel:
    cc = native.compiler()
    if cc is None:
        pytest.skip("no C compiler: the portable path runs")
    path, why = native.built(paged_decode.SOURCE, native.isa_flags(request.param))
    assert path is not None, why
    return paged_decode._load(path)


def prefill_case(length: int, start: int, kv_heads: int, group: int, dim: int, dtype,
                 sink: int = 0, window: int = 0, seed: int = 0):  # fmt: skip
    """A chunk of ``length`` queries after ``start`` cached tokens, its keys' slots scattered in
    the pool; with a window, the keys it gave back (between the sink and the chunk's first
    query's window) are no longer held."""
    gen = torch.Generator().manual_seed(seed)
    positions = torch.arange(start + length)
    if window:
        positions = positions[(positions < sink) | (positions > start - window)]
    total = 2 * positions.numel() + 7
    pool = torch.randn(total, 2 * kv_heads, dim, generator=gen).to(dtype)
    slots = torch.randperm(total, generator=gen)[: positions.numel()]
    q = torch.randn(length, kv_heads * group, dim, generator=gen).to(dtype)
    return q, pool, slots, positions


def float64_attention(q, pool, slots, positions, start, sink, window, cap: float = 0.0):
    """Textbook attention in float64: K/V repeated per query head, scores soft-capped at
    ``cap`` (0: not), mask, softmax."""
    length, heads, dim = q.shape
    kv_heads = pool.shape[1] // 2
    rows = pool.index_select(0, slots).double()
    k = rows[:, :kv_heads].repeat_interleave(heads // kv_heads, dim=1)  # [T, H, D]
    v = rows[:, kv_heads:].repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("lhd,thd->hlt", q.double(), k) / dim**0.5
    if cap:
        scores = cap * torch.tanh(scores / cap)
    queries = torch.arange(start, start + length)[:, None]
    seen = positions[None, :] <= queries
    if window:
        seen &= (positions[None, :] > queries - window) | (positions[None, :] < sink)
    scores = scores.masked_fill(~seen, float("-inf"))
    return torch.einsum("hlt,thd->lhd", scores.softmax(-1), v).reshape(length, heads * dim)


PREFILL_CASES = [
    (1, 0, 3, 3, 64, 0, 0),  # one query: the decode kernel's case
    (37, 0, 3, 3, 64, 0, 0),  # SmolLM2's heads, a first chunk shorter than a tile of queries
    (70, 50, 2, 4, 128, 0, 0),  # after a cached prefix, over three tiles of queries
    (70, 200, 3, 3, 64, 4, 60),  # a cache window with a sink: keys 4…140 were given back
    (33, 5, 4, 1, 32, 2, 10),  # no GQA, a window shorter than the chunk
    (20, 9, 2, 4, 8, 0, 0),  # the tiny test models' head size: eight dimensions
    (26, 0, 2, 2, 44, 0, 0),  # 32 + 8 + 4 dimensions: every part of the value product
    (100, 0, 1, 8, 64, 0, 0),  # eight query heads on one KV head
]


# These two build every level below this process's own themselves: the AVX2 leg would build
# and test what the main run on an AVX-512 machine already does.
@pytest.mark.no_engine_paths
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("length", "start", "kv_heads", "group", "dim", "sink", "window"),
                         PREFILL_CASES)  # fmt: skip
def test_the_prefill_kernel_matches_float64_attention(
    built_at, length, start, kv_heads, group, dim, sink, window, dtype
) -> None:
    q, pool, slots, positions = prefill_case(length, start, kv_heads, group, dim, dtype, sink,
                                             window)  # fmt: skip
    got = paged_decode._call_prefill(built_at, q, pool, slots, positions, start, sink, window)
    want = float64_attention(q, pool, slots, positions, start, sink, window)
    assert got.dtype == dtype and got.shape == want.shape
    # fp32 arithmetic from the same inputs; a bf16 result is rounded once more at the end
    tol = 2e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got.double(), want.to(dtype).double(), atol=tol, rtol=tol)


@pytest.mark.no_engine_paths
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("length", "start", "kv_heads", "group", "dim", "sink", "window"),
    [PREFILL_CASES[2], PREFILL_CASES[3], PREFILL_CASES[6]],
)
def test_soft_capped_scores_match_float64_attention(
    built_at, length, start, kv_heads, group, dim, sink, window, dtype
) -> None:
    """Gemma 2's ``cap · tanh(s / cap)`` of each score before the mask, at a cap of 1.5 that
    these scores (about N(0, 1)) reach: a prefill chunk, and the same keys as one decode row
    per query (its last)."""
    q, pool, slots, positions = prefill_case(length, start, kv_heads, group, dim, dtype, sink,
                                             window, seed=4)  # fmt: skip
    cap, tol = 1.5, 2e-6 if dtype == torch.float32 else 8e-3
    got = paged_decode._call_prefill(built_at, q, pool, slots, positions, start, sink, window, cap)
    want = float64_attention(q, pool, slots, positions, start, sink, window, cap)
    torch.testing.assert_close(got.double(), want.to(dtype).double(), atol=tol, rtol=tol)
    assert not torch.allclose(want, float64_attention(q, pool, slots, positions, start, sink,
                                                      window), atol=1e-2)  # fmt: skip
    last = q[-1:]  # the chunk's last query, as a decode step: every held key, one row
    mask = torch.zeros(1, positions.numel())
    if window:
        query = start + length - 1
        hidden = (positions <= query - window) & (positions >= sink)
        mask[0, hidden] = float("-inf")
    got = paged_decode._call(built_at, last, pool, slots[None], torch.tensor([slots.numel()]),
                             mask, cap)  # fmt: skip
    torch.testing.assert_close(got.double(), want[-1:].to(dtype).double(), atol=tol, rtol=tol)


@pytest.mark.no_engine_paths
def test_fp32_queries_over_a_bf16_pool_keep_their_precision(built_at) -> None:
    """Only queries of bf16 values take the bf16 dot products: fp32 queries over a bf16 pool
    (the bf16 KV cache of an fp32 model) are multiplied in fp32, not cut to bf16 first."""
    q, pool, slots, positions = prefill_case(70, 50, 2, 4, 128, torch.bfloat16, seed=5)
    q = q.float() + torch.randn(q.shape, generator=torch.Generator().manual_seed(6)) * 1e-3
    got = paged_decode._call_prefill(built_at, q, pool, slots, positions, 50, 0, 0)
    want = float64_attention(q, pool, slots, positions, 50, 0, 0)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=2e-6)


@pytest.mark.no_engine_paths
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_query_gets_the_same_bits_in_any_chunk_and_thread_count(built_at, dtype) -> None:
    """A query's output depends on its own position and keys only: not on the chunk it came
    in (where its tile of queries starts) nor on the threads."""
    q, pool, slots, positions = prefill_case(90, 30, 3, 3, 64, dtype, seed=3)
    whole = paged_decode._call_prefill(built_at, q, pool, slots, positions, 30, 0, 0)
    for cut in (1, 32, 57):  # a later chunk starting at each of these queries
        tail = paged_decode._call_prefill(built_at, q[cut:], pool, slots, positions, 30 + cut, 0, 0)
        assert torch.equal(tail, whole[cut:])
    for threads in (1, 3):
        torch.set_num_threads(threads)
        try:
            again = paged_decode._call_prefill(built_at, q, pool, slots, positions, 30, 0, 0)
            assert torch.equal(again, whole)
        finally:
            torch.set_num_threads(int(os.environ["INFERSIGHT_THREADS"]))


@needs_kernel
@pytest.mark.parametrize("window", [None, (4, 24)], ids=["causal", "window"])
def test_the_engine_prefills_through_the_kernel(tiny_model_dir, monkeypatch, window) -> None:
    """Prompts computed in chunks after cached prefixes (and under a cache window) give the
    portable path's tokens, every prefill chunk through the kernel."""
    from engine.core.config import EngineConfig
    from engine.core.sampling import SamplingParams
    from engine.core.scheduler import SchedulerLimits
    from engine.kv_cache.window import CacheWindow

    folder, _ = tiny_model_dir("llama", False)
    monkeypatch.setenv(paged_decode.ENV, "paged")  # not SDPA, wherever it measured faster
    config = EngineConfig(
        num_blocks=64,
        limits=SchedulerLimits(max_tokens_per_step=24),  # a 60-token prompt: three chunks
        window=None if window is None else CacheWindow(*window),
    )
    engine = load_model(folder, config=config)
    assert paged_decode.reads_pool(engine.kv.kv[0]), paged_decode.status()
    calls = []
    real = paged_decode._call_prefill
    monkeypatch.setattr(
        paged_decode, "_call_prefill", lambda *a: calls.append(a[1].shape[0]) or real(*a)
    )
    prompt = [(7 * i + 3) % 300 for i in range(60)]
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    fast = [e.token_id for e in engine.generate(prompt, params)]
    assert sorted(set(calls)) == [12, 24]  # chunks of 24, 24 and 12 queries, in every layer
    assert len(calls) == 3 * engine.cfg.num_layers
    with paged_decode.portable():
        calls.clear()
        engine.clear_prefix_cache()
        slow = [e.token_id for e in engine.generate(prompt, params)]
    assert not calls
    assert slow == fast


def test_a_chunk_under_two_windows_takes_the_portable_path() -> None:
    from engine.kv_cache.window import CacheWindow, _one_window

    mine, models = CacheWindow(4, 24), CacheWindow(0, 32)
    assert _one_window(None, None) == (True, None)
    assert _one_window(mine, None) == (True, mine)
    assert _one_window(None, models) == (True, models)
    assert _one_window(mine, mine) == (True, mine)
    assert _one_window(mine, models) == (False, None)


@needs_kernel
@pytest.mark.parametrize("ours", [True, False])
def test_prefill_chunks_take_the_path_measured_faster(
    tiny_model_dir, monkeypatch, fresh_measurements, ours
):
    """The paged prefill kernel against gather + SDPA is timed once per machine, dtype and
    shape (kept in kernels.json); prefill chunks take the faster, the load report says which,
    and both give the same tokens."""
    from engine.core.sampling import SamplingParams
    from engine.kernels import lowbit

    monkeypatch.setattr(paged_decode, "_measured_faster", functools.cache(
        paged_decode._measured_faster.__wrapped__))  # fmt: skip
    timings = []

    def timed(*shape):
        timings.append(shape)
        return lowbit.Timing(ours_ms=1.0 if ours else 3.0, torch_ms=2.0)

    monkeypatch.setattr(paged_decode, "time_prefill", timed)
    folder, _ = tiny_model_dir("llama", False)
    engine = load_model(folder)
    cfg = engine.cfg
    # a verdict against ours is timed twice (engine/hardware/verdicts.py)
    shape = (torch.float32, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    assert timings == [shape] * (1 if ours else 2)
    assert ("the paged kernel (measured faster" if ours else "gather + SDPA (measured") in (
        engine.kernels
    )
    calls = []
    real = paged_decode._call_prefill
    monkeypatch.setattr(paged_decode, "_call_prefill", lambda *a: calls.append(1) or real(*a))
    prompt = [(5 * i + 1) % 300 for i in range(40)]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    got = [e.token_id for e in engine.generate(prompt, params)]
    assert bool(calls) == ours
    paged_decode._measured_faster.cache_clear()
    load_model(folder)  # the verdict is kept in kernels.json: no more timing
    assert len(timings) == (1 if ours else 2)
    engine.clear_prefix_cache()
    with paged_decode.portable():
        assert [e.token_id for e in engine.generate(prompt, params)] == got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (4, 4)])
def test_a_whole_prompt_attends_causally_without_a_mask(dtype, heads, kv_heads) -> None:
    """A prompt over its own keys hands SDPA ``is_causal`` (and its own GQA) instead of a
    mask: the masked call's values, within the dtype's rounding."""
    from engine.model.attention import grouped_attention

    gen = torch.Generator().manual_seed(heads)
    q = torch.randn(37, heads, 16, generator=gen).to(dtype)
    k, v = (torch.randn(kv_heads, 37, 16, generator=gen).to(dtype) for _ in range(2))
    mask = torch.ones(37, 37, dtype=torch.bool).tril()
    got = grouped_attention(q, k, v, None, causal=True)
    want = grouped_attention(q, k, v, mask)
    tol = 1e-6 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    first = grouped_attention(q[:1], k[:, :1], v[:, :1], None)  # query 0 sees key 0 only
    torch.testing.assert_close(got[:1].float(), first.float(), rtol=tol, atol=tol)


def test_sdpa_falls_back_to_its_math_backend_where_the_fused_kernel_refuses(monkeypatch) -> None:
    """torch's CPU flash attention refuses bf16 on an AMX CPU held below AVX-512 (the AVX2
    leg of the tests runs there); the call then takes SDPA's math backend, the same values,
    and so does every later one."""
    from engine.model import attention

    monkeypatch.setattr(attention, "_FUSED_REFUSED", False)
    real = torch.nn.functional.scaled_dot_product_attention
    calls = []

    def refusing(*args, **kwargs):
        calls.append(attention._FUSED_REFUSED)
        if not attention._FUSED_REFUSED:
            raise RuntimeError("pack_vnni2 is only supported when avx512 is supported")
        return real(*args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", refusing)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=gen) for _ in range(3))
    got = attention.sdpa(q, k, v, is_causal=True)
    torch.testing.assert_close(got, real(q, k, v, is_causal=True))
    attention.sdpa(q, k, v)
    assert calls == [False, True, True]  # refused once, then straight to the math backend
    monkeypatch.setattr(attention, "_FUSED_REFUSED", False)

    def failing(*args, **kwargs):
        raise RuntimeError("other")

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", failing)
    with pytest.raises(RuntimeError, match="other"):  # any other error is not swallowed
        attention.sdpa(q, k, v)
