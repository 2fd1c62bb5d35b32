"""A server as a side of the A/B lab (:class:`~engine.evals.known.RemoteModel`, whose
comparison is :mod:`engine.evals.remote`): its generation from token ids with the top-k at each
token, its teacher-forced scores of a given answer (completions with ``echo``), and its
tokenizer (vLLM's ``/tokenize``, which ours serves too).

Tokens are asked for by id (vLLM's ``return_tokens_as_token_ids``, which ours takes); a server
that refuses that field names them by text, read back to ids through the local model's
vocabulary (``ids_of``): a text that is no single token there, or several, leaves that
alternative out of the top-k (the comparison pools it with the rest).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from app.endpoints.client import (
    Endpoint,
    EndpointError,
    Streamed,
    TokenLogprob,
    completion_logprobs,
    get_json,
    post,
    stream_chat,
    stream_completion,
)
from engine.errors import InvalidRequestError
from engine.evals.known import KnownRow, RemoteRun

#: the top-k asked for at each position: OpenAI's and vLLM's most (ours too)
TOP_K = 20
IDS_FIELD = "return_tokens_as_token_ids"
ID_PREFIX = "token_id:"


@dataclass(slots=True)
class ServerTokenizer:
    """A server's tokenizer read through its ``/detokenize`` (vLLM's route, ours too): what
    the lab decodes pieces and alternatives with when no local model is on either side. Each
    id sequence is asked once. Special tokens are kept (the route keeps them)."""

    endpoint: Endpoint
    vocab_size: int
    _seen: dict[tuple[int, ...], str] = field(default_factory=dict)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        key = tuple(int(i) for i in ids)
        if not key:
            return ""
        if key not in self._seen:
            body = {"model": self.endpoint.model, "tokens": list(key)}
            answer = post(self.endpoint, "/detokenize", body)
            text = answer.get("prompt") if isinstance(answer, dict) else None
            if not isinstance(text, str):
                raise EndpointError("protocol", f"{self.endpoint.name} answered /detokenize "
                                    "without a prompt text")  # fmt: skip
            self._seen[key] = text
        return self._seen[key]


@dataclass(slots=True)
class ServerSide:
    """One endpoint as an A/B side. ``ids_of`` reads a token's text back to its id where the
    server names tokens by text only (None: not one token)."""

    endpoint: Endpoint
    ids_of: Callable[[str], int | None] = lambda text: None
    k: int = TOP_K
    #: whether the server takes ``return_tokens_as_token_ids`` (learnt at the first refusal)
    by_id: bool = True
    notes: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.endpoint.name

    # -- RemoteModel -----------------------------------------------------------------------
    def prompt_ids(self, text: str) -> list[int] | None:
        body = {"model": self.endpoint.model, "prompt": text, "add_special_tokens": False}
        return self._tokens("/tokenize", body)

    def _tokens(self, route: str, body: dict[str, Any]) -> list[int] | None:
        try:
            answer = post(self.endpoint, route, body)
        except EndpointError as exc:
            if exc.kind in ("model", "refused"):  # no such route, or another body for it
                return None
            raise
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        # llama.cpp's /tokenize reads another field and answers an empty list to this body
        return [int(t) for t in tokens] if isinstance(tokens, list) and tokens else None

    def chat_prompt_ids(self, messages: list[dict[str, str]]) -> list[int] | None:
        body = {"model": self.endpoint.model, "messages": messages,
                "add_generation_prompt": True, "add_special_tokens": False}  # fmt: skip
        return self._tokens("/tokenize", body)

    def decoder(self) -> ServerTokenizer | None:
        try:  # vLLM serves it only with --enable-tokenizer-info-endpoint: optional here
            info = get_json(self.endpoint, "/tokenizer_info")
        except EndpointError as exc:
            if exc.kind not in ("model", "refused"):  # not "no such route"
                raise
            info = {}
        vocab = info.get("vocab_size") if isinstance(info, dict) else None
        decoder = ServerTokenizer(self.endpoint, vocab if isinstance(vocab, int) else 1 << 31)
        try:
            decoder.decode([0])
        except EndpointError as exc:
            if exc.kind in ("model", "refused"):  # no /detokenize
                return None
            raise
        return decoder

    def generate(
        self, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float,
        seed: int | None, on_text: Callable[[str], None],
    ) -> RemoteRun:  # fmt: skip
        def stream(extra: dict[str, Any], reply: Streamed) -> Any:
            return stream_completion(self.endpoint, prompt_ids, max_tokens=max_new_tokens,
                                     temperature=temperature, seed=seed, logprobs=self.k,
                                     extra=extra, reply=reply)  # fmt: skip

        reply, rows = self._by_id(stream, on_text)
        tps = 1.0 / reply.tpot_s if reply.tpot_s else None
        return RemoteRun(rows, reply.finish_reason, reply.ttft_s, tps, reply.text,
                         list(self.notes))  # fmt: skip

    def chat(
        self, messages: list[dict[str, str]], max_new_tokens: int, temperature: float,
        seed: int | None, on_text: Callable[[str], None],
    ) -> RemoteRun:  # fmt: skip
        reply = Streamed(time.perf_counter())
        for chunk in stream_chat(self.endpoint, messages, max_tokens=max_new_tokens,
                                 temperature=temperature, seed=seed, reply=reply):  # fmt: skip
            on_text(chunk.text)
        tps = 1.0 / reply.tpot_s if reply.tpot_s else None
        return RemoteRun([], reply.finish_reason, reply.ttft_s, tps, reply.text)

    def score(self, prompt_ids: Sequence[int], ids: Sequence[int]) -> list[KnownRow] | None:
        if not ids:
            return []
        body: dict[str, Any] = {
            "model": self.endpoint.model, "prompt": [*prompt_ids, *ids], "max_tokens": 1,
            "echo": True, "logprobs": self.k, "temperature": 0.0,
        }  # fmt: skip
        if self.by_id:
            body[IDS_FIELD] = True
        try:
            answer = post(self.endpoint, "/v1/completions", body)
        except EndpointError as exc:
            if exc.kind != "refused":
                raise
            if IDS_FIELD in str(exc) and self.by_id:
                self._refused_ids()
                return self.score(prompt_ids, ids)
            if "echo" in str(exc) or "logprobs" in str(exc):
                return None  # no echo, or no scoring of a given text
            raise
        try:
            entries = completion_logprobs(answer["choices"][0]["logprobs"])
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise EndpointError(
                "protocol", f"{self.endpoint.name} answered an echo with no log-probabilities"
            ) from exc
        start = len(prompt_ids)
        rows = [self._row(e) for e in entries[start : start + len(ids)]]
        if [r.token for r in rows] != list(ids):
            return None  # it echoed something else (a server that re-tokenizes the text)
        return rows

    # -- how tokens are named ----------------------------------------------------------------
    def _by_id(
        self, stream: Callable[[dict[str, Any], Streamed], Any], on_text: Callable[[str], None]
    ) -> tuple[Streamed, list[KnownRow]]:
        """Stream once, by id where the server takes it, else (once refused) by text."""
        while True:
            reply = Streamed(time.perf_counter())
            rows: list[KnownRow] = []
            try:
                for chunk in stream({IDS_FIELD: True} if self.by_id else {}, reply):
                    on_text(chunk.text)
                    rows.extend(self._row(t) for t in chunk.tokens)
            except EndpointError as exc:
                if exc.kind == "refused" and IDS_FIELD in str(exc) and self.by_id:
                    self._refused_ids()
                    continue
                raise
            return reply, rows

    def _refused_ids(self) -> None:
        self.by_id = False
        self.notes.append(
            f"{self.endpoint.name} names tokens by text only: they are read back to ids "
            "through the local model's vocabulary, and an alternative that is no single "
            "token there is pooled with the rest"
        )

    def _id(self, name: str) -> int | None:
        if name.startswith(ID_PREFIX):
            try:
                return int(name.removeprefix(ID_PREFIX))
            except ValueError:
                return None
        if self.by_id:  # a server that takes the field quietly and names tokens by text
            self._refused_ids()
        return self.ids_of(name)

    def _row(self, entry: TokenLogprob) -> KnownRow:
        token = self._id(entry.token)
        if token is None:
            raise InvalidRequestError(
                f"{self.endpoint.name} returned the token {entry.token!r}, which is no single "
                "token of the local model: the two tokenizers differ; compare the answers as "
                "text, or pick a local model of the server's family"
            )
        # OpenAI and vLLM add the chosen token to its top-k where it is not among them: the
        # top is its k likeliest, the chosen token's log-probability is the row's own
        top = tuple((t, lp) for t, lp in ((self._id(n), lp) for n, lp in entry.top[: self.k])
                    if t is not None)  # fmt: skip
        return KnownRow(token, entry.logprob, top)
