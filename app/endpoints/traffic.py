"""One request of a load (:class:`~app.endpoints.load.EndpointLoad`), sent the way its drawn
:class:`~engine.bench.load_spec.Shape` says: to ``/v1/chat/completions`` or (the messages as
one text) ``/v1/completions``, streamed or not, greedy or sampled, and with the fault it
carries:

* ``disconnect``: the client hangs up after the second chunk with text;
* ``cancel``: it hangs up as soon as the server took the request (its status line), before a
  byte of the answer;
* ``slow_reader``: it pauses after each chunk;
* ``oversize_body``: a prompt of :data:`OVERSIZE_BYTES`, over the body limit of most servers
  (``serve``'s is 1 MiB);
* ``over_context``: a prompt of about 80k tokens, past the context of most local models;
* ``malformed``: a body cut off mid-JSON.

The reply is collected in a :class:`~app.endpoints.client.Streamed` (chunks, finish reason,
usage); a server's failure raises :class:`~app.endpoints.client.EndpointError`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import httpx2

from app.endpoints.client import (
    Endpoint,
    EndpointError,
    Streamed,
    check_response,
    headers,
    post,
    sampling_body,
    server_url,
    stream_chat,
    stream_completion,
    transport_error,
)
from engine.bench.load_spec import Shape

#: an oversize body's prompt, in bytes
OVERSIZE_BYTES = 2 << 20
#: an over-context prompt: about 80k tokens in the tokenizers we know, under 1 MiB as a body
OVER_CONTEXT = "lorem ipsum " * 40_000


def send(
    endpoint: Endpoint, session: httpx2.Client, messages: list[dict[str, str]], out: int,
    shape: Shape, reply: Streamed, *, temperature: float, ignore_eos: bool,
    on_chunk: Callable[[], bool],
) -> bool:  # fmt: skip
    """Send one request and read its answer into ``reply``; ``on_chunk`` is called at each
    streamed chunk with text and returns False to hang up (a stop). Returns True where the
    client cut the request (its fault, or a stop); raises :class:`EndpointError`."""
    if shape.fault == "over_context":
        messages = [{"role": "user", "content": OVER_CONTEXT}]
    elif shape.fault == "oversize_body":
        messages = [{"role": "user", "content": "x" * OVERSIZE_BYTES}]
    chat = shape.route == "chat"
    prompt = "\n\n".join(m["content"] for m in messages) + "\n"
    sampled = shape.seed is not None
    args: dict[str, Any] = {
        "max_tokens": out, "temperature": temperature if sampled else 0.0, "seed": shape.seed,
        "extra": {"ignore_eos": True} if ignore_eos else None,
    }  # fmt: skip
    if shape.fault in ("cancel", "malformed") or not shape.stream:
        route = "/v1/chat/completions" if chat else "/v1/completions"
        said = {"model": endpoint.model, **({"messages": messages} if chat else {"prompt": prompt})}
        body = sampling_body(said, **args, stream=bool(shape.fault))
        if shape.fault:
            return _raw(endpoint, session, route, body, shape.fault)
        return _whole(endpoint, session, route, body, reply)
    if chat:
        stream = stream_chat(endpoint, messages, reply=reply, session=session, **args)
    else:
        stream = stream_completion(endpoint, prompt, reply=reply, session=session, **args)
    for chunks, _ in enumerate(stream, 1):
        if not on_chunk() or (shape.fault == "disconnect" and chunks >= 2):
            stream.close()  # the connection closes: the server takes it as a cancel
            return True
        if shape.pause_s:
            time.sleep(shape.pause_s)
    return False


def _whole(
    endpoint: Endpoint, session: httpx2.Client, route: str, body: dict[str, Any], reply: Streamed
) -> bool:
    """A reply not streamed: its finish reason and usage into ``reply`` (no chunks: the
    client sees no first token)."""
    answer = post(endpoint, route, body, session=session)
    try:
        reply.finish_reason = answer["choices"][0].get("finish_reason")
        usage = answer.get("usage")
        reply.usage = usage if isinstance(usage, dict) else None
    except (KeyError, IndexError, TypeError, AttributeError) as exc:
        raise EndpointError(
            "protocol", f"{endpoint.name} answered {route} with no choices: is it an "
            "OpenAI-compatible server?", status=200,
        ) from exc  # fmt: skip
    return False


def _raw(
    endpoint: Endpoint, session: httpx2.Client, route: str, body: dict[str, Any], fault: str
) -> bool:
    """A cancel (the request sent whole, the connection closed once the server took it) or a
    malformed body (the same request cut off mid-JSON): the server's refusal raises."""
    content = json.dumps(body).encode()
    if fault == "malformed":
        content = content[: len(content) // 2]
    sent = {**headers(endpoint), "Content-Type": "application/json"}
    url = server_url(endpoint.base_url) + route
    try:
        with session.stream("POST", url, content=content, headers=sent) as response:
            if response.status_code >= 400:
                response.read()
                check_response(endpoint, response)
            if fault == "malformed":  # a server that took it: say so
                raise EndpointError(
                    "protocol", f"{endpoint.name} took a body that is not JSON (HTTP "
                    f"{response.status_code})", status=response.status_code,
                )  # fmt: skip
    except (httpx2.HTTPError, httpx2.InvalidURL) as exc:
        raise transport_error(endpoint, exc, 0) from exc
    return True
