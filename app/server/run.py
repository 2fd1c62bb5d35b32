"""One HTTP request's engine requests (its choices) as the route waits for them: their events
from the engine's thread (:func:`sink`), their places in the bounded queue until their first
token, their cancellation when the client leaves, and the stream of chunks."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import torch
from fastapi import Request

from app.server.engine_loop import Sink
from app.server.errors import HTTPError, error_body
from app.server.schema import Choice, Reply, Scored, StreamOptions, scored, sse
from engine.core.output import Logprobs, TokenEvent
from engine.errors import EngineBusyError, InvalidRequestError

if TYPE_CHECKING:
    from app.server.routes import Server


def sink(
    loop: asyncio.AbstractEventLoop,
    events: asyncio.Queue[tuple[int, TokenEvent | BaseException]],
    index: int,
) -> Sink:
    def put(event: TokenEvent | BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # the asyncio loop is gone (shut down)
            loop.call_soon_threadsafe(events.put_nowait, (index, event))

    return put


class Run:
    """The engine requests behind one HTTP request (its ``n`` choices): their events, the
    queue places they hold until their first token, and their cancellation if the client
    leaves."""

    def __init__(
        self, server: Server, events: asyncio.Queue[tuple[int, TokenEvent | BaseException]],
        choices: list[Choice],
    ) -> None:  # fmt: skip
        self.server, self.events, self.choices = server, events, choices
        self.waiting = {c.index for c in choices}  # without a first event yet

    def done(self) -> bool:
        return all(c.finish is not None for c in self.choices)

    async def next(self) -> tuple[Choice, str, list[Scored]]:
        """The next event's choice, the text it adds and the tokens it scores (an echoed
        prompt's come first, with the choice's first token)."""
        index, event = await self.events.get()
        choice = self.choices[index]
        if index in self.waiting:
            self.waiting.discard(index)
            self.server.admission.give_back(choice.prompt_tokens)
        if isinstance(event, BaseException):
            choice.finish = "error"
            self.cancel()
            raise failure(event)
        text, new = "", []
        if choice.echo is not None and event.token_id is not None and choice.tokens == 0:
            text, new = choice.echo, _echoed(choice.prompt_ids, event.prompt_logprobs)
        if event.token_id is not None:
            choice.tokens += 1
            if choice.keep_tokens:
                text += event.text
                if event.logprob is not None:
                    new.append(scored(event))
        choice.text += text
        choice.scored += new
        if event.finish_reason == "timeout":
            choice.finish = "error"
            self.cancel()
            raise HTTPError(
                503, "the request waited longer than the server's queue timeout; try again",
                code="queue_timeout", headers={"Retry-After": "1"},
            )  # fmt: skip
        choice.finish = event.finish_reason
        if not choice.keep_tokens and choice.finish in ("stop", "length"):
            choice.finish = "length"  # max_tokens 0: the limit ended it, at once
        return choice, text, new

    def cancel(self) -> None:
        """Cancel every choice still going (the engine frees their blocks at its next step)
        and give back their queue places."""
        for choice in self.choices:
            if choice.finish is None:
                self.server.loop.cancel(choice.request_id)
                choice.finish = "cancelled"
        for index in self.waiting:
            self.server.admission.give_back(self.choices[index].prompt_tokens)
        self.waiting.clear()

    async def wait(self, request: Request) -> None:
        """Collect every choice, cancelling them if the client disconnects meanwhile: asked
        every tenth of a second, between tokens too (a reply whose tokens come faster than
        that would otherwise never ask, and run to its end for no one)."""
        loop = asyncio.get_running_loop()
        asked = loop.time()
        try:
            while not self.done():
                getter = asyncio.ensure_future(self.next())
                while not getter.done():
                    await asyncio.wait({getter}, timeout=0.1)
                    if not getter.done():
                        asked = loop.time()
                        if await request.is_disconnected():
                            getter.cancel()
                            self.cancel()
                            return
                getter.result()
                if loop.time() - asked >= 0.1:
                    asked = loop.time()
                    if await request.is_disconnected():
                        self.cancel()
                        return
        finally:
            if not self.done():
                self.cancel()

    async def stream(
        self, reply: Reply, options: StreamOptions | None, request: Request
    ) -> AsyncIterator[str]:
        usage = options is not None and options.include_usage
        every = options is not None and options.continuous_usage_stats
        try:
            if reply.chat:  # the first delta of each choice carries its role
                for choice in self.choices:
                    yield reply.chunk(choice.index, "", None, first=True)
            while not self.done():
                try:
                    choice, text, new = await self.next()
                except HTTPError as exc:
                    yield sse(error_body(exc.message, exc.kind, exc.param, exc.code))
                    break
                if reply.tools is not None and reply.tools.parse:  # held whole: calls or text,
                    if choice.finish is not None:  # told at its end
                        finish = choice.finish if choice.finish != "cancelled" else None
                        yield reply.tool_chunk(choice.index, choice.text, finish)
                    continue
                if text or choice.finish is not None or new:
                    finish = choice.finish if choice.finish != "cancelled" else None
                    yield reply.chunk(
                        choice.index, text, finish, scored=new, offset=choice.offset,
                        usage=reply.usage(self.choices) if every else None,
                    )  # fmt: skip
                    if new and reply.token_text is not None:
                        choice.offset += sum(len(reply.token_text(t)) for t, _, _ in new)
            else:
                if usage:
                    yield sse(reply.usage_chunk(self.choices))
            yield "data: [DONE]\n\n"
        finally:  # the client left (the task is cancelled) or the stream ended
            if not self.done():
                self.cancel()


def _echoed(prompt: list[int], lps: list[Logprobs | None] | None) -> list[Scored]:
    """An echoed prompt's scored tokens (none where log-probabilities were not asked for)."""
    if lps is None:
        return []
    return [
        (t, None, ()) if lp is None else (t, lp[0], lp[1])
        for t, lp in zip(prompt, lps, strict=True)
    ]


def failure(exc: BaseException) -> HTTPError:
    if isinstance(exc, HTTPError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return HTTPError(400, str(exc))
    if isinstance(exc, EngineBusyError | torch.OutOfMemoryError):  # try again in a moment
        return HTTPError(503, str(exc), code="server_busy", headers={"Retry-After": "1"})
    return HTTPError(500, f"the engine failed: {type(exc).__name__}: {exc}", code="engine_error")
