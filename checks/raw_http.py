"""What a schema does not reach, sent to ``infersight serve`` on raw sockets: a body cut short,
the wrong content types, a 10 MB body, a million-token prompt, bytes that are not UTF-8, a
slow-loris client, a thousand idle connections. Each case says what the server answered and
whether a plain request was still answered, in time, while (or after) it ran; none may be a
5xx, a crash or a hang.

``python -m checks.raw_http --out build/raw-http`` prints the table (markdown) and writes it
as JSON; exit status 1 where a case failed."""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

from checks.serve_process import serving_process

KEY = "raw-key"
#: a plain request answered within this many seconds is "still answered"
ANSWERED_S = 20.0
MODEL = ""  # the served model's id, read from /v1/models


@contextlib.contextmanager
def connection(host: str, port: int, timeout: float = 30.0) -> Iterator[socket.socket]:
    s = socket.create_connection((host, port), timeout=timeout)
    try:
        yield s
    finally:
        s.close()


def head(path: str, length: int | None, content_type: str = "application/json",
         extra: str = "") -> bytes:  # fmt: skip
    size = "" if length is None else f"Content-Length: {length}\r\n"
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: {content_type}\r\n{size}{extra}\r\n").encode()  # fmt: skip


def answer(s: socket.socket) -> tuple[int, str]:
    """The status and the body's first 200 characters of one HTTP answer (0: none)."""
    data = b""
    with contextlib.suppress(OSError):
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        s.settimeout(2.0)
        with contextlib.suppress(OSError):
            while len(data) < 4096 and (chunk := s.recv(65536)):
                data += chunk
    if not data.startswith(b"HTTP/1.1 "):
        return 0, data[:200].decode("utf-8", "replace")
    status = int(data[9:12])
    body = data.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in data else b""
    return status, body[:200].decode("utf-8", "replace")


def plain(host: str, port: int) -> float | None:
    """Seconds a small completion took (None: not answered within :data:`ANSWERED_S`)."""
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 2}).encode()
    began = time.perf_counter()
    try:
        with connection(host, port, ANSWERED_S) as s:
            s.sendall(head("/v1/completions", len(body), extra="Connection: close\r\n") + body)
            status, _ = answer(s)
    except OSError:
        return None
    return time.perf_counter() - began if status == 200 else None


def case_truncated(host: str, port: int) -> dict[str, object]:
    with connection(host, port) as s:
        s.sendall(head("/v1/completions", 200) + b'{"model": "x", "pro')
        s.shutdown(socket.SHUT_WR)  # the client will send no more
        status, body = answer(s)
    return {"answer": status or "closed", "body": body}


def case_truncated_held(host: str, port: int) -> dict[str, object]:
    """A body cut short and the connection held open: the others are served meanwhile."""
    with connection(host, port) as s:
        s.sendall(head("/v1/completions", 200) + b'{"model": "x", "pro')
        took = plain(host, port)
    return {"answer": "held (waits for the rest)", "others_s": took}


def case_content_type(kind: str) -> Callable[[str, int], dict[str, object]]:
    def run(host: str, port: int) -> dict[str, object]:
        body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2}).encode()
        if kind == "application/x-www-form-urlencoded":
            body = b"model=x&prompt=Hi"
        with connection(host, port) as s:
            s.sendall(head("/v1/completions", len(body), kind) + body)
            status, text = answer(s)
        return {"answer": status, "body": text}

    return run


def case_ten_mb(host: str, port: int) -> dict[str, object]:
    size = 10 << 20
    with connection(host, port) as s:
        s.sendall(head("/v1/completions", size))
        sent = 0
        with contextlib.suppress(OSError):  # the server may answer and close before the end
            while sent < size:
                s.sendall(b" " * (1 << 20))
                sent += 1 << 20
        status, text = answer(s)
    return {"answer": status, "body": text, "sent_mb": sent >> 20}


def case_ten_mb_chunked(host: str, port: int) -> dict[str, object]:
    with connection(host, port) as s:
        s.sendall(head("/v1/completions", None, extra="Transfer-Encoding: chunked\r\n"))
        with contextlib.suppress(OSError):
            for _ in range(10):
                s.sendall(b"100000\r\n" + b" " * (1 << 20) + b"\r\n")
            s.sendall(b"0\r\n\r\n")
        status, text = answer(s)
    return {"answer": status, "body": text}


def case_million_tokens(host: str, port: int) -> dict[str, object]:
    body = json.dumps({"model": MODEL, "prompt": list(range(1000)) * 1000, "max_tokens": 1})
    with connection(host, port, 120) as s:
        began = time.perf_counter()
        s.sendall(head("/v1/completions", len(body)) + body.encode())
        status, text = answer(s)
    return {"answer": status, "body": text, "took_s": round(time.perf_counter() - began, 2)}


