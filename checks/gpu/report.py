"""The run's record: each check in turn under its own time limit, its result appended to the
JSON file as it ends (so a run killed at its limit leaves what it measured), and the table."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from checks.gpu.common import GiB, Skip

#: Seconds a check that is stuck in native code (a CUDA call that never returns, where no
#: Python signal handler runs) may overrun its limit before the run records it and exits;
#: also what a stopped check's clean-up (its engine let go, the device synchronized) may take.
STUCK_GRACE_S = 60.0


class CheckTimeout(BaseException):
    """Raised inside a check that ran past its time limit: a BaseException, so that no
    ``except Exception`` in the engine (a kernel's load-time check, a graph's capture, a
    compile) takes it for that step's own failure and carries on."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise CheckTimeout("past its time limit")


def forget_kernel_checks() -> None:
    """Clear the remembered verdicts of our kernels' load-time checks, so that none cut short
    by a timeout stands for the loads of later checks."""
    from engine.kernels import triton_check

    for cache in (triton_check._attention, triton_check._gemms, triton_check._fused):
        cache.cache_clear()


class Report:
    """The run's JSON object: the environment, the shapes, and each check's status, time,
    why (when not passed), figures (kept when it fails halfway) and what ran (kernels, step
    path). Written to ``path`` when a check starts (``running``) and when it ends."""

    def __init__(
        self,
        path: Path | None,
        dry_run: bool,
        budget_s: float,
        mode: str,
        grace_s: float = STUCK_GRACE_S,
    ) -> None:
        self.path = path
        self.budget_s = budget_s
        self.grace_s = grace_s
        self.started = time.perf_counter()
        self.data: dict[str, Any] = {
            "gpu_check": {
                "dry_run": dry_run,
                "mode": mode,
                "budget_s": budget_s,
                "finished": False,
                "running": None,
            },
            "environment": {},
            "shapes": {},
            "checks": [],
        }
        self._lock = threading.Lock()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def run(self, name: str, fn: Callable[[dict[str, Any]], None], limit_s: float) -> None:
        """Run one check: skipped when the budget cannot hold its limit; stopped with
        :class:`CheckTimeout` past ``limit_s``; past that and :data:`STUCK_GRACE_S` (stuck in
        native code: no signal handler runs there), recorded as timed out and the process
        ends with 124, the JSON saved."""
        figures: dict[str, Any] = {}
        entry: dict[str, Any] = {"name": name, "status": "passed", "seconds": 0.0, "why": ""}
        left = self.budget_s - self.elapsed
        limit = min(limit_s, left)
        start = time.perf_counter()
        with self._lock:
            self.data["gpu_check"]["running"] = {"name": name, "limit_s": round(limit, 1)}
            self.save()
        watchdog = threading.Timer(limit + self.grace_s, self._stuck, (name, figures, start))
        watchdog.daemon = True
        try:
            if limit < min(limit_s, 20.0):
                raise Skip(f"the run's {self.budget_s:.0f} s budget has {left:.0f} s left")
            watchdog.start()
            previous = signal.signal(signal.SIGALRM, _on_alarm)
            signal.setitimer(signal.ITIMER_REAL, limit)
            try:
                fn(figures)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
        except Skip as why:
            entry.update(status="skipped", why=str(why))
        except CheckTimeout:
            entry.update(status="failed", why=f"timed out: still running after {limit:.0f} s")
            forget_kernel_checks()  # a check cut short is no verdict on a kernel
        except Exception as exc:
            traceback.print_exc()
            entry.update(status="failed", why=f"{type(exc).__name__}: {exc}")
        finally:
            watchdog.cancel()
        entry.update(seconds=round(time.perf_counter() - start, 2), figures=figures)
        self._record(entry)

    def _record(self, entry: dict[str, Any]) -> None:
        with self._lock:
            self.data["checks"].append(entry)
            self.data["gpu_check"]["running"] = None
            self.save()
        label = {"passed": "ok  ", "skipped": "skip", "failed": "FAIL"}[entry["status"]]
        because = f": {entry['why']}" if entry["why"] else ""
        print(f"{label} {entry['name']} ({entry['seconds']:.1f} s){because}", flush=True)
        print("gpu-check-result " + json.dumps(entry, default=str), flush=True)

    def _stuck(self, name: str, figures: dict[str, Any], start: float) -> None:
        """The watchdog: a check stuck past its limit in native code; record it and end."""
        took = time.perf_counter() - start
        entry = {"name": name, "status": "failed", "seconds": round(took, 2),
                 "why": f"timed out: stuck in native code for {took:.0f} s; the run ended here",
                 "figures": dict(figures)}  # fmt: skip
        self._record(entry)
        self.finish()
        os._exit(124)

    def finish(self) -> bool:
        summary = self.data["gpu_check"]
        summary.update(
            finished=True,
            seconds=round(self.elapsed, 1),
            over_budget=self.elapsed > self.budget_s,
            passed=all(c["status"] != "failed" for c in self.data["checks"]),
        )
        self.save()
        return bool(summary["passed"])

    def save(self) -> None:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
            tmp.replace(self.path)


