"""``infersight serve --ray``: the server as Ray Serve replicas (:mod:`app.replicas`), on a
local Ray instance started here or on a cluster (``--address``), until Ctrl+C or SIGTERM."""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from engine.errors import InvalidRequestError

#: the builder a config file must name (what `infersight tune --capacity --json` writes)
IMPORT_PATH = "app.replicas.deployments:build"
#: the object store of a local instance: requests and replies only pass through it
OBJECT_STORE_BYTES = 128 * 2**20


def _ray() -> Any:
    try:
        import ray
        from ray import serve  # noqa: F401
    except ImportError:
        raise InvalidRequestError(
            "serve --ray needs Ray Serve, which is not installed: "
            "pip install 'infersight[ray]' (or pip install 'ray[serve]')"
        ) from None
    return ray


def autoscaling(text: str, target: int) -> dict[str, Any]:
    """``--autoscale MIN..MAX`` as Ray Serve's ``autoscaling_config``, aiming at ``target``
    requests in progress per replica."""
    lo, sep, hi = text.partition("..")
    if not sep or not lo.strip().isdigit() or not hi.strip().isdigit():
        raise InvalidRequestError(f"--autoscale {text}: give MIN..MAX replicas, e.g. 1..4")
    low, high = int(lo), int(hi)
    if not 0 <= low <= high or high < 1:
        raise InvalidRequestError(f"--autoscale {text}: need 0 <= MIN <= MAX and MAX >= 1")
    return {"min_replicas": low, "max_replicas": high, "target_ongoing_requests": target,
            "initial_replicas": max(low, 1)}  # fmt: skip


def read_config(path: str) -> dict[str, Any]:
    """A Ray Serve config file (YAML or JSON) of one infersight application: its ``args``
    (the serve options), its deployments' options by name, its ``http_options``."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise InvalidRequestError(f"cannot read {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise InvalidRequestError(f"{path} is not YAML or JSON: {exc}") from None
    if isinstance(data, dict) and "knees" in data:  # `tune --capacity RATE --json`'s report
        data = _from_tune_report(path, data)
    apps = data.get("applications") if isinstance(data, dict) else None
    if not isinstance(apps, list) or len(apps) != 1 or not isinstance(apps[0], dict):
        raise InvalidRequestError(
            f"{path} must hold one application under 'applications' (a Ray Serve config, "
            "as `infersight tune --capacity ... --json` writes)"
        )
    app = apps[0]
    if app.get("import_path") != IMPORT_PATH:
        raise InvalidRequestError(
            f"{path}: its application's import_path is {app.get('import_path')!r}; "
            f"infersight serves {IMPORT_PATH!r}"
        )
    deployments = {
        d["name"]: {k: v for k, v in d.items() if k != "name"}
        for d in app.get("deployments") or []
        if isinstance(d, dict) and "name" in d
    }
    return {
        "args": app.get("args") or {},
        "deployments": deployments,
        "http": data.get("http_options") or {},
    }


def _from_tune_report(path: str, report: dict[str, Any]) -> Any:
    """The Ray Serve config of a tuner report's knee: the best setting's series first."""
    knees = report.get("knees") or {}
    best = report.get("best_for_slo")
    order = sorted(knees.items(), key=lambda item: item[1].get("label") != best)
    for _, k in order:
        if isinstance(k, dict) and "ray_serve" in k:
            return k["ray_serve"]
    raise InvalidRequestError(
        f"{path} is a tuner report without a capacity plan: run `infersight tune` with "
        "--capacity RATE (and a sweep of at least three loads of one setting) and --json"
    )


def plan(args: argparse.Namespace) -> dict[str, Any]:
    """What to deploy: the serve options, the engine and front deployments' options, the
    proxy's host and port; from ``--config`` or from the flags."""
    from app.replicas.deployments import ENGINE, FRONT, serve_options

    if args.config:
        if args.replicas is not None or args.autoscale is not None:
            raise InvalidRequestError(
                "--config sets the replicas (its deployments' num_replicas or "
                "autoscaling_config): drop --replicas/--autoscale, or the config"
            )
        config = read_config(args.config)
        options = serve_options(config["args"])
        engine = config["deployments"].get(ENGINE, {})
        front = config["deployments"].get(FRONT, {})
        host = config["http"].get("host", args.host)
        port = int(config["http"].get("port", args.port))
    else:
        options = serve_options({k: v for k, v in vars(args).items() if k != "handler"})
        if args.autoscale is not None:
            engine = {"autoscaling_config": autoscaling(args.autoscale, args.max_batch_size)}
        else:
            replicas = 1 if args.replicas is None else args.replicas
            if replicas < 1:
                raise InvalidRequestError("--replicas must be at least 1")
            engine = {"num_replicas": replicas}
        front, host, port = {}, args.host, args.port
    cpus = float(args.cpus_per_replica)
    if cpus <= 0:
        raise InvalidRequestError("--cpus-per-replica must be > 0")
    actor = dict(engine.get("ray_actor_options") or {})
    actor.setdefault("num_cpus", cpus)
    engine = {**engine, "ray_actor_options": actor}
    return {"options": options, "engine": engine, "front": front, "host": host, "port": port}


