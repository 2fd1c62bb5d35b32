"""One OpenAI-compatible server, as the workbench talks to it: its models (``/v1/models``) and
streamed chat completions, each chunk stamped with the client's own clock (what TTFT and TPOT
are, seen from here), with the top-k log-probabilities the server returns where asked.

Every way a server fails a user ends in one :class:`EndpointError` with a ``kind`` and one
line that says what to do: unreachable, a key refused, a model gone, rate-limited (with the
server's ``Retry-After``), a request refused, the server's own failure, nothing sent before the
timeout, a stream dropped before its end, a chunk that is not JSON. Nothing is retried here:
the caller (the chat keeps its conversation, the tuner marks its run) decides.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import httpx2

from engine.errors import InfersightError

#: how an endpoint failed (:attr:`EndpointError.kind`)
KINDS = ("unreachable", "auth", "model", "rate_limited", "refused", "server", "timeout",
         "dropped", "protocol")  # fmt: skip


class EndpointError(InfersightError):
    """A server failed a request: ``kind`` (one of :data:`KINDS`), the line to show, and, for
    a rate limit, the seconds the server asked to wait (``Retry-After``; None: not said)."""

    def __init__(
        self, kind: str, message: str, retry_after: float | None = None, *, status: int = 0,
        shaped: bool = False,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.kind = kind
        self.retry_after = retry_after
        self.status = status  # the HTTP status it came with (0: none, e.g. unreachable)
        self.shaped = shaped  # its body was an OpenAI error: {"error": {"message", "type"}}


def server_url(base_url: str) -> str:
    """A server's URL as given with or without a trailing slash or ``/v1``: without them (what
    names the server: its key in the keyring, the app's lists)."""
    return base_url.strip().rstrip("/").removesuffix("/v1")


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A server's base URL (with or without ``/v1``), the model to ask for ("": the first its
    ``/v1/models`` lists, :func:`with_model`), the API key (None: none sent), and how long to
    wait to connect and for each read (a first byte later than ``read_s`` is a timeout)."""

    base_url: str
    model: str = ""
    api_key: str | None = None
    connect_s: float = 5.0
    read_s: float = 120.0

    @property
    def api(self) -> str:
        """The base URL of its ``/v1`` routes."""
        return server_url(self.base_url) + "/v1"

    @property
    def name(self) -> str:
        """How the app names it: the model at the server."""
        return f"{self.model or '?'} @ {server_url(self.base_url)}"


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token as the server scored it: its text, log-probability, and the
    server's top alternatives (as many as asked, or fewer where the server gives fewer)."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True, slots=True)
class Chunk:
    """One streamed chunk: its text, when it arrived (``time.perf_counter``), and its tokens'
    log-probabilities where they were asked for."""

    text: str
    at: float
    tokens: tuple[TokenLogprob, ...] = ()


@dataclass(slots=True)
class Streamed:
    """A whole streamed reply: when it was sent, its chunks, how it finished and the server's
    token counts (``usage``, where it sends them)."""

    started: float
    chunks: list[Chunk] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks)

    @property
    def tokens(self) -> int:
        """Tokens generated: the server's count, else its scored tokens, else the chunks with
        text (a server streams one token a chunk unless it batches them)."""
        if self.usage and isinstance(self.usage.get("completion_tokens"), int):
            return int(self.usage["completion_tokens"])
        scored = sum(len(c.tokens) for c in self.chunks)
        return scored or sum(1 for c in self.chunks if c.text)

    @property
    def ttft_s(self) -> float | None:
        """Seconds from sending to the first chunk with text (None: none came)."""
        first = next((c.at for c in self.chunks if c.text), None)
        return None if first is None else first - self.started

    @property
    def tpot_s(self) -> float | None:
        """Seconds per token after the first, by the client's clock (None: one token)."""
        timed = [c.at for c in self.chunks if c.text]
        if len(timed) < 2 or self.tokens < 2:
            return None
        return (timed[-1] - timed[0]) / (self.tokens - 1)


def models(endpoint: Endpoint) -> list[str]:
    """The model ids the server lists (``GET /v1/models``)."""
    with _client(endpoint) as client:
        try:
            response = client.get(endpoint.api + "/models", headers=headers(endpoint))
        except (httpx2.HTTPError, httpx2.InvalidURL) as exc:
            raise transport_error(endpoint, exc, 0) from exc
        check_response(endpoint, response)
        try:
            data = response.json()["data"]
            return [str(m["id"]) for m in data]
        except (ValueError, KeyError, TypeError) as exc:
            raise EndpointError(
                "protocol", f"{_where(endpoint)} answered /v1/models with no model list: is it "
                "an OpenAI-compatible server?",
            ) from exc  # fmt: skip


