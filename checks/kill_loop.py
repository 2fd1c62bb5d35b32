"""The app's chat store under ``kill -9``: the app started again and again on one data folder,
each time sending a message (``INFERSIGHT_AUTOSEND``) and killed at a random moment — before
its reply, while it streams, or after — while the store is watched read-only from outside.
After each kill: SQLite's ``integrity_check`` is ``ok``, every message the store had shown
before the kill is still there with at least the text it had (nothing acknowledged lost),
and the next start opens the store.

``python -m checks.kill_loop --runs 30 --out build/kill-loop`` prints each run and the count
of corruptions and losses (exit 1 where there is one)."""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Tell me a long story about a lighthouse keeper.", "Name three colours.",
           "Explain what a KV cache holds.", "Write a poem about rain on a tin roof."]  # fmt: skip
START_S = 300.0


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


def integrity(db: Path) -> str:
    with sqlite3.connect(db, timeout=30) as con:
        return str(con.execute("PRAGMA integrity_check").fetchone()[0])


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
            if moment == "later" and texts and len(texts[0]) > 600:
                break
            time.sleep(0.02)
        seen = snapshot(db)  # what was acknowledged (written) just before the kill
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    check = integrity(db) if db.exists() else "no store yet"
    after = snapshot(db)
    lost = [i for i, (role, content) in seen.items()
            if i not in after or not after[i][1].startswith(content)]  # fmt: skip
    return {"run": run, "moment": moment, "messages": len(after), "integrity": check,
            "lost": lost}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m checks.kill_loop")
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("build/kill-loop"))
    args = p.parse_args(argv)
    data = args.out / "data"
    settings(data)
    rng = random.Random(args.seed)
    results = []
    for run in range(args.runs):
        r = one_run(data, run, rng, args.out / "app-stderr.log")
        results.append(r)
        print(f"run {run}: killed {r['moment']}, {r['messages']} messages, integrity "
              f"{r['integrity']}, lost {len(r['lost'])}", flush=True)  # fmt: skip
    (args.out / "kill-loop.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    corrupt = sum(r["integrity"] not in ("ok", "no store yet") for r in results)
    lost = sum(bool(r["lost"]) for r in results)
    print(f"{len(results)} runs, {corrupt} corruptions, {lost} runs that lost an acknowledged "
          "message")  # fmt: skip
    return 1 if corrupt or lost else 0


if __name__ == "__main__":
    sys.exit(main())
