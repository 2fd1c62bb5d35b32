"""``make bench-serving`` (second half): ``infersight serve`` against llama.cpp's server on
the same GGUF, both driven by the tuner's endpoint mode (``infersight tune --endpoint``), one
server at a time on this machine, each with the same threads.

Ours serves the default model (the shipped ``SmolLM2-135M-Instruct.Q4_1.gguf``, converted) at
``--precision`` (default ``int4-g32+head``, the bits Q4_1 holds); the peer is llama-cpp-python's
server (``.peers/venv``, built by ``make bench-peers``; its ``[server]`` extras added by the
make target) on that very GGUF. The load is the tuner's closed loop at each number of users,
its requests drawn from the tuner's prompt set with the same seed for both. ``ignore_eos`` is
sent to both; llama-cpp-python's server drops fields it does not know, so its requests may end
at EOS: the table gives each side's output tokens per request, and the per-token figures
(output tokens/s, TPOT) are what compare. A quarter of the prompts are documents of about a
thousand tokens (the tuner's mix): their prefill is the p95 TTFT.

Prints a Markdown table (and ``--json`` writes the raw reports).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import date
from pathlib import Path
from typing import Any

from checks.serve_process import answers, healthy, serving


def tune(base: str, args: argparse.Namespace, log: Path) -> dict[str, Any]:
    """One ``infersight tune --endpoint`` sweep over ``--users``: its JSON report."""
    cmd = [sys.executable, "-m", "app.cli", "tune", "--endpoint", base, "--json",
           "--users", *map(str, args.users), "--requests", str(args.requests),
           "--output-median", str(args.output), "--output-max", str(args.output)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    log.write_text(done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"tune --endpoint {base} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def peer_serving(python: str, gguf: Path, threads: int, log: Path) -> Iterator[str]:
    """llama-cpp-python's server on ``gguf`` on a free port: its base URL."""
    port = free_port()
    with log.open("w") as out:
        proc = subprocess.Popen(
            [python, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
             "--port", str(port), "--n_threads", str(threads), "--n_ctx", "4096",
             "--model_alias", gguf.stem,
             # its default cuts the running stream short when the next request comes
             "--interrupt_requests", "False"],
            stdout=out, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 300
            while not answers(f"{base}/v1/models"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    said = log.read_text()[-2000:]
                    raise SystemExit(f"llama.cpp's server did not start:\n{said}")
                time.sleep(0.5)
            yield base
        finally:
            proc.terminate()
            proc.wait(60)


def table(ours: dict[str, Any], peer: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        f"`make bench-serving` ({date.today()}): ours `{args.precision}` vs llama.cpp's server "
        f"(Q4_1 GGUF), {args.threads} threads each, closed loop, {args.requests} requests a "
        f"setting, {args.output} output tokens asked",
        "",
        "| users | ours out tok/s | llama.cpp out tok/s | ours ÷ llama.cpp | TTFT p50, p95 ours / "
        "llama.cpp (ms) | TPOT p50 ours / llama.cpp (ms) | out tokens a request ours / "
        "llama.cpp | failed ours / llama.cpp |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for a, b in zip(ours["points"], peer["points"], strict=True):
        ratio = a["output_throughput"] / b["output_throughput"] if b["output_throughput"] else 0
        lines.append(
            f"| {a['label'].split()[0]} | {a['output_throughput']:.1f} | "
            f"{b['output_throughput']:.1f} | "
            f"{ratio:.2f}× | {a['median_ttft_ms']:.0f}, {a['p95_ttft_ms']:.0f} / "
            f"{b['median_ttft_ms']:.0f}, {b['p95_ttft_ms']:.0f} | "
            f"{a['median_tpot_ms']:.1f} / {b['median_tpot_ms']:.1f} | "
            f"{per_request(a):.0f} / {per_request(b):.0f} | "
            f"{a['failed']} / {b['failed']} |"
        )
    return "\n".join(lines)


def per_request(point: dict[str, Any]) -> float:
    """Output tokens a completed request got."""
    return point["total_output_tokens"] / max(1, point["completed"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--peer-python", required=True, help="llama-cpp-python's venv's python")
    p.add_argument("--gguf", type=Path, required=True)
    p.add_argument("--precision", default="int4-g32+head")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--users", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--json", type=Path, help="write both reports here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp)
        with serving("default", args.precision, logs / "ours.log", threads=args.threads) as base:
            assert healthy(base)
            ours = tune(base, args, logs / "ours-tune.log")
        with peer_serving(args.peer_python, args.gguf, args.threads, logs / "peer.log") as base:
            peer = tune(base, args, logs / "peer-tune.log")
    if args.json:
        args.json.write_text(json.dumps({"ours": ours, "llama.cpp": peer}, indent=1))
    print(table(ours, peer, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
