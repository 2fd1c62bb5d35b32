"""Our C kernels (``csrc/``), built once per machine with the system's C compiler.

A kernel's source is compiled with ``$CC``, else ``cc``, ``gcc`` or ``clang``, for this CPU
(``-O3 -march=native``; ``-mavx2 -mfma`` where ``INFERSIGHT_CPU_CAPABILITY=AVX2`` caps the
level, so that an AVX-512 machine proves the AVX2 build; no instruction-set flags where it is
``DEFAULT``: the portable code), with OpenMP where the compiler has it. The library is cached
under the user cache by a hash of the source, the flags, the compiler and the CPU, and called
through ``ctypes`` (which releases the GIL). Each kernel module probes its library in a child
process before this one loads it (:mod:`engine.hardware.isolated`): C that crashes there
leaves this process on the portable path.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.hardware.measured import machine_name
from engine.paths import home

log = logging.getLogger(__name__)

#: While True (``bench --profile``: :mod:`engine.bench.profile`), :func:`call` records each
#: call of our C kernels as a profiler event: ``torch.profiler`` sees operators, and a ctypes
#: call is none, so its time would read as Python.
RECORDING = False


def call(name: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, a C function of ours, recorded as the profiler event ``name`` while
    :data:`RECORDING`."""
    if not RECORDING:
        return fn(*args)
    import torch

    with torch.profiler.record_function(name):
        return fn(*args)


class Switch:
    """A fast path of ours that a block of code can turn off, for side-by-side measurements
    (``with switch.turned_off(): …`` runs the fallback)."""

    def __init__(self) -> None:
        self.off = False

    @contextlib.contextmanager
    def turned_off(self) -> Iterator[None]:
        before, self.off = self.off, True
        try:
            yield
        finally:
            self.off = before


CSRC = Path(__file__).resolve().parent / "csrc"


def compiler() -> str | None:
    """The C compiler to build with, or None where there is none."""
    for name in filter(None, (os.environ.get("CC"), "cc", "gcc", "clang")):
        found = shutil.which(name)
        if found:
            return found
    return None


def isa_flags(level: str | None = None) -> list[str]:
    """Instruction sets to build for at ``level`` (a level of
    :data:`engine.hardware.cpu_paths.LEVELS`; by default the forced one, else this CPU's own):
    ``-march=native``, ``-mavx2 -mfma`` at AVX2, none at DEFAULT. Empty off x86-64, where the
    compiler's default target is this CPU's architecture."""
    from engine.hardware.cpu_paths import forced_level

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    level = level or forced_level()
    if level == "DEFAULT":
        return []
    return ["-mavx2", "-mfma"] if level == "AVX2" else ["-march=native"]


def _cpu() -> str:
    """The CPU's name and instruction-set flags (``/proc/cpuinfo``), else ``platform``'s."""
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            flags = next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = platform.platform()
    return machine_name() + "|" + flags


def suffix() -> str:
    return ".dll" if os.name == "nt" else (".dylib" if platform.system() == "Darwin" else ".so")


def library_path(source: Path, cc: str, flags: list[str]) -> Path:
    """Where the build of ``source`` with ``cc`` and ``flags`` for this CPU is kept."""
    try:
        version = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        version = cc
    # -march=native: the build holds for this CPU's instruction sets, not just its name; the
    # headers beside the source (csrc/*.h) are part of it too
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    key = hashlib.sha256(
        source.read_bytes() + headers + version.encode() + _cpu().encode() + str(flags).encode()
    ).hexdigest()
    return home() / "kernels" / f"{source.stem}-{key[:16]}{suffix()}"