def with_model(endpoint: Endpoint) -> Endpoint:
    """``endpoint`` with its model id: as given, else the first the server lists."""
    if endpoint.model:
        return endpoint
    listed = models(endpoint)
    if not listed:
        raise EndpointError("model", f"{_where(endpoint)} lists no model to talk to")
    return replace(endpoint, model=listed[0])


def stream_chat(
    endpoint: Endpoint, messages: Sequence[dict[str, Any]], *, max_tokens: int,
    temperature: float = 0.0, seed: int | None = None, top_logprobs: int | None = None,
    extra: dict[str, Any] | None = None, reply: Streamed | None = None,
    session: httpx2.Client | None = None,
) -> Generator[Chunk, None, None]:  # fmt: skip
    """Stream one chat completion: yields each chunk with text as it arrives; ``reply`` (made
    here where not given) collects them, the finish reason and the usage. Leaving the loop
    early (a stop) closes the connection, which a server takes as a cancel. ``top_logprobs``:
    ask for each token's log-probability and that many alternatives. ``session``: a client
    of :func:`session` whose connections requests share (else one of its own, opened and
    closed here: its connection's setup falls inside the TTFT). Raises
    :class:`EndpointError`."""
    body: dict[str, Any] = {"model": endpoint.model, "messages": list(messages)}
    if top_logprobs is not None:
        body["logprobs"], body["top_logprobs"] = True, top_logprobs
    return _stream(endpoint, "/chat/completions", body, max_tokens, temperature, seed, extra,
                   reply, session)  # fmt: skip


def stream_completion(
    endpoint: Endpoint, prompt: str | Sequence[int], *, max_tokens: int,
    temperature: float = 0.0, seed: int | None = None, logprobs: int | None = None,
    extra: dict[str, Any] | None = None, reply: Streamed | None = None,
    session: httpx2.Client | None = None,
) -> Generator[Chunk, None, None]:  # fmt: skip
    """Stream one (legacy) completion of ``prompt``, a text or token ids (vLLM, llama.cpp's
    server and ours take ids: the prompt exactly as the caller tokenized it), as
    :func:`stream_chat` does a chat's; ``logprobs``: each token's log-probability and that
    many alternatives."""
    body: dict[str, Any] = {
        "model": endpoint.model, "prompt": prompt if isinstance(prompt, str) else list(prompt)
    }  # fmt: skip
    if logprobs is not None:
        body["logprobs"] = logprobs
    return _stream(endpoint, "/completions", body, max_tokens, temperature, seed, extra, reply,
                   session)  # fmt: skip


def _stream(
    endpoint: Endpoint, route: str, body: dict[str, Any], max_tokens: int, temperature: float,
    seed: int | None, extra: dict[str, Any] | None, reply: Streamed | None,
    session: httpx2.Client | None,
) -> Generator[Chunk, None, None]:  # fmt: skip
    body = sampling_body(body, max_tokens, temperature, seed, extra, stream=True)
    reply = reply if reply is not None else Streamed(time.perf_counter())
    done = False
    with contextlib.nullcontext(session) if session is not None else _client(endpoint) as client:
        reply.started = time.perf_counter()
        try:
            with client.stream("POST", endpoint.api + route, json=body,
                               headers=headers(endpoint)) as response:  # fmt: skip
                if response.status_code >= 400:
                    response.read()
                    check_response(endpoint, response)
                for line in response.iter_lines():
                    if done or not line.startswith("data:"):
                        # blank lines between events, comments, other fields; after the
                        # end, the rest of the body read out, so that a kept-alive
                        # connection serves the next request
                        continue
                    data = line.removeprefix("data:").strip()
                    if data == "[DONE]":
                        done = True
                        continue
                    chunk = _chunk(endpoint, data, reply)
                    if chunk is not None:
                        reply.chunks.append(chunk)
                        yield chunk
        except (httpx2.HTTPError, httpx2.InvalidURL) as exc:
            raise transport_error(endpoint, exc, len(reply.chunks)) from exc
    if not done:
        raise EndpointError(
            "dropped", f"{_where(endpoint)} ended the stream after {len(reply.chunks)} chunks "
            "without finishing it (the server stopped or the connection broke): the reply so "
            "far is kept",
        )  # fmt: skip


