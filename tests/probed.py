"""Expectations taken from the probes (engine/hardware/cpu_paths.py), never from the machine a
test was written on: marks for tests that need a path the probe may not find on another CPU
kind."""

from __future__ import annotations

import platform
from typing import Any

import pytest

from engine.hardware.cpu_paths import LEVELS, cpu_paths, forced_level, native_level

_INT4 = cpu_paths().int4_kernel

#: A test that loads an INT4 precision: INT4 has no fallback, so where the probe found no
#: kernel (aarch64, ``INFERSIGHT_CPU_CAPABILITY=DEFAULT``) the load is refused by name, which
#: tests/test_cpu_paths.py checks.
needs_int4 = pytest.mark.skipif(not _INT4.ok, reason=f"no INT4 kernel here: {_INT4.why}")


def precisions(*specs: str) -> list[Any]:
    """``specs`` as parameters, those with INT4 parts marked :data:`needs_int4`."""
    return [pytest.param(s, marks=needs_int4) if "int4" in s else s for s in specs]


def cpu_flags() -> set[str]:
    """The instruction-set flags the CPU reports of itself (``/proc/cpuinfo``), empty where it
    cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            line = next((x for x in info if x.startswith(("flags", "Features"))), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


#: Whether this is an x86-64 CPU, whose lower levels our C kernels build for.
X86 = platform.machine().lower() in ("x86_64", "amd64")


def built_levels() -> list[str | None]:
    """The builds of our C kernels this machine makes: its own (None: ``-march=native``, or
    the level this process is held to) and, on x86-64, each level below it that
    ``INFERSIGHT_CPU_CAPABILITY`` can force."""
    own = forced_level() or native_level()
    return [None] + [lvl for lvl in LEVELS if X86 and LEVELS.index(lvl) < LEVELS.index(own)]
