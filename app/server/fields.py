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
import json
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel

from app.server.errors import HTTPError

#: fields that only label a request (OpenAI's and vLLM's): accepted, changing nothing
LABELS = frozenset({
    "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
    "prompt_cache_retention", "prompt_cache_options", "request_id", "priority",
})  # fmt: skip


#: fields we know but do not implement, with the values besides null that do nothing
#: (accepted: clients send their defaults)
NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "logit_bias": ({},),
    "suffix": ("",),
    "best_of": (1,),
    "functions": ([],),
    "function_call": ("none",),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "reasoning_effort": (),
    "verbosity": (),
    "web_search_options": (),
    "moderation": (),
    # vLLM's extras
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "structured_outputs": (),
    "prompt_logprobs": (),
    "allowed_token_ids": ([],),
    "bad_words": ([],),
    "use_beam_search": (False,),
    "length_penalty": (1,),
    "truncate_prompt_tokens": (),
    "spaces_between_special_tokens": (True,),
    "add_special_tokens": (),
    "chat_template": (),
    "chat_template_kwargs": ({},),
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "documents": ([],),
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
            if value is None or value in noop:
                continue
            allowed = " or ".join(["null", *(json.dumps(v) for v in noop)])
            raise HTTPError(
                400, f"'{name}' is not supported by this server (only as {allowed}); leave it "
                "out", param=name, code="unsupported_parameter",
            )  # fmt: skip
        close = _nearest(name, fields_of(type(body)) | LABELS)
        hint = f"; did you mean '{close}'?" if close else ""
        raise HTTPError(400, f"unknown field '{name}'{hint}", param=name, code="unknown_parameter")


def _nearest(name: str, known: Iterable[str]) -> str | None:
    found = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
    return found[0] if found else None
