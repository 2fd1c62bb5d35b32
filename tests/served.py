"""``infersight serve`` as a user runs it, for every test that talks to it: one subprocess per
test worker on a free loopback port (session fixtures, registered in ``conftest.py``), the real
``openai`` SDK as its client, and raw HTTP (:func:`request`) where the SDK hides the wire."""

from __future__ import annotations

import http.client
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import openai

KEY = "test-key-123"
MAX_WAITING = 64
MAX_N = 4
MAX_TOKENS = 512


@pytest.fixture(scope="session")
def server_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("serve") / "serve.log"


@pytest.fixture(scope="session")
def server(default_model: Path, server_log: Path) -> Iterator[str]:
    """The server's base URL; it runs for the whole session (one per test worker: a module's
    tests check deltas, never absolute counts), its output going to a file (a pipe
    nobody reads would fill and stall it). ``--port 0``: the server takes a free port itself
    and names it, so no other process can take it between choosing and serving."""
    out = open(server_log, "w", encoding="utf-8")  # noqa: SIM115 (closed at the end)
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve", "--model", "default", "--port", "0",
         "--api-key", KEY, "--max-waiting", str(MAX_WAITING), "--max-n", str(MAX_N),
         "--max-tokens", str(MAX_TOKENS), "--max-batch-size", "16",
         # the self-test at start only: a later one would add its tokens to the engine's
         # counts in the middle of a test that checks them
         "--self-test-interval", "0"],
        stdout=out, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    base = ""
    deadline = time.monotonic() + 120
    while True:
        if not base:  # the line that names the port comes once the model is loaded
            named = re.search(r" on (http://127\.0\.0\.1:\d+)/v1", server_log.read_text())
            base = named.group(1) if named else ""
        try:
            if base and request(base, "GET", "/health")[0] == 200:
                break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the server did not start:\n{server_log.read_text()}")
        time.sleep(0.2)
    yield base
    proc.terminate()  # uvicorn's graceful shutdown: the engine loop cancels and ends
    try:
        proc.wait(30)
    finally:
        proc.kill()
        out.close()
    # uvicorn raises the signal again once it has shut down, as the default handler would
    text = server_log.read_text()
    assert proc.returncode in (0, -15) and "infersight serve: stopped" in text, text[-2000:]


@pytest.fixture(scope="session")
def client(server: str) -> openai.OpenAI:
    # imported where a test asks for the client: the suite's other tests (the GPU image's
    # kernel tests, `make gpu-versions`) run where the SDK is not installed
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)


def request(
    base: str, method: str, path: str, body: object = None, *, key: str | None = KEY,
    raw: bytes | None = None,
) -> tuple[int, dict[str, str], bytes]:  # fmt: skip
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    conn.request(method, path, body=data, headers=headers)
    resp = conn.getresponse()
    out = resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    conn.close()
    return out


def metrics(base: str) -> dict[str, float]:
    """Every sample of ``/metrics`` by name (labels other than the model folded into the name)."""
    from prometheus_client.parser import text_string_to_metric_families

    _, _, body = request(base, "GET", "/metrics")
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            extra = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{extra}}}" if extra else "")] = s.value
    return out


def wait_idle(server: str) -> dict[str, float]:
    """``/metrics`` once nothing runs, waits or holds a KV block, and the engine's token count
    has stood still over two snapshots (the snapshot lags the engine by at most a quarter
    second, and a request an earlier test sent may still be on its way to the engine)."""
    deadline = time.monotonic() + 30
    generated = "vllm:generation_tokens_total"
    last: dict[str, float] | None = None
    while True:
        m = metrics(server)
        idle = m["vllm:num_requests_running"] == m["vllm:num_requests_waiting"] == 0
        idle = idle and m["vllm:kv_cache_usage_perc"] == 0
        if (idle and last is not None and last.get(generated) == m.get(generated)) or (
            time.monotonic() > deadline
        ):
            return m
        last = m if idle else None
        time.sleep(0.3)
