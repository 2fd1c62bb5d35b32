"""Where a prefill's attention time goes: our paged prefill kernel against the portable path.

The default model computes one prompt of ``--prompt-len`` tokens (prefix caching off, so that
every run computes all of it) with the paged prefill kernel
(:mod:`engine.kernels.paged_decode`) and with the portable path (a gather of the sequence's
K/V, then SDPA with an explicit mask; :func:`engine.kernels.paged_decode.portable`), the two
alternating in one process so that the machine's noise falls on both:

* the whole prefill's wall time, median of ``--repeats`` back-to-back pairs;
* the attention's own time under ``torch.profiler`` (the self CPU time of the attention ops,
  summed over the layers), median of three profiled pairs, and the ratio.

Run: ``python -m checks.prefill_attention [--precision bf16] [--prompt-len 512] [--threads 2]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from engine.bench.profile import ATTENTION_KERNELS

#: The ops each path's attention runs: our kernels (as ``bench --profile`` counts them), and
#: the portable path's SDPA, gather and mask.
ATTENTION_OPS = ATTENTION_KERNELS | {
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::scaled_dot_product_attention",
    "aten::index_select",
    "aten::repeat",
    "aten::le",
    "aten::bitwise_and",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    from engine.core.config import EngineConfig
    from engine.core.sampling import SamplingParams
    from engine.kernels import native, paged_decode
    from engine.loader.load import load_model
    from engine.store.model_store import pull_default

    torch.set_num_threads(args.threads)
    blocks = args.prompt_len // 16 + 4
    engine = load_model(
        pull_default(),
        precision=args.precision,
        config=EngineConfig(prefix_caching=False, num_blocks=blocks),
    )
    if not paged_decode.reads_pool(engine.kv.kv[0]):
        print(f"the prefill kernel does not run here: {paged_decode.status()}")
        return 1
    prompt = [(13 * i + 7) % 40_000 + 100 for i in range(args.prompt_len)]
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)

    def prefill(portable: bool) -> float:
        started = time.perf_counter()
        if portable:
            with paged_decode.portable():
                list(engine.generate(prompt, params))
        else:
            list(engine.generate(prompt, params))
        return time.perf_counter() - started

    def attention_ms(run: Callable[[], float]) -> float:
        native.RECORDING = True  # our kernels' ctypes calls as profiler events
        try:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                run()
        finally:
            native.RECORDING = False
        own = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
        return sum(us for op, us in own.items() if op in ATTENTION_OPS) / 1e3

    prefill(False), prefill(True)  # warm-up: the kernel's build, first allocations
    wall: dict[str, list[float]] = {"ours": [], "portable": []}
    for _ in range(args.repeats):
        wall["portable"].append(prefill(True) * 1e3)
        wall["ours"].append(prefill(False) * 1e3)
    attention: dict[str, list[float]] = {"ours": [], "portable": []}
    for _ in range(3):
        attention["portable"].append(attention_ms(lambda: prefill(True)))
        attention["ours"].append(attention_ms(lambda: prefill(False)))
    result = {
        "precision": args.precision,
        "prompt_tokens": args.prompt_len,
        "threads": args.threads,
        "layers": engine.cfg.num_layers,
        "prefill_ms": {k: round(statistics.median(v), 1) for k, v in wall.items()},
        "attention_ms": {k: round(statistics.median(v), 1) for k, v in attention.items()},
    }
    result["attention_ratio"] = round(
        result["attention_ms"]["ours"] / result["attention_ms"]["portable"], 2
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
