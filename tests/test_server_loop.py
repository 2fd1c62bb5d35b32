"""The server's engine loop and health in-process, on a tiny model: a step that runs out of
memory fails its requests, lets the held-back margin go and serving goes on; the self-test
holds the first answer and turns /health's status when a later one differs."""

from __future__ import annotations

import asyncio
import queue
import time
from pathlib import Path

import pytest
import torch

from app.server import EngineLoop, SelfTest, Server
from app.server_metrics import ServerMetrics
from engine.engine import LLMEngine, TokenEvent
from engine.sampling import SamplingParams


@pytest.fixture
def tiny_engine(tiny_model_dir) -> LLMEngine:
    folder, _ = tiny_model_dir("llama", False)
    return LLMEngine.load(folder)


def collect(loop: EngineLoop, rid: str, prompt: list[int]) -> list[TokenEvent | BaseException]:
    got: queue.Queue[TokenEvent | BaseException] = queue.Queue()
    loop.submit(rid, prompt, SamplingParams(max_new_tokens=4), 30.0, got.put)
    out = []
    while True:
        item = got.get(timeout=60)
        out.append(item)
        if isinstance(item, BaseException) or item.finish_reason is not None:
            return out


def test_running_out_of_memory_fails_the_step_lets_the_margin_go_and_serving_goes_on(
    tiny_engine, monkeypatch
):
    loop = EngineLoop(tiny_engine, ServerMetrics("tiny"), margin_bytes=1 << 20)
    assert loop.margin_held
    real_step, calls = tiny_engine.step, []

    def step() -> list[TokenEvent]:
        calls.append(1)
        if len(calls) == 2:  # the second step of the first request
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_step()

    monkeypatch.setattr(tiny_engine, "step", step)
    loop.start()
    try:
        failed = collect(loop, "a", [5, 6, 7])
        assert isinstance(failed[-1], torch.OutOfMemoryError) and loop.out_of_memory == 1
        assert tiny_engine.kv.manager.num_used == 0  # its blocks came back
        after = collect(loop, "b", [5, 6, 7])  # the next request is served
        assert isinstance(after[-1], TokenEvent) and after[-1].finish_reason == "length"
        deadline = time.monotonic() + 10
        while not loop.margin_held and time.monotonic() < deadline:
            time.sleep(0.01)
        assert loop.margin_held  # taken again once the engine was idle
    finally:
        loop.stop()
    assert loop.metrics.request_errors._value.get() == 1  # type: ignore[attr-defined]


def test_the_self_test_keeps_the_first_answer_and_a_different_one_fails_health(tiny_engine):
    test = SelfTest()
    test.record("4", None)
    assert (test.ok, test.answer) == (True, "4")
    test.record("5", None)
    assert test.ok is False and "not '4'" in (test.error or "")
    test.record("", None)
    assert test.error == "the answer was empty"

    server = Server(tiny_engine, name="tiny")
    server.loop.start()
    try:
        asyncio.run(server.run_self_test())
        assert server.self_test.ok and server.health()["status"] == "ok"
        server.self_test.answer = "something else"  # as if the model now answered otherwise
        asyncio.run(server.run_self_test())
        health = server.health()
        assert health["status"] == "unavailable"
        assert any("self-test failed" in p for p in health["problems"])
    finally:
        server.loop.stop()


def test_health_names_a_stopped_engine(tiny_engine: LLMEngine, tmp_path: Path) -> None:
    server = Server(tiny_engine, name="tiny")
    health = server.health()  # the loop was never started
    assert health["status"] == "unavailable" and "stopped" in health["problems"][0]
