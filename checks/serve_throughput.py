"""Throughput of one machine's ways to serve: ``infersight serve`` as one process, split over
two (``--tensor-parallel 2``), and as two Ray Serve replicas (``--ray --replicas 2``), each
under the same closed-loop load through the ``openai`` SDK, one after the other.

    python -m checks.serve_throughput [--users 8] [--requests 4] [--tokens 64] [--json]

Not a test (it times); its table goes to docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

SETUPS = {
    "one process": [],
    "--tensor-parallel 2": ["--tensor-parallel", "2"],
    "--ray --replicas 2": ["--ray", "--replicas", "2"],
}


def _start(extra: list[str], log: Path) -> tuple[subprocess.Popen[str], str]:
    from app.server.routes import bind

    with bind("127.0.0.1", 0) as sock:
        port = sock.getsockname()[1]
    out = open(log, "w", encoding="utf-8")  # noqa: SIM115 (the process writes it)
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve", "--model", "default", "--port", str(port),
         "--max-batch-size", "16", "--self-test-interval", "0", *extra],
        stdout=out, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while not (re.search(r"serving .*on http", log.read_text()) and _healthy(port)):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the server did not start:\n{log.read_text()[-2000:]}")
        time.sleep(0.5)
    return proc, f"http://127.0.0.1:{port}/v1"


def _healthy(port: int) -> bool:
    import http.client

    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False


def _load(base: str, users: int, requests: int, tokens: int) -> dict[str, Any]:
    import openai

    client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    latencies: list[float] = []
    produced: list[int] = []
    errors: list[str] = []

    def user(u: int) -> None:
        for r in range(requests):
            prompt = f"Story {u}.{r}: a traveller reaches a town by the sea, and"
            started = time.perf_counter()
            try:
                reply = client.completions.create(
                    model=model, prompt=prompt, max_tokens=tokens, temperature=0
                )
            except openai.APIError as exc:
                errors.append(str(exc))
                continue
            latencies.append(time.perf_counter() - started)
            produced.append(reply.usage.completion_tokens if reply.usage else 0)

    for u in range(2):  # warm-up: each replica's first requests
        client.completions.create(model=model, prompt=f"Hello {u}", max_tokens=4)
    started = time.perf_counter()
    threads = [threading.Thread(target=user, args=(u,)) for u in range(users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    return {
        "requests": len(latencies), "errors": len(errors), "wall_s": round(wall, 2),
        "output_tok_s": round(sum(produced) / wall, 1),
        "request_s": round(len(latencies) / wall, 3),
        "p50_latency_s": round(statistics.median(latencies), 2) if latencies else None,
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--requests", type=int, default=4, help="per user, one after another")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results: dict[str, Any] = {}
    folder = Path(tempfile.mkdtemp(prefix="serve-throughput-"))
    for name, extra in SETUPS.items():
        print(f"{name}: starting", file=sys.stderr, flush=True)
        proc, base = _start(extra, folder / f"{len(results)}.log")
        try:
            results[name] = _load(base, args.users, args.requests, args.tokens)
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(120)
        print(f"{name}: {results[name]}", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    one = results["one process"]["output_tok_s"]
    print(f"{args.users} users × {args.requests} requests × {args.tokens} tokens, default model")
    print(f"{'setup':<22} {'out tok/s':>10} {'req/s':>7} {'p50 s':>6} {'vs one':>7}")
    for name, r in results.items():
        print(f"{name:<22} {r['output_tok_s']:>10.1f} {r['request_s']:>7.2f} "
              f"{r['p50_latency_s']:>6} {r['output_tok_s'] / one:>6.2f}×")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
