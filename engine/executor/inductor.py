"""The decode step as one compiled graph (TorchInductor), chosen at load.

In eager PyTorch a decode step of a small model is hundreds of tiny operators, each paying
Python and dispatch costs that dwarf its own work on a CPU (RMSNorm alone is ~10 operators).
``torch.compile`` traces the whole forward of a decode-only step into one graph and
TorchInductor fuses what lies between the matmuls (residual add + RMSNorm, RoPE on q and k,
SiLU·mul, the dtype casts around INT4) into a few generated C++ loops. What it must not touch
stays opaque: oneDNN's packed linears (:func:`engine.kernels.packed_linear.packed_linear`) and
the paged attention with its cache write
(:func:`engine.attention.ops.paged_decode_attention`), so the data and memory flow
are the engine's own in both modes.

Only decode-only steps run compiled; prefill (long, one-off, shape-varied) stays eager, as
does any step while hooks are on the model (layer timings, ``bench --profile`` scopes).

The mode is settled at load (``--decode-graph`` or ``INFERSIGHT_DECODE_GRAPH``):

* ``off``: eager;
* ``on``: compiled, or eager with the reason in the load report when this machine cannot
  compile (no C++ compiler, an Inductor error);
* ``auto`` (default): compiled where it was measured to be faster on this kind of device
  (:data:`FASTER_COMPILED`), else eager.

Compiling costs minutes on a small CPU (85–190 s per load on 2 cores; Inductor's on-disk
caches make the later ones the quicker). The engine compiles at load (a few warm-up steps on
scratch sequences), never in the middle of a reply.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.executor import table
from engine.hardware.cpu_paths import forced_level, isolate_compile_cache, native_level
from engine.hardware.measured import machine_name

log = logging.getLogger(__name__)

ENV = "INFERSIGHT_DECODE_GRAPH"
MODES = ("auto", "on", "off")

#: Where ``auto`` compiles: (device type, CPU capability or "*"), from side-by-side
#: ``infersight bench --table`` runs (README, Performance). A kind not listed stays eager until
#: it has been measured.
FASTER_COMPILED: frozenset[tuple[str, str]] = frozenset()
#: Kinds measured where ``auto`` stays eager: on the 2-core AVX2 EPYC a compiled step decoded
#: 1.25–1.5× as fast, but compiling took 85–190 s at every load.
EAGER_MEASURED: frozenset[tuple[str, str]] = frozenset({("cpu", "AVX2")})


@dataclass(frozen=True, slots=True)
class GraphChoice:
    """What the load settled: ``compiled`` or not, and why (one line for the load report)."""

    compiled: bool
    why: str

    def summary(self) -> str:
        return f"decode step {'compiled (TorchInductor)' if self.compiled else 'eager'}: {self.why}"


def requested_mode(mode: str | None) -> str:
    """The mode to use: the argument, else ``INFERSIGHT_DECODE_GRAPH``, else ``auto``."""
    chosen = (mode or os.environ.get(ENV) or "auto").strip().lower()
    if chosen not in MODES:
        raise ValueError(f"decode graph mode must be one of {', '.join(MODES)}, not {chosen!r}")
    return chosen


def device_kind(device: torch.device) -> tuple[str, str]:
    if device.type == "cpu":
        return ("cpu", torch.backends.cpu.get_cpu_capability())
    return (device.type, "*")


def choose(
    mode: str | None,
    device: torch.device,
    *,
    backend: str = "torch",
    tensor_parallel: bool = False,
    experts: bool = False,
) -> GraphChoice:
    """Settle the mode for ``device`` before the model is compiled: the one place that says
    whether an engine compiles its decode step (the load asks it, and so does gpu-check).
    Refused where the compatibility table refuses it (:mod:`engine.executor.table`: under
    our Triton attention, ``backend``, and under tensor parallelism), before any probe of
    the compiler."""
    mode = requested_mode(mode)
    kind = device_kind(device)
    if mode == "off":
        return GraphChoice(False, "off as asked")
    refused = table.refusal("compiled", backend, tensor_parallel=tensor_parallel, experts=experts)
    if refused:
        return GraphChoice(False, f"eager: {refused}")
    if mode == "auto" and kind not in FASTER_COMPILED:
        where = "/".join(kind)
        if kind in EAGER_MEASURED:
            why = f"on {where} compiling costs more at load than it saves (auto)"
        else:
            why = f"not yet measured on {where} (auto; --decode-graph on compiles)"
        return GraphChoice(False, why)
    problem = compiler_problem(device.type)
    if problem:
        return GraphChoice(False, f"cannot compile here ({problem}); eager instead")
    how = "on as asked" if mode == "on" else f"measured faster on {'/'.join(kind)} (auto)"
    return GraphChoice(True, how)


@functools.cache
def compiler_problem(device_type: str = "cpu") -> str:
    """Why TorchInductor cannot compile for this kind of device here (a C++ compiler on a CPU,
    Triton on a GPU), or "" when it can: a tiny function is compiled and run on such a device
    (the probe, not a guess from ``PATH``). The probe runs once per machine in a child process
    (:mod:`engine.hardware.isolated`), since a compiler or Inductor crash would otherwise end
    this one; its verdict is kept for later loads."""
    from engine.hardware import isolated

    isolate_compile_cache()  # the child inherits the cache of this process's level
    why = isolated.verdict(
        f"torch.compile {device_type}", PROBE[device_type], probe_key(device_type)
    )
    if why:
        log.info("TorchInductor unavailable: %s", why)
    return why


def probe_key(device_type: str) -> str:
    """What a compile probe's verdict holds for: the machine at its level, torch, Python (whose
    headers the generated code includes), the compiler TorchInductor calls, and on a GPU the
    device and Triton."""
    level = forced_level() or native_level()
    python = f"python {sys.version.split()[0]}"
    parts = [machine_name(), level, f"torch {torch.__version__}", python, device_type,
             _cpp_compiler()]  # fmt: skip
    if device_type == "cuda" and torch.cuda.is_available():
        try:
            import triton

            parts += [torch.cuda.get_device_name(), f"triton {triton.__version__}"]
        except ImportError:
            parts.append("no triton")
    return " | ".join(parts)


def _cpp_compiler() -> str:
    """The C++ compiler TorchInductor would call, with its version line, or why none."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        compiler = get_cpp_compiler()
    except Exception as exc:  # a private API: its absence or failure is part of the key
        return f"no c++ ({type(exc).__name__})"
    found = shutil.which(compiler)
    if found is None:
        return f"no c++ ({compiler} not found)"
    try:
        version = subprocess.run([found, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout.partition("\n")[0]  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        version = "?"
    return f"{found} {version}"


def probe_compile(device_type: str) -> str:
    """The probe itself (run in the child): "" if a compiled tiny function equals eager."""

    def tiny(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(x) * x + 1

    isolate_compile_cache()
    try:
        x = torch.linspace(-2, 2, 16, device=device_type)
        ok = torch.allclose(torch.compile(tiny)(x), tiny(x))
    except Exception as exc:  # any failure means "not here"; the reason goes to the report
        if _machine_trouble(exc):
            raise  # a full disk, a folder it may not write: no verdict on this machine's compiler
        return reason(exc)
    return "" if ok else "a compiled probe gave wrong results"


def _machine_trouble(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it wraps) is the machine's, not the compiler's: out of disk
    space or memory, no permission to write the cache."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, MemoryError) or (
            isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EACCES, errno.EROFS,
                                                         errno.ENOMEM, errno.EDQUOT)
        ):  # fmt: skip
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _probe_cpu() -> str:
    return probe_compile("cpu")


def _probe_cuda() -> str:
    return probe_compile("cuda")


#: The probe each device type runs in the child (``module:function``; tests swap in others).
PROBE = {"cpu": f"{__name__}:_probe_cpu", "cuda": f"{__name__}:_probe_cuda"}


def reason(exc: BaseException) -> str:
    """One line for the load report: the first line of ``exc`` that says what went wrong
    (Dynamo wraps a backend's error under a "backend='inductor' raised:" line)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    lines = [line for line in lines if not line.endswith("raised:")] or [type(exc).__name__]
    return lines[0][:160]


class CompiledDecode:
    """The compiled decode step: compiles while :attr:`warm` is false (the load's warm-up),
    then never again: a step whose shapes no compiled graph covers (a first token at
    position 0 has one key, a size TorchInductor specialises) runs eagerly instead of
    stalling a reply for a compile."""

    def __init__(self, body: Callable[..., Any]) -> None:
        self.graph = compile_forward(body)
        self.warm = False

    def __call__(self, *args: Any) -> Any:
        if not self.warm:
            return self.graph(*args)
        with torch.compiler.set_stance("eager_on_recompile"):
            return self.graph(*args)


def compile_forward(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` compiled for decode steps, every size symbolic from the start (the batch,
    the keys per sequence, the KV pool's slots), so that one graph serves every step of
    batch ≥ 2 and one every step of batch 1 (a size of 1 is always specialised), and the
    on-disk caches find them again at the next load whatever the pool's size."""
    isolate_compile_cache()
    # Generated kernels are recorded for the profiler (``bench --profile``); a cheap check
    # when it is off.
    return torch.compile(
        forward, dynamic=True, fullgraph=True, options={"cpp.enable_kernel_profile": True}
    )
