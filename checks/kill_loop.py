"""The app's chat store under ``kill -9``, and ``infersight serve`` too. The app is started
again and again on one data folder, each time sending a message (``INFERSIGHT_AUTOSEND``),
and killed at a random moment — before its reply, while it streams, or after — while the
store is watched read-only from outside. After each kill: SQLite's ``integrity_check`` is
``ok``, every message the store had shown before the kill is still there with at least the
text it had (nothing acknowledged lost), and the next start opens the store. Then the app
*while it serves* (``--serve PORT``: a client's request streaming from its engine beside its
own chat) is killed the same way, and must serve again on the same port at its next start.
Then ``serve`` is killed — while it loads, or mid-stream — and started again: it must come up
and answer.

``python -m checks.kill_loop --runs 30 --serving-runs 10 --serve-runs 10 --out
build/kill-loop`` prints each run and the count of corruptions, losses and servers that did
not come back (exit 1 where there is one)."""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Tell me a long story about a lighthouse keeper.", "Name three colours.",
           "Explain what a KV cache holds.", "Write a poem about rain on a tin roof."]  # fmt: skip
START_S = 300.0
KEY = "kill-loop-key"


def settings(data: Path) -> None:
    from PySide6.QtCore import QSettings

    data.mkdir(parents=True, exist_ok=True)
    s = QSettings(str(data / "settings.ini"), QSettings.Format.IniFormat)
    s.setValue("controls", json.dumps({"max_new_tokens": "300", "temperature": "0",
                                       "kv_memory": "128"}))  # fmt: skip
    s.sync()


def snapshot(db: Path) -> dict[int, tuple[str, str]]:
    """Every message the store holds now, read-only: id → (role, content)."""
    if not db.exists():
        return {}
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as con:
            return {i: (r, c) for i, r, c in con.execute("SELECT id, role, content FROM messages")}
    except sqlite3.OperationalError:  # the schema not there yet
        return {}


def _ended(db: Path) -> bool:
    """Whether the last reply has ended (its status no longer ``streaming``)."""
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as con:
            row = con.execute("SELECT status FROM messages WHERE role = 'assistant' "
                              "ORDER BY id DESC LIMIT 1").fetchone()  # fmt: skip
    except sqlite3.OperationalError:
        return False
    return row is not None and row[0] != "streaming"


def integrity(db: Path) -> str:
    with sqlite3.connect(db, timeout=30) as con:
        return str(con.execute("PRAGMA integrity_check").fetchone()[0])


def serving_run(data: Path, run: int, rng: random.Random, log: Path, port: int) -> dict[str, Any]:
    """The app serving on ``port`` while it writes its own chat, killed while a client's
    request streams from it: the store as :func:`one_run` checks it, and whether it served
    (a whole answer first, so that the next run's shows it serves again after a kill)."""
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "INFERSIGHT_API_KEY": KEY,
           "INFERSIGHT_AUTOSEND": f"{rng.choice(PROMPTS)} (serving run {run})"}  # fmt: skip
    db = data / "chats.sqlite3"
    base = f"http://127.0.0.1:{port}"
    with log.open("ab") as err:
        command = [sys.executable, "-m", "app.cli", "app", "--data-dir", str(data),
                   "--serve", str(port)]  # fmt: skip
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)
        served = streaming = False
        try:
            _healthy(base, proc)
            served = _complete(base, KEY)
            streamer = threading.Thread(target=_stream, args=(base, KEY), daemon=True)
            streamer.start()
            time.sleep(rng.uniform(0.2, 2.0))  # its request streaming, the chat's reply too
            streaming = streamer.is_alive()  # (not yet ended when it is killed)
        except Exception as exc:  # counted as a start that did not serve, the loop goes on
            print(f"serving run {run}: the app did not serve: {exc!r}", file=sys.stderr)
        store = killed(proc, db)
    moment = "while serving, mid-stream" if streaming else "while serving"
    return {"run": run, "moment": moment, **store, "served": served}


