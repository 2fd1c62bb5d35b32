"""Build every configuration of our Triton kernels for the NVIDIA architectures from sm_75 to
sm_90, no GPU needed, and check each one's shared memory against the architecture's limit.

``python -m engine.kernels.triton_aot [--json FILE] [--jobs N] [--all-targets] [--targets SM …]``
prints one line per configuration and architecture and exits 1 if any failed to compile or
needs more shared memory than its architecture has; ``--report FILE`` prints a saved run
again (with its exit status). ``make test`` runs it in the background beside the tests. It
needs Triton's real compiler: it refuses to run under ``TRITON_INTERPRET=1``.

Each build is the whole pipeline a GPU's first launch runs (Triton IR, its GPU dialect, LLVM
IR, PTX, and ``ptxas`` to a cubin), about a second per configuration and target. sm_75
(Turing: no bf16, no MMA in Triton 3.9), sm_80 (Ampere's MMA, async copies) and sm_90
(Hopper's warp-group MMA) are built. sm_86 and sm_89 run Ampere's code generation: Triton
3.9 emits the same GPU-dialect IR for 8.0, 8.6 and 8.9 and allocates the same shared memory
(compared over a sample of our configurations: only LLVM's instruction scheduling in the PTX
differs), so their rows check the sm_80 build's shared memory against their own, smaller
limits (99 KiB against Ampere's 163 KiB), which is where a kernel tuned on an A100 would fail
on an RTX card. ``--all-targets`` builds them too.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from engine.kernels import triton_support

#: What is built, and for each architecture left out, the one whose build stands for it.
BUILT = (75, 80, 90)
SAME_AS = {86: 80, 89: 80}


def configurations() -> list[triton_support.KernelConfig]:
    """Every configuration of every module of :mod:`engine.kernels.triton_kernels` (each
    module's ``configs()``; a module of device functions only, such as ``rounding``, has
    none: the kernels that call them build them)."""
    from engine.kernels import triton_kernels

    out: list[triton_support.KernelConfig] = []
    for info in sorted(pkgutil.iter_modules(triton_kernels.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{triton_kernels.__name__}.{info.name}")
        configs: Callable[[], list[triton_support.KernelConfig]] | None = getattr(
            module, "configs", None
        )
        out += configs() if configs is not None else []
    return out


def build(name: str, target: int) -> dict[str, Any]:
    """One configuration (by name) built for one architecture: its row of the report."""
    config = next(c for c in configurations() if c.name == name)
    row: dict[str, Any] = {"kernel": name, "target": f"sm_{target}"}
    try:
        built = triton_support.compile_for(config, target)
    except Exception as exc:  # the compiler's refusal is the finding
        return row | {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
    return row | {"shared_bytes": built.shared_bytes, "num_warps": built.num_warps,
                  "cubin_bytes": built.cubin_bytes}  # fmt: skip


def judged(row: dict[str, Any], target: int) -> dict[str, Any]:
    """``row`` with its verdict for ``target``: built, and within its shared memory."""
    if "error" in row:
        return row | {"target": f"sm_{target}"}
    limit = triton_support.SHARED_MEMORY[target]
    out = row | {"target": f"sm_{target}", "shared_limit": limit}
    out["ok"] = row["shared_bytes"] <= limit
    if not out["ok"]:
        out["error"] = f"needs {row['shared_bytes']} B of shared memory, has {limit}"
    return out


def run(jobs: int, all_targets: bool, targets: tuple[int, ...] = ()) -> dict[str, Any]:
    """Every build (for ``targets`` only, where given), ``jobs`` at a time, and the report."""
    built: tuple[int, ...] = triton_support.TARGETS if all_targets else BUILT
    if targets:
        built = tuple(t for t in built if t in targets)
        all_targets = True  # no other architecture judged from these builds
    todo = [(c.name, t) for c in configurations() for t in built if t >= c.min_target]
    minimum = {c.name: c.min_target for c in configurations()}
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        rows = dict(zip(todo, pool.map(build, *zip(*todo, strict=True)), strict=True))
    results = []
    for (name, target), row in rows.items():
        results.append(judged(row, target))
        if not all_targets and target in SAME_AS.values():
            for other, same in SAME_AS.items():
                if same == target and other >= minimum[name]:
                    results.append(judged(row, other) | {"built_as": f"sm_{same}"})
    took = time.perf_counter() - started
    ok = bool(results) and all(r["ok"] for r in results)
    return {"ok": ok, "seconds": round(took, 1), "builds": len(todo), "results": results}


def table(report: dict[str, Any]) -> str:
    lines = []
    for r in report["results"]:
        shared = f"{r['shared_bytes']:>7} B" if "shared_bytes" in r else ""
        alias = f"(as {r['built_as']})" if "built_as" in r else ""
        mark = "ok " if r["ok"] else "BAD"
        lines.append(f"{mark} {r['target']:<6} {r['kernel']:<48} {shared} {alias}".rstrip())
        if "error" in r:
            lines.append(f"    {r['error']}")
    bad = sum(not r["ok"] for r in report["results"])
    lines.append(
        f"Triton ahead-of-time build: {report['builds']} builds in {report['seconds']:.0f} s, "
        f"{len(report['results'])} configuration × architecture checks, {bad} failed"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.kernels.triton_aot")
    parser.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="builds at once")
    parser.add_argument(
        "--all-targets", action="store_true", help="build sm_86 and sm_89 too (about 5/3 the time)"
    )
    parser.add_argument(
        "--targets", type=int, nargs="+", default=[], metavar="SM",
        help="only these compute capabilities, e.g. 80 90 (sm_80, sm_90)",
    )  # fmt: skip
    parser.add_argument("--report", metavar="FILE", help="print a saved run and exit with it")
    parser.add_argument(
        "--quiet", action="store_true", help="print only the failures and the total"
    )
    args = parser.parse_args(argv)
    if args.report:
        report = json.loads(Path(args.report).read_text())
    else:
        if triton_support.interpreting():
            print("unset TRITON_INTERPRET: the build needs Triton's real compiler", file=sys.stderr)
            return 2
        unknown = set(args.targets) - set(triton_support.TARGETS)
        if unknown:
            known = ", ".join(map(str, triton_support.TARGETS))
            print(f"--targets: {sorted(unknown)} are not ours to build ({known})", file=sys.stderr)
            return 2
        report = run(max(1, args.jobs), args.all_targets, tuple(args.targets))
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(report, indent=1))
    text = table(report)
    if args.quiet:
        text = "\n".join(line for line in text.splitlines() if not line.startswith("ok "))
    print(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
