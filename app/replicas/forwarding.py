"""An HTTP request carried from the front deployment to an engine replica, and run there
through the replica's own server app (:class:`app.server.routes.Server`) as ASGI.

Ray Serve's proxy routes an HTTP request before its body is read: its router sees the path
and the headers only. So the front reads the body, names the prompt's leading chunks
(:func:`prefix_keys`) for the router to match against where earlier prompts went, and hands
the whole request on (:class:`Forwarded`); the replica replays it into its app
(:func:`call`) and streams the response back as parts: first ``("start", status,
headers)``, then ``("body", bytes)`` as the app sends them.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message

#: characters of prompt text per routing key: about a KV block's 16 tokens of English
CHUNK_CHARS = 64
#: keys per prompt at most (its first 2048 characters)
MAX_KEYS = 32


@dataclass(frozen=True, slots=True)
class Forwarded:
    """One HTTP request as the front received it, and its prompt's routing keys."""

    method: str
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None = None
    #: the keys of the prompt's leading chunks, shortest prefix first (:func:`prefix_keys`)
    prefix: tuple[str, ...] = field(default=())


Part = tuple[Any, ...]  # ("start", status, headers) | ("body", bytes)


def prompt_text(path: str, body: bytes) -> str:
    """The prompt a completion request's body carries, as text: a chat's messages joined
    (role and content, as its template will lay them out in order), a completion's prompt;
    "" for anything else or a body that is not such JSON."""
    if not path.endswith(("/chat/completions", "/completions")):
        return ""
    try:
        data = json.loads(body)
    except ValueError:
        return ""
    if not isinstance(data, dict):
        return ""
    messages = data.get("messages")
    if isinstance(messages, list):
        parts = []
        for m in messages:
            if isinstance(m, dict):
                content = m.get("content")
                if isinstance(content, list):  # content parts: their texts
                    content = "".join(
                        str(p.get("text", "")) for p in content if isinstance(p, dict)
                    )
                parts.append(f"{m.get('role', '')}\n{content or ''}\n")
        return "".join(parts)
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):  # token ids
        return " ".join(str(t) for t in prompt)
    return ""


def prefix_keys(text: str) -> tuple[str, ...]:
    """Keys of ``text``'s whole leading chunks of :data:`CHUNK_CHARS` characters, each key
    naming the text up to its chunk's end (a chained hash), at most :data:`MAX_KEYS`. Two
    prompts share their first ``k`` keys exactly when they share their first ``k`` chunks:
    what the engine's prefix cache would reuse, at block-ish granularity."""
    keys: list[str] = []
    h = hashlib.blake2b(digest_size=8)
    for start in range(0, min(len(text), CHUNK_CHARS * MAX_KEYS), CHUNK_CHARS):
        chunk = text[start : start + CHUNK_CHARS]
        if len(chunk) < CHUNK_CHARS:
            break
        h.update(chunk.encode("utf-8", "surrogatepass"))
        keys.append(h.copy().hexdigest())
    return tuple(keys)


async def call(app: ASGIApp, request: Forwarded) -> AsyncIterator[Part]:
    """Run ``request`` through ``app`` and yield its response as parts, as the app sends
    them. Cancelling the iteration (the client went away) tells the app the client
    disconnected, which cancels the engine's requests."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
        "method": request.method, "scheme": "http", "path": request.path, "raw_path":
        request.path.encode(), "query_string": request.query, "root_path": "",
        "headers": request.headers, "client": request.client, "server": ("replica", 0),
    }  # fmt: skip
    sent: asyncio.Queue[Message | None] = asyncio.Queue()
    gone = asyncio.Event()
    body: list[Message] = [{"type": "http.request", "body": request.body, "more_body": False}]

    async def receive() -> Message:
        if body:
            return body.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await sent.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await sent.put(None)

    task = asyncio.ensure_future(run())
    try:
        while True:
            message = await sent.get()
            if message is None:
                break
            if message["type"] == "http.response.start":
                yield ("start", message["status"], list(message.get("headers", [])))
            elif message["type"] == "http.response.body":
                chunk = message.get("body", b"")
                if chunk:
                    yield ("body", chunk)
                if not message.get("more_body", False):
                    break
        await task  # the app's own errors surface here
    finally:
        if not task.done():  # the caller stopped reading: the client is gone
            gone.set()
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(task, timeout=5)