def killed(proc: subprocess.Popen[bytes], db: Path) -> dict[str, Any]:
    """Kill the app (``SIGKILL``) and check its store: the messages it holds after, its
    ``integrity_check``, and the ids of the messages it had shown before the kill that are gone
    or shorter (lost)."""
    seen = snapshot(db)  # what was acknowledged (written) just before the kill
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    check = integrity(db) if db.exists() else "no store yet"
    after = snapshot(db)
    lost = [i for i, (role, content) in seen.items()
            if i not in after or not after[i][1].startswith(content)]  # fmt: skip
    return {"messages": len(after), "integrity": check, "lost": lost}


def _healthy(base: str, proc: subprocess.Popen[bytes]) -> None:
    """Wait until the server at ``base`` answers (the app's: its model loaded, the box
    ticked)."""
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"it exited ({proc.returncode})")
        with contextlib.suppress(OSError), urllib.request.urlopen(base + "/health", timeout=5) as r:
            if r.status == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{base} did not answer in time")


def one_run(data: Path, run: int, rng: random.Random, log: Path) -> dict[str, Any]:
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen",
           "INFERSIGHT_AUTOSEND": f"{rng.choice(PROMPTS)} (run {run})"}  # fmt: skip
    db = data / "chats.sqlite3"
    before = snapshot(db)
    with log.open("ab") as err:
        command = [sys.executable, "-m", "app.cli", "app", "--data-dir", str(data)]
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)
        moment = rng.choice(["at start", "once sent", "mid-reply", "mid-reply", "later"])
        deadline = time.monotonic() + START_S
        seen = before
        while time.monotonic() < deadline and proc.poll() is None:
            seen = snapshot(db)
            new = {i: m for i, m in seen.items() if i not in before}
            texts = [c for r, c in new.values() if r == "assistant"]
            if moment == "at start" and time.monotonic() > deadline - START_S + rng.uniform(1, 6):
                break
            if moment == "once sent" and new:
                break
            if moment == "mid-reply" and texts and len(texts[0]) > rng.randint(1, 400):
                break
            if moment == "later" and texts and (len(texts[0]) > 600 or _ended(db)):
                break
            time.sleep(0.02)
        store = killed(proc, db)
    return {"run": run, "moment": moment, **store}


def serve_run(run: int, rng: random.Random, log: Path) -> dict[str, Any]:
    """``infersight serve`` killed at a random moment — while loading, or mid-stream — then
    started again: it must come up and answer (nothing it left behind in the model store or
    the kernel cache may stop it)."""
    moment = rng.choice(["while loading", "mid-stream", "mid-stream"])
    proc, base = _serve(log)
    if moment == "while loading":
        time.sleep(rng.uniform(0.5, 4.0))
    else:
        base = _ready(proc, log)
        streamer = threading.Thread(target=_stream, args=(base,), daemon=True)
        streamer.start()
        time.sleep(rng.uniform(0.2, 2.0))
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    again, _ = _serve(log)
    try:
        answered = _complete(_ready(again, log))
    except (OSError, RuntimeError) as exc:
        answered = False
        print(f"run {run}: serve did not come back: {exc}", file=sys.stderr)
    finally:
        again.send_signal(signal.SIGTERM)
        again.wait(60)
    return {"run": run, "moment": f"serve {moment}", "answered_after": answered}


def _serve(log: Path) -> tuple[subprocess.Popen[bytes], str]:
    log.write_text("")
    out = log.open("ab")
    command = [sys.executable, "-m", "app.cli", "serve", "--model", "default", "--port", "0",
               "--self-test-interval", "0"]  # fmt: skip
    return subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=out), ""


