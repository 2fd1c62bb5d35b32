"""Thread counts (engine/hardware/threads.py): asked for, or timed once per machine and model."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from engine.hardware import threads
from engine.loader.load import load_model
from engine.model.inventory import linear_modules


@pytest.fixture
def untimed(fresh_measurements, monkeypatch) -> Iterator[list[int]]:
    """No count asked for, an empty cache, four cores; yields the counts that were timed."""
    monkeypatch.delenv(threads.ENV, raising=False)
    monkeypatch.setattr(threads, "_asked", None)
    monkeypatch.setattr(threads, "DEFAULT_THREADS", 4)
    timed: list[int] = []
    fake_ms = {1: 3.0, 2: 1.0, 4: 2.0}

    def fake(linears, dtype, count):
        timed.append(count)
        return fake_ms[count]

    monkeypatch.setattr(threads, "_time_linears", fake)
    threads._verdicts.cache_clear()
    before = torch.get_num_threads()
    yield timed
    torch.set_num_threads(before)
    threads._verdicts.cache_clear()


def test_candidates_double_up_to_the_default():
    assert threads.candidates(1) == [1]
    assert threads.candidates(2) == [1, 2]
    assert threads.candidates(6) == [1, 2, 4, 6]


def test_the_fastest_count_is_taken_and_kept(tiny_model_dir, untimed):
    folder, _ = tiny_model_dir("llama", True)
    engine = load_model(folder)
    assert torch.get_num_threads() == 2
    assert untimed == [1, 2, 4] * 3  # three interleaved rounds
    report = threads.settle_threads(linear_modules(engine.model), torch.float32)
    assert report.startswith("2 threads") and report.endswith("kept)")
    assert len(untimed) == 9  # read back, not timed again
    threads._verdicts.cache_clear()
    threads.settle_threads(linear_modules(engine.model), torch.float32)  # a new process reads it
    assert len(untimed) == 9


def test_the_default_holds_unless_another_count_is_clearly_faster(
    tiny_model_dir, untimed, monkeypatch
):
    folder, _ = tiny_model_dir("llama", True)
    model = load_model(folder).model  # 2 threads (1.0 ms) beat 4 (2.0 ms) by far
    monkeypatch.setattr(threads, "_time_linears", lambda _l, _d, n: {1: 3.0, 2: 1.9, 4: 2.0}[n])
    # a new verdict (another dtype): 2 threads are only 5% faster than the default
    assert threads.settle_threads(linear_modules(model), torch.float64).startswith("4 threads")


def test_a_count_asked_for_is_never_timed(tiny_model_dir, untimed, monkeypatch):
    monkeypatch.setenv(threads.ENV, "1")
    folder, _ = tiny_model_dir("llama", True)
    load_model(folder)
    assert torch.get_num_threads() == 1 and untimed == []
    monkeypatch.delenv(threads.ENV)
    threads.set_threads(3)  # --threads wins over the timing too
    load_model(folder)
    assert torch.get_num_threads() == 3 and untimed == []


def test_real_timing_gives_a_time_per_count(tiny_model_dir):
    """The figure is the best of the call's rounds (a warm-up and three), each running every
    linear once at the count asked for: so four of it fit in the call's own time."""
    folder, _ = tiny_model_dir("llama", True)
    model = load_model(folder).model
    linears = linear_modules(model)
    calls: list[int] = []
    hooks = [m.register_forward_hook(lambda *_: calls.append(torch.get_num_threads()))
             for m in linears]  # fmt: skip
    before = torch.get_num_threads()
    try:
        started = time.perf_counter()
        ms = threads._time_linears(linears, torch.float32, 1)
        took = time.perf_counter() - started
    finally:
        for hook in hooks:
            hook.remove()
    assert calls == [1] * (4 * len(linears))  # four rounds of every linear, at 1 thread
    assert torch.get_num_threads() == before  # and the count it had is back
    assert 0 < 4 * ms / 1e3 <= took


def test_a_c_decode_step_settles_the_count_on_its_own_steps(tiny_model_dir, untimed,
                                                             monkeypatch):  # fmt: skip
    """Where decode steps run in one C call, the load times that step at each count (three
    interleaved rounds, on a scratch sequence it frees again) and takes the fastest, kept
    under a key that names the step's kernels: the linears' probe, which calls each from
    Python, is not what decode runs."""
    from engine.kernels import lowbit, native
    from engine.loader import load

    if native.compiler() is None:
        pytest.skip("no C compiler: our CPU kernels are not built here")
    stepped: list[int] = []
    step_ms = {1: 5.0, 2: 9.0, 4: 2.0}
    time_step = load._time_step

    def fake(engine, count):
        stepped.append(count)
        assert time_step(engine, count) > 0  # the real step runs at that count
        return step_ms[count]

    monkeypatch.setattr(load, "_time_step", fake)
    folder, _ = tiny_model_dir("llama", False, intermediate_size=128)
    with lowbit.choosing("ours"):
        engine = load_model(folder)
    assert engine.runner.executor.c_step is not None, engine.kernels
    assert untimed == [1, 2, 4] * 3 and stepped == [1, 2, 4] * 3
    assert torch.get_num_threads() == 4  # the step's fastest, where the linears' said 2
    assert engine.threads_report.startswith("4 threads, the fastest for this model's decode")
    assert engine.kv.manager.num_free == engine.kv.manager.num_blocks  # the scratch is gone
    with lowbit.choosing("ours"):
        again = load_model(folder)
    assert len(stepped) == 9 and again.threads_report.endswith("kept)")
