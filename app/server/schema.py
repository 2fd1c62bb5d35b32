"""OpenAI's shapes: the request bodies of both routes and the replies, whole or as
Server-Sent Events chunks (errors: :mod:`app.server.errors`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.server.errors import HTTPError
from app.server.tools import ToolChoice, ToolPlan, ToolSpec
from engine.core.output import TokenEvent
from engine.core.sampling import MAX_LOGPROBS
from engine.core.structured import Constraint

# -- request bodies -----------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False  # a usage-only chunk before [DONE]
    continuous_usage_stats: bool = False  # vLLM's: the usage so far on every chunk


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # held to the schema whatever it says: the mask never strays


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> Constraint | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return Constraint("json_object")
        if self.json_schema is None:
            raise HTTPError(
                400, "response_format of type json_schema needs its json_schema",
                param="response_format",
            )  # fmt: skip
        return Constraint.json_schema(self.json_schema.schema_)


class RequestBody(BaseModel):
    """The sampling fields both routes share (OpenAI's, and vLLM's extras that load generators
    and harnesses send). Other fields are kept as extras for :mod:`app.server.fields`, which
    refuses those that would change the answer."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, lt=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    seed: int | None = Field(default=None, ge=0, le=2**62)  # choice i uses seed + i
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's sampling extras
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    #: vLLM's: each token in ``logprobs`` named ``token_id:<id>`` instead of its text, which
    #: tells two tokens of one text apart (the A/B lab's comparison with a server needs ids)
    return_tokens_as_token_ids: bool = False
    #: structured outputs: the reply held to JSON, or to a JSON schema (engine.core.structured)
    response_format: ResponseFormat | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return value


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None  # a label
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # the call a tool message answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise HTTPError(400, "only text content parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)

    def for_template(self, tools_in_template: bool) -> dict[str, Any]:
        """The message as chat templates take it (Hugging Face's convention: a call's
        arguments as a mapping); for a template that knows no tools, an assistant's calls are
        its text, as the model was asked to write them."""
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": self.text()}
        calls = [
            {"name": c.get("function", {}).get("name"),
             "arguments": _arguments(c.get("function", {}).get("arguments"))}
            for c in self.tool_calls or []
        ]  # fmt: skip
        if calls and tools_in_template:
            out["tool_calls"] = [{"type": "function", "function": c} for c in calls]
        elif calls:
            out["content"] = json.dumps(calls[0] if len(calls) == 1 else calls)
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            raise HTTPError(400, "a tool call's arguments are not JSON", param="messages") from None
    return value or {}


class ChatBody(RequestBody):
    messages: list[_Message] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def wanted_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionBody(RequestBody):
    #: a text, token ids, or a list of either (each prompt its own choices)
    prompt: str | list[int] | list[str] | list[list[int]] = Field(min_length=1)
    #: 0 only with ``echo``: the prompt scored, nothing generated (as harnesses ask)
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    #: the prompt first in each choice's text (and its tokens' log-probabilities, the first
    #: token's null, where ``logprobs`` is given)
    echo: bool = False

    def wanted_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        given: Any = self.prompt
        if isinstance(given, str):
            return [given]
        if isinstance(given[0], int):
            return [list(given)]
        return list(given)


# -- replies ------------------------------------------------------------------------------------


#: a scored token: its id, its log-probability (None: the prompt's first) and the likeliest
#: ``(id, logprob)`` at its step
Scored = tuple[int, float | None, tuple[tuple[int, float], ...]]


def scored(event: TokenEvent) -> Scored:
    return event.token_id or 0, event.logprob, event.top_logprobs


@dataclass(slots=True)
class Choice:
    index: int
    request_id: str
    prompt_tokens: int = 0
    text: str = ""
    tokens: int = 0
    finish: str | None = None
    scored: list[Scored] = field(default_factory=list)  # tokens with logprobs
    offset: int = 0  # characters of the scored tokens streamed so far (completions' offsets)
    #: ``echo``: the prompt's text and its ids, scored once the prefill has run
    echo: str | None = None
    prompt_ids: list[int] = field(default_factory=list)
    #: False for ``max_tokens: 0``: the one token the engine makes is not the client's
    keep_tokens: bool = True


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


