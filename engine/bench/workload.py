"""The mixed workload (``infersight bench --workload mixed``): requests of seeded, mixed prompt
and output lengths, all arriving at once, through our continuous batching at each batch size,
against our batch 1 and, optionally, transformers' static batching of the same requests. The
prefix cache is emptied before each run (:func:`run_workload`); ``--prefix-cache both`` and
``--shared-prefix`` measure caching itself.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from engine.bench.speed import HFRunner
from engine.core.engine import LLMEngine
from engine.core.instruments import percentiles
from engine.core.sampling import SamplingParams
from engine.errors import InfersightError
from engine.loader.load import load_model


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    prompt_ids: list[int]
    output_tokens: int


def mixed_workload(
    engine: LLMEngine,
    requests: int,
    *,
    seed: int = 0,
    prompt_range: tuple[int, int] = (16, 512),
    output_range: tuple[int, int] = (16, 256),
    shared_prefix: int = 0,
) -> list[WorkloadRequest]:
    """``requests`` requests with prompt and output lengths drawn uniformly (seeded); with
    ``shared_prefix``, every prompt starts with the same that many tokens (a system prompt)."""
    gen = torch.Generator().manual_seed(seed)
    low = max(engine.eos_token_ids | {engine.cfg.bos_token_id or 0}) + 1
    # Small-context models: shrink the ranges so that every request fits its context.
    ctx = engine.context_length
    out_hi = min(output_range[1], ctx // 2)
    output_range = (min(output_range[0], out_hi), out_hi)
    if shared_prefix > ctx - out_hi - 2:
        raise InfersightError(
            f"a shared prefix of {shared_prefix} tokens leaves no room for prompts and outputs "
            f"in a {ctx}-token context; use at most {ctx - out_hi - 2}"
        )
    prompt_hi = min(prompt_range[1], ctx - out_hi - 1 - shared_prefix)
    prompt_range = (min(prompt_range[0], prompt_hi), prompt_hi)
    prefix = torch.randint(low, engine.cfg.vocab_size, (shared_prefix,), generator=gen).tolist()
    out = []
    for _ in range(requests):
        n_prompt = int(torch.randint(prompt_range[0], prompt_range[1] + 1, (1,), generator=gen))
        n_out = int(torch.randint(output_range[0], output_range[1] + 1, (1,), generator=gen))
        ids = torch.randint(low, engine.cfg.vocab_size, (n_prompt,), generator=gen).tolist()
        out.append(WorkloadRequest(prefix + ids, n_out))
    return out


@dataclass(slots=True)
class WorkloadResult:
    engine: str
    max_batch_size: int
    wall_s: float
    prompt_tokens: int
    output_tokens: int
    output_tok_s: float
    total_tok_s: float
    ttft_p50_s: float
    ttft_p95_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p95_s: float
    tpot_p99_s: float
    peak_kv_usage: float | None = None
    mean_kv_waste: float | None = None  # reserved-but-empty share of used blocks
    mean_contiguous_utilisation: float | None = None  # same tokens in max_len × batch slots
    preemptions: int = 0
    prefix_caching: bool | None = None
    cached_prompt_tokens: int = 0  # found in the prefix cache, not computed


def _pcts(values: list[float]) -> tuple[float, float, float]:
    p = percentiles(values)
    return (p["p50"], p["p95"], p["p99"]) if p else (float("nan"),) * 3


def run_workload(
    engine: LLMEngine, workload: list[WorkloadRequest], max_batch_size: int
) -> WorkloadResult:
    """All requests arrive at once; continuous batching with ``max_batch_size``. The prefix
    cache starts empty: a run does not reuse the previous run's prompts."""
    engine.update_limits(max_batch_size=max_batch_size)
    engine.clear_prefix_cache()
    max_len = max(len(r.prompt_ids) + r.output_tokens for r in workload)
    mgr = engine.kv.manager
    ids: dict[str, WorkloadRequest] = {}
    started = time.perf_counter()
    for r in workload:
        params = SamplingParams(max_new_tokens=r.output_tokens, ignore_eos=True)
        ids[engine.add_request(r.prompt_ids, params)] = r
    peak, waste, contiguous = 0.0, [], []
    while engine.has_work():
        engine.step()
        occ = mgr.occupancy()
        peak = max(peak, occ.usage)
        if occ.used_blocks:
            waste.append(occ.waste_slots / (occ.used_blocks * mgr.block_size))
            running = len(engine.scheduler.running)
            if running:
                contiguous.append(occ.tokens_stored / (running * max_len))
    wall = time.perf_counter() - started
    # every request's own figures (the snapshot's list covers only its last 30 s)
    finished = [m for m in map(engine.request_metrics, ids) if m is not None]
    ttft = _pcts([m.time_to_first_token_seconds or 0.0 for m in finished])
    tpot = _pcts([m.time_per_output_token_seconds or 0.0 for m in finished])
    prompt = sum(len(r.prompt_ids) for r in workload)
    output = sum(r.output_tokens for r in workload)
    return WorkloadResult(
        engine="infersight", max_batch_size=max_batch_size, wall_s=wall,
        prompt_tokens=prompt, output_tokens=output, output_tok_s=output / wall,
        total_tok_s=(prompt + output) / wall, ttft_p50_s=ttft[0], ttft_p95_s=ttft[1],
        ttft_p99_s=ttft[2], tpot_p50_s=tpot[0], tpot_p95_s=tpot[1], tpot_p99_s=tpot[2],
        peak_kv_usage=peak, mean_kv_waste=statistics.fmean(waste) if waste else 0.0,
        mean_contiguous_utilisation=statistics.fmean(contiguous) if contiguous else 0.0,
        preemptions=sum(m.preemptions for m in finished),
        prefix_caching=engine.kv.manager.prefix_caching,
        cached_prompt_tokens=sum(m.cached_prompt_tokens for m in finished),
    )  # fmt: skip


