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

from app.cli.server_setup import check_port, check_serve_args, free_port, make_server


def cmd_serve(args: argparse.Namespace) -> int:
    check_serve_args(args)
    if getattr(args, "ray", False):
        from app.cli.serve_ray import serve_on_ray

        return serve_on_ray(args)
    # before minutes of loading, not after; any free port is taken now and held
    sock = free_port(args.host) if args.port == 0 else None
    port = args.port if sock is None else int(sock.getsockname()[1])
    if sock is None:
        check_port(args.host, port)
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
