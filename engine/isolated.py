"""Probes that may crash natively, run once per machine in a child process.

Most probes (:mod:`engine.hardware`) run in-process: a path that raises or disagrees is simply
not used. A few run native code that can take the whole process down instead of raising:
TorchInductor's first compile (a C++ compiler, a cache on disk, generated code loaded with
``dlopen``) and the paged decode kernel's first check (our C, called through ``ctypes``). A
crash there must not end the app or a test run, so those run here first: in a fresh
interpreter, with this process's environment, and the verdict (``""`` for "works", else one
line saying why not) is kept in ``<cache>/probes.json`` under a key that names what the verdict
holds for (the machine, the CPU level, torch, the source), so later loads read it back at no
cost. A child that dies by a signal, exits non-zero or runs past its time limit gives a verdict
that says so, and the caller falls back as for any other failed probe.

A probe is a function ``module:function`` taking no arguments and returning the verdict
string; it runs in the child only after the parent found no verdict on disk.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from engine import measured

log = logging.getLogger(__name__)

FILE = "probes.json"
#: The line the child prints before its verdict, so that noise on stdout is never read as one.
MARK = "infersight-probe-verdict:"

_LOCK = threading.Lock()  # the app loads models on a thread of its own


def verdict(name: str, target: str, key: str, *, timeout_s: float = 300.0) -> str:
    """The verdict of probe ``target`` (``module:function``) for ``key``: read from
    ``probes.json``, else run in a child process now and kept. ``""`` means it works."""
    with _LOCK:
        known = measured.read(FILE).get(key, {}).get(name)
        if isinstance(known, str):
            return known
        found = run(target, timeout_s=timeout_s)
        if found.startswith(_UNSETTLED):  # a time-out may be a busy machine: ask again later
            return found
        measured.write(FILE, {key: {name: found}})
        return found


#: The folder that holds ``engine/``: the child imports the engine from there, never from its
#: working folder (``-c`` puts that first, where a user's own ``engine`` package could be).
ROOT = Path(__file__).resolve().parent.parent
_CHILD = """
import sys
root, target = sys.argv[1:3]
if sys.path and sys.path[0] == "":
    del sys.path[0]
sys.path.insert(0, root)
from engine.isolated import child
child(target)
"""

#: Verdicts not kept: the next process asks again.
_UNSETTLED = "the probe took longer than"


def run(target: str, *, timeout_s: float = 300.0) -> str:
    """Run probe ``target`` in a child process; its verdict, or why it gave none."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, str(ROOT), target],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env={**os.environ, "PYTHONFAULTHANDLER": "1"},
        )
    except subprocess.TimeoutExpired:
        return f"{_UNSETTLED} {timeout_s:.0f} s"
    except OSError as exc:
        return f"the probe could not start: {exc}"
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(MARK) and done.returncode == 0:
            return str(json.loads(line.removeprefix(MARK)))
    why = _death(done.returncode)
    detail = _last_words(done.stderr)
    log.warning("probe %s %s%s", target, why, f": {detail}" if detail else "")
    return f"the probe {why}" + (f" ({detail})" if detail else "")


def child(target: str) -> None:
    """The child's side: run the probe and print its verdict behind :data:`MARK`."""
    module, _, function = target.partition(":")
    found = getattr(importlib.import_module(module), function)()
    print(MARK + json.dumps(str(found)), flush=True)


def _death(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"crashed ({signal.Signals(-returncode).name})"
        except ValueError:
            return f"crashed (signal {-returncode})"
    return f"failed (exit status {returncode})"


def _last_words(stderr: str) -> str:
    """The line of a dead child's stderr that says most: a glibc or Python fatal error, else
    the last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for line in lines:
        if line.startswith(("Fatal Python error", "double free", "free():", "malloc():")):
            return line[:160]
    return lines[-1][:160] if lines else ""
