"""A server written for the tests that fails as servers fail users (a key refused, a rate
limit with Retry-After, a stream dropped mid-reply, nothing sent for a while, an event that is
not JSON or of another shape), and one that streams slowly while it counts how many requests
it serves at once (the oracle of a load's concurrency). Registered as the ``misbehaving``
fixture in ``conftest.py``."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

RIGHT = "right-key"


class Concurrency:
    """The ``tick`` model's requests: how many it serves now, and when each arrived."""

    lock = threading.Lock()
    now = 0
    arrivals: list[float] = []  # noqa: RUF012 (one list for the server's threads)

    @classmethod
    def reset(cls) -> None:
        with cls.lock:
            cls.arrivals.clear()


class Misbehaving(BaseHTTPRequestHandler):
    """By the model asked for: ``drop`` streams two chunks and hangs up, ``busy`` answers 429
    with Retry-After, ``slow`` sends nothing for two seconds, ``garbage`` streams an event
    that is not JSON, ``shape`` one of another shape, ``error`` a word and an error event,
    ``long`` a word every half second for ten seconds, ``tick`` four words in 0.4 s (counted
    in :class:`Concurrency`), anything else one chunk and the end."""

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        if not self._authorized():
            return
        self._json(200, {"data": [{"id": m} for m in ("drop", "busy", "slow", "garbage")]})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", 0))
        body = json.loads(self.rfile.read(length))
        if not self._authorized():
            return
        model = body.get("model")
        if model == "strict" and "ignore_eos" in body:  # as OpenAI's own API refuses it
            message = "Unrecognized request argument supplied: ignore_eos"
            self._json(400, {"error": {"message": message, "param": "ignore_eos"}})
            return
        if model == "busy":
            self.send_response(429)
            self.send_header("Retry-After", "3")
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps({"error": {"message": "slow down"}}).encode())
            return
        if model == "slow":
            time.sleep(2.0)
        if model == "tick":
            self._tick()
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        if model == "garbage":
            self.wfile.write(b"data: this is not json\n\n")
            return
        if model == "shape":
            self.wfile.write(b'data: {"choices": {"index": 0}}\n\n')
            return
        if model == "error":  # a word, then the server's failure named in the stream
            event = {"choices": [{"index": 0, "delta": {"content": "Red"}}]}
            failure = {"error": {"message": "the engine stopped", "type": "server_error"}}
            self.wfile.write(f"data: {json.dumps(event)}\n\ndata: {json.dumps(failure)}\n\n"
                             "data: [DONE]\n\n".encode())  # fmt: skip
            return
        if model == "long":  # a word every half second for ten seconds
            for _ in range(20):
                event = {"choices": [{"index": 0, "delta": {"content": "la "}}]}
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                self.wfile.flush()
                time.sleep(0.5)
            self.wfile.write(b"data: [DONE]\n\n")
            return
        for word in ("Red", " green") if model == "drop" else ("Blue",):
            event = {"choices": [{"index": 0, "delta": {"content": word}}]}
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
            self.wfile.flush()
        if model != "drop":  # the dropped stream ends without its finish and [DONE]
            end = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
            self.wfile.write(f"data: {json.dumps(end)}\n\ndata: [DONE]\n\n".encode())

    def _tick(self) -> None:
        """Four words a tenth of a second apart, counted while they stream."""
        with Concurrency.lock:
            Concurrency.now += 1
            Concurrency.arrivals.append(time.perf_counter())
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for _ in range(4):
                event = {"choices": [{"index": 0, "delta": {"content": "tick "}}]}
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                self.wfile.flush()
                time.sleep(0.1)
            self.wfile.write(b"data: [DONE]\n\n")
        finally:
            with Concurrency.lock:
                Concurrency.now -= 1

    def _authorized(self) -> bool:
        if self.headers.get("Authorization") == f"Bearer {RIGHT}":
            return True
        self._json(401, {"error": {"message": "invalid api key"}})
        return False

    def _json(self, status: int, payload: object) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class Quiet(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that timed out and hung up: the slow reply's broken pipe


@pytest.fixture(scope="module")
def misbehaving() -> Iterator[str]:
    httpd = Quiet(("127.0.0.1", 0), Misbehaving)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
