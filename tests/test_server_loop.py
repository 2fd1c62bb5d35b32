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

from app.server.engine_loop import EngineLoop, SelfTest
from app.server.metrics import ServerMetrics
from app.server.routes import Server
from engine.core.engine import LLMEngine
from engine.core.output import TokenEvent
from engine.core.sampling import SamplingParams
from engine.loader.load import load_model


@pytest.fixture
def tiny_engine(tiny_model_dir) -> LLMEngine:
    folder, _ = tiny_model_dir("llama", False)
    return load_model(folder)


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


def test_a_cancel_ends_the_request_at_the_next_step_and_frees_its_blocks(tiny_engine):
    """Cancelled from its sink at its third token, on the engine's thread between two steps
    (as a handler's cancel can land): the next step gives only the end, nothing more."""
    loop = EngineLoop(tiny_engine, ServerMetrics("tiny"))
    got: queue.Queue[TokenEvent | BaseException] = queue.Queue()
    sent: list[object] = []

    def sink(event: TokenEvent | BaseException) -> None:
        sent.append(event)
        got.put(event)
        if len(sent) == 3:
            loop.cancel("long")

    loop.start()
    try:
        params = SamplingParams(max_new_tokens=200, ignore_eos=True)
        loop.submit("long", [5, 6, 7, 8], params, 30.0, sink)
        events = []
        while not events or events[-1].finish_reason is None:
            event = got.get(timeout=30)
            assert isinstance(event, TokenEvent)
            events.append(event)
        assert [e.token_id is not None for e in events] == [True, True, True, False]
        assert events[-1].finish_reason == "cancelled"
        assert tiny_engine.kv.manager.num_used == 0
    finally:
        loop.stop()


def test_a_request_that_waits_past_the_queue_timeout_gets_a_503(tiny_model_dir, monkeypatch):
    """A real HTTP server in this process (uvicorn on a thread) over an engine that runs one
    request at a time: the second waits past its 0.2 s queue timeout and is told so. Until
    the 503 arrives each step of the first takes at least 50 ms, so it is still running then
    (its 253 tokens take 12 s) however fast this CPU decodes."""
    import http.client
    import json
    import threading

    import uvicorn

    from app.server.routes import ServerLimits, bind
    from engine.core.config import EngineConfig
    from engine.core.scheduler import SchedulerLimits

    folder, _ = tiny_model_dir("llama", False)
    engine = load_model(folder, config=EngineConfig(limits=SchedulerLimits(max_batch_size=1)))
    told = threading.Event()  # the late request has its 503
    real_step = engine.step

    def step() -> list[TokenEvent]:
        told.wait(0.05)
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    server = Server(engine, name="tiny", limits=ServerLimits(queue_timeout_s=0.2, self_test_s=0))
    sock = bind("127.0.0.1", 0)  # held from here on: no other process can take the port
    port = int(sock.getsockname()[1])
    uv = uvicorn.Server(uvicorn.Config(server.app, log_level="warning"))
    thread = threading.Thread(target=uv.run, args=([sock],), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started and time.monotonic() < deadline:
        time.sleep(0.02)

    def post(body: dict[str, object]) -> http.client.HTTPResponse:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})  # fmt: skip
        return conn.getresponse()

    try:
        busy = post({"prompt": [5, 6, 7], "max_tokens": 2000, "stream": True, "temperature": 0})
        assert busy.fp.readline()  # it runs: the next one must wait
        late = post({"prompt": [9, 10, 11], "max_tokens": 4})
        error = json.loads(late.read())["error"]
        told.set()
        assert late.status == 503 and error["code"] == "queue_timeout"
        assert late.getheader("Retry-After")
        busy.close()
    finally:
        told.set()
        uv.should_exit = True
        thread.join(30)
        sock.close()


