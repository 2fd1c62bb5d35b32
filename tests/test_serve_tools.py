"""Tool calling through ``serve`` with the openai SDK (issue 47): a forced call, the tool's
answer sent back and the model's final answer, greedy, on the default model (whose template
knows no tools: they reach it as a system message); ``required`` with parallel calls;
a streamed call; and the formats models write calls in, read back."""

from __future__ import annotations

import json

import pytest

from app.server.tools import ToolCall, parse_tool_calls
from tests.served import request

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
        "required": ["zone"], "additionalProperties": False}},
}  # fmt: skip


@pytest.mark.real_model
def test_a_tool_call_round_trip_with_the_openai_sdk(client):
    messages: list = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(
        model=None, messages=messages, tools=[WEATHER, TIME], temperature=0, max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # type: ignore[arg-type]  # fmt: skip
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21})},
    ]
    final = client.chat.completions.create(
        model=None, messages=messages, tools=[WEATHER, TIME], tool_choice="none",
        temperature=0, max_tokens=40,
    )  # type: ignore[arg-type]  # fmt: skip
    answer = final.choices[0]
    assert answer.message.tool_calls is None and answer.message.content
    assert answer.finish_reason in ("stop", "length")


@pytest.mark.real_model
def test_required_calls_parse_and_a_streamed_call_comes_whole(server, client):
    done = client.chat.completions.create(
        model=None, messages=[{"role": "user", "content": "Weather in Oslo and time in UTC?"}],
        tools=[WEATHER, TIME], tool_choice="required", temperature=0, max_tokens=80,
    )  # type: ignore[arg-type]  # fmt: skip
    calls = done.choices[0].message.tool_calls
    assert calls and {c.function.name for c in calls} <= {"get_weather", "get_time"}
    assert done.choices[0].finish_reason == "tool_calls"
    chunks = list(client.chat.completions.create(
        model=None, messages=[{"role": "user", "content": "Weather in Rome?"}],
        tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0, max_tokens=60, stream=True,
    ))  # type: ignore[arg-type]  # fmt: skip
    deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(deltas) == 1 and deltas[0].tool_calls[0].function.name == "get_weather"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    bad = request(server, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "nope"}}})  # fmt: skip
    assert bad[0] == 400 and json.loads(bad[2])["error"]["param"] == "tool_choice"


def test_calls_are_read_in_the_formats_models_write():
    hermes = 'Sure.<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    assert parse_tool_calls(hermes) == [ToolCall("f", {"x": 1})]
    two = (
        '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "g", "arguments": "{\\"y\\": 2}"}</tool_call>'
    )
    assert parse_tool_calls(two) == [ToolCall("f", {}), ToolCall("g", {"y": 2})]
    llama = '<|python_tag|>{"name": "f", "parameters": {"x": "a"}}'
    assert parse_tool_calls(llama) == [ToolCall("f", {"x": "a"})]
    assert parse_tool_calls('[{"name": "f", "arguments": {}}]') == [ToolCall("f", {})]
    assert parse_tool_calls("The weather is fine.") is None
    assert parse_tool_calls('{"answer": 42}') is None
