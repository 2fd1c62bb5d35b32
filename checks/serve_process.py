"""``infersight serve`` as a child process on a free port, for the checks that point a
third-party client at it (``bench_serving``: GuideLLM; ``eval_serving``: lm-evaluation-harness)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def serving(model: str, precision: str, log: Path, threads: int | None = None) -> Iterator[str]:
    """``infersight serve`` on a free port for the block (``threads``: its CPU threads, None:
    its own choice): its base URL."""
    with serving_process(model, precision, log, threads) as (base, _):
        yield base


@contextmanager
def serving_process(
    model: str, precision: str, log: Path, threads: int | None = None, extra: tuple[str, ...] = ()
) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """:func:`serving`, and the process (``extra``: more of serve's arguments)."""
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "serve", "--model", model, "--precision",
             precision, "--port", "0", "--self-test-interval", "0", "--max-batch-size", "16",
             *(["--threads", str(threads)] if threads else []), *extra],
            stdout=out, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 300
            while not (named := re.search(r" on (http://127\.0\.0\.1:\d+)/v1", log.read_text())):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the server did not start:\n{log.read_text()[-2000:]}")
                time.sleep(0.5)
            base = named.group(1)
            while not healthy(base):  # named once loaded; listening a moment later
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the server did not answer:\n{log.read_text()[-2000:]}")
                time.sleep(0.2)
            yield base, proc
        finally:
            proc.terminate()
            proc.wait(60)


def healthy(base: str) -> bool:
    return answers(f"{base}/health")


def answers(url: str) -> bool:
    """Whether a GET of ``url`` answers 200 within 5 s."""
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False