def _ready(proc: subprocess.Popen[bytes], log: Path) -> str:
    """``serve``'s base URL once it names it and answers."""
    deadline = time.monotonic() + START_S
    while not (named := re.search(r" on (http://127\.0\.0\.1:\d+)/v1", log.read_text())):
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited: {log.read_text()[-500:]}")
        if time.monotonic() > deadline:
            raise RuntimeError("serve did not name its address in time")
        time.sleep(0.2)
    _healthy(named.group(1), proc)
    return named.group(1)


def _headers(key: str | None) -> dict[str, str]:
    return {"Content-Type": "application/json",
            **({"Authorization": f"Bearer {key}"} if key else {})}  # fmt: skip


def _body(base: str, stream: bool, key: str | None) -> bytes:
    listing = urllib.request.Request(base + "/v1/models", headers=_headers(key))
    with urllib.request.urlopen(listing, timeout=10) as r:
        model = json.loads(r.read())["data"][0]["id"]
    return json.dumps({"model": model, "messages": [{"role": "user", "content": PROMPTS[0]}],
                       "max_tokens": 200, "stream": stream}).encode()  # fmt: skip


def _stream(base: str, key: str | None = None) -> None:
    asked = urllib.request.Request(base + "/v1/chat/completions", data=_body(base, True, key),
                                   headers=_headers(key))  # fmt: skip
    # the server is killed under it: the read ends however it ends
    with (contextlib.suppress(OSError, http.client.HTTPException),
          urllib.request.urlopen(asked, timeout=60) as r):  # fmt: skip
        while r.read(64):
            pass


def _complete(base: str, key: str | None = None) -> bool:
    asked = urllib.request.Request(base + "/v1/chat/completions", data=_body(base, False, key),
                                   headers=_headers(key))  # fmt: skip
    with urllib.request.urlopen(asked, timeout=120) as r:
        return bool(json.loads(r.read())["choices"][0]["message"]["content"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m checks.kill_loop")
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serving-runs", type=int, default=10,
                   help="runs that kill the app while it serves")  # fmt: skip
    p.add_argument("--serve-runs", type=int, default=10, help="runs that kill serve instead")
    p.add_argument("--out", type=Path, default=Path("build/kill-loop"))
    args = p.parse_args(argv)
    data = args.out / "data"
    settings(data)
    rng = random.Random(args.seed)
    results, served = [], []
    for run in range(args.runs):
        r = one_run(data, run, rng, args.out / "app-stderr.log")
        results.append(r)
        print(f"run {run}: killed {r['moment']}, {r['messages']} messages, integrity "
              f"{r['integrity']}, lost {len(r['lost'])}", flush=True)  # fmt: skip
    with socket.socket() as s:  # one port for every serving run: each start binds it again
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serving = []
    for run in range(args.serving_runs):
        r = serving_run(data, run, rng, args.out / "app-stderr.log", port)
        serving.append(r)
        print(f"serving run {run}: killed {r['moment']}, served {r['served']}, "
              f"{r['messages']} messages, integrity {r['integrity']}, lost {len(r['lost'])}",
              flush=True)  # fmt: skip
    for run in range(args.serve_runs):
        r = serve_run(run, rng, args.out / "serve.log")
        served.append(r)
        print(f"serve run {run}: killed {r['moment']}, answered after: {r['answered_after']}",
              flush=True)  # fmt: skip
    report = {"app": results, "app_serving": serving, "serve": served}
    (args.out / "kill-loop.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    apps = results + serving
    corrupt = sum(r["integrity"] not in ("ok", "no store yet") for r in apps)
    lost = sum(bool(r["lost"]) for r in apps)
    unserved = sum(not r["served"] for r in serving)
    down = sum(not r["answered_after"] for r in served)
    print(
        f"{len(results)} runs of the app and {len(serving)} while it served: {corrupt} "
        f"corruptions, {lost} runs that lost an acknowledged message, {unserved} starts that "
        f"did not serve; {len(served)} of serve, {down} that did not come back"
    )
    return 1 if corrupt or lost or unserved or down else 0


if __name__ == "__main__":
    sys.exit(main())
