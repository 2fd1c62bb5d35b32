"""Tokenizer, chat template and incremental detokenization.

* :class:`Tokenizer` wraps a ``tokenizers`` ``tokenizer.json`` and renders the model's chat
  template in a sandboxed jinja2 environment (templates come with downloaded models).
* :class:`IncrementalDetokenizer` turns a growing list of token ids into text deltas and never
  emits half of a multi-byte UTF-8 character (byte-level BPE splits them across tokens).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from engine.errors import InvalidRequestError, ModelLoadError

REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    def __init__(
        self,
        backend: HFTokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos_token: bool = False,
    ) -> None:
        self._tok = backend
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_folder(cls, folder: Path) -> Tokenizer:
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(
                f"{path} is missing; a model folder needs tokenizer.json (GGUF imports write one)"
            )
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on parse errors
            raise ModelLoadError(f"cannot read {path}: {exc}") from exc
        config = _read_json(folder / "tokenizer_config.json")
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jinja_file = folder / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        return cls(
            backend,
            chat_template=template if isinstance(template, str) else None,
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            add_bos_token=bool(config.get("add_bos_token", False)),
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, adding no special tokens (special-token *text* is still
        recognised, as chat templates rely on)."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_prompt(self, text: str) -> list[int]:
        """Ids of a raw (non-chat) prompt: :meth:`encode` plus BOS where the model wants it."""
        ids = self.encode(text)
        bos = self.token_to_id(self.bos_token) if self.bos_token else None
        if self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def backend_json(self) -> str:
        """The ``tokenizers`` tokenizer as its JSON (a grammar engine builds its vocabulary
        from it: :mod:`engine.core.structured`)."""
        return str(self._tok.to_str())

    def token_to_id(self, token: str) -> int | None:
        result = self._tok.token_to_id(token)
        return None if result is None else int(result)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:  # fmt: skip
        if not self.chat_template:
            raise InvalidRequestError(
                "this model has no chat template; use a plain prompt (--prompt) instead of --chat"
            )
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **({"tools": tools} if tools is not None else {}),
        )


def _raise(message: str) -> None:
    raise InvalidRequestError(f"the chat template refused the conversation: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


_ENV = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
_ENV.globals["raise_exception"] = _raise
_ENV.globals["strftime_now"] = _strftime_now
_ENV.filters["tojson"] = _tojson


def render_chat_template(
    template: str, messages: list[dict[str, Any]], *, add_generation_prompt: bool, **extra: Any
) -> str:
    """Render a HF chat template the way ``transformers`` does, but in a sandbox."""
    try:
        compiled = _ENV.from_string(template)
        return compiled.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **extra
        )
    except InvalidRequestError:
        raise
    except TemplateError as exc:
        raise InvalidRequestError(f"the model's chat template failed to render: {exc}") from exc


class IncrementalDetokenizer:
    """Decode a token stream piece by piece.

    Keeps two offsets into the ids seen so far: text is decoded from ``prefix`` (a point known
    to fall on a character boundary) and the part past ``read`` is new. A delta that ends in
    U+FFFD is an incomplete UTF-8 sequence and is held back until later tokens complete it.
    The concatenation of every :meth:`add` result plus :meth:`flush` equals the full decode.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is held back, even if it is not valid UTF-8 (the model produced that)."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        prefix_text = self._tok.decode(
            self.ids[self._prefix : self._read], skip_special_tokens=self._skip
        )
        full_text = self._tok.decode(self.ids[self._prefix :], skip_special_tokens=self._skip)
        if len(full_text) <= len(prefix_text) and not final:
            return ""
        if full_text.endswith(REPLACEMENT_CHAR) and not final:
            return ""
        delta = full_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self.ids)
        return delta


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # AddedToken serialised by transformers
        content = value.get("content")
        return content if isinstance(content, str) else None
    return value if isinstance(value, str) else None