def sampling_body(
    body: dict[str, Any], max_tokens: int, temperature: float, seed: int | None,
    extra: dict[str, Any] | None, *, stream: bool,
) -> dict[str, Any]:  # fmt: skip
    """``body`` (the model, and the messages or the prompt) with the sampling fields, streamed
    (with the usage at the end) or not, and ``extra`` over them all."""
    out = {**body, "max_tokens": max_tokens, "temperature": temperature, "stream": stream}
    if stream:
        out["stream_options"] = {"include_usage": True}
    if seed is not None:
        out["seed"] = seed
    out.update(extra or {})
    return out


def post(
    endpoint: Endpoint, route: str, body: dict[str, Any], *, session: httpx2.Client | None = None
) -> Any:
    """One request whose answer is JSON (``route`` under the server's URL, e.g.
    ``/v1/completions`` or vLLM's ``/tokenize``): the answer, or :class:`EndpointError`.
    ``session``: as :func:`stream_chat`'s."""
    return _json(endpoint, "POST", route, body, session)


def get_json(endpoint: Endpoint, route: str) -> Any:
    """``GET route`` under the server's URL (e.g. vLLM's ``/tokenizer_info``), as :func:`post`."""
    return _json(endpoint, "GET", route, None)


def _json(
    endpoint: Endpoint, method: str, route: str, body: dict[str, Any] | None,
    session: httpx2.Client | None = None,
) -> Any:  # fmt: skip
    with contextlib.nullcontext(session) if session is not None else _client(endpoint) as client:
        try:
            response = client.request(method, server_url(endpoint.base_url) + route, json=body,
                                      headers=headers(endpoint))  # fmt: skip
        except (httpx2.HTTPError, httpx2.InvalidURL) as exc:
            raise transport_error(endpoint, exc, 0) from exc
        check_response(endpoint, response)
        try:
            return response.json()
        except ValueError as exc:
            raise EndpointError("protocol", f"{_where(endpoint)} answered {route} with no "
                                "JSON: is it an OpenAI-compatible server?") from exc  # fmt: skip


def _chunk(endpoint: Endpoint, data: str, reply: Streamed) -> Chunk | None:
    """One ``data:`` event's chunk, a chat's or a completion's (None: one without text, e.g.
    the usage at the end)."""
    at = time.perf_counter()
    try:
        event = json.loads(data)
    except ValueError as exc:
        raise EndpointError(
            "protocol", f"{_where(endpoint)} sent a stream event that is not JSON "
            f"({data[:60]!r}): is it an OpenAI-compatible server?",
        ) from exc  # fmt: skip
    if isinstance(event, dict) and "error" in event:  # an error inside the stream
        raise EndpointError("server", f"{_where(endpoint)} failed mid-reply: "
                            f"{_message(event)}", status=200)  # fmt: skip
    try:
        if isinstance(event, dict) and isinstance(event.get("usage"), dict):
            reply.usage = event["usage"]
        choices = event.get("choices") if isinstance(event, dict) else None
        if not choices:
            return None
        choice = choices[0]
        if choice.get("finish_reason"):
            reply.finish_reason = choice["finish_reason"]
        if "text" in choice:  # a completion's
            text = choice.get("text") or ""
            tokens = completion_logprobs(choice.get("logprobs"))
        else:
            text = (choice.get("delta") or {}).get("content") or ""
            scored = ((choice.get("logprobs") or {}).get("content")) or []
            tokens = tuple(
                TokenLogprob(str(t.get("token", "")), float(t.get("logprob", 0.0)),
                             tuple((str(a.get("token", "")), float(a.get("logprob", 0.0)))
                                   for a in t.get("top_logprobs") or ()))
                for t in scored
            )  # fmt: skip
    except (AttributeError, KeyError, IndexError, TypeError, ValueError) as exc:
        raise EndpointError(
            "protocol", f"{_where(endpoint)} sent a stream event of another shape than a "
            f"completion chunk ({data[:60]!r}): is it an OpenAI-compatible server?",
        ) from exc  # fmt: skip
    if not text and not tokens:
        return None
    return Chunk(text, at, tokens)


def completion_logprobs(given: Any) -> tuple[TokenLogprob, ...]:
    """A completion's ``logprobs`` object (parallel lists) as one entry per token; an echoed
    prompt's first token, which has no log-probability, reads as ``nan``."""
    if not given:
        return ()
    tops = given.get("top_logprobs") or [None] * len(given["tokens"])
    return tuple(
        TokenLogprob(str(token), float("nan") if lp is None else float(lp),
                     tuple(sorted(((str(t), float(v)) for t, v in (top or {}).items()),
                                  key=lambda tv: -tv[1])))
        for token, lp, top in zip(given["tokens"], given["token_logprobs"], tops, strict=True)
    )  # fmt: skip


