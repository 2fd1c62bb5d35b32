"""The paged decode kernel (engine/kernels/paged_decode.py, engine/kernels/csrc/paged_decode.c):
the same attention as the portable gather + SDPA path for every shape the engine makes,
batch-invariant to the bit, used by the engine's decode steps, and a clear fallback where it
cannot run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engine.kernels import native, paged_decode
from engine.kernels.gather_attention import gather_attention
from engine.loader.load import load_model

needs_compiler = pytest.mark.skipif(
    native.compiler() is None, reason="no C compiler: the portable path runs"
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


@needs_compiler
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


@needs_compiler
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


@needs_compiler
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


@needs_compiler
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
