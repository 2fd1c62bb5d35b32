"""What ``infersight serve`` and its Ray Serve replicas (:mod:`app.replicas`) share: the
server's options checked, the server built from them, the port it listens on. It sits below
both, so that a replica never imports the command (:mod:`app.cli.serve`) that starts it."""

from __future__ import annotations

import argparse
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

    from app.server.routes import API_KEY_ENV, Server

    engine = load_engine(args, config=engine_config(args, max_batch_size=args.max_batch_size))
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    name = args.served_model_name or engine.name
    return Server(engine, name=name, limits=server_limits(args), api_key=api_key)


def free_port(host: str) -> socket.socket:
    """A socket bound to any free port of ``host`` (``--port 0``), for uvicorn to serve on."""
    from app.server.routes import bind

    try:
        return bind(host, 0)
    except OSError as exc:
        raise InvalidRequestError(
            f"cannot listen on {host} ({exc.strerror or exc}): check --host"
        ) from None


def check_port(host: str, port: int) -> None:
    import socket

    try:
        with socket.create_server((host, port)):
            pass
    except OSError as exc:
        raise InvalidRequestError(
            f"cannot listen on {host}:{port} ({exc.strerror or exc}); another program may be "
            "using it: choose another --port, or check --host"
        ) from None
