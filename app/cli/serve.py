"""``infersight serve``: the command's checks, then the OpenAI-compatible server
(:mod:`app.server.routes`) on uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from app.cli.common import engine_config, load_engine
from engine.errors import InvalidRequestError

if TYPE_CHECKING:
    import socket

    from app.server.routes import Server, ServerLimits


def check_serve_args(args: argparse.Namespace) -> None:
    """The server's numeric options, checked before anything loads."""
    for name in ("max_batch_size", "max_waiting", "max_waiting_tokens", "max_n",
                 "max_tokens", "max_body_bytes"):  # fmt: skip
        if getattr(args, name) < 1:
            raise InvalidRequestError(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 <= args.port <= 65535:
        raise InvalidRequestError("--port must be 1 to 65535 (or 0: any free port)")
    if not args.queue_timeout > 0:
        raise InvalidRequestError("--queue-timeout must be > 0 seconds")
    if args.self_test_interval < 0 or args.oom_margin_mib < 0:
        raise InvalidRequestError("--self-test-interval and --oom-margin-mib must be >= 0")


def server_limits(args: argparse.Namespace) -> ServerLimits:
    from app.server.routes import ServerLimits

    return ServerLimits(
        max_waiting=args.max_waiting, max_waiting_tokens=args.max_waiting_tokens,
        queue_timeout_s=args.queue_timeout, max_n=args.max_n, max_tokens=args.max_tokens,
        max_body_bytes=args.max_body_bytes, self_test_s=args.self_test_interval,
        oom_margin_mib=args.oom_margin_mib,
    )  # fmt: skip


def make_server(args: argparse.Namespace) -> Server:
    """The command's model loaded, behind the OpenAI-compatible routes with the command's
    limits and API key (``--api-key`` or ``INFERSIGHT_API_KEY``): one server, or one Ray
    Serve replica's (:mod:`app.replicas`)."""
    import os

    from app.server.routes import Server

    engine = load_engine(args, config=engine_config(args, max_batch_size=args.max_batch_size))
    api_key = args.api_key or os.environ.get("INFERSIGHT_API_KEY") or None
    name = args.served_model_name or engine.name
    return Server(engine, name=name, limits=server_limits(args), api_key=api_key)


def cmd_serve(args: argparse.Namespace) -> int:
    check_serve_args(args)
    if getattr(args, "ray", False):
        from app.cli.serve_ray import serve_on_ray

        return serve_on_ray(args)
    # before minutes of loading, not after; any free port is taken now and held
    sock = _free_port(args.host) if args.port == 0 else None
    port = args.port if sock is None else int(sock.getsockname()[1])
    if sock is None:
        _check_port(args.host, port)
    import uvicorn

    server = make_server(args)
    from app.server.logs import JsonLines

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLines())
    server_log = logging.getLogger("infersight.server")
    server_log.addHandler(handler)
    server_log.setLevel(logging.INFO)
    server_log.propagate = False
    engine, where = server.engine, f"http://{args.host}:{port}"
    key = " (API key required)" if server.api_key else ""
    print(f"serving {server.name} ({engine.precision.text}, {engine.device}) on {where}/v1{key}",
          file=sys.stderr, flush=True)  # fmt: skip
    # On SIGTERM and Ctrl+C streams get 5 s to end before the lifespan cancels what still
    # runs. uvicorn raises the signal again once it has shut down; Python's own SIGINT
    # handler would turn that into a KeyboardInterrupt inside asyncio's runner, which then
    # cancels the lifespan task and logs its traceback: with a handler of ours in place,
    # asyncio installs none, and the raised signal finds nothing left to interrupt.
    logging.getLogger("uvicorn.error").addFilter(_not_a_cancelled_lifespan)
    with _quiet_sigint():
        if sock is None:
            uvicorn.run(
                server.app, host=args.host, port=port, log_level="warning",
                timeout_graceful_shutdown=5,
            )  # fmt: skip
            return 0
        uv = uvicorn.Server(uvicorn.Config(server.app, log_level="warning",
                                           timeout_graceful_shutdown=5))  # fmt: skip
        uv.run(sockets=[sock])
    return 0 if uv.started else 3  # uvicorn.run's status when it could not start


def _not_a_cancelled_lifespan(record: logging.LogRecord) -> bool:
    """uvicorn logs the lifespan task's cancellation (starlette reports it as a failed
    shutdown, its traceback as the message), which asyncio's runner makes when the server has
    already shut down (after Ctrl+C; the shutdown itself said "stopped"): not an error, so
    not a traceback on the user's terminal."""
    exc = record.exc_info[1] if record.exc_info else None
    text = record.getMessage().rstrip()
    return not (isinstance(exc, asyncio.CancelledError) or text.endswith("CancelledError"))


@contextlib.contextmanager
def _quiet_sigint() -> Iterator[None]:
    """SIGINT ignored outside uvicorn's own handling of it (which it installs while it
    serves), the previous handler back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda *_: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _free_port(host: str) -> socket.socket:
    """A socket bound to any free port of ``host`` (``--port 0``), for uvicorn to serve on."""
    from app.server.routes import bind

    try:
        return bind(host, 0)
    except OSError as exc:
        raise InvalidRequestError(
            f"cannot listen on {host} ({exc.strerror or exc}): check --host"
        ) from None


def _check_port(host: str, port: int) -> None:
    import socket

    try:
        with socket.create_server((host, port)):
            pass
    except OSError as exc:
        raise InvalidRequestError(
            f"cannot listen on {host}:{port} ({exc.strerror or exc}); another program may be "
            "using it: choose another --port, or check --host"
        ) from None
