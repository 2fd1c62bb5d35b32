"""Whether a path of ours measured faster than torch's on this machine, for one shape: timed
once, kept in ``<cache>/kernels.json``, read back by every later load.

A verdict holds for a :class:`Key`: this machine (:func:`engine.hardware.measured.machine_key`:
the CPU, its capability, torch), the build of ours (what makes that version: a C library's
file stem and instruction set, ``bf16 GEMM, torch 2.x``), the thread count where the kernels'
speed depends on it, and the shape. A changed build, machine or thread count is timed anew; an
entry that does not read back as two timings is timed again. What is kept is the
:class:`Timing` itself, not the choice, so that the rule, ours where it runs within ``slack``
× torch's time (:meth:`Timing.ours_within`), is applied in one place by both
:func:`faster`, which times what it does not know, and :func:`known`, which never times (a
memory plan asks it beside a decoding model).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from engine.hardware import measured

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Timing:
    """One shape's two paths, timed streaming from memory: ms per product (ours, torch's)."""

    ours_ms: float
    torch_ms: float

    @property
    def ours(self) -> bool:
        return self.ours_ms < self.torch_ms

    def ours_within(self, slack: float) -> bool:
        """Whether ours runs the shape when it may take up to ``slack`` × torch's time."""
        return self.ours_ms < slack * self.torch_ms


@dataclass(frozen=True, slots=True)
class Key:
    """What a verdict holds for, besides this machine: the ``build`` of ours, the ``shape``,
    and the ``threads`` it ran on (None: a verdict asked before a load settles the count)."""

    build: str
    shape: str
    threads: int | None = None

    def entry(self) -> str:
        """The file's key for this machine and build (its shapes sit under it)."""
        parts = [measured.machine_key(), self.build]
        if self.threads is not None:
            parts.append(f"{self.threads} threads")
        return " | ".join(parts)


#: held while a verdict is read, timed and written (the app loads models on a thread of its own)
LOCK = threading.Lock()


def known(key: Key, slack: float = 1.0) -> bool | None:
    """The kept verdict for ``key`` (as :func:`faster` gives it), or None where none is kept:
    never times."""
    timing = _kept(key)
    return None if timing is None else timing.ours_within(slack)


def faster(
    key: Key, timer: Callable[[], Timing], slack: float = 1.0,
    sides: tuple[str, str] = ("ours", "torch"),
) -> bool:  # fmt: skip
    """Whether ours measured faster than torch's for ``key`` (or within ``slack`` × its time):
    :func:`timing`."""
    return timing(key, timer, sides).ours_within(slack)


def timing(
    key: Key, timer: Callable[[], Timing], sides: tuple[str, str] = ("ours", "torch")
) -> Timing:
    """The kept timing for ``key``, else ``timer()``'s, timed now (once: under :data:`LOCK`)
    and kept; ``sides`` name the two paths in the log line."""
    with LOCK:
        kept = _kept(key)
        if kept is not None:
            return kept
        found = timer()
        log.info("timed %s: %s %.3f ms, %s %.3f ms per token",
                 key.shape, sides[0], found.ours_ms, sides[1], found.torch_ms)  # fmt: skip
        measured.write(measured.KERNELS_FILE, {key.entry(): {key.shape: asdict(found)}})
        return found


def _kept(key: Key) -> Timing | None:
    """The timing on disk for ``key``; None where there is none or it does not read back (a
    file an older version wrote, or a damaged one: timed again)."""
    raw: Any = measured.read(measured.KERNELS_FILE).get(key.entry(), {}).get(key.shape)
    try:
        return Timing(ours_ms=float(raw["ours_ms"]), torch_ms=float(raw["torch_ms"]))
    except (TypeError, KeyError, ValueError):
        return None