def run_workload_hf(
    hf: HFRunner, workload: list[WorkloadRequest], batch_size: int
) -> WorkloadResult:
    """transformers, batched statically as a user would: groups of ``batch_size`` in arrival
    order, prompts left-padded, each group generating its longest output."""
    ttfts: list[float] = []
    tpots: list[float] = []
    started = time.perf_counter()
    for g in range(0, len(workload), batch_size):
        group = workload[g : g + batch_size]
        width = max(len(r.prompt_ids) for r in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for i, r in enumerate(group):
            ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids) :] = 1
        steps = max(r.output_tokens for r in group)
        timing = hf.run_batch(ids.to(hf.device), mask.to(hf.device), steps)
        for r in group:  # every member waits for the group; its own tokens end at its length
            ttfts.append(timing[1] - started)
            end = timing[min(r.output_tokens, len(timing) - 1)]
            tpots.append((end - timing[1]) / max(r.output_tokens - 1, 1))
    wall = time.perf_counter() - started
    prompt = sum(len(r.prompt_ids) for r in workload)
    output = sum(r.output_tokens for r in workload)
    ttft, tpot = _pcts(ttfts), _pcts(tpots)
    return WorkloadResult(
        engine="transformers", max_batch_size=batch_size, wall_s=wall, prompt_tokens=prompt,
        output_tokens=output, output_tok_s=output / wall, total_tok_s=(prompt + output) / wall,
        ttft_p50_s=ttft[0], ttft_p95_s=ttft[1], ttft_p99_s=ttft[2], tpot_p50_s=tpot[0],
        tpot_p95_s=tpot[1], tpot_p99_s=tpot[2],
    )  # fmt: skip