def build(cc: str, source: Path, out: Path, flags: list[str]) -> str | None:
    """Compile ``source`` into the shared library ``out``; returns the flags used, or None."""
    base = ["-O3", "-shared", "-fPIC", "-std=c11"]
    for extra in (["-fopenmp"], []):  # without OpenMP (e.g. Apple clang): one thread
        used = [*base, *flags, *extra]
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        cmd = [cc, *used, str(source), "-o", str(tmp), "-lm"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.debug("compiling %s failed: %s", source.name, exc)
            continue
        if done.returncode == 0:
            tmp.replace(out)
            return " ".join(used)
        log.debug("compiling %s with %s failed: %s", source.name, used, done.stderr[-2000:])
        tmp.unlink(missing_ok=True)
    return None


#: ``INFERSIGHT_KERNEL_SANITIZE=address`` builds the kernels under AddressSanitizer (its own
#: cache entries; load with ``LD_PRELOAD`` of the compiler's libasan: ``make asan``)
SANITIZERS = {"address": ["-fsanitize=address", "-fno-omit-frame-pointer", "-g"]}


def sanitizer_flags() -> list[str]:
    """The flags :data:`SANITIZERS` names for ``INFERSIGHT_KERNEL_SANITIZE`` (none unset)."""
    name = os.environ.get("INFERSIGHT_KERNEL_SANITIZE", "")
    if name and name not in SANITIZERS:
        raise ValueError(f"INFERSIGHT_KERNEL_SANITIZE={name}: give one of {', '.join(SANITIZERS)}")
    return SANITIZERS.get(name, [])


def built(source: Path, flags: list[str]) -> tuple[Path | None, str]:
    """The library of ``source`` built with ``flags`` for this machine (built now if it is
    not in the cache yet), or None and why not."""
    flags = [*flags, *sanitizer_flags()]
    cc = compiler()
    if cc is None:
        return None, "no C compiler found"
    if not source.is_file():
        return None, f"its source {source} is missing"
    path = library_path(source, cc, flags)
    if path.is_file():
        return path, ""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return None, f"no folder for its build: {exc}"
    if build(cc, source, path, flags) is None:
        return None, "it did not compile here"
    return path, ""


@dataclass(frozen=True, slots=True)
class Library:
    """A loaded build of one of our C sources, or why there is none."""

    lib: Any  # the ctypes library, or None
    why: str
    path: Path | None = None
    #: the library's function that names the instruction set its build uses
    isa_symbol: str = ""

    @property
    def available(self) -> bool:
        return self.lib is not None

    @property
    def isa(self) -> str:
        """The instruction set the build uses (``avx512-vnni``, ``avx2``, ``portable`` …)."""
        if self.lib is None:
            return "none"
        return str(getattr(self.lib, self.isa_symbol)().decode())


def load(path: Path, isa_symbol: str, declare: Callable[[Any], None]) -> Library:
    """Load the build ``path``; ``declare`` gives its functions their C signatures."""
    lib = ctypes.CDLL(str(path))
    getattr(lib, isa_symbol).restype = ctypes.c_char_p
    getattr(lib, isa_symbol).argtypes = []
    declare(lib)
    return Library(lib, "", path, isa_symbol)


def build_library(
    source: Path, what: str, level: str | None, loader: Callable[[Path], Library]
) -> Library:
    """Build ``source`` (once per machine) for ``level`` and load it with ``loader``, without
    the child's check (tests check each level themselves); ``what`` names it in the reason
    there is none."""
    path, why = built(source, isa_flags(level))
    return Library(None, f"{what}: {why}") if path is None else loader(path)


def checked(found: Library, what: str, probe: str) -> Library:
    """``found`` if its first check (``probe``, ``module:function``) passes, run once per
    build in a child process and kept (:func:`engine.hardware.isolated.verdict`: C that
    crashes there leaves this process on torch's paths); else no library, and why."""
    from engine.hardware import isolated

    if found.path is None:
        return found
    problem = isolated.verdict(what, probe, str(found.path))
    if problem:
        log.warning("our %s failed the check (%s); not using it", what, problem)
        return Library(None, f"our {what} failed the check: {problem}")
    return found
