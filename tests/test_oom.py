"""Running out of memory in a step, and the CUDA allocator's setting.

The recovery (:mod:`engine.core.recovery`) that ``infersight serve``'s loop and the app's worker
share, on a tiny model: a prompt that runs out is computed again in smaller chunks, to the
same tokens; a decode step that runs out ends only the largest request. Then the app's real
window: the reply ends with a message or completes, the chat keeps its history and the next
message is answered. Last, the ``infersight`` command's allocator setting, without CUDA.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest
import torch

from app.cli.common import CUDA_ALLOC_CONF, configure_cuda_allocator
from app.cli.main import main
from app.gui.main_window import MainWindow
from engine.core.engine import LLMEngine
from engine.core.output import TokenEvent
from engine.core.recovery import MIN_CHUNK, StepRecovery
from engine.core.sampling import SamplingParams
from engine.loader.load import load_model
from tests.app_window import LONG_WAIT_MS, send, stored

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)


def run_out(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch, at: Callable[[int], bool]) -> None:
    """The model's forward runs out of memory on the calls ``at`` picks (1 is the first)."""
    real, calls = engine.model.forward, [0]

    def forward(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        if at(calls[0]):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", forward)


def drive(engine: LLMEngine, recovery: StepRecovery) -> tuple[dict[str, list[int]], set[str]]:
    """Step until idle: each request's tokens, and the requests the recovery ended."""
    tokens: dict[str, list[int]] = {}
    failed: set[str] = set()
    while engine.has_work():
        stepped = recovery.step(engine)
        failed |= set(stepped.failed)
        for event in stepped.events:
            assert event.request_id not in failed  # an ended request sends nothing more
            if event.token_id is not None:
                tokens.setdefault(event.request_id, []).append(event.token_id)
    return tokens, failed


@pytest.fixture
def tiny(tiny_model_dir) -> Callable[[], LLMEngine]:
    folder, _ = tiny_model_dir("llama", False)
    return lambda: load_model(folder)


def prompt(n: int, offset: int = 0) -> list[int]:
    return [5 + (offset + i) % 300 for i in range(n)]


# -- the shared recovery, on a tiny model -------------------------------------------------------


def test_a_prompt_that_runs_out_is_computed_again_in_half_the_chunk_to_the_same_tokens(
    tiny, monkeypatch
):
    alone = tiny()
    alone.add_request(prompt(100), GREEDY, request_id="a")
    expected, _ = drive(alone, StepRecovery())

    engine, recovery = tiny(), StepRecovery(margin_bytes=1 << 10)
    recovery.reserve(engine.device)
    assert recovery.margin_held
    run_out(engine, monkeypatch, lambda call: call == 1)  # the prompt's first chunk
    engine.add_request(prompt(100), GREEDY, request_id="a")
    tokens, failed = drive(engine, recovery)
    assert tokens == expected and not failed
    assert engine.scheduler.limits.max_tokens_per_step == 50  # min(512, 100) // 2
    assert (recovery.out_of_memory, recovery.chunks_lowered) == (1, 1)
    assert not recovery.margin_held  # let go for the recovery; the front end takes it again
    assert engine.kv.manager.num_used == 0


def test_a_decode_step_that_runs_out_ends_only_the_largest_request(tiny, monkeypatch):
    alone = tiny()
    alone.add_request(prompt(10), GREEDY, request_id="small")
    expected, _ = drive(alone, StepRecovery())

    engine, recovery = tiny(), StepRecovery()
    run_out(engine, monkeypatch, lambda call: call == 3)  # the prefill, a decode, this one
    engine.add_request(prompt(10), GREEDY, request_id="small")
    engine.add_request(prompt(30, 50), GREEDY, request_id="large")
    tokens, failed = drive(engine, recovery)
    assert failed == {"large"} and tokens["small"] == expected["small"]
    assert recovery.requests_failed == 1 and recovery.chunks_lowered == 0
    assert engine.kv.manager.num_used == 0 and not engine.seqs


def test_a_step_that_keeps_running_out_lowers_the_chunk_to_the_least_then_ends_each_request(
    tiny, monkeypatch
):
    engine, recovery = tiny(), StepRecovery()
    run_out(engine, monkeypatch, lambda call: True)
    engine.add_request(prompt(20), GREEDY, request_id="b")
    engine.add_request(prompt(40, 7), GREEDY, request_id="a")
    stepped = recovery.step(engine)  # one call: it stops once nothing is left to try
    # 40 → 20 → 16 tokens a step, then the 40-token request ends, then the 20-token one
    assert list(stepped.failed) == ["a", "b"] and stepped.chunk == (512, MIN_CHUNK)
    assert (recovery.out_of_memory, recovery.chunks_lowered) == (4, 2)
    assert all(isinstance(e, torch.OutOfMemoryError) for e in stepped.failed.values())
    assert not stepped.events and not engine.has_work()
    assert engine.kv.manager.num_used == 0


def test_the_ends_a_step_that_ran_out_had_taken_up_are_still_sent(tiny, monkeypatch):
    """A cancellation waiting in the engine and a timeout found by the failed step's schedule
    are events that step had taken: they still arrive."""
    engine, recovery = tiny(), StepRecovery()
    engine.add_request(prompt(30), GREEDY, request_id="runs")
    assert not recovery.step(engine).failed  # "runs" decodes from now on
    run_out(engine, monkeypatch, lambda call: call == 1)  # its next token
    engine.add_request(prompt(10, 3), GREEDY, request_id="gone")
    engine.cancel("gone")  # its end waits in the engine for the next step
    engine.add_request(prompt(10, 9), GREEDY, request_id="late", timeout_s=0.0)
    stepped = recovery.step(engine)
    ends = {e.request_id: e.finish_reason for e in stepped.events if e.finish_reason}
    assert ends == {"gone": "cancelled", "late": "timeout"}
    assert list(stepped.failed) == ["runs"] and not engine.has_work()


# -- the app: a real window on the default model ------------------------------------------------


@pytest.mark.real_model
@pytest.mark.usefixtures("gui_gc")
def test_the_app_ends_a_reply_that_runs_out_while_decoding_keeps_the_chat_and_answers_the_next(
    qtbot: object, window: MainWindow, monkeypatch: pytest.MonkeyPatch
) -> None:
    window.controls.max_new_tokens.set_value(4)  # the second reply runs out at its third token
    send(qtbot, window, "First question.")
    engine = window.worker.engine
    assert engine is not None
    run_out(engine, monkeypatch, lambda call: call == 3)  # the prompt, a token, then this
    window.chat.input.setPlainText("Second question.")
    window.chat._submit()
    qtbot.waitUntil(lambda: window.active is None, timeout=LONG_WAIT_MS)  # type: ignore[attr-defined]
    reply = window.chat.last
    assert reply is not None and reply.view.status == "error"
    notice = window.chat.notice.text()
    assert "memory ran out for this reply" in notice and "shorten the conversation" in notice
    assert reply.view.text  # the token before it ran out is kept
    assert stored(window)[-1] == ("assistant", reply.view.text, "error")
    assert engine.kv.manager.num_used == 0  # nothing leaked
    assert window.worker.recovery.out_of_memory == 1 and window.worker.running
    assert window.engine_thread.isRunning()
    send(qtbot, window, "Third question.")
    assert window.chat.last is not None and window.chat.last.view.status == "done"
    assert window.chat.last.view.text
    assert [r for r, _, _ in stored(window)] == ["user", "assistant"] * 3


@pytest.mark.real_model
@pytest.mark.usefixtures("gui_gc")
def test_the_app_computes_a_prompt_that_ran_out_in_smaller_chunks_and_the_reply_completes(
    qtbot: object, window: MainWindow, oracle: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = (
        "Describe a small harbour at dawn: the fishing boats coming in, the gulls over the "
        "water, the smell of salt and diesel, and the people who work on the quay."
    )
    engine = window.worker.engine
    assert engine is not None
    chunk = engine.scheduler.limits.max_tokens_per_step
    run_out(engine, monkeypatch, lambda call: call == 1)  # the prompt's first chunk
    window.controls.max_new_tokens.set_value(12)  # a real answer on the recomputed cache
    send(qtbot, window, text)
    reply = window.chat.last
    assert reply is not None and reply.view.status == "done"
    ids = oracle.chat_prompt_ids([{"role": "user", "content": text}])
    gen = oracle.generate(ids, SamplingParams(max_new_tokens=12))
    for _ in gen:
        pass
    assert len(gen.result.token_ids) == 12
    assert reply.view.text == gen.result.text  # the same reply as without running out
    lowered = max(MIN_CHUNK, min(chunk, len(ids)) // 2)
    assert len(ids) > MIN_CHUNK and engine.scheduler.limits.max_tokens_per_step == lowered
    assert f"now computes prompts {lowered} tokens a step" in window.chat.notice.text()
    assert stored(window) == [("user", text, "done"), ("assistant", gen.result.text, "done")]
    assert window.worker.recovery.out_of_memory == 1


# -- the CUDA allocator -------------------------------------------------------------------------


def test_the_allocator_gets_expandable_segments_unless_the_user_set_it() -> None:
    absent: dict[str, str] = {}
    assert configure_cuda_allocator(absent, "linux") == CUDA_ALLOC_CONF
    assert absent == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    theirs = {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}
    assert configure_cuda_allocator(theirs, "linux") == "backend:cudaMallocAsync"
    assert theirs == {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}
    elsewhere: dict[str, str] = {}  # PyTorch has expandable segments on Linux only
    assert configure_cuda_allocator(elsewhere, "win32") is None and not elsewhere


@pytest.mark.parametrize("theirs", [None, "max_split_size_mb:128"])
def test_the_command_sets_the_allocator_first_thing(
    theirs: str | None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if theirs is None:
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    else:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", theirs)
    monkeypatch.setattr(sys, "platform", "linux")
    with pytest.raises(SystemExit):  # --help: the parser exits, after the setting
        main(["--help"])
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == (theirs or CUDA_ALLOC_CONF)
    assert not torch.cuda.is_initialized()


def test_events_of_an_idle_engine_pass_through(tiny) -> None:
    """No memory trouble: the recovery hands on exactly the engine's events."""
    engine, recovery = tiny(), StepRecovery()
    engine.add_request(prompt(5), GREEDY, request_id="a")
    events: list[TokenEvent] = []
    while engine.has_work():
        stepped = recovery.step(engine)
        assert stepped.out_of_memory == 0 and not stepped.failed and stepped.chunk is None
        events += stepped.events
    assert [e.finish_reason for e in events] == [None] * 5 + ["length"]