def case_not_utf8(host: str, port: int) -> dict[str, object]:
    body = b'{"model": "x", "prompt": "caf\xe9 \xff\xfe", "max_tokens": 2}'
    with connection(host, port) as s:
        s.sendall(head("/v1/completions", len(body)) + body)
        status, text = answer(s)
    return {"answer": status, "body": text}


def case_slow_loris(
    host: str, port: int, clients: int = 50, seconds: float = 20.0
) -> dict[str, object]:
    """``clients`` connections each sending its headers a byte a second: the others are
    served meanwhile, and how many the server closed on its own."""
    socks = [socket.create_connection((host, port), timeout=5) for _ in range(clients)]
    request = head("/v1/completions", 10)
    closed, took, t0 = set(), None, time.perf_counter()
    for i in range(int(seconds)):
        for n, s in enumerate(socks):
            if n in closed:
                continue
            try:
                s.sendall(request[i : i + 1])
            except OSError:
                closed.add(n)
        if i == int(seconds) // 2:
            took = plain(host, port)
        time.sleep(max(0.0, t0 + i + 1 - time.perf_counter()))
    for s in socks:
        s.close()
    return {"answer": f"{len(closed)} of {clients} closed by the server in {seconds:.0f} s",
            "others_s": took}  # fmt: skip


def case_idle(host: str, port: int, count: int = 1000) -> dict[str, object]:
    socks = []
    try:
        for _ in range(count):
            socks.append(socket.create_connection((host, port), timeout=5))
        took = plain(host, port)
    finally:
        for s in socks:
            s.close()
    after = plain(host, port)
    return {"answer": f"{len(socks)} open at once", "others_s": took, "after_s": after}


CASES: dict[str, Callable[[str, int], dict[str, object]]] = {
    "body cut short, the client done": case_truncated,
    "body cut short, connection held": case_truncated_held,
    "Content-Type: text/plain": case_content_type("text/plain"),
    "Content-Type: form-urlencoded": case_content_type("application/x-www-form-urlencoded"),
    "10 MB body (Content-Length)": case_ten_mb,
    "10 MB body (chunked)": case_ten_mb_chunked,
    "a million-token prompt (ids)": case_million_tokens,
    "bytes that are not UTF-8": case_not_utf8,
    "slow loris: 50 clients, a header byte a second": case_slow_loris,
    "1,000 idle connections": case_idle,
}


def judge(result: dict[str, object]) -> bool:
    """No 5xx; a 4xx (or a held or refused connection); the others still answered."""
    status = result.get("answer")
    if isinstance(status, int) and (status >= 500 or status == 0):
        return False
    return all(result.get(k, 0.0) is not None for k in ("others_s", "after_s"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m checks.raw_http")
    p.add_argument("--model", default="default")
    p.add_argument("--out", type=Path, default=Path("build/raw-http"))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = {}
    with serving_process(args.model, "fp32", args.out / "serve.log",
                         extra=("--api-key", KEY)) as (base, proc):  # fmt: skip
        url = urlsplit(base)
        host, port = url.hostname or "127.0.0.1", url.port or 80
        global MODEL  # the id the server answers to
        asked = urllib.request.Request(
            f"{base}/v1/models", headers={"Authorization": f"Bearer {KEY}"}
        )
        with urllib.request.urlopen(asked, timeout=10) as listed:
            MODEL = json.loads(listed.read())["data"][0]["id"]
        for name, case in CASES.items():
            try:
                result = case(host, port)
            except OSError as exc:
                result = {"answer": 0, "body": f"{type(exc).__name__}: {exc}"}
            result["passed"] = judge(result) and proc.poll() is None
            rows[name] = result
            print(f"{'ok' if result['passed'] else 'FAILED':6} {name}: {result}", flush=True)
        alive = proc.poll() is None
    (args.out / "raw-http.json").write_text(json.dumps(rows, indent=1), encoding="utf-8")
    print("\n| case | the server answered | a plain request meanwhile / after |\n|---|---|---|")
    for name, r in rows.items():
        others = [f"{r[k]:.2f} s" for k in ("others_s", "after_s") if isinstance(r.get(k), float)]
        said = r["answer"] if not r.get("body") else f"{r['answer']}: {str(r['body'])[:90]}"
        print(f"| {name} | {said} | {' / '.join(others) or '–'} |")
    print(f"\nthe server {'was alive' if alive else 'DIED'} at the end")
    return 0 if alive and all(r["passed"] for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
