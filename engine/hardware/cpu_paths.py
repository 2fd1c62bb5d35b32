"""Which fast CPU paths this machine runs, found by probing at load, never assumed.

CPUs differ: AVX-512 with or without BF16/AMX, AVX2 only (most AMD Zen 2/3 and Intel client
CPUs), aarch64. Each fast path the engine can take on a CPU is tried once per process on a tiny
tensor and compared with a plain reference; a path that raises or disagrees is not used, and the
next best one runs instead. The load report (``-v``) and the app's model info say which path
each kind of layer took.

| path             | fast                                   | fallback                          |
|------------------|----------------------------------------|-----------------------------------|
| ``packed_fp32``  | oneDNN blocked weights (:mod:`linear`) | ``nn.Linear``                     |
| ``packed_bf16``  | the same in bf16 (AVX-512 BW/VL/DQ or  | ``nn.Linear`` in bf16             |
|                  | AVX-NE-CONVERT)                        |                                   |
| ``int8_kernel``  | ``torch._weight_int8pack_mm``          | int8 weights converted per call   |
| ``int4_kernel``  | ``_weight_int4pack_mm_for_cpu``        | none: INT4 is refused by name     |

**One switch forces the fallbacks**, so every path runs on every machine:
``INFERSIGHT_CPU_CAPABILITY=AVX2`` makes the probes answer as they would on an AVX2-only CPU;
``DEFAULT`` turns every fast path off (INT4, which has no fallback, is then refused), so that
the fallbacks run even on an AVX2 machine. Under the switch a path counts only at the level it
is known to need (``needs`` below, the lowest level it has been run on); the switch only ever
lowers what the CPU has. Set ``ATEN_CPU_CAPABILITY`` to the same level (``avx2``, ``default``)
so that torch's own kernels take their matching code paths too; ``make test`` runs such a leg.
``ATEN_CPU_CAPABILITY`` alone lowers the level just the same (:func:`forced_level`): a process
whose torch runs AVX2 kernels answers every probe as on an AVX2 CPU, whatever the CPU has.

**Compiled code is kept per level.** TorchInductor caches what it compiles on disk, and a kernel
compiled at a lowered level and found again by a process at the CPU's own level corrupts that
process's heap (torch 2.13, AVX2 → AVX-512). TorchInductor generates vector code for the level
``ATEN_CPU_CAPABILITY`` names; :func:`isolate_compile_cache` sends a process where that is
lowered to a cache of that level, beside the user's own; the engine calls it before anything is
compiled.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.formats.int4 import cpu_int4_block_rows, dequantize_int4, quantize_int4

log = logging.getLogger(__name__)

FORCE_ENV = "INFERSIGHT_CPU_CAPABILITY"
#: x86 vector levels, lowest first; the forced level and each path's need are read on this scale.
LEVELS = ("DEFAULT", "AVX2", "AVX512")
F32, BF16 = torch.float32, torch.bfloat16


@dataclass(frozen=True, slots=True)
class PathProbe:
    """The outcome of one probe: ``ok`` and, when not, why (shown in the load report)."""

    ok: bool
    why: str = ""


@dataclass(frozen=True, slots=True)
class CpuPaths:
    """What this process's CPU runs fast. Built once by :func:`cpu_paths`."""

    capability: str  # torch's answer: AVX512, AVX2, DEFAULT, SVE256, …
    forced: str | None  # the level INFERSIGHT_CPU_CAPABILITY caps it to, if set
    packed_fp32: PathProbe
    packed_bf16: PathProbe
    int8_kernel: PathProbe
    int4_kernel: PathProbe
    #: rows per block of the CPU INT4 packing (a tied INT4 head reads embedding rows from it)
    int4_block_rows: int | None

    def packed(self, dtype: torch.dtype) -> PathProbe:
        if dtype == torch.float32:
            return self.packed_fp32
        if dtype == torch.bfloat16:
            return self.packed_bf16
        return PathProbe(False, f"oneDNN packing is not used for {dtype}")

    def summary(self) -> str:
        """One line for the load report."""
        level = self.capability + (f", forced to {self.forced}" if self.forced else "")
        names = {
            "oneDNN fp32": self.packed_fp32,
            "oneDNN bf16": self.packed_bf16,
            "int8 kernel": self.int8_kernel,
            "int4 kernel": self.int4_kernel,
        }
        parts = [f"{name} {'yes' if p.ok else 'no'}" for name, p in names.items()]
        return f"CPU {level}: " + ", ".join(parts)


ATEN_ENV = "ATEN_CPU_CAPABILITY"


@functools.cache
def native_level() -> str:
    """The CPU's own level, from what the CPU says of itself (cpuinfo), not from torch's
    dispatch, which ``ATEN_CPU_CAPABILITY`` lowers. Outside x86: torch's capability."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return torch.backends.cpu.get_cpu_capability()
    if torch.cpu._is_avx512_supported():
        return "AVX512"
    return "AVX2" if torch.cpu._is_avx2_supported() else "DEFAULT"


def _named_level() -> str | None:
    raw = os.environ.get(FORCE_ENV, "").strip().upper().replace("-", "")
    if not raw:
        return None
    if raw not in LEVELS:
        log.warning("ignoring %s=%s; use one of %s", FORCE_ENV, raw, ", ".join(LEVELS))
        return None
    return raw


#: ``ATEN_CPU_CAPABILITY``'s x86 values as torch reads them: exactly these lowercase names (any
#: other spelling is ignored by ATen's dispatch and by TorchInductor alike)
_ATEN_NAMES = {"default": "DEFAULT", "avx2": "AVX2", "avx512": "AVX512"}


def aten_level() -> str | None:
    """The level ``ATEN_CPU_CAPABILITY`` holds torch to (its kernels, and the vector code
    TorchInductor generates) where that is below the CPU's own; else ``None``."""
    level = _ATEN_NAMES.get(os.environ.get(ATEN_ENV, ""))
    if level is None:
        return None
    native = native_level()
    if native not in LEVELS:  # another architecture: only "default" is a level of its
        return level if level == "DEFAULT" else None
    return level if LEVELS.index(level) < LEVELS.index(native) else None


