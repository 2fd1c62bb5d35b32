"""The app serving its own engine: ``infersight serve``'s routes (:class:`app.server.routes.Server`)
on a uvicorn thread of the app, stepped by the app's :class:`~app.gui.worker.EngineWorker`.

Requests from outside go to the worker as :class:`~app.gui.commands.Serve` commands and are batched
with the user's own chat by the same engine, so the instruments show them (their request ids
name the client). No Qt here beyond the worker's ``post``: the server's handlers run on the
uvicorn thread, the engine on the worker's."""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time

import uvicorn

from app.gui.commands import CancelServe, Serve
from app.gui.worker import EngineWorker
from app.server.engine_loop import SELF_TEST_ID, Sink
from app.server.routes import API_KEY_ENV, Server, ServerLimits
from engine.core.engine import LLMEngine
from engine.core.output import TokenEvent
from engine.core.sampling import SamplingParams


class WorkerFront:
    """:class:`app.server.engine_loop.EngineFront` over the app's worker."""

    def __init__(self, worker: EngineWorker) -> None:
        self.worker = worker
        self.server: Server | None = None  # set by ServeHost: whose metrics to fill

    @property
    def out_of_memory(self) -> int:
        return self.worker.recovery.out_of_memory

    @property
    def engine(self) -> LLMEngine | None:
        return self.worker.engine

    @property
    def alive(self) -> bool:
        return self.worker.running

    def start(self) -> None:  # the app owns the worker
        pass

    def stop(self) -> None:
        pass

    def submit(
        self, request_id: str, prompt: list[int], params: SamplingParams, timeout_s: float,
        sink: Sink, priority: int = 0,
    ) -> None:  # fmt: skip
        def observed(event: TokenEvent | BaseException) -> None:  # on the worker's thread
            engine, server = self.worker.engine, self.server
            served = not request_id.startswith(SELF_TEST_ID)  # the server's own: not counted
            if isinstance(event, TokenEvent) and engine and server and served:
                server.metrics.observe_event(event, engine)
                finished = engine.request_metrics(request_id) if event.finish_reason else None
                if finished is not None:
                    server.metrics.observe_request(finished)
            sink(event)

        self.worker.post(Serve(request_id, prompt, params, timeout_s, observed, priority))

    def cancel(self, request_id: str) -> None:
        self.worker.post(CancelServe(request_id))


class ServeHost:
    """``Serve on localhost:PORT``: started and stopped by the app; ``key``, where not given,
    is ``$INFERSIGHT_API_KEY`` as ``serve`` takes it, else generated. ``sock``: a socket
    already bound (:func:`app.server.routes.bind`) to serve on instead of binding ``port``;
    the host closes it when it stops."""

    def __init__(
        self, worker: EngineWorker, port: int, key: str | None = None,
        sock: socket.socket | None = None,
    ) -> None:  # fmt: skip
        engine = worker.engine
        if engine is None:
            raise RuntimeError("load a model before serving it")
        self.port = port if sock is None else int(sock.getsockname()[1])
        generated = f"sk-infersight-{secrets.token_urlsafe(18)}"
        self.key = key or os.environ.get(API_KEY_ENV) or generated
        self.front = WorkerFront(worker)
        self.server = Server(engine, limits=ServerLimits(self_test_s=0), api_key=self.key,
                             front=self.front)  # fmt: skip
        self.front.server = self.server
        config = uvicorn.Config(
            self.server.app, host="127.0.0.1", port=port, log_level="warning",
            timeout_graceful_shutdown=2,
        )  # fmt: skip
        self._uvicorn = uvicorn.Server(config)
        self._sock = sock
        sockets = None if sock is None else [sock]
        self._thread = threading.Thread(target=self._uvicorn.run, args=(sockets,),
                                        name="infersight-serve", daemon=True)  # fmt: skip

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout_s: float = 30.0) -> None:
        """Start listening; raises ``OSError`` if it could not (the port is taken)."""
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._uvicorn.started:
            if not self._thread.is_alive():
                self.stop()
                raise OSError(f"could not listen on 127.0.0.1:{self.port} (in use?)")
            if time.monotonic() > deadline:
                raise OSError(f"the server on port {self.port} did not start")
            time.sleep(0.02)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._uvicorn.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self._sock is not None:  # uvicorn closes it once it has served; this, if it never did
            self._sock.close()

    def examples(self) -> dict[str, str]:
        """Copyable ways to call it: curl and the openai SDK."""
        model = self.server.name
        body = json.dumps(
            {"model": model, "stream": True, "messages": [{"role": "user", "content": "Hello!"}]}
        )
        curl = (
            f"curl {self.url}/chat/completions \\\n"
            f"  -H 'Authorization: Bearer {self.key}' -H 'Content-Type: application/json' \\\n"
            f"  -d '{body}'"
        )
        python = (
            "from openai import OpenAI\n\n"
            f'client = OpenAI(base_url="{self.url}", api_key="{self.key}")\n'
            "for chunk in client.chat.completions.create(\n"
            f'    model="{model}", stream=True,\n'
            '    messages=[{"role": "user", "content": "Hello!"}],\n'
            "):\n"
            '    print(chunk.choices[0].delta.content or "", end="")\n'
        )
        return {"curl": curl, "python": python}
