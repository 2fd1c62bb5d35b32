"""Tool calling in chat completions: ``tools``, ``tool_choice`` and ``parallel_tool_calls``.

The tools reach the model through its own chat template where the template takes them (the
Hugging Face convention: a ``tools`` variable, as Llama 3.x's and Qwen's do); for a template that
does not, a system message lists them and says how to call one (a JSON object with ``name`` and
``arguments``). A reply is read back as tool calls in the formats models emit:

* Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call;
* Llama 3.x: a JSON object ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``), or a
  list of them, as the whole reply (after an optional ``<|python_tag|>``).

``tool_choice`` ``required`` or a named function holds the reply to those shapes with the
grammar of structured outputs (:mod:`engine.core.structured`): a JSON object naming one of the
allowed functions with arguments matching its parameters' schema (a list of them where
``parallel_tool_calls`` allows several), so the call always parses. ``auto`` lets the model
choose and parses what it wrote; ``none`` renders the tools but never reads calls back.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.server.errors import HTTPError
from engine.core.structured import Constraint


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    strict: bool | None = None  # held to its schema whatever it says where a call is forced


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionSpec


class NamedChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    class _Name(BaseModel):
        name: str

    type: Literal["function"]
    function: _Name


ToolChoice = Literal["none", "auto", "required"] | NamedChoice


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments)},
        }  # fmt: skip
        return out if index is None else {"index": index, **out}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a request's tools mean for its prompt and reply: the tools as the template takes
    them, the constraint that forces a call (None: the model chooses), and whether calls are
    read back at all."""

    tools: list[dict[str, Any]]
    names: tuple[str, ...]
    constraint: Constraint | None
    parse: bool

    def prompt_messages(
        self, messages: list[dict[str, Any]], template: str
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The messages and the ``tools`` argument for the model's template: the template
        takes them where it reads a ``tools`` variable, else a system message lists them."""
        if takes_tools(template):
            return messages, self.tools
        listing = "\n".join(json.dumps(t["function"]) for t in self.tools)
        note = (
            "You can call these functions. To call one, reply with only a JSON object "
            '{"name": <function name>, "arguments": <its arguments>}.\n' + listing
        )
        if messages and messages[0]["role"] == "system":
            first = {**messages[0], "content": messages[0]["content"] + "\n\n" + note}
            return [first, *messages[1:]], None
        return [{"role": "system", "content": note}, *messages], None

    def calls(self, text: str) -> list[ToolCall] | None:
        """The tool calls in a reply, or None where it is a plain answer."""
        if not self.parse:
            return None
        found = parse_tool_calls(text)
        if not found or any(c.name not in self.names for c in found):
            return None
        return found


def takes_tools(template: str) -> bool:
    """Whether a chat template reads a ``tools`` variable (Hugging Face's convention)."""
    return "tools" in template


def plan_tools(
    tools: list[ToolSpec] | None, choice: ToolChoice | None, parallel: bool | None
) -> ToolPlan | None:
    """The request's :class:`ToolPlan` (None without tools); a choice naming no given tool, or
    a choice without tools, is refused."""
    if not tools:
        if choice not in (None, "none"):
            raise HTTPError(400, "tool_choice needs tools", param="tool_choice")
        return None
    by_name = {t.function.name: t.function for t in tools}
    if len(by_name) != len(tools):
        raise HTTPError(400, "two tools have the same name", param="tools")
    choice = choice or "auto"
    if isinstance(choice, NamedChoice):
        if choice.function.name not in by_name:
            raise HTTPError(
                400, f"tool_choice names {choice.function.name!r}, which is not among the tools",
                param="tool_choice",
            )  # fmt: skip
        forced = [by_name[choice.function.name]]
    elif choice == "required":
        forced = list(by_name.values())
    else:
        forced = []
    constraint = None
    if forced:
        one = (
            {"anyOf": [_call_schema(f) for f in forced]}
            if len(forced) > 1
            else _call_schema(forced[0])
        )
        many = parallel is not False and not isinstance(choice, NamedChoice)
        schema = {"type": "array", "items": one, "minItems": 1} if many else one
        constraint = Constraint.json_schema(schema)
    return ToolPlan(
        tools=[t.model_dump(exclude_none=True) for t in tools], names=tuple(by_name),
        constraint=constraint, parse=choice != "none",
    )  # fmt: skip


def _call_schema(function: FunctionSpec) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": function.name}, "arguments": function.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> list[ToolCall] | None:
    """Tool calls written as Hermes/Qwen blocks or as Llama 3.x JSON (see the module's
    docstring); None where the text is not wholly calls."""
    blocks = _HERMES.findall(text)
    if blocks:
        items: list[Any] = []
        for block in blocks:
            items.append(_json(block))
        return _calls(items)
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith(("{", "[")):
        return None
    loaded = _json(body)
    return _calls(loaded if isinstance(loaded, list) else [loaded])


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _calls(items: list[Any]) -> list[ToolCall] | None:
    out = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            args = _json(args)
        if not isinstance(args, dict):
            return None
        out.append(ToolCall(item["name"], args))
    return out or None
