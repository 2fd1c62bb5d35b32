"""``make gpu-check``: what only a GPU can show, on Llama-3.1-8B's shapes, in one process, run
with the lent machine's own ``python3`` (docs/gpu-check.md); ``--dry-run`` runs the same code
on a CPU with tiny shapes (``make test`` runs it through ``tests/test_gpu_check.py``, so the
check cannot rot before a GPU is lent).

The model is synthetic: random weights of the shapes in ``resources/configs/llama-3.1-8b.json``
drawn on the device and loaded through the real loader (:mod:`engine.loader.synthetic`): no hub,
nothing written to disk, token ids in and out. The checks run in the order of what they tell,
each under its own time limit, whatever the others gave:

1. **bandwidth** (:mod:`checks.gpu.kernels`): the device's memory read bandwidth, the limit
   that batch-1 decode is a fraction of;
2. **triton kernels**: each of our kernels' load-time check on this GPU, split paths forced
   (decode attention split over the context, GEMV and 16-row GEMMs split over K), the
   quantized layers against their dequantized references, a tied INT4 head read back as
   embedding rows exactly, and the quantized GEMV's speed as a share of the bandwidth;
3. **precision int4-g32+head (12 GB card)** (:mod:`checks.gpu.precision`): on a 12 GiB card
   emulated (the allocator held to it, the plan made for it): the load, a 4k-token prompt
   with 15 copies decoding beside it, batch-1 decode; the plan's peak within 10% of
   ``max_memory_allocated``, decode within the bandwidth limit, the batch's gain; then the
   pool the engine profiles itself on that card;
4. **triton and graphs** (:mod:`checks.gpu.graphs`): CUDA graphs against eager steps and our
   kernels against torch's on the default model's shapes, greedy ids by the tie rule; decode
   at 8k tokens of context against 512 on the 8B;
5. **compiled decode**: the decode step compiled where the engine compiles it (torch's
   attention; under our Triton attention the engine refuses, and the check asks the same
   place the engine does, :func:`engine.executor.inductor.choose`);
6. **transformers fp16** (:mod:`checks.gpu.serving`) and **out of memory** (on the 12 GB card:
   the server's loop recovers a step that ran out for real), what no other check covers;
7. the other precisions, each where native and planned to fit;
8. **app worker** (skipped where PySide6 is missing: the lent GPU image has none),
   **kernels at 0 rows** and **tensor parallel** (:mod:`checks.gpu.parallel`; two GPUs, else
   skipped).

``--quick`` runs 1–4 (the 8k context left out) within 5 minutes on an H100; the whole run
fits 8 (a cold Triton cache compiles each kernel the first time it runs). Every check that
builds an engine records what ran (kernels, decode step, graphs, each quantized layer's path)
and fails where that is not what it claims to test (a kernel fallen back to torch after
failing its check). Greedy ids compared between two runs must
agree, or part at a tie (:func:`checks.gpu.common.parting`).

Output: a line per check as it ends (and its JSON on a ``gpu-check-result`` line), a table,
then one JSON object on stdout and in ``--json`` PATH, written as each check starts and ends:
a run killed at its limit leaves what it measured. Exits 1 if a check failed. Without CUDA
and without ``--dry-run`` it says so and exits 0.

Run: ``python -m checks.gpu [--dry-run] [--quick] [--only NAME …] [--device cuda:N]
[--json PATH] [--precision P …] [--card-gib G]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from checks.gpu import families, graphs, kernels, parallel, precision, serving
from checks.gpu.common import (
    BUDGET_S,
    CARD_BYTES,
    DRY,
    GPU,
    PRECISIONS,
    QUICK_BUDGET_S,
    TWELVE_GB,
    GiB,
    Scale,
    environment,
)
from checks.gpu.report import Report, table
from engine.loader.memory_plan import CUDA_RUNTIME_BYTES

#: A check: its name, its time limit on a GPU (s), whether ``--quick`` runs it, and its body.
Check = tuple[str, float, bool, Callable[[dict[str, Any]], None]]


def checks(
    scale: Scale,
    device: torch.device,
    dry: bool,
    quick: bool,
    card: int | None,
    chosen: list[str],
    state: dict[str, Any],
) -> list[Check]:
    """Every check in the order of what it tells (``state``: what one hands the next)."""
    first, rest = chosen[:1], chosen[1:]
    out: list[Check] = [
        ("bandwidth", 30, True, partial(kernels.check_bandwidth, scale, device, state)),
        ("triton kernels", 180, True, partial(kernels.check_triton_kernels, device, dry, state)),
    ]
    for p in first:
        body = partial(precision.check_precision, scale, device, p, state, card if card else None)
        out.append((f"precision {p}{' (12 GB card)' if card else ''}", 180, True, body))
    out += [
        ("triton and graphs", 150, True, partial(graphs.check_triton, scale, device, dry, quick)),
        ("compiled decode", 150, False, partial(graphs.check_compiled, scale, device, dry)),
    ]
    out += [
        ("transformers fp16", 120, False,
         partial(serving.check_transformers, scale, device, state)),
        ("out of memory", 120, False, partial(serving.check_out_of_memory, scale, device, card)),
    ]  # fmt: skip
    for p in rest:
        on_card = card if p in TWELVE_GB else None
        body = partial(precision.check_precision, scale, device, p, state, on_card)
        out.append((f"precision {p}{' (12 GB card)' if on_card else ''}", 90, False, body))
    out += [
        ("experts and Gemma 3", 120, False,
         partial(families.check_families, scale, device, dry)),
        ("app worker", 90, False, partial(serving.check_worker, device)),
        ("kernels at 0 rows", 30, False, partial(kernels.check_empty_kernels, device)),
        ("tensor parallel", 120, False,
         partial(parallel.check_tensor_parallel, scale, device, dry)),
    ]  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--dry-run", action="store_true", help="the same checks on the CPU with tiny shapes"
    )
    parser.add_argument(
        "--quick", action="store_true", help="the first four checks (within 5 minutes)"
    )
    parser.add_argument("--only", nargs="+", metavar="NAME", help="checks whose name starts so")
    parser.add_argument("--device", default="cuda:0", help="the CUDA device to check")
    parser.add_argument("--json", type=Path, help="also write the JSON object to this file")
    parser.add_argument(
        "--precision", nargs="+", default=list(PRECISIONS),
        help="the precisions to run (default: all that fit; the first on the 12 GB card)",
    )  # fmt: skip
    parser.add_argument(
        "--card-gib", type=float, default=CARD_BYTES / GiB,
        help="the card the first precision and out of memory emulate (0: the whole GPU)",
    )  # fmt: skip
    parser.add_argument("--budget", type=float, help="the run's seconds (default 480, quick 300)")
    args = parser.parse_args(argv)
    from app.cli.common import configure_cuda_allocator

    configure_cuda_allocator()  # as `infersight` does, before CUDA starts
    if args.dry_run:
        device, scale = torch.device("cpu"), DRY
    elif not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        print(
            f"gpu-check skipped: torch {torch.__version__} ({build}) sees no CUDA device; "
            "--dry-run runs it on the CPU with tiny shapes"
        )
        return 0
    else:
        device, scale = torch.device(args.device), GPU
        if device.index is None:  # "cuda": the current device, by its number
            device = torch.device("cuda", torch.cuda.current_device())
    budget = args.budget or (QUICK_BUDGET_S if args.quick else BUDGET_S)
    card = int(args.card_gib * GiB) if args.card_gib and device.type == "cuda" else None
    report = Report(args.json, args.dry_run, budget, "quick" if args.quick else "full")
    report.data["environment"] = environment(device)
    report.data["shapes"] = scale.describe()
    env = report.data["environment"]
    print(f"gpu-check on {env['name']} ({device}), torch {env['torch']}: {scale.name}", flush=True)
    state: dict[str, Any] = {}
    listed = checks(scale, device, args.dry_run, args.quick, card, list(args.precision), state)
    names = [name for name, *_ in listed]
    unknown = [o for o in args.only or () if not any(n.startswith(o) for n in names)]
    if unknown:
        print(f"gpu-check: no check is named like {unknown}; the checks: {', '.join(names)}")
        return 2
    for name, limit, in_quick, body in listed:
        if args.quick and not in_quick:
            continue
        if args.only and not any(name.startswith(prefix) for prefix in args.only):
            continue
        report.run(name, body, limit * (10 if args.dry_run else 1))
    env.update(
        cuda_runtime_bytes=state.get("cuda_runtime_bytes"),
        planned_cuda_runtime_bytes=CUDA_RUNTIME_BYTES,
    )
    passed = report.finish()
    print(table(report.data))
    if report.data["gpu_check"]["over_budget"]:
        print(f"WARNING: gpu-check took over its {budget:.0f} s budget")
    print(json.dumps(report.data, default=str))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
