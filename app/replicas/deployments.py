"""``infersight serve --ray``: the OpenAI-compatible server as a Ray Serve application.

Two deployments (see docs/replicas.md):

- **engine** (:class:`EngineReplica`): one engine per replica, each behind the very app
  ``infersight serve`` runs (:class:`app.server.routes.Server`: its bounded queue, API key
  and limits, its self-tests). Ray's health check asks the replica's own health; the
  replicas are routed by :class:`app.replicas.router.PrefixRouter`.
- **front** (:class:`Front`): the HTTP ingress behind Ray's proxy. It reads each request's
  body (Ray's proxy routes before the body is read, so a router there cannot see the
  prompt), names the prompt's leading chunks for the router, and streams the chosen
  replica's response back. It serves ``/metrics`` and ``/health`` itself, from what every
  replica reports to it each :data:`REPORT_S`: vLLM's names, each sample labelled with its
  replica; the health of each.

:func:`build` is Ray Serve's application builder (``import_path:
app.replicas.deployments:build`` in a config file): its ``args`` are ``infersight serve``'s
options by name (``model``, ``precision``, ``max_batch_size``…).
"""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations at run time.
import argparse
import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from app.replicas import forwarding
from app.replicas.forwarding import Forwarded
from app.replicas.metrics import merge
from app.server.errors import HTTPError, error_body
from app.server.routes import NEEDS_KEY, bearer_matches
from app.server.schema import sse

log = logging.getLogger(__name__)

#: the application's name in Ray Serve, and its deployments'
APP, ENGINE, FRONT = "infersight", "engine", "front"
#: seconds between a replica's reports (metrics and health) to the front; a report older
#: than three of these is a replica gone
REPORT_S = 1.0
#: the router of the engine replicas
ROUTER = "app.replicas.router:PrefixRouter"
#: options of the serve command that are Ray's, not a replica's
RAY_OPTIONS = ("ray", "replicas", "autoscale", "address", "config", "cpus_per_replica")


def serve_options(given: Mapping[str, Any]) -> dict[str, Any]:
    """``infersight serve``'s options: its defaults, updated with ``given`` (by name); an
    unknown name is refused."""
    from app.cli.options import serve_defaults

    defaults = serve_defaults()
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        from engine.errors import InvalidRequestError

        raise InvalidRequestError(
            f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} in the "
            "application's args; use `infersight serve`'s option names (max_batch_size …)"
        )
    return {k: v for k, v in {**defaults, **given}.items() if k not in RAY_OPTIONS}


def replica_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The engine deployment's Ray options for these serve options: Ray routes up to a
    batch and a full queue to a replica (its server refuses past that with 503 and
    Retry-After), and holds as many more in the front (past that, 503). Ray counts a request
    as queued from its arrival until it is routed, so a burst's requests queue for a moment
    even when replicas have room: a tighter front queue would turn them away."""
    ongoing = int(options["max_batch_size"]) + int(options["max_waiting"])
    gpu = str(options.get("device", "auto")).startswith("cuda")
    return {
        "max_ongoing_requests": ongoing,
        "max_queued_requests": ongoing,
        "ray_actor_options": {"num_cpus": 1.0, **({"num_gpus": 1} if gpu else {})},
        "health_check_period_s": 10.0,
        "health_check_timeout_s": 30.0,
        "request_router_config": {"request_router_class": ROUTER},
    }


# -- the engine replicas ------------------------------------------------------------------------


@serve.deployment(name=ENGINE)
class EngineReplica:
    """One engine and its server app; requests arrive as :class:`Forwarded`."""

    async def __init__(self, options: dict[str, Any]) -> None:  # type: ignore[misc]
        from app.cli.server_setup import make_server

        args = argparse.Namespace(**options)
        self.server = await asyncio.to_thread(make_server, args)
        self.name = serve.get_replica_context().replica_id.unique_id
        self._lifespan = contextlib.AsyncExitStack()
        app = self.server.app
        await self._lifespan.enter_async_context(app.router.lifespan_context(app))
        self._front: DeploymentHandle[Any] = serve.get_deployment_handle(
            FRONT, app_name=serve.get_replica_context().app_name
        )
        self._reports = asyncio.ensure_future(self._report())

    async def forward(self, request: Forwarded) -> AsyncIterator[forwarding.Part]:
        async for part in forwarding.call(self.server.app, request):
            yield part

    def check_health(self) -> None:
        """Ray's health check: a replica whose engine thread stopped, whose model is gone or
        whose self-test gave another answer is replaced (a full queue is not a failure)."""
        server = self.server
        fatal = [
            text for failed, text in (
                (not server.loop.alive, "the engine's thread has stopped"),
                (server.loop.engine is None, "no model is loaded"),
                (server.self_test.ok is False, f"the self-test failed: {server.self_test.error}"),
            ) if failed
        ]  # fmt: skip
        if fatal:
            raise RuntimeError("; ".join(fatal))

    async def _report(self) -> None:
        """Tell the front this replica's metrics and health, every :data:`REPORT_S`."""
        while True:
            try:
                text = self.server.metrics.render()[0].decode()
                health = {**self.server.health(), "pid": os.getpid()}
                await self._front.report.remote(self.name, text, health)
            except Exception as exc:  # the front restarting: the next report reaches it
                log.debug("report to the front failed: %s", exc)
            await asyncio.sleep(REPORT_S)

    async def __del__(self) -> None:
        self._reports.cancel()
        await self._lifespan.aclose()


