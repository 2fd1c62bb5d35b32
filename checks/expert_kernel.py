"""One layer of experts on one decode row: the experts' one C call against the expert modules
(``engine/kernels/experts.py``), on a model's first mixture of experts, interleaved rounds of
the median of 200 calls each (docs/performance.md quotes it)::

    python -m checks.expert_kernel MODEL_FOLDER int4-g32+head [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.loader.load import load_model
from engine.model.moe import MoE


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("::")[0])
    parser.add_argument("model", help="a mixture of experts' folder (`infersight models synth`)")
    parser.add_argument("precision", help="int4-g32+head, int8+head …")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    engine = load_model(args.model, precision=args.precision)
    moe = next((m.mlp for m in engine.model.layers if isinstance(m.mlp, MoE)), None)
    if moe is None:
        parser.error(f"{args.model} has no layer of experts")
    kernel = moe.kernel
    if kernel is None:
        parser.error(f"its experts run one module at a time: {moe.kernel_refusal}")
    x = torch.randn(1, engine.model.cfg.hidden_size).to(engine.dtype)

    def timed() -> float:
        times = []
        for _ in range(args.calls):
            start = time.perf_counter()
            moe(x)
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    print(f"{engine.name} · {args.precision} · {kernel.name} against the expert modules")
    with torch.inference_mode():
        for _ in range(args.rounds):
            moe.kernel = kernel
            one = timed()
            moe.kernel = None
            modules = timed()
            print(f"one call {one:.3f} ms, modules {modules:.3f} ms: {modules / one:.2f}×")
    moe.kernel = kernel
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
