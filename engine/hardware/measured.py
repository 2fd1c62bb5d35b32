"""Small JSON files of measurements about this machine in the user cache (``kernels.json``,
``threads.json``): timed once, read back by every later load.

A file maps a key (the machine, the shapes measured) to a JSON object of figures. Writes go
to a temporary file that replaces the old one, merged over what is on disk at that moment,
so that two processes timing different things keep each other's entries. A missing or
unreadable file reads as empty: the figures are timed again.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def path(name: str) -> Path:
    from engine.store.model_store import home

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
