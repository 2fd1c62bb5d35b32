"""``infersight serve``: an OpenAI-compatible HTTP server over one :class:`LLMEngine`.

One thread, :class:`~app.server.engine_loop.EngineLoop`, owns the engine and steps it while it
has work: handlers never touch it. A request's handler (on the asyncio loop) checks the
request, takes a place in the bounded queue (:class:`Admission`, decided and taken with no
``await`` in between, so a burst cannot slip past the check), and posts it to the loop; the
loop hands each of its :class:`~engine.core.engine.TokenEvent` back to the handler's asyncio
queue. A client that goes away cancels its request at the next step, which frees its blocks.

Routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (streaming as Server-Sent
Events, or whole; a request field we lack is refused by name, :mod:`app.server.fields`),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text, vLLM's names and
buckets, :mod:`app.server.metrics`) and vLLM's tokenizer routes
(:mod:`app.server.tokenizer_routes`). Errors take OpenAI's shape
(:mod:`app.server.schema`): ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.server.engine_loop import (
    SELF_TEST_ID,
    SELF_TEST_PRIORITY,
    SELF_TEST_PROMPT,
    SELF_TEST_TOKENS,
    EngineFront,
    EngineLoop,
    SelfTest,
)
from app.server.errors import REFUSALS, HTTPError, document
from app.server.fields import refuse_unsupported
from app.server.logs import log_event
from app.server.metrics import ServerMetrics
from app.server.run import Run, sink
from app.server.schema import (
    ChatBody,
    Choice,
    CompletionBody,
    Reply,
    RequestBody,
)
from app.server.tokenizer_routes import add_tokenizer_routes
from app.server.tools import ToolPlan, plan_tools, takes_tools
from engine.core.engine import LLMEngine
from engine.core.output import TokenEvent
from engine.core.sampling import SamplingParams
from engine.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """What one server accepts: requests waiting for their first token (count and prompt
    tokens), how long one may wait, and the caps on ``n``, ``max_tokens`` and body size."""

    max_waiting: int = 64
    max_waiting_tokens: int = 65_536
    queue_timeout_s: float = 60.0
    max_n: int = 8
    max_tokens: int = 4096
    max_body_bytes: int = 1 << 20
    retry_after_s: int = 1
    self_test_s: float = 300.0  # between self-tests (0: only the one at start)
    oom_margin_mib: int = 256  # GPU memory held back for recovering from running out


# -- the listening socket -----------------------------------------------------------------------


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` for ``uvicorn.Server.run(sockets=[...])``; port 0
    takes any free port (``getsockname()`` says which). The port is held from here on, so
    nobody can take it between choosing and serving; it is refused connections until
    uvicorn listens on it. Raises ``OSError`` where the address cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if os.name != "nt":  # as asyncio binds (on Windows it would share a port in use)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


# -- health -------------------------------------------------------------------------------------


def _memory(device: torch.device) -> dict[str, Any]:
    """Free and total memory where the engine runs; within bounds while 2% of it is free
    (CUDA: what the driver says is free; CPU: what the OS says is available)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
    else:
        import psutil

        vm = psutil.virtual_memory()
        free, total = vm.available, vm.total
    return {"free_bytes": int(free), "total_bytes": int(total), "ok": free >= 0.02 * total}


# -- the bounded queue --------------------------------------------------------------------------


class Admission:
    """The bounded queue: requests accepted but without a first token yet, by count and by
    prompt tokens. Used from the asyncio loop's thread only, so checking and taking a place
    is one uninterrupted step."""

    def __init__(self, limits: ServerLimits) -> None:
        self.limits = limits
        self.requests = 0
        self.tokens = 0

    def take(self, requests: int, tokens: int) -> None:
        lim = self.limits
        if self.requests + requests > lim.max_waiting or (
            self.requests and self.tokens + tokens > lim.max_waiting_tokens
        ):
            raise HTTPError(
                503,
                f"the server is busy: {self.requests} requests ({self.tokens} prompt tokens) "
                "are waiting; try again shortly",
                code="server_busy",
                headers={"Retry-After": str(lim.retry_after_s)},
            )
        self.requests += requests
        self.tokens += tokens

    def give_back(self, tokens: int) -> None:
        self.requests -= 1
        self.tokens -= tokens


# -- the app ------------------------------------------------------------------------------------


