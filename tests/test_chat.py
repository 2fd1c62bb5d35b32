"""The terminal chat keeps the conversation whatever happens to a reply."""

from __future__ import annotations

import io
import json
import shutil

import pytest

from app.cli.chat import ChatSession
from engine.core.engine import LLMEngine
from engine.core.sampling import SamplingParams
from engine.loader.load import load_model

TEMPLATE = (
    "{% for m in messages %}t1 {{ m['content'] }} t2 {% endfor %}"
    "{% if add_generation_prompt %}t3 {% endif %}"
)


@pytest.fixture()
def engine(tiny_model_dir, tmp_path) -> LLMEngine:
    folder, _ = tiny_model_dir("llama", True)
    copy = tmp_path / "chatty"
    shutil.copytree(folder, copy)
    (copy / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return load_model(copy)


def test_multi_turn_history_and_reset(engine):
    session = ChatSession(engine, SamplingParams(max_new_tokens=4, ignore_eos=True))
    out = io.StringIO()
    session.reply("t5 t6", out)
    session.reply("t7", out)
    assert [m["role"] for m in session.history] == ["user", "assistant", "user", "assistant"]
    assert session.history[2]["content"] == "t7"
    session.reset()
    assert session.history == []


def test_a_crash_mid_reply_keeps_the_chat_and_the_next_message_works(engine, monkeypatch):
    session = ChatSession(engine, SamplingParams(max_new_tokens=6, ignore_eos=True))
    out = io.StringIO()
    session.reply("t5", out)
    calls = {"n": 0}
    real_forward = engine.model.forward

    def failing_forward(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated kernel failure")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", failing_forward)
    session.reply("t8", out)
    assert "[error: RuntimeError: simulated kernel failure]" in out.getvalue()
    assert [m["content"] for m in session.history][:3] == [
        session.history[0]["content"],
        session.history[1]["content"],
        "t8",
    ]
    assert not engine.scheduler.has_work()  # the failed request was cancelled, blocks freed
    assert engine.kv.manager.num_free == engine.kv.manager.num_blocks
    monkeypatch.setattr(engine.model, "forward", real_forward)
    session.reply("t9", out)
    assert session.history[-2]["content"] == "t9" and len(session.history) == 6


def test_the_banner_says_which_sampling_runs(engine, monkeypatch, capsys):
    from app.cli.chat import run_chat

    def eof(_prompt: str) -> str:
        raise EOFError

    monkeypatch.setattr("builtins.input", eof)
    params = SamplingParams(temperature=0.2, top_k=50, top_p=0.9)
    assert run_chat(engine, params) == 0
    assert "temperature 0.2, top-k 50, top-p 0.9" in capsys.readouterr().out
    assert run_chat(engine, SamplingParams()) == 0
    assert "; greedy)" in capsys.readouterr().out