def forced_level() -> str | None:
    """The level this process is held to: ``INFERSIGHT_CPU_CAPABILITY``, or
    ``ATEN_CPU_CAPABILITY`` where it is below the CPU's own level (torch then runs that level's
    kernels), the lower of the two when both are set; ``None`` when neither is set."""
    named = [level for level in (_named_level(), aten_level()) if level is not None]
    return min(named, key=LEVELS.index) if named else None


INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def compile_cache_dir() -> str:
    """Where TorchInductor keeps what this process compiles: the user's cache (their
    ``TORCHINDUCTOR_CACHE_DIR``, else torch's default), or, where ``ATEN_CPU_CAPABILITY``
    lowers the vector code it generates, a cache of that level beside it (``…-cpu-avx2``),
    never the one the CPU's own level uses. ``INFERSIGHT_CPU_CAPABILITY`` alone changes which
    of our paths a model takes, not the code TorchInductor generates for this CPU, so it
    compiles into the user's cache (a cache of another level would then hold this CPU's
    code, which a process really at that level could find)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    base = os.environ.get(INDUCTOR_CACHE_ENV) or default_cache_dir()
    base = os.path.abspath(base).rstrip(os.sep)
    base = _LEVEL_SUFFIX.sub("", base)  # set by an earlier call, or inherited from a parent
    lowered = aten_level()
    return base if lowered is None else f"{base}-cpu-{lowered.lower()}"


_LEVEL_SUFFIX = re.compile(r"-cpu-(?:" + "|".join(level.lower() for level in LEVELS) + r")$")


def isolate_compile_cache() -> str:
    """Point TorchInductor at :func:`compile_cache_dir` before anything is compiled (every
    compile of the engine's goes through here); returns the folder."""
    folder = compile_cache_dir()
    if os.environ.get(INDUCTOR_CACHE_ENV) != folder:
        os.environ[INDUCTOR_CACHE_ENV] = folder
        log.debug("TorchInductor's cache for this process: %s", folder)
    return folder


def _level_allows(forced: str | None, needs: str) -> bool:
    return forced is None or LEVELS.index(forced) >= LEVELS.index(needs)


def _probe(name: str, forced: str | None, needs: str, run: Callable[[], bool]) -> PathProbe:
    if not _level_allows(forced, needs):
        return PathProbe(False, f"forced off by {FORCE_ENV}={forced}, needs {needs}")
    try:
        ok = run()
    except (RuntimeError, NotImplementedError, AttributeError, TypeError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        log.debug("CPU path %s unavailable: %s", name, first_line)
        return PathProbe(False, first_line)
    return PathProbe(True) if ok else PathProbe(False, "gave wrong results on this CPU")


def _tiny(rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=gen)


def _packed_linear_works(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        raise RuntimeError("this torch build has no oneDNN")
    w, x = _tiny(48, 64, 1).to(dtype), _tiny(3, 64, 2).to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, batch_size=16)
    y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return torch.allclose(y.float(), F.linear(x.float(), w.float()), rtol=2e-2, atol=2e-2)


def _int8_kernel_works() -> bool:
    w = torch.randint(-127, 128, (48, 64), generator=torch.Generator().manual_seed(3))
    q = w.to(torch.int8)
    scales = torch.rand(48, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    x = _tiny(3, 64, 5).to(torch.bfloat16)
    y = torch._weight_int8pack_mm(x, q, scales)
    ref = F.linear(x.float(), q.float()) * scales.float()
    return torch.allclose(y.float(), ref, rtol=3e-2, atol=0.5)


def _int4_kernel_works() -> bool:
    w = _tiny(64, 64, 6)
    q, scale, zero = quantize_int4(w, 32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    sz = torch.stack([scale, zero], dim=2).transpose(0, 1).contiguous()
    x = _tiny(3, 64, 7).to(torch.bfloat16)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz)
    ref = F.linear(x.float(), dequantize_int4(q, scale, zero, 32))
    return torch.allclose(y.float(), ref, rtol=3e-2, atol=0.25)


@functools.cache
def cpu_paths() -> CpuPaths:
    """Probe every CPU path once per process (a few milliseconds)."""
    forced = forced_level()
    int4 = _probe("int4_kernel", forced, "AVX2", _int4_kernel_works)
    paths = CpuPaths(
        capability=torch.backends.cpu.get_cpu_capability(),
        forced=forced,
        # Packing is a speed choice measured on AVX2 and AVX-512 CPUs; oneDNN's bf16 reorder
        # needs AVX-512 BW/VL/DQ (or AVX-NE-CONVERT), which the probe itself finds out.
        packed_fp32=_probe("packed_fp32", forced, "AVX2", lambda: _packed_linear_works(F32)),
        packed_bf16=_probe("packed_bf16", forced, "AVX512", lambda: _packed_linear_works(BF16)),
        int8_kernel=_probe("int8_kernel", forced, "AVX2", _int8_kernel_works),
        int4_kernel=int4,
        int4_block_rows=cpu_int4_block_rows() if int4.ok else None,
    )
    log.info("%s", paths.summary())
    return paths
