"""Which request fields ``serve`` acts on, and the refusal of every other: a field that would
change the answer and that we lack is answered 400 naming it, never dropped.

A request body's fields fall in four kinds:

* implemented: the body models' own fields (:mod:`app.server.schema`);
* labels: they name or file a request and change no answer (``user``, ``metadata``, …),
  accepted and kept nowhere;
* known, not implemented: OpenAI's or vLLM's fields we lack. Given as ``null`` or as the
  value that does nothing (``frequency_penalty: 0``, ``logit_bias: {}``, ``functions: []``),
  they are accepted, since clients send their defaults; any other value is refused by name;
* unknown: refused, with the nearest field's name where one is close (``max_token``).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from typing import Any

from pydantic import BaseModel

from app.server.schema import HTTPError

#: fields that only label a request (OpenAI's and vLLM's): accepted, changing nothing
LABELS = frozenset({
    "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
    "prompt_cache_retention", "prompt_cache_options", "request_id", "priority",
})  # fmt: skip


def _none(value: Any) -> bool:
    return value is None


def _zero(value: Any) -> bool:
    return value is None or value == 0


def _empty(value: Any) -> bool:
    return value is None or value in ({}, [], "")


def _is(*noop: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or value in noop


#: fields we know but do not implement, with the values that do nothing (accepted)
NOT_IMPLEMENTED: dict[str, Callable[[Any], bool]] = {
    "frequency_penalty": _zero,
    "presence_penalty": _zero,
    "logit_bias": _empty,
    "suffix": _empty,
    "best_of": _is(1),
    "functions": _empty,
    "function_call": _is("none"),
    "modalities": _is(["text"]),
    "audio": _none,
    "prediction": _none,
    "reasoning_effort": _none,
    "verbosity": _none,
    "web_search_options": _none,
    "moderation": _none,
    # vLLM's extras
    "guided_json": _none,
    "guided_regex": _none,
    "guided_choice": _none,
    "guided_grammar": _none,
    "structured_outputs": _none,
    "prompt_logprobs": _none,
    "allowed_token_ids": _empty,
    "bad_words": _empty,
    "use_beam_search": _is(False),
    "length_penalty": _is(1, 1.0),
    "truncate_prompt_tokens": _none,
    "spaces_between_special_tokens": _is(True),
    "return_tokens_as_token_ids": _is(False),
    "add_special_tokens": _none,
    "chat_template": _none,
    "chat_template_kwargs": _empty,
    "add_generation_prompt": _is(True),
    "continue_final_message": _is(False),
    "documents": _empty,
}


def fields_of(model: type[BaseModel]) -> frozenset[str]:
    """The fields a body model implements."""
    return frozenset(model.model_fields)


def refuse_unsupported(body: BaseModel) -> None:
    """Raise a 400 naming the first field of ``body`` (kept as its extras) that would change
    the answer and that this server lacks, or that no API knows."""
    for name, value in (body.model_extra or {}).items():
        if name in LABELS:
            continue
        noop = NOT_IMPLEMENTED.get(name)
        if noop is not None:
            if noop(value):
                continue
            raise HTTPError(
                400, f"'{name}' is not supported by this server (only as "
                f"{_noop_text(name)}); leave it out", param=name, code="unsupported_parameter",
            )  # fmt: skip
        close = _nearest(name, fields_of(type(body)) | LABELS)
        hint = f"; did you mean '{close}'?" if close else ""
        raise HTTPError(400, f"unknown field '{name}'{hint}", param=name, code="unknown_parameter")


def _noop_text(name: str) -> str:
    examples = {
        "frequency_penalty": "0", "presence_penalty": "0", "logit_bias": "{}", "suffix": '""',
        "best_of": "1", "functions": "[]",
        "function_call": '"none"',
        "modalities": '["text"]', "use_beam_search": "false", "length_penalty": "1",
        "spaces_between_special_tokens": "true", "return_tokens_as_token_ids": "false",
        "add_generation_prompt": "true", "continue_final_message": "false",
        "allowed_token_ids": "[]", "bad_words": "[]", "chat_template_kwargs": "{}",
        "documents": "[]",
    }  # fmt: skip
    return f"null or {examples[name]}" if name in examples else "null"


def _nearest(name: str, known: Iterable[str]) -> str | None:
    found = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
    return found[0] if found else None