def run_workload_bench(
    folder: Path,
    *,
    requests: int,
    batch_sizes: list[int],
    precision: str = "fp32",
    device: str = "cpu",
    compare_hf: bool = False,
    hf_batch_sizes: list[int] | None = None,
    seed: int = 0,
    engine_config: Any = None,
    shared_prefix: int = 0,
    prefix_cache: str = "on",
    log: Callable[[str], None] = lambda _: None,
    tensor_parallel: int = 1,
) -> dict[str, Any]:
    """The mixed workload through our continuous batching at each of ``batch_sizes`` and,
    with ``compare_hf``, through transformers' static batching at each of ``hf_batch_sizes``
    (default: the same sizes), the two taking turns. ``prefix_cache``: ``on``, ``off`` or
    ``both`` (off, then on, at each batch size)."""
    engine = load_model(folder, precision=precision, device=device, config=engine_config,
                        tensor_parallel=tensor_parallel)  # fmt: skip
    workload = mixed_workload(engine, requests, seed=seed, shared_prefix=shared_prefix)
    caching = {"on": [True], "off": [False], "both": [False, True]}[prefix_cache]
    hf = HFRunner(folder, precision, torch.device(device)) if compare_hf else None
    hf_sizes = list(batch_sizes if hf_batch_sizes is None else hf_batch_sizes)
    results: list[WorkloadResult] = []
    for b in sorted(set(batch_sizes) | (set(hf_sizes) if hf is not None else set())):
        if b in batch_sizes:
            for on in caching:
                log(f"infersight, max batch size {b}, prefix cache {'on' if on else 'off'}")
                engine.set_prefix_caching(on)
                results.append(run_workload(engine, workload, b))
        if hf is not None and b in hf_sizes:
            log(f"transformers, static batches of {b}")
            results.append(run_workload_hf(hf, workload, b))
    report: dict[str, Any] = {
        "model": str(folder),
        "precision": precision,
        "device": device,
        "threads": torch.get_num_threads(),
        "requests": requests,
        "seed": seed,
        "shared_prefix": shared_prefix,
        "kv_blocks": engine.kv.manager.num_blocks,
        "block_size": engine.kv.block_size,
        "results": [asdict(r) for r in results],
    }
    if prefix_cache == "both":  # on / off at each batch size, measured one after the other
        off = {r.max_batch_size: r for r in results if r.prefix_caching is False}
        report["prefix_cache_on_vs_off"] = {
            r.max_batch_size: {
                "output_tok_s": r.output_tok_s / off[r.max_batch_size].output_tok_s,
                "ttft_p50": r.ttft_p50_s / off[r.max_batch_size].ttft_p50_s,
            }
            for r in results
            if r.prefix_caching
        }
    # the comparisons below take our runs with the cache as set last (on, with "both")
    ours = {r.max_batch_size: r for r in results if r.engine == "infersight"}
    if 1 in ours:
        report["speedup_vs_batch1"] = {
            b: r.output_tok_s / ours[1].output_tok_s for b, r in ours.items()
        }
    if hf is not None:
        theirs = {r.max_batch_size: r for r in results if r.engine == "transformers"}
        report["ratio_vs_transformers"] = {
            b: ours[b].output_tok_s / theirs[b].output_tok_s for b in ours if b in theirs
        }
        if ours and theirs:  # each engine at its own best batch size
            best_ours = max(ours.values(), key=lambda r: r.output_tok_s)
            best_theirs = max(theirs.values(), key=lambda r: r.output_tok_s)
            report["best_vs_best_transformers"] = {
                "ours": best_ours.max_batch_size, "transformers": best_theirs.max_batch_size,
                "ratio": best_ours.output_tok_s / best_theirs.output_tok_s,
                "transformers_precision": hf.precision,
            }  # fmt: skip
    if 1 in ours:
        best_ours = max(ours.values(), key=lambda r: r.output_tok_s)
        ratio = best_ours.output_tok_s / ours[1].output_tok_s
        report["best_vs_batch1"] = {"batch": best_ours.max_batch_size, "ratio": ratio}
    return report
