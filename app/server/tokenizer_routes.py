"""The tokenizer over HTTP, as vLLM serves it: ``POST /tokenize`` (a prompt, or chat
messages through the model's template), ``POST /detokenize`` and ``GET /tokenizer_info``.
Harnesses use them to count and cut prompts with the server's own tokenizer
(lm-evaluation-harness picks its "remote" tokenizer where they answer)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from app.server.errors import HTTPError
from app.server.fields import refuse_unsupported
from engine.core.engine import LLMEngine
from engine.errors import InvalidRequestError


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: str
    content: str


class TokenizeBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[_Message] | None = None
    #: BOS where the model wants one (a prompt); off for text to be joined to other text
    add_special_tokens: bool = True
    add_generation_prompt: bool = True  # with messages
    return_token_strs: bool = False


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[int] = Field(min_length=0)


def add_tokenizer_routes(app: FastAPI, engine: Callable[[], LLMEngine]) -> None:
    """The three routes on ``app``, over the engine serving now (``engine()``)."""

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody) -> dict[str, Any]:
        refuse_unsupported(body)
        serving = engine()
        tok = serving.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise HTTPError(400, "give a prompt or messages, not both", param="prompt")
        if body.messages is not None:
            messages = [m.model_dump() for m in body.messages]
            try:
                text = tok.apply_chat_template(
                    messages, add_generation_prompt=body.add_generation_prompt
                )
            except InvalidRequestError as exc:
                raise HTTPError(400, str(exc), param="messages") from None
            ids = tok.encode(text)
        else:
            assert body.prompt is not None
            ids = (
                tok.encode_prompt(body.prompt)
                if body.add_special_tokens
                else tok.encode(body.prompt)
            )
        strs = [tok.decode([i], skip_special_tokens=False) for i in ids]
        return {"count": len(ids), "max_model_len": serving.context_length, "tokens": ids,
                "token_strs": strs if body.return_token_strs else None}  # fmt: skip

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeBody) -> dict[str, Any]:
        refuse_unsupported(body)
        serving = engine()
        vocab = serving.tokenizer.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise HTTPError(400, f"token ids {bad[:5]} are outside [0, {vocab})", param="tokens")
        return {"prompt": serving.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        serving = engine()
        tok = serving.tokenizer
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": tok.bos_token,
            "eos_token": tok.eos_token,
            "pad_token": None,
            "add_bos_token": tok.add_bos_token,
            "chat_template": tok.chat_template,
            "model_max_length": serving.context_length,
            "vocab_size": tok.vocab_size,
        }
