"""``infersight bench --prefill-table``: prefill speed of each precision, side by side.

Each precision of the list is loaded once; then every repeat computes one prompt of
``prompt_len`` tokens in each, in turn (the prefix cache emptied first, so the whole prompt is
computed every time, and one token generated: the time to it is the prefill's), so that the
machine's noise falls on every row alike. Reported: median tok/s per row, and each row's ratio
to the first's median of per-repeat ratios (the first is the reference, fp32 by default).

This is where W8A8 pays: a prefill chunk is bound by compute, and ``w8a8`` multiplies int8 by
int8 (:mod:`engine.quant.w8a8`) where weight-only formats multiply floats.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.bench.speed import bench_prompt, run_ours
from engine.core.config import EngineConfig
from engine.loader.load import load_model


def run_prefill_table(
    folder: Path,
    precisions: list[str],
    *,
    prompt_len: int = 512,
    repeats: int = 5,
    device: str = "cpu",
    engine_config: EngineConfig | None = None,
    log: Callable[[str], None] = lambda _: None,
    tensor_parallel: int = 1,
) -> dict[str, Any]:
    engines = {}
    for precision in precisions:
        log(f"loading {precision}")
        engines[precision] = load_model(folder, precision=precision, device=device,
                                        config=engine_config,
                                        tensor_parallel=tensor_parallel)  # fmt: skip
    first = engines[precisions[0]]
    prompt = bench_prompt(first, prompt_len, seed=0)
    for eng in engines.values():  # a warm-up each: first-call costs stay out of the figures
        run_ours(eng, prompt, 1)
    seconds: dict[str, list[float]] = {p: [] for p in precisions}
    for rep in range(repeats):
        log(f"repeat {rep + 1}/{repeats}")
        for precision, eng in engines.items():
            seconds[precision].append(run_ours(eng, prompt, 1).ttft_s)
    rows = []
    for precision in precisions:
        ratios = [b / s for s, b in zip(seconds[precision], seconds[precisions[0]], strict=True)]
        median = statistics.median(seconds[precision])
        rows.append({
            "precision": precision,
            "prefill_ms": median * 1e3,
            "prefill_tok_s": prompt_len / median,
            "vs_first": statistics.median(ratios),
            "kernels": engines[precision].kernels,
        })  # fmt: skip
    return {
        "model": first.name, "device": device, "threads": torch.get_num_threads(),
        "prompt_tokens": prompt_len, "repeats": repeats, "rows": rows,
    }  # fmt: skip


def format_prefill_table(report: dict[str, Any]) -> str:
    first = report["rows"][0]["precision"]
    lines = [
        f"{report['model']} · {report['device']}, {report['threads']} threads · prefill of "
        f"{report['prompt_tokens']} tokens (prefix cache emptied), median of "
        f"{report['repeats']}, every row in turn within each repeat",
        f"{'precision':>22} {'prefill ms':>11} {'tok/s':>9} {'vs ' + first:>12}",
    ]
    for row in report["rows"]:
        lines.append(
            f"{row['precision']:>22} {row['prefill_ms']:11.1f} {row['prefill_tok_s']:9.1f} "
            f"{row['vs_first']:11.2f}×"
        )
    return "\n".join(lines)
