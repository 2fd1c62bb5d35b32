"""Probes that may crash natively, run once per machine in a child process.

Most probes (:mod:`engine.hardware.cpu_paths`) run in-process: a path that raises or disagrees
is simply not used. A few run native code that can take the whole process down instead of
raising: TorchInductor's first compile (a C++ compiler, a cache on disk, generated code loaded
with ``dlopen``) and the paged decode kernel's first check (our C, called through ``ctypes``). A
crash there must not end the app or a test run, so those run here first: in a fresh
interpreter, with this process's environment, and the verdict (``""`` for "works", else one
line saying why not) is kept in ``<cache>/probes.json`` under a key that names what the verdict
holds for (the machine, the CPU level, torch, the source), so later loads read it back at no
cost. A child that crashes gives a verdict that says so, kept like any other; a child the
machine stopped (killed, out of processes, past its time limit) gives one for this load only.
Either way the caller falls back as for any other failed probe.

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
from dataclasses import dataclass
from pathlib import Path

from engine.hardware import measured

log = logging.getLogger(__name__)

FILE = "probes.json"
#: The line the child prints before its verdict, so that noise on stdout is never read as one.
MARK = "infersight-probe-verdict:"


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a child said: its ``verdict`` ("" = works), and whether that is ``settled``: the
    probe's own answer or a crash of the native code it runs, kept for later loads; not what
    the machine did to the child (killed by the OOM killer or a Ctrl-C, no process to be had,
    a time-out on a busy machine), which the next load asks again."""

    verdict: str
    settled: bool


#: Signals of native code gone wrong (a corrupted heap aborts): the probe's fault, kept.
CRASHES = frozenset({signal.SIGSEGV, signal.SIGABRT, signal.SIGILL, signal.SIGFPE,
                     getattr(signal, "SIGBUS", signal.SIGSEGV)})  # fmt: skip

_LOCKS: dict[str, threading.Lock] = {}  # one per probe: the app loads on threads of its own
_GUARD = threading.Lock()
#: verdicts of this process by file, key and probe, for a cache folder that cannot be written
_MEMO: dict[tuple[str, str, str], str] = {}


def verdict(name: str, target: str, key: str, *, timeout_s: float = 300.0) -> str:
    """The verdict of probe ``target`` (``module:function``) for ``key``: read from
    ``probes.json``, else run in a child process now and, where settled, kept. ``""`` means
    it works."""
    with _GUARD:
        lock = _LOCKS.setdefault(name, threading.Lock())
    with lock:
        memo = (str(measured.path(FILE)), key, name)
        known = _MEMO.get(memo, measured.read(FILE).get(key, {}).get(name))
        if isinstance(known, str):
            return known
        found = run(target, timeout_s=timeout_s)
        if found.settled:
            _MEMO[memo] = found.verdict
            measured.write(FILE, {key: {name: found.verdict}})
        return found.verdict


#: The folder that holds ``engine/``: a child imports the engine from there, never from its
#: working folder (``-c`` puts that first, where a user's own ``engine`` package could be).
ROOT = Path(__file__).resolve().parents[2]
_BOOT = """
import importlib, sys
root, entry, *args = sys.argv[1:]
if sys.path and sys.path[0] == "":
    del sys.path[0]
if root not in sys.path:
    sys.path.insert(0, root)
module, _, function = entry.partition(":")
code = getattr(importlib.import_module(module), function)(*args)
sys.exit(code if isinstance(code, int) else 0)
"""


def python_command(entry: str, *args: str) -> list[str]:
    """The command that runs ``entry`` (``module:function``) with ``args`` in a fresh Python
    with this process's engine; the function's int result is the exit status."""
    return [sys.executable, "-c", _BOOT, str(ROOT), entry, *args]


def run(target: str, *, timeout_s: float = 300.0) -> Outcome:
    """Run probe ``target`` in a child process (its own session: a Ctrl-C in the terminal
    reaches this process, which ends the child, not the child itself). A frozen build
    (PyInstaller), whose ``sys.executable`` is the app and not Python, runs it here."""
    if getattr(sys, "frozen", False):
        return Outcome(_call(target), settled=True)
    try:
        done = subprocess.run(
            python_command(f"{__name__}:child", target),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env={**os.environ, "PYTHONFAULTHANDLER": "1"},
            start_new_session=True,
        )
    except subprocess.TimeoutExpired:
        return Outcome(f"the probe took longer than {timeout_s:.0f} s", settled=False)
    except OSError as exc:
        return Outcome(f"the probe could not start: {exc}", settled=False)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(MARK) and done.returncode == 0:
            return Outcome(str(json.loads(line.removeprefix(MARK))), settled=True)
    why = _death(done.returncode)
    detail = _last_words(done.stderr)
    log.warning("probe %s %s%s", target, why, f": {detail}" if detail else "")
    crashed = done.returncode < 0 and -done.returncode in CRASHES
    return Outcome(f"the probe {why}" + (f" ({detail})" if detail else ""), settled=crashed)


def _call(target: str) -> str:
    module, _, function = target.partition(":")
    return str(getattr(importlib.import_module(module), function)())


def child(target: str) -> None:
    """The child's side: run the probe and print its verdict behind :data:`MARK`."""
    print(MARK + json.dumps(_call(target)), flush=True)


def _death(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"crashed ({name})" if -returncode in CRASHES else f"was stopped ({name})"
    return f"failed (exit status {returncode})"


def _last_words(stderr: str) -> str:
    """The line of a dead child's stderr that says most: a glibc or Python fatal error, else
    the last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for line in lines:
        if line.startswith(("Fatal Python error", "double free", "free():", "malloc():")):
            return line[:160]
    return lines[-1][:160] if lines else ""
