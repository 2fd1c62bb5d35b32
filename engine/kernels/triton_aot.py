"""Build every configuration of our Triton kernels for every target architecture, no GPU
needed, and check each one's shared memory against the architecture's limit.

``python -m engine.kernels.triton_aot [--json]``: one line per kernel configuration and
architecture (or one JSON object), exit 1 if any failed to compile or needs more shared memory
than its architecture has. ``make test`` runs it (tests/test_triton_aot.py). Triton's real
compiler only: it refuses to run under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys
import time
from collections.abc import Callable

from engine.kernels import triton_support


def configurations() -> list[triton_support.KernelConfig]:
    """Every configuration of every module of :mod:`engine.kernels.triton_kernels` (each
    module's ``configs()``)."""
    from engine.kernels import triton_kernels

    out: list[triton_support.KernelConfig] = []
    for info in sorted(pkgutil.iter_modules(triton_kernels.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{triton_kernels.__name__}.{info.name}")
        configs: Callable[[], list[triton_support.KernelConfig]] = module.configs
        out += configs()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.kernels.triton_aot")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if triton_support.interpreting():
        print("unset TRITON_INTERPRET: the build needs Triton's real compiler", file=sys.stderr)
        return 2
    results: list[dict[str, object]] = []
    started = time.perf_counter()
    for config in configurations():
        for target in triton_support.TARGETS:
            if target < config.min_target:
                continue
            row: dict[str, object] = {"kernel": config.name, "target": f"sm_{target}"}
            try:
                built = triton_support.compile_for(config, target)
            except Exception as exc:  # the compiler's refusal is the finding
                row |= {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
            else:
                limit = triton_support.SHARED_MEMORY[target]
                row |= {
                    "ok": built.fits, "shared_bytes": built.shared_bytes,
                    "shared_limit": limit, "num_warps": built.num_warps,
                    "cubin_bytes": built.cubin_bytes,
                }  # fmt: skip
                if not built.fits:
                    row["error"] = f"needs {built.shared_bytes} B of shared memory, has {limit}"
            results.append(row)
    took = time.perf_counter() - started
    ok = all(r["ok"] for r in results)
    if args.json:
        print(json.dumps({"ok": ok, "seconds": round(took, 1), "results": results}))
    else:
        for r in results:
            shared = f"{r['shared_bytes']:>7} B" if "shared_bytes" in r else ""
            print(f"{'ok ' if r['ok'] else 'BAD'} {r['target']:<6} {r['kernel']:<48} {shared}")
            if "error" in r:
                print(f"    {r['error']}")
        print(f"{len(results)} builds in {took:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