def check_options(options: dict[str, Any]) -> None:
    """What a replica's load would refuse at once (the precision, a drafter, the cache
    window), checked here, before Ray starts: a replica that fails to start is retried
    three times before Ray gives up."""
    import torch

    from app.cli.common import engine_config, speculative_config
    from app.loading import resolve_device
    from engine.quant.spec import parse_precision_spec

    args = argparse.Namespace(**options)
    parse_precision_spec(args.precision, torch.device(resolve_device(args.device)))
    speculative_config(args)
    engine_config(args, max_batch_size=args.max_batch_size)


def replica_failure(serve: Any) -> str:
    """Why the engine replicas failed to start, from Ray Serve's status: the last line of
    the replica's traceback that names an error (an error of ours: its text alone); "" if
    none."""
    from app.replicas.deployments import APP, ENGINE

    try:
        message = serve.status().applications[APP].deployments[ENGINE].message
    except Exception:  # no status to read: the caller says what Ray said
        return ""
    for line in reversed([line.strip() for line in str(message).splitlines()]):
        named = re.match(r"^((?:[\w.]+\.)?\w+(?:Error|Exception)): (.+)$", line)
        if named:
            kind, text = named.groups()  # ours say what to do: their text alone
            return text if kind.startswith(("engine.", "app.")) else line
    return ""


def _most_replicas(engine: dict[str, Any]) -> int:
    auto = engine.get("autoscaling_config")
    if isinstance(auto, dict):
        return int(auto.get("max_replicas", 1))
    return int(engine.get("num_replicas", 1))


def serve_on_ray(args: argparse.Namespace) -> int:
    from app.cli.server_setup import free_port

    ray = _ray()
    todo = plan(args)
    local = args.address is None
    options = todo["options"]
    if local:  # fetched and converted once here, not by each replica at once
        from app.cli.common import progress_printer
        from app.loading import resolve_model_folder

        options["model"] = str(resolve_model_folder(options["model"], progress_printer()))
        check_options(options)
    # the key from the environment too, as one server takes it: the replicas' and the
    # front's processes may not see this one's environment (another node)
    options["api_key"] = options.get("api_key") or os.environ.get("INFERSIGHT_API_KEY") or None
    port = todo["port"]
    if port == 0:
        with free_port(todo["host"]) as sock:
            port = int(sock.getsockname()[1])
    engine = todo["engine"]
    need = _most_replicas(engine) * float(engine["ray_actor_options"]["num_cpus"])
    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")  # no idle workers
    from ray import serve

    from app.replicas.deployments import APP, application

    if local:
        ray.init(
            address="local", num_cpus=max(os.cpu_count() or 1, math.ceil(need)),
            include_dashboard=False, namespace=APP, object_store_memory=OBJECT_STORE_BYTES,
            log_to_driver=False, configure_logging=False,
        )  # fmt: skip
    else:
        ray.init(address=args.address, namespace=APP, log_to_driver=False)
    # our own lines say what starts and where; Ray Serve's INFO lines would repeat them
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    stop = threading.Event()
    try:
        serve.start(http_options={"host": todo["host"], "port": port})
        app = application(options, engine, todo["front"])
        what = f"{_replicas_text(engine)} of {options['model']} ({options['precision']})"
        print(f"infersight serve --ray: starting {what}…", file=sys.stderr, flush=True)
        try:
            serve.run(app, name=APP, route_prefix="/", blocking=False)
        except RuntimeError as exc:
            why = replica_failure(serve) or str(exc).strip() or type(exc).__name__
            raise InvalidRequestError(f"the replicas did not start: {why}") from None
        where = f"http://{todo['host']}:{port}"
        print(f"serving on {where}/v1: {_replicas_text(engine)} on Ray Serve behind its "
              f"proxy; {where}/metrics and /health gather every replica's. Ctrl+C stops.",
              file=sys.stderr, flush=True)  # fmt: skip
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        while not stop.wait(0.5):
            pass
    finally:
        if local:
            serve.shutdown()  # type: ignore[no-untyped-call]
        else:
            from contextlib import suppress

            with suppress(Exception):
                serve.delete(APP)
        ray.shutdown()
        print("infersight serve --ray: stopped", file=sys.stderr, flush=True)
    return 0


def _replicas_text(engine: dict[str, Any]) -> str:
    auto = engine.get("autoscaling_config")
    if isinstance(auto, dict):
        return f"{auto.get('min_replicas')}–{auto.get('max_replicas')} replicas (autoscaled)"
    n = int(engine.get("num_replicas", 1))
    return f"{n} replica{'s' if n != 1 else ''}"
