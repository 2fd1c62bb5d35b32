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

Where the C decode step would run the layer, our kernel is judged without what a call of it
from Python costs (the timing's ``call_ms``: ours on the smallest problem, timed beside it):
the step calls it from C. On a 576×576 INT8 product at 2 threads ours timed 0.010 ms, 4.2 µs
of it the call, against torch's 0.007 ms: judged with the call, the one shape went to torch's
kernel and sent every decode step of the model back to the eager code (:class:`Allowance`).
The smallest problem's call still holds the kernel's own fixed work (a parallel region where
there are threads, a µs or so), which the step pays too: within the allowance's margin.

A noisy moment must not fix a choice for good: a first timing that goes against ours is
timed again at once (each timer's own rounds are interleaved already), each side's best of
the two kept, and their disagreement kept as the timing's ``noise`` (:meth:`Timing.again`).
Torch's path wins only by more than that noise: within it, ours (the path the step prefers:
a layer on torch's kernel sends a whole decode step back to eager). ``infersight kernels
--retime`` forgets every verdict of this machine, to be timed again by the next load.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from engine.hardware import measured

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Allowance:
    """What a kernel of ours may lose by and still run a layer: up to ``factor`` × torch's
    time; ``in_c``: the C decode step would call it, from C, so that what a call from Python
    costs (:attr:`Timing.call_ms`) is not counted against it."""

    factor: float = 1.0
    in_c: bool = False


@dataclass(frozen=True, slots=True)
class Timing:
    """One shape's two paths, timed streaming from memory: ms per product (ours, torch's)."""

    ours_ms: float
    torch_ms: float
    #: how far two timings of the shape disagreed, relative (0: timed once)
    noise: float = 0.0
    #: of ``ours_ms``, what a call from Python costs (ours on the smallest problem; 0: not timed)
    call_ms: float = 0.0

    @property
    def ours(self) -> bool:
        return self.ours_within(1.0)

    def ours_within(self, slack: float | Allowance) -> bool:
        """Whether ours runs the shape when it may take up to ``slack`` × torch's time (less
        its calls' cost where the C step calls it), widened by the timing's noise (torch's
        path must win by more than that)."""
        allow = slack if isinstance(slack, Allowance) else Allowance(slack)
        ours = max(self.ours_ms - self.call_ms, 0.0) if allow.in_c else self.ours_ms
        return ours < allow.factor * self.torch_ms * (1.0 + self.noise)

    def again(self, other: Timing) -> Timing:
        """This timing and ``other`` of the same shape: each side's best, and how far the
        two disagreed: the smaller of the two sides' relative gaps (a spike on one side alone
        says nothing of the machine's noise: that side's best already drops it), at most
        :data:`MAX_NOISE`."""
        ours, theirs = min(self.ours_ms, other.ours_ms), min(self.torch_ms, other.torch_ms)
        gap = min(_gap(self.ours_ms, other.ours_ms), _gap(self.torch_ms, other.torch_ms))
        calls = [t.call_ms for t in (self, other) if t.call_ms > 0]
        return Timing(ours, theirs, min(max(gap, self.noise, other.noise), MAX_NOISE),
                      min(calls, default=0.0))  # fmt: skip


#: the widest a timing's noise may widen torch's time in ours' favour
MAX_NOISE = 0.25


def _gap(a: float, b: float) -> float:
    """How far two timings of one path disagree, relative to the larger (0 where either is
    not a finite positive time)."""
    top = max(a, b)
    if not (math.isfinite(a) and math.isfinite(b)) or top <= 0:
        return 0.0
    return abs(a - b) / top


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


def known(key: Key, slack: float | Allowance = 1.0) -> bool | None:
    """The kept verdict for ``key`` (as :func:`faster` gives it), or None where none is kept:
    never times."""
    timing = _kept(key)
    return None if timing is None else timing.ours_within(slack)


def faster(
    key: Key, timer: Callable[[], Timing], slack: float | Allowance = 1.0,
    sides: tuple[str, str] = ("ours", "torch"),
) -> bool:  # fmt: skip
    """Whether ours measured faster than torch's for ``key`` (or within ``slack`` × its time,
    and its noise): :func:`timing`."""
    return timing(key, timer, sides, slack).ours_within(slack)


def timing(
    key: Key, timer: Callable[[], Timing], sides: tuple[str, str] = ("ours", "torch"),
    slack: float | Allowance = 1.0,
) -> Timing:  # fmt: skip
    """The kept timing for ``key``, else ``timer()``'s, timed now (under :data:`LOCK`; again
    where the first goes against ours at ``slack``, the module's rule) and kept; ``sides``
    name the two paths in the log line."""
    with LOCK:
        raw: Any = measured.read(measured.KERNELS_FILE).get(key.entry(), {}).get(key.shape)
        kept = read_timing(raw)
        in_c = isinstance(slack, Allowance) and slack.in_c
        if kept is not None and (
            kept.ours_within(slack) or ("noise" in raw and (not in_c or kept.call_ms > 0))
        ):
            return kept
        # a verdict against ours is timed twice (one kept by a version that timed it once,
        # or, for the C step, without the cost of a call, is timed again, its figures among
        # the two)
        found = timer() if kept is None else kept
        if not found.ours_within(slack):
            found = found.again(timer())
        log.info("timed %s: %s %.3f ms, %s %.3f ms per token",
                 key.shape, sides[0], found.ours_ms, sides[1], found.torch_ms)  # fmt: skip
        measured.write(measured.KERNELS_FILE, {key.entry(): {key.shape: asdict(found)}})
        return found


def _kept(key: Key) -> Timing | None:
    """The timing on disk for ``key``; None where there is none or it does not read back (a
    file an older version wrote, or a damaged one: timed again)."""
    return read_timing(measured.read(measured.KERNELS_FILE).get(key.entry(), {}).get(key.shape))


def read_timing(raw: Any) -> Timing | None:
    """A kept entry as a :class:`Timing`; None where it does not read back as one."""
    try:
        return Timing(float(raw["ours_ms"]), float(raw["torch_ms"]),
                      float(raw.get("noise", 0)), float(raw.get("call_ms", 0)))  # fmt: skip
    except (TypeError, KeyError, ValueError, AttributeError):
        return None


def _machine_prefix() -> str:
    """What every entry of this machine's starts with (:meth:`Key.entry`)."""
    return measured.machine_key() + " | "


def kept_here() -> dict[str, dict[str, Any]]:
    """This machine's entries, each build (and thread count) to its shapes' figures."""
    prefix = _machine_prefix()
    return {
        build.removeprefix(prefix): shapes
        for build, shapes in measured.read(measured.KERNELS_FILE).items()
        if build.startswith(prefix)
    }


def this_machine() -> dict[str, int]:
    """How this machine's kept verdicts fall (at no slack): shapes on ours, on torch's, and
    within their noise (ours): what a benchmark ran under."""
    counts = {"ours": 0, "torch": 0, "within_noise": 0}
    for shapes in kept_here().values():
        for t in filter(None, map(read_timing, shapes.values())):
            counts["ours" if t.ours else "torch"] += 1
            counts["within_noise"] += int(t.ours and t.ours_ms >= t.torch_ms)
    return counts


def forget_this_machine() -> int:
    """Forget every verdict kept for this machine (each build and thread count): the next
    load times them again. Returns how many shapes were forgotten."""
    with LOCK:
        return measured.forget(measured.KERNELS_FILE, _machine_prefix())
