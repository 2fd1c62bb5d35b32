"""What padding a prefill product's rows to :func:`engine.quant.int8.bucket_rows` costs.

The default model at ``--precision`` computes one prompt of each ``--lengths`` (one chunk, up
to 512 tokens; the prefix cache emptied, one token generated: the time to it is the
prefill's) with the products' rows padded to their buckets (what runs) and at their exact
counts (what ran before: a GEMM shape per chunk length, which oneDNN keeps memory for:
``checks.rss_growth --exact-rows``), the two alternating in one process so that the machine's
noise falls on both. Reported per length: the rows it is padded to, each side's median, and
the median of the per-repeat ratios.
The worst lengths are just past a power of two (257 → 288); a bucket's own length pads nothing.

Run: ``python -m checks.prefill_rows [--precision int4-g32] [--lengths 33,65,129,200,257,320]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from app.loading import resolve_model_folder
from engine.bench.speed import bench_prompt, run_ours
from engine.errors import InfersightError
from engine.loader.load import load_model
from engine.quant import int8


def main(argv: list[str] | None = None) -> int:
    about = (__doc__ or "").split("\n")[0]
    p = argparse.ArgumentParser(prog="python -m checks.prefill_rows", description=about)
    p.add_argument("--model", default="default")
    p.add_argument("--precision", default="int4-g32")
    p.add_argument("--lengths", default="33,65,129,200,257,320,500")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        p.error(f"--lengths takes token counts separated by commas, got {args.lengths!r}")
    if min(lengths) < 1 or args.repeats < 1:
        p.error("--lengths and --repeats must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        engine = load_model(resolve_model_folder(args.model, None), precision=args.precision)
    except InfersightError as exc:
        p.error(str(exc))
    bucketed = int8.bucket_rows
    sides = {"exact": lambda m: m, "bucketed": bucketed}
    print(f"{engine.name} {args.precision} · {torch.get_num_threads()} threads · prefill ms, "
          f"median of {args.repeats}, the two sides alternating")  # fmt: skip
    print(f"{'tokens':>6} {'padded to':>9} {'exact':>8} {'bucketed':>9} {'exact/bucketed':>15}")
    try:
        for n in lengths:
            prompt = bench_prompt(engine, n, seed=0)
            ms: dict[str, list[float]] = {side: [] for side in sides}
            for rep in range(args.repeats + 1):  # the first pair warms each shape up
                for side, rows in sides.items():
                    int8.bucket_rows = rows
                    seconds = run_ours(engine, prompt, 1).ttft_s
                    if rep:
                        ms[side].append(seconds * 1e3)
            ratio = statistics.median(
                a / b for a, b in zip(ms["exact"], ms["bucketed"], strict=True)
            )
            exact, padded = statistics.median(ms["exact"]), statistics.median(ms["bucketed"])
            print(f"{n:6d} {bucketed(n):9d} {exact:8.1f} {padded:9.1f} {ratio:14.3f}×", flush=True)
    finally:
        int8.bucket_rows = bucketed
    return 0


if __name__ == "__main__":
    sys.exit(main())