def test_metrics_carry_the_spec_decode_counters_of_a_speculative_engine(tiny_engine):
    """vLLM's spec_decode_* counters on /metrics equal the engine's own counts, position by
    position, and only grow (a new drafter starts its counts at zero)."""
    from engine.speculative.config import VerifyCost, parse_speculative

    tiny_engine.set_speculation(
        parse_speculative("lookup", 3, adaptive=False, ngram_min=1, verify_cost=VerifyCost())
    )
    metrics = ServerMetrics("tiny")
    piece = [5, 6, 7, 8, 9, 10]
    gen = tiny_engine.generate(piece * 3, SamplingParams(max_new_tokens=24, ignore_eos=True))
    for _ in gen:
        pass
    snap = tiny_engine.metrics()
    assert snap.spec_decode_num_draft_tokens > 0
    metrics.observe_engine(snap)
    tiny_engine.set_speculation(None)  # off: the snapshot's counts fall to zero
    metrics.observe_engine(tiny_engine.metrics())
    text = metrics.render()[0].decode()

    def value(name: str, extra: str = "") -> float:
        line = next(x for x in text.splitlines() if x.startswith(name + "{") and extra in x)
        return float(line.rsplit(" ", 1)[1])

    assert value("vllm:spec_decode_num_drafts_total") == snap.spec_decode_num_drafts
    assert value("vllm:spec_decode_num_draft_tokens_total") == snap.spec_decode_num_draft_tokens
    assert value("vllm:spec_decode_num_accepted_tokens_total") == (
        snap.spec_decode_num_accepted_tokens
    )
    for pos, accepted in enumerate(snap.spec_decode_num_accepted_tokens_per_pos):
        if accepted:
            name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
            assert value(name, f'position="{pos}"') == accepted


def test_the_counters_equal_the_served_tokens_under_speculative_decoding(tiny_model_dir):
    """Issue 47: with drafts accepted several a step, ``generation_tokens`` still counts each
    token a client got, ``prompt_tokens`` each prompt once at its first token, and a cancel
    is ``abort``; the self-test's request counts nowhere."""
    from app.server.engine_loop import SELF_TEST_ID
    from engine.speculative.config import parse_speculative

    folder, _ = tiny_model_dir("llama", False)
    engine = load_model(folder)
    engine.set_speculation(parse_speculative("lookup", k=4, adaptive=False))
    metrics = ServerMetrics("tiny")
    loop = EngineLoop(engine, metrics)
    loop.start()
    prompts = {"a": [5, 6, 7, 5, 6, 7, 5, 6], "b": [9, 10, 11, 9, 10, 11], "c": [3, 4] * 6,
               f"{SELF_TEST_ID}0": [8, 9, 10]}  # fmt: skip
    boxes = {rid: queue.Queue() for rid in prompts}
    try:
        for rid, ids in prompts.items():
            params = SamplingParams(max_new_tokens=24 if rid != "c" else 200, ignore_eos=True)
            loop.submit(rid, ids, params, 30.0, boxes[rid].put)
        got: dict[str, int] = {}
        for rid, box in boxes.items():
            tokens = 0
            while True:
                event = box.get(timeout=60)
                assert isinstance(event, TokenEvent)
                tokens += event.token_id is not None
                if rid == "c" and tokens == 5:
                    loop.cancel("c")
                if event.finish_reason is not None:
                    break
            got[rid] = tokens
    finally:
        loop.stop()
    assert engine.speculator is not None and engine.speculator.stats.num_accepted_tokens > 0
    served = [rid for rid in prompts if not rid.startswith(SELF_TEST_ID)]

    def sample(name: str, **labels: str) -> float:
        value = metrics.registry.get_sample_value(name, {"model_name": "tiny", **labels})
        return value or 0.0

    assert sample("vllm:generation_tokens_total") == sum(got[r] for r in served)
    assert sample("vllm:prompt_tokens_total") == sum(len(prompts[r]) for r in served)
    assert sample("vllm:request_success_total", finished_reason="abort") == 1
    assert sample("vllm:request_success_total", finished_reason="length") == 2
    assert sample("vllm:request_generation_tokens_sum") == sum(got[r] for r in served)