def session(endpoint: Endpoint, connections: int) -> httpx2.Client:
    """A client whose connections a run's requests share (up to ``connections`` open at
    once, kept alive between requests): a load's TTFT without a connection's setup in each.
    Close it (``with``) when the run ends."""
    return _client(endpoint, connections)


def _client(endpoint: Endpoint, connections: int = 1) -> httpx2.Client:
    timeout = httpx2.Timeout(endpoint.read_s, connect=endpoint.connect_s)
    limits = httpx2.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx2.Client(timeout=timeout, follow_redirects=True, limits=limits)


def headers(endpoint: Endpoint) -> dict[str, str]:
    return {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}


def _where(endpoint: Endpoint) -> str:
    return server_url(endpoint.base_url)


def _message(body: Any) -> str:
    """The server's own words from an OpenAI-shaped error body (or the body itself)."""
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if body.get("detail"):
            return str(body["detail"])
    return str(body)[:200]


def check_response(endpoint: Endpoint, response: httpx2.Response) -> None:
    """Raise the :class:`EndpointError` a failed response means (its body read)."""
    status = response.status_code
    if status < 400:
        return
    code, shaped = "", False
    try:
        body = response.json()
        said = _message(body)
        err = body.get("error") if isinstance(body, dict) else None
        code = str(err.get("code") or "") if isinstance(err, dict) else ""
        shaped = isinstance(err, dict) and all(isinstance(err.get(k), str)
                                               for k in ("message", "type"))  # fmt: skip
    except ValueError:
        said = response.text[:200] or response.reason_phrase
    where = _where(endpoint)
    if status in (401, 403):
        raise EndpointError("auth", f"{where} refused the API key (HTTP {status}: {said}): "
                            "check the key kept for this endpoint", status=status,
                            shaped=shaped)  # fmt: skip
    if status == 404 or code == "model_not_found":  # OpenAI and vLLM: 404; ours: 400
        raise EndpointError("model", f"{where} has no {endpoint.model or 'such'} model or route "
                            f"(HTTP {status}: {said}): pick one it lists", status=status,
                            shaped=shaped)  # fmt: skip
    if status == 429:
        wait = _retry_after(response.headers.get("retry-after"))
        after = f"; retry after {wait:g} s" if wait is not None else ""
        raise EndpointError("rate_limited", f"{where} is limiting requests (HTTP 429: {said})"
                            f"{after}", retry_after=wait, status=status, shaped=shaped)  # fmt: skip
    if status < 500:
        raise EndpointError("refused", f"{where} refused the request (HTTP {status}: {said})",
                            status=status, shaped=shaped)  # fmt: skip
    wait = _retry_after(response.headers.get("retry-after"))  # an overloaded server's 503
    after = f"; retry after {wait:g} s" if wait is not None else ""
    raise EndpointError("server", f"{where} failed (HTTP {status}: {said}){after}",
                        retry_after=wait, status=status, shaped=shaped)  # fmt: skip


def _retry_after(value: str | None) -> float | None:
    """``Retry-After`` in seconds (a number of seconds; an HTTP date counts from now)."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        from email.utils import parsedate_to_datetime

        try:
            return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
        except (TypeError, ValueError):
            return None


def transport_error(
    endpoint: Endpoint, exc: httpx2.HTTPError | httpx2.InvalidURL, chunks: int
) -> EndpointError:
    """What a failure below HTTP means to the user."""
    where = _where(endpoint)
    if isinstance(exc, httpx2.UnsupportedProtocol | httpx2.InvalidURL):
        return EndpointError("unreachable", f"{endpoint.base_url!r} is no URL a server can be "
                             f"reached at ({exc}): give it as http://host:port or "
                             "https://host")  # fmt: skip
    if isinstance(exc, httpx2.ConnectTimeout | httpx2.ConnectError):
        return EndpointError("unreachable", f"{where} is unreachable ({exc}): is the server "
                             "running, and is the URL right?")  # fmt: skip
    if isinstance(exc, httpx2.ReadTimeout):
        what = "nothing" if chunks == 0 else f"nothing more after {chunks} chunks"
        return EndpointError("timeout", f"{where} sent {what} for {endpoint.read_s:g} s: the "
                             "server is busy or stalled")  # fmt: skip
    if isinstance(exc, httpx2.TransportError):
        return EndpointError("dropped", f"{where} broke the connection after {chunks} chunks "
                             f"({type(exc).__name__}): the reply so far is kept")  # fmt: skip
    return EndpointError("protocol", f"{where}: {exc}")