# -- the front ----------------------------------------------------------------------------------


def _busy(message: str, code: str) -> JSONResponse:
    """503 in OpenAI's shape, to be tried again in a second."""
    return HTTPError(503, message, code=code, headers={"Retry-After": "1"}).response()


@serve.deployment(
    name=FRONT, num_replicas=1, max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0}
)
@serve.ingress()
class Front:
    """The HTTP ingress: requests to the engine replicas, ``/metrics`` and ``/health`` from
    their reports."""

    def __init__(self, engine: DeploymentHandle[Any], options: dict[str, Any]) -> None:
        self.engine = engine.options(stream=True, method_name="forward")
        self.reports: dict[str, tuple[float, str, dict[str, Any]]] = {}
        # the replicas check the key on what they answer; /metrics is answered here
        self.api_key: str | None = options.get("api_key") or None

    def report(self, replica: str, metrics: str, health: dict[str, Any]) -> None:
        self.reports[replica] = (time.monotonic(), metrics, health)

    def fresh(self) -> dict[str, tuple[str, dict[str, Any]]]:
        """The reports of the replicas alive now (reported within three periods)."""
        now = time.monotonic()
        for replica in [r for r, (t, *_) in self.reports.items() if now - t > 3 * REPORT_S]:
            del self.reports[replica]
        return {r: (text, health) for r, (_, text, health) in self.reports.items()}

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = FastAPI(title="Infersight on Ray Serve", docs_url=None, redoc_url=None,
                      openapi_url=None)  # fmt: skip

        @app.get("/metrics")
        async def metrics(request: Request) -> Response:
            if self.api_key and not bearer_matches(
                request.headers.get("authorization", ""), self.api_key
            ):
                return HTTPError(401, NEEDS_KEY, code="invalid_api_key").response()
            texts = {r: text for r, (text, _) in self.fresh().items()}
            return Response(merge(texts), media_type=CONTENT_TYPE_LATEST)

        @app.get("/health")
        async def health() -> Response:
            replicas = {r: h for r, (_, h) in self.fresh().items()}
            ok = bool(replicas) and all(h.get("status") == "ok" for h in replicas.values())
            body = {"status": "ok" if ok else "unavailable", "replicas": replicas}
            return JSONResponse(body, status_code=200 if ok else 503)

        @app.api_route("/{path:path}", methods=["GET", "POST"])
        async def forward(request: Request, path: str) -> Response:
            return await self.forward(request)

        return app

    async def forward(self, request: Request) -> Response:
        body = await request.body()
        client = (request.client.host, request.client.port) if request.client else None
        forwarded = Forwarded(
            request.method, request.url.path, request.url.query.encode(),
            list(request.headers.raw), body, client,
            forwarding.prefix_keys(forwarding.prompt_text(request.url.path, body)),
        )  # fmt: skip
        stream: Any = self.engine.remote(forwarded)
        try:
            first = await stream.__anext__()
        except BackPressureError:
            return _busy(
                "every replica is busy and the front's queue is full; try again shortly",
                "server_busy",
            )
        except Exception as exc:  # the replica died before answering: nothing was sent
            log.warning("a replica failed before answering: %s", exc)
            return _busy(
                f"the replica serving this request failed ({type(exc).__name__}); it is "
                "being replaced: try again", "replica_failed",
            )  # fmt: skip
        _, status, raw = first
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in raw}
        events = headers.get("content-type", "").startswith("text/event-stream")
        return StreamingResponse(
            _rest(stream, events), status_code=status, headers=headers,
            media_type=headers.get("content-type"),
        )  # fmt: skip


async def _rest(stream: Any, events: bool) -> AsyncIterator[bytes]:
    """The body parts after the start; a replica that dies mid-stream ends an event stream
    with an error event (the OpenAI SDK raises it), any other body cut short."""
    try:
        async for _, chunk in stream:
            yield chunk
    except Exception as exc:
        log.warning("a replica failed mid-reply: %s", exc)
        if not events:
            raise
        message = (
            f"the replica serving this request failed mid-reply ({type(exc).__name__}); the "
            "reply is incomplete: try again"
        )
        yield sse(error_body(message, "server_error", code="replica_failed")).encode()


# -- the application ----------------------------------------------------------------------------


def application(
    options: Mapping[str, Any],
    engine: Mapping[str, Any] | None = None,
    front: Mapping[str, Any] | None = None,
) -> Any:
    """The front over engine replicas loading the model ``options`` name (``infersight
    serve``'s options, :func:`serve_options`), the engine deployment with the options of
    :func:`replica_options` updated with ``engine`` (``num_replicas``,
    ``autoscaling_config`` …), the front's with ``front``."""
    # (the decorators made both classes Ray Serve deployments)
    replica = cast(Any, EngineReplica).options(**{**replica_options(options), **(engine or {})})
    entry = cast(Any, Front).options(**front) if front else cast(Any, Front)
    return entry.bind(replica.bind(dict(options)), dict(options))


def build(args: Mapping[str, Any] | None = None) -> Any:
    """Ray Serve's application builder (a config file's ``import_path``): ``args`` are
    ``infersight serve``'s options by name; the file's ``deployments`` entries (by name:
    ``engine``, ``front``) then set each deployment's replicas and limits."""
    return application(serve_options(dict(args or {})))