class Server:
    """The routes over one engine, stepped by an :class:`~app.server.engine_loop.EngineLoop` of
    its own or by the ``front`` given (which then observes ``server.metrics`` as its requests
    finish)."""

    def __init__(
        self, engine: LLMEngine, *, name: str | None = None, limits: ServerLimits | None = None,
        api_key: str | None = None, front: EngineFront | None = None,
    ) -> None:  # fmt: skip
        self._name = name
        self.limits = limits or ServerLimits()
        self.api_key = api_key
        self.metrics = ServerMetrics(name or engine.name, engine.context_length)
        margin = self.limits.oom_margin_mib << 20 if engine.device.type == "cuda" else 0
        self.loop: EngineFront = front or EngineLoop(engine, self.metrics, margin)
        self.self_test = SelfTest()
        self.admission = Admission(self.limits)
        self.created = int(time.time())
        self.app = self._build()

    @property
    def engine(self) -> LLMEngine:
        """The engine serving now (the app's follows the model its user loads)."""
        engine = self.loop.engine
        if engine is None:
            raise HTTPError(503, "no model is loaded yet; try again shortly", code="no_model")
        return engine

    @property
    def name(self) -> str:
        return self._name or self.engine.name

    # -- routes ----------------------------------------------------------------------------
    def _build(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(_: FastAPI) -> AsyncIterator[None]:
            self.loop.start()
            with contextlib.suppress(HTTPError):  # no model yet: /health says so
                await self.run_self_test()  # the answer later self-tests must give again
            tests = asyncio.create_task(self._self_tests())
            try:
                yield
            finally:  # graceful shutdown: what runs is cancelled, the loop ends
                tests.cancel()
                self.loop.stop()
                print("infersight serve: stopped", file=sys.stderr, flush=True)

        # the OpenAPI document at /openapi.json (behind the key, as every route but /health):
        # what clients and fuzzers such as schemathesis read the routes from
        app = FastAPI(
            title="Infersight", docs_url=None, redoc_url=None, openapi_url="/openapi.json",
            lifespan=lifespan, responses=REFUSALS,
        )  # fmt: skip
        document(app)

        @app.exception_handler(HTTPError)
        async def _http_error(request: Request, exc: HTTPError) -> Response:
            self.metrics.reject(exc.status)
            await self._log_refusal(request, exc)
            return exc.response()

        @app.exception_handler(StarletteHTTPException)
        async def _routing(request: Request, exc: StarletteHTTPException) -> Response:
            # no such route (404), or not by this method (405): in OpenAI's shape as the rest
            said = {404: f"no route {request.url.path}: see /openapi.json for the ones there are",
                    405: f"{request.url.path} does not take {request.method}"}  # fmt: skip
            error = HTTPError(exc.status_code, said.get(exc.status_code, str(exc.detail)),
                              headers=dict(exc.headers or {}))  # fmt: skip
            self.metrics.reject(exc.status_code)
            await self._log_refusal(request, error)
            return error.response()

        @app.exception_handler(RequestValidationError)
        async def _invalid(request: Request, exc: RequestValidationError) -> Response:
            first = exc.errors()[0] if exc.errors() else {}
            loc = [str(p) for p in first.get("loc", ()) if p != "body"]
            param = ".".join(loc) or None
            message = f"{param or 'body'}: {first.get('msg', 'invalid request')}"
            self.metrics.reject(400)
            error = HTTPError(400, message, param=param)
            await self._log_refusal(request, error)
            return error.response()

        @app.get("/health")
        async def health() -> Response:
            body = self.health()
            return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

        @app.get("/metrics", response_class=PlainTextResponse)
        async def metrics() -> Response:
            body, content_type = self.metrics.render()
            return Response(body, media_type=content_type)

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{
                "id": self.name, "object": "model", "created": self.created,
                "owned_by": "infersight", "max_model_len": self.engine.context_length,
            }]}  # fmt: skip

        @app.post("/v1/chat/completions")
        async def chat(body: ChatBody, request: Request) -> Response:
            refuse_unsupported(body)
            plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
            template = self.engine.tokenizer.chat_template or ""
            with_tools = plan is not None and takes_tools(template)
            messages: list[dict[str, Any]] = [m.for_template(with_tools) for m in body.messages]
            tools = None
            if plan is not None:
                messages, tools = plan.prompt_messages(messages, template)
            try:
                prompt = self.engine.chat_prompt_ids(messages, tools=tools)
            except InvalidRequestError as exc:
                raise HTTPError(400, str(exc), param="messages") from None
            limit = body.max_completion_tokens or body.max_tokens
            return await self._complete(
                body, request, [(prompt, None)], limit, body.wanted_logprobs(), chat=True,
                tools=plan,
            )  # fmt: skip

        @app.post("/v1/completions")
        async def completions(body: CompletionBody, request: Request) -> Response:
            refuse_unsupported(body)
            tok = self.engine.tokenizer
            prompts: list[tuple[list[int], str | None]] = []
            for given in body.prompts():
                if isinstance(given, str):
                    ids = tok.encode_prompt(given)
                    text = given
                else:
                    ids = list(given)
                    if not ids:
                        raise HTTPError(400, "a prompt of no tokens", param="prompt")
                    try:  # ids outside the vocabulary, before the tokenizer reads them
                        self.engine.validate_prompt(ids)
                    except InvalidRequestError as exc:
                        raise HTTPError(400, str(exc), param="prompt") from None
                    text = tok.decode(ids, skip_special_tokens=False)
                prompts.append((ids, text if body.echo else None))
            return await self._complete(
                body, request, prompts, body.max_tokens, body.wanted_logprobs(), chat=False
            )

        add_tokenizer_routes(app, lambda: self.engine)
        app.add_middleware(_Guard, server=self)
        return app

    # -- health ----------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """Serving is healthy when the engine's thread runs, the queue has room, memory is
        within bounds and the last self-test gave the known answer; each part says why not."""
        engine = self.loop.engine
        memory = _memory(engine.device if engine is not None else torch.device("cpu"))
        problems = [
            text for failed, text in (
                (not self.loop.alive, "the engine's thread has stopped"),
                (engine is None, "no model is loaded"),
                (self.admission.requests >= self.limits.max_waiting, "the queue is full"),
                (not memory["ok"], "memory is nearly exhausted"),
                (self.self_test.ok is False, f"the self-test failed: {self.self_test.error}"),
            ) if failed
        ]  # fmt: skip
        return {
            "status": "ok" if not problems else "unavailable",
            "problems": problems,
            "model": self._name or (engine.name if engine is not None else None),
            "engine_running": self.loop.alive,
            "waiting": self.admission.requests,
            "max_waiting": self.limits.max_waiting,
            "memory": memory,
            "self_test": {"ok": self.self_test.ok, "runs": self.self_test.runs,
                          "skipped": self.self_test.skipped, "answer": self.self_test.answer,
                          "error": self.self_test.error},
            "out_of_memory_steps": self.loop.out_of_memory,
        }  # fmt: skip

    async def run_self_test(self) -> None:
        """A fixed greedy prompt through the engine (not the queue); its answer must equal the
        first run's, or /health turns 503."""
        engine, test = self.engine, self.self_test
        if engine.tokenizer.chat_template:
            prompt = engine.chat_prompt_ids(SELF_TEST_PROMPT)
        else:
            prompt = engine.tokenizer.encode_prompt(SELF_TEST_PROMPT[0]["content"])
        events: asyncio.Queue[tuple[int, TokenEvent | BaseException]] = asyncio.Queue()
        rid = f"{SELF_TEST_ID}{test.runs}"
        params = SamplingParams(max_new_tokens=SELF_TEST_TOKENS, temperature=0.0)
        put = sink(asyncio.get_running_loop(), events, 0)
        self.loop.submit(rid, prompt, params, 60.0, put, priority=SELF_TEST_PRIORITY)
        text, error = "", None
        try:
            while True:
                _, event = await asyncio.wait_for(events.get(), timeout=120)
                if isinstance(event, BaseException):
                    error = f"{type(event).__name__}: {event}"
                    break
                if event.finish_reason == "timeout":  # a busy server is not a broken one
                    test.skipped += 1
                    return
                text += event.text
                if event.finish_reason is not None:
                    break
        except TimeoutError:
            self.loop.cancel(rid)
            test.skipped += 1
            return
        test.record(text, error)
        log_event("self_test", logging.INFO if test.ok else logging.ERROR,
                  ok=test.ok, runs=test.runs, error=test.error)  # fmt: skip

    async def _self_tests(self) -> None:
        while self.limits.self_test_s > 0:
            await asyncio.sleep(self.limits.self_test_s)
            await self.run_self_test()

    # -- one request -----------------------------------------------------------------------
    async def _log_refusal(self, request: Request, exc: HTTPError) -> None:
        """A refused request is logged with its context: route, status, message and (for a
        client's mistake) the body it sent, cut at 2 kB. Never its headers (the key)."""
        fields: dict[str, Any] = {"route": request.url.path, "status": exc.status,
                                  "message": exc.message, "param": exc.param}  # fmt: skip
        if 400 <= exc.status < 500 and exc.status != 413:
            body = await request.body()
            fields["body"] = body[:2048].decode("utf-8", "replace")
        log_event("refused", logging.WARNING, **fields)

    def _token_text(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    def _params(
        self, body: RequestBody, limit: int | None, logprobs: int | None, prompt_tokens: int,
        *, echo: bool = False, tools: ToolPlan | None = None,
    ) -> list[SamplingParams]:  # fmt: skip
        lim = self.limits
        if body.model is not None and body.model != self.name:
            raise HTTPError(
                400, f"unknown model {body.model!r}; this server serves {self.name!r}",
                param="model", code="model_not_found",
            )  # fmt: skip
        if body.n > min(lim.max_n, lim.max_waiting):
            raise HTTPError(400, f"n must be at most {min(lim.max_n, lim.max_waiting)}", param="n")
        if limit is None:  # as much as the context and the KV pool leave, up to the cap
            mgr = self.engine.kv.manager
            room = min(self.engine.context_length, mgr.capacity * mgr.block_size)
            max_new = max(1, min(lim.max_tokens, room - prompt_tokens))
        elif limit == 0 and not echo:
            raise HTTPError(
                400, "max_tokens: 0 asks for nothing; give echo: true to score the prompt",
                param="max_tokens",
            )  # fmt: skip
        else:
            max_new = max(limit, 1)  # 0 with echo: one token made, none returned
        if max_new > lim.max_tokens:
            raise HTTPError(400, f"max_tokens must be at most {lim.max_tokens}", param="max_tokens")
        stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        constraint = body.response_format.constraint() if body.response_format else None
        if tools is not None and tools.constraint is not None:
            if constraint is not None:
                raise HTTPError(
                    400, "response_format and a forced tool call cannot both hold the reply",
                    param="tool_choice",
                )  # fmt: skip
            constraint = tools.constraint
        try:
            return [
                SamplingParams(
                    max_new_tokens=max_new, temperature=body.temperature,
                    top_k=max(body.top_k, 0), top_p=body.top_p, min_p=body.min_p,
                    repetition_penalty=body.repetition_penalty,
                    seed=None if body.seed is None else body.seed + i, stop=stops,
                    logprobs=logprobs, prompt_logprobs=logprobs if echo else None,
                    ignore_eos=body.ignore_eos, min_tokens=min(body.min_tokens, max_new),
                    extra_stop_token_ids=tuple(body.stop_token_ids or ()),
                    skip_special_tokens=body.skip_special_tokens,
                    include_stop_str_in_output=body.include_stop_str_in_output,
                    constraint=constraint,
                )
                for i in range(body.n)
            ]  # fmt: skip
        except InvalidRequestError as exc:
            raise HTTPError(400, str(exc)) from None

    async def _complete(
        self, body: RequestBody, request: Request, prompts: list[tuple[list[int], str | None]],
        limit: int | None, logprobs: int | None, *, chat: bool, tools: ToolPlan | None = None,
    ) -> Response:  # fmt: skip
        """Run each prompt ``n`` times (choice ``i * n + j``: prompt ``i``'s ``j``-th), a
        prompt given with its text where ``echo`` puts it before the reply."""
        if not self.loop.alive:
            raise HTTPError(503, "the engine has stopped; see /health", code="engine_stopped")
        echo = prompts[0][1] is not None
        longest = max(len(ids) for ids, _ in prompts)
        params = self._params(body, limit, logprobs, longest, echo=echo, tools=tools)
        constraint = params[0].constraint
        if constraint is not None:  # a bad grammar is refused here, not mid-stream; compiled
            try:  # off the event loop, which other streams need meanwhile
                await asyncio.to_thread(self.engine.grammars.matcher, constraint)
            except InvalidRequestError as exc:
                param = "response_format" if body.response_format else "tools"
                raise HTTPError(400, str(exc), param=param) from None
        if len(prompts) * len(params) > self.limits.max_waiting:
            raise HTTPError(
                400, f"{len(prompts)} prompts × n = {len(params)} exceed the "
                f"{self.limits.max_waiting} requests this server queues; send fewer",
                param="prompt",
            )  # fmt: skip
        for ids, _ in prompts:
            try:
                self.engine.check_request(ids, params[0])
            except InvalidRequestError as exc:
                raise HTTPError(400, str(exc), param="messages" if chat else "prompt") from None
        tokens = sum(len(ids) for ids, _ in prompts) * len(params)
        self.admission.take(len(prompts) * len(params), tokens)  # may raise 503
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[int, TokenEvent | BaseException]] = asyncio.Queue()
        prefix = "chatcmpl" if chat else "cmpl"
        base = f"{prefix}-{secrets.token_hex(12)}"
        # the engine's ids name the client: the app's instruments show whose blocks are whose
        client = f"{request.client.host}:{request.client.port}" if request.client else "client"
        choices: list[Choice] = []
        submits: list[tuple[list[int], SamplingParams]] = []
        for ids, text in prompts:
            for p in params:
                i = len(choices)
                choices.append(Choice(
                    i, f"{base}-{i}@{client}", len(ids), echo=text, prompt_ids=ids,
                    keep_tokens=limit != 0,
                ))  # fmt: skip
                submits.append((ids, p))
        log_event(
            "arrival", request_id=base, route=request.url.path, prompt_tokens=tokens,
            n=len(choices), max_tokens=params[0].max_new_tokens, stream=body.stream,
        )  # fmt: skip
        for choice, (ids, p) in zip(choices, submits, strict=True):
            put = sink(loop, events, choice.index)
            self.loop.submit(choice.request_id, ids, p, self.limits.queue_timeout_s, put)
        run = Run(self, events, choices)
        token_text = None if logprobs is None else self._token_text
        prompt_tokens = sum(len(ids) for ids, _ in prompts)
        reply = Reply(base, self.name, chat, prompt_tokens, int(time.time()), token_text, tools,
                      body.return_tokens_as_token_ids)  # fmt: skip
        if body.stream:
            return StreamingResponse(
                run.stream(reply, body.stream_options, request), media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )  # fmt: skip
        await run.wait(request)
        return JSONResponse(reply.whole(choices))


