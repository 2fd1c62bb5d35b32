"""Decode steps over static buffers (engine/executor/cuda_graphs.py), which a GPU replays as CUDA
graphs: on this CPU the same buffers, buckets and padding run eagerly (our Triton kernels in
Triton's interpreter), and must give what the plain engine gives, token for token."""

from __future__ import annotations

import pytest

from engine.core.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.executor import cuda_graphs
from engine.kv_cache.window import CacheWindow
from engine.loader.load import load_model
from tests.conftest import WIDE_HEADS
from tests.test_triton_engine import generate

NEW = 6
PROMPTS = [[5, 17, 33, 8], [9, 9, 41, 2, 77, 3, 12], [100, 4, 4]]


def test_buckets_are_powers_of_two_up_to_the_largest_batch():
    assert cuda_graphs.buckets(1) == (1,)
    assert cuda_graphs.buckets(16) == (1, 2, 4, 8, 16)
    assert cuda_graphs.buckets(12) == (1, 2, 4, 8, 12)


def test_the_mode_is_checked():
    with pytest.raises(InvalidRequestError, match="one of auto, on, off"):
        EngineConfig(cuda_graphs="sometimes")


def run(engine, prompts: list[list[int]]) -> list[list[int]]:
    return generate(engine, prompts, steps=NEW)


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("llama", False, **WIDE_HEADS)[0]


def test_where_they_run_and_why_not(folder, monkeypatch):
    plain = load_model(folder)
    assert plain.runner.static is None and "Triton" in plain.graphs.why
    monkeypatch.setenv("INFERSIGHT_KERNELS", "triton")
    auto = load_model(folder)
    assert auto.runner.static is None and "off on a CPU" in auto.graphs.why
    on = load_model(folder, config=EngineConfig(cuda_graphs="on"))
    assert on.runner.static is not None and "eager on cpu" in on.graphs.why
    from app.gui.worker import compute_paths  # the model's tooltip in the app

    paths = compute_paths(on)
    assert f"kernels: {on.kernels}" in paths and on.graphs.summary() in paths
    assert "interpreted" in on.kernels


def test_static_steps_give_the_plain_engines_tokens_in_padded_buckets(folder, monkeypatch):
    want = run(load_model(folder), PROMPTS)
    monkeypatch.setenv("INFERSIGHT_KERNELS", "triton")
    config = EngineConfig(cuda_graphs="on")
    engine = load_model(folder, config=config)
    static = engine.runner.static
    assert static is not None
    sizes: list[tuple[int, int]] = []  # (sequences, bucket) of each static step
    real_run = static.run

    def spy(batch):
        sizes.append((len(batch.ids), static.bucket(len(batch.ids))))
        return real_run(batch)

    monkeypatch.setattr(static, "run", spy)
    assert run(engine, PROMPTS) == want
    # every decode step of the three ran static, three rows padded to a bucket of four
    assert sizes and all(bucket == 4 for n, bucket in sizes if n == 3)
    assert sum(n for n, _ in sizes) == len(PROMPTS) * (NEW - 1)
    alone = run(engine, PROMPTS[:1])  # batch 1: no padding
    assert alone == want[:1]


def test_a_new_window_runs_eagerly_until_captured_again(folder, monkeypatch):
    monkeypatch.setenv("INFERSIGHT_KERNELS", "triton")
    engine = load_model(folder, config=EngineConfig(cuda_graphs="on"))
    static = engine.runner.static
    assert static is not None
    calls: list[int] = []
    real_run = static.run
    monkeypatch.setattr(static, "run", lambda batch: (calls.append(1), real_run(batch))[1])
    engine.set_window(CacheWindow(sink=2, window=8))
    run(engine, PROMPTS[:1])
    assert calls == []  # the step's window is not the one the buffers were built for