@dataclass(frozen=True, slots=True)
class Reply:
    """OpenAI's response and chunk shapes for one request."""

    id: str
    model: str
    chat: bool
    prompt_tokens: int
    created: int  # one time for every chunk of the reply
    #: decodes one token id, where log-probabilities were asked for (None: they were not)
    token_text: Callable[[int], str] | None = None
    #: a chat request's tools: its replies are read back as calls where they are
    tools: ToolPlan | None = None
    #: ``return_tokens_as_token_ids``: tokens named ``token_id:<id>`` in ``logprobs``
    token_ids: bool = False

    def message(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """A chat reply's message and finish reason: its tool calls where it made them."""
        calls = self.tools.calls(text) if self.tools is not None else None
        if calls is None:
            return {"role": "assistant", "content": text}, finish
        return (
            {"role": "assistant", "content": None, "tool_calls": [c.as_openai() for c in calls]},
            "tool_calls" if finish == "stop" else finish,
        )

    def tool_chunk(self, index: int, text: str, finish: str | None) -> str:
        """A streamed chat reply with tools, whole in one delta once it has ended (its calls
        cannot be told from text before)."""
        message, finish = self.message(text, finish) if finish else ({"content": text}, None)
        calls = message.get("tool_calls")
        delta: dict[str, Any] = (
            {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]} if calls
            else {"content": text}
        )  # fmt: skip
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        return sse({**self._head("chat.completion.chunk"), "choices": [choice]})

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created,
                "model": self.model}  # fmt: skip

    def chunk(
        self, index: int, text: str, finish: str | None, *, first: bool = False,
        scored: list[Scored] | None = None, offset: int = 0, usage: dict[str, int] | None = None,
    ) -> str:  # fmt: skip
        logprobs = self.logprobs(scored or [], offset)
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {
                "content": text}  # fmt: skip
            choice = {"index": index, "delta": delta, "logprobs": logprobs,
                      "finish_reason": finish}  # fmt: skip
            body = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
            body = {**self._head("text_completion"), "choices": [choice]}
        return sse(body if usage is None else {**body, "usage": usage})

    def logprobs(self, scored: list[Scored], offset: int) -> dict[str, Any] | None:
        """OpenAI's ``logprobs`` object for these tokens: chat's ``content`` list, or the
        completions' parallel lists (``text_offset`` counted from ``offset``; an echoed
        prompt's first token has null ones, as vLLM and OpenAI's legacy API give it)."""
        text_of = self.token_text
        if text_of is None or not scored:
            return None
        name = (lambda t: f"token_id:{t}") if self.token_ids else text_of
        if self.chat:

            def entry(tid: int, lp: float) -> dict[str, Any]:
                text = name(tid)
                return {"token": text, "logprob": lp, "bytes": list(text.encode())}

            return {"content": [
                {**entry(tid, lp or 0.0), "top_logprobs": [entry(t, v) for t, v in top]}
                for tid, lp, top in scored
            ]}  # fmt: skip
        offsets = []
        for tid, _, _ in scored:
            offsets.append(offset)
            offset += len(text_of(tid))
        return {
            "tokens": [name(tid) for tid, _, _ in scored],
            "token_logprobs": [lp for _, lp, _ in scored],
            "top_logprobs": [
                None if lp is None else {name(t): v for t, v in top} for _, lp, top in scored
            ],
            "text_offset": offsets,
        }

    def usage(self, choices: list[Choice]) -> dict[str, int]:
        completion = sum(c.tokens for c in choices if c.keep_tokens)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}  # fmt: skip

    def usage_chunk(self, choices: list[Choice]) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(kind), "choices": [], "usage": self.usage(choices)}

    def whole(self, choices: list[Choice]) -> dict[str, Any]:
        if self.chat:
            out = []
            for c in choices:
                message, finish = self.message(c.text, c.finish)
                logprobs = self.logprobs(c.scored, 0)
                out.append({"index": c.index, "message": message, "logprobs": logprobs,
                            "finish_reason": finish})  # fmt: skip
            return {**self._head("chat.completion"), "choices": out, "usage": self.usage(choices)}
        out = [{"index": c.index, "text": c.text, "logprobs": self.logprobs(c.scored, 0),
                "finish_reason": c.finish} for c in choices]  # fmt: skip
        return {**self._head("text_completion"), "choices": out, "usage": self.usage(choices)}
