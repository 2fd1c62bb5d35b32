"""Small JSON files of measurements about this machine in the user cache (``kernels.json``,
``threads.json``): timed once, read back by every later load.

A file maps a key (the machine, the shapes measured) to a JSON object of figures. Writes go
to a temporary file that replaces the old one, merged over what is on disk at that moment,
so that two processes timing different things keep each other's entries. A missing or
unreadable file reads as empty: the figures are timed again. :func:`machine_name` and
:func:`machine_key` name the machine a figure holds for.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from engine.paths import home

log = logging.getLogger(__name__)


#: the kernel and layout verdicts (:mod:`engine.hardware.verdicts`)
KERNELS_FILE = "kernels.json"


def path(name: str) -> Path:
    return home() / name


def read(name: str) -> dict[str, dict[str, Any]]:
    try:
        raw = json.loads(path(name).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(raw, dict):
        return {}
    return {k: v for k, v in raw.items() if isinstance(v, dict)}


def write(name: str, entries: dict[str, dict[str, Any]]) -> None:
    """Merge ``entries`` (key → figures, figures merged one level deep) into the file."""
    merged = read(name)
    for key, figures in entries.items():
        merged.setdefault(key, {}).update(figures)
    target = path(name)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(merged, indent=1, sort_keys=True), encoding="utf-8")
        tmp.replace(target)
    except OSError as exc:  # a read-only cache costs a timing at the next load, nothing more
        log.warning("could not keep the measurements in %s: %s", target, exc)


def forget(name: str, prefix: str) -> int:
    """Drop the file's entries whose key starts with ``prefix`` (this machine's: its builds
    and thread counts); returns how many figures went with them."""
    kept = read(name)
    gone = {k: v for k, v in kept.items() if k.startswith(prefix)}
    if not gone:
        return 0
    target = path(name)
    rest = {k: v for k, v in kept.items() if k not in gone}
    try:
        tmp = target.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(rest, indent=1, sort_keys=True), encoding="utf-8")
        tmp.replace(target)
    except OSError as exc:
        log.warning("could not forget the measurements in %s: %s", target, exc)
        return 0
    return sum(len(v) for v in gone.values())


@functools.cache
def machine_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            return next(
                (line.split(":", 1)[1].strip() for line in info if line.startswith("model name")),
                name,
            )
    except OSError:
        return name


def machine_key() -> str:
    """What a layout verdict holds for: this CPU, its capability and torch. (Not the thread
    count: a memory estimate asks before a load has settled it.)"""
    capability = torch.backends.cpu.get_cpu_capability()
    return f"{machine_name()} | {capability} | torch {torch.__version__}"


def best_of_three(runs: Sequence[Callable[[], object]], calls: int) -> list[float]:
    """Milliseconds per call of each of ``runs`` (each makes ``calls`` calls): each run once to
    warm up and once timed, three rounds interleaved so that a noisy moment hurts them all;
    the best round of each."""
    best = [float("inf")] * len(runs)
    for _ in range(3):
        for i, run in enumerate(runs):
            run()
            started = time.perf_counter()
            run()
            best[i] = min(best[i], (time.perf_counter() - started) / calls * 1e3)
    return best
