"""How many threads a CPU model decodes with: asked for, or timed once per machine and model.

torch starts with one intra-op thread per physical core. Batch-1 decode of a small model is a
chain of small products: on a many-core CPU, waking every core for each of them can cost more
than it gains, while a 2-core machine wants both. So where the user asked for no count
(``--threads``, ``INFERSIGHT_THREADS``), the load times the model's own linears for one token
at 1, 2, 4, … threads up to torch's default, keeps the fastest, and remembers the verdict in
``<cache>/threads.json`` under the CPU, torch version and the model's shapes. Threads are a
process-wide setting in torch: the last CPU load's choice holds for every engine.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable

import torch
from torch import nn

from engine.hardware import measured
from engine.hardware.measured import machine_name

log = logging.getLogger(__name__)

ENV = "INFERSIGHT_THREADS"
FILE = "threads.json"
#: torch's own default (one thread per physical core), read before anything changes it
DEFAULT_THREADS = torch.get_num_threads()
_asked: int | None = None


def set_threads(count: int | None) -> None:
    """The user's choice (``--threads``), kept for every later load; ``None`` changes nothing."""
    global _asked
    if count is None:
        return
    if count < 1:
        raise ValueError(f"threads must be at least 1, got {count}")
    torch.set_num_threads(count)
    _asked = count


def asked_threads() -> int | None:
    if _asked is not None:
        return _asked
    raw = os.environ.get(ENV, "").strip()
    if raw.isdigit() and int(raw) >= 1:
        return int(raw)
    if raw:
        log.warning("ignoring %s=%s: give a whole number of threads", ENV, raw)
    return None


def candidates(default: int | None = None) -> list[int]:
    """1, 2, 4, … and torch's default itself, never above it."""
    default = default or DEFAULT_THREADS
    out = {default}
    n = 1
    while n < default:
        out.add(n)
        n *= 2
    return sorted(out)


def settle_threads(linears: list[nn.Module], dtype: torch.dtype) -> str:
    """Set torch's thread count for decoding a model whose linears, in forward order, are
    ``linears`` (:func:`engine.model.inventory.linear_modules`); returns one line for the load
    report."""
    asked = asked_threads()
    if asked is not None:
        torch.set_num_threads(asked)
        return f"{asked} threads, as asked"
    options = candidates()
    if len(options) == 1:
        torch.set_num_threads(options[0])
        return f"{options[0]} thread, the only core"
    linears = _streaming_prefix(linears)
    shapes = sorted({(m.out_features, m.in_features) for m in linears})
    key = (
        f"{machine_name()} | torch {torch.__version__} | {DEFAULT_THREADS} cores | "
        f"{str(dtype).removeprefix('torch.')} {len(linears)} linears {shapes}"
    )
    return _fastest(key, options, lambda t: _time_linears(linears, dtype, t), "matmuls")


def settle_step_threads(key: str, time_step: Callable[[int], float]) -> str | None:
    """Where the engine's decode step can be timed whole (a decode step in one C call:
    :mod:`engine.executor.c_step`), the thread count whose step ``time_step(count)`` (ms)
    measured fastest, interleaved three times and kept under ``key`` (which names what the
    step runs), then set as :func:`settle_threads` sets it; the load report's line, or None
    where the count was asked for or there is one core (nothing to time). The linears' probe
    calls each from Python, with waits between them that a C step does not have."""
    if asked_threads() is not None:
        return None
    options = candidates()
    if len(options) == 1:
        return None
    return _fastest(key, options, time_step, "decode step in C")


def _fastest(key: str, options: list[int], time_ms: Callable[[int], float], what: str) -> str:
    """Set the count of ``options`` whose ``time_ms(count)`` is fastest, timed in three
    interleaved rounds (a noisy moment hurts every count alike) and kept under ``key``, or
    read back from there; torch's default holds unless another count is clearly (10%)
    faster. Returns the load report's line for ``what`` was timed."""
    with _LOCK:
        verdicts = _verdicts()
        timings = verdicts.get(key)
        cached = timings is not None
        if timings is None:
            best_ms = dict.fromkeys(options, float("inf"))
            for _ in range(3):
                for t in options:
                    best_ms[t] = min(best_ms[t], time_ms(t))
            timings = {str(t): ms for t, ms in best_ms.items()}
            verdicts[key] = timings
            _save(verdicts)
    fastest = min(timings, key=lambda t: timings[t])
    best = (
        int(fastest) if timings[fastest] < 0.9 * timings[str(DEFAULT_THREADS)] else DEFAULT_THREADS
    )
    torch.set_num_threads(best)
    spread = ", ".join(f"{t}: {ms:.1f} ms" for t, ms in timings.items())
    kept = ", kept" if cached else ""
    return f"{best} threads, the fastest for this model's {what} ({spread}{kept})"


#: weights the timing streams through: beyond any cache, yet a fraction of a big model
STREAM_BYTES = 96 * 2**20
_LOCK = threading.Lock()  # the app loads models on a thread of its own


def _streaming_prefix(linears: list[nn.Module]) -> list[nn.Module]:
    """The first linears in forward order that hold :data:`STREAM_BYTES` (all of a small
    model): a big model's first layers time the same shapes as its whole stack."""
    out: list[nn.Module] = []
    total = 0
    for module in linears:
        out.append(module)
        nbytes = getattr(module, "nbytes", None)
        if not isinstance(nbytes, int):
            weight = getattr(module, "weight")  # noqa: B009
            nbytes = weight.numel() * weight.element_size()
        total += nbytes
        if total >= STREAM_BYTES:
            break
    return out


def _time_linears(linears: list[nn.Module], dtype: torch.dtype, threads: int) -> float:
    """ms for one token through every linear at ``threads`` threads, the best of three."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    inputs = [torch.randn(1, getattr(m, "in_features"), dtype=dtype) for m in linears]  # noqa: B009
    best = float("inf")
    try:
        with torch.inference_mode():
            for _ in range(4):  # the first round warms up
                started = time.perf_counter()
                for module, x in zip(linears, inputs, strict=True):
                    module(x)
                best = min(best, time.perf_counter() - started)
    finally:
        torch.set_num_threads(before)
    return best * 1e3


@functools.cache
def _verdicts() -> dict[str, dict[str, float]]:
    out = {}
    for key, timings in measured.read(FILE).items():
        try:
            out[key] = {t: float(ms) for t, ms in timings.items()}
        except (TypeError, ValueError):
            continue
    return out


def _save(verdicts: dict[str, dict[str, float]]) -> None:
    measured.write(FILE, dict(verdicts))