def bearer_matches(authorization: str, key: str) -> bool:
    """Whether an ``Authorization`` header carries ``key`` as its bearer token (compared in
    constant time)."""
    token = authorization[7:] if authorization.lower().startswith("bearer ") else ""
    return secrets.compare_digest(token.encode(), key.encode())


#: what a request without the right key is answered
#: where ``serve`` and the app's *Serve on localhost* take their API key from when none is given
API_KEY_ENV = "INFERSIGHT_API_KEY"
NEEDS_KEY = "a valid API key is needed: send it as 'Authorization: Bearer KEY'"


class _Guard:
    """ASGI middleware before every route: the API key (all routes but ``/health``) and the
    body size limit, both answered in OpenAI's error shape."""

    def __init__(self, app: ASGIApp, server: Server) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        server = self.server
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        key = server.api_key
        if (
            key
            and scope["path"] != "/health"
            and not bearer_matches(headers.get("authorization", ""), key)
        ):
            server.metrics.reject(401)
            await HTTPError(401, NEEDS_KEY, code="invalid_api_key").response()(scope, receive, send)
            return
        limit = server.limits.max_body_bytes
        too_big = HTTPError(413, f"the request body is larger than {limit} bytes")
        length = headers.get("content-length")
        if length is not None and length.isdigit():
            if int(length) > limit:
                server.metrics.reject(413)
                await too_big.response()(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        # No length (chunked): read the body here, up to the limit, and hand it on whole.
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                server.metrics.reject(413)
                await too_big.response()(scope, receive, send)
                return
            more = message.get("more_body", False)
        whole: list[Message] = [{"type": "http.request", "body": b"".join(chunks)}]

        async def replay() -> Message:
            return whole.pop() if whole else await receive()

        await self.app(scope, replay, send)