def table(data: dict[str, Any]) -> str:
    """The precisions and transformers as a table, then every check's status."""

    def gib(x: float | None) -> str:
        return "-" if x is None else f"{x / GiB:.2f}"

    def num(x: float | None, fmt: str = ".1f") -> str:
        return "-" if x is None else format(x, fmt)

    lines = [
        f"{'':<24} {'weights':>8} {'peak':>7} {'plan':>7} {'off':>6} {'load':>6} "
        f"{'prefill':>9} {'decode':>8} {'of BW':>6} {'batch':>8}",
        f"{'':<24} {'GiB':>8} {'GiB':>7} {'GiB':>7} {'':>6} {'s':>6} "
        f"{'tok/s':>9} {'tok/s':>8} {'limit':>6} {'tok/s':>8}",
    ]
    for check in data["checks"]:
        f = check["figures"]
        if check["name"].startswith("precision ") and "decode_tok_s" in f:
            frac = f.get("bandwidth_fraction")
            lines.append(
                f"{check['name'][10:]:<24} {gib(f['weights_bytes']):>8} "
                f"{gib(f.get('peak_bytes')):>7} {gib(f['plan']['peak_bytes']):>7} "
                f"{num(f.get('peak_error') and 100 * f['peak_error'], '+.1f'):>5}% "
                f"{num(f['load_s']):>6} {num(f['prefill_tok_s'], '.0f'):>9} "
                f"{num(f['decode_tok_s']):>8} {num(frac and 100 * frac, '.0f'):>5}% "
                f"{num(f['batch_decode_tok_s'], '.0f'):>8}"
            )
        if check["name"] == "transformers fp16" and "transformers" in f:
            for who in ("ours", "transformers"):
                frac = f[who].get("bandwidth_fraction")
                lines.append(
                    f"{'fp16 ' + who:<24} {'':>8} {'':>7} {'':>7} {'':>6} {'':>6} {'':>9} "
                    f"{num(f[who]['decode_tok_s']):>8} {num(frac and 100 * frac, '.0f'):>5}%"
                )
        if check["name"] == "triton and graphs" and "small" in f:
            for who, run in f["small"].items():
                label = {"graphs": "ours, CUDA graphs", "eager": "ours, eager"}.get(who, who)
                lines.append(f"{'135M fp16 ' + label:<38} {num(run['decode_tok_s']):>8} tok/s")
            for target, met in f["targets"].items():
                lines.append(f"target {target}: {'met' if met else 'NOT met'}")
    lines.append("")
    for check in data["checks"]:
        why = f"  {check['why'][:150]}" if check["why"] else ""
        lines.append(f"{check['status']:<8} {check['name']:<30} {check['seconds']:>7.1f} s{why}")
    summary = data["gpu_check"]
    over = f", over its {summary['budget_s']:.0f} s budget" if summary.get("over_budget") else ""
    lines.append(f"gpu-check took {summary.get('seconds', 0):.0f} s{over}")
    return "\n".join(lines)
