"""The harness behind ``infersight bench``: prefill and decode speed, latency and memory,
optionally side by side with transformers' ``generate`` on the same folder and prompt ids.

Runs alternate (ours, theirs, ours, theirs, …) so that a noisy shared machine hurts both
alike, and each figure is the median over the repeats. Every run of ours starts with an empty
prefix cache (:func:`run_ours`): the single workload repeats one prompt, which prefix caching
would otherwise find cached from the second run on and time a prefill it did not compute. The
mixed workload empties it before each run too (:func:`run_workload`); its ``--prefix-cache``
and ``--shared-prefix``, like the chat workload (:mod:`engine.bench.chat`), measure caching
itself, and their reports say so.
"""

from __future__ import annotations

import contextlib
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from engine.core.engine import LLMEngine, parse_precision
from engine.core.metrics import percentiles
from engine.core.sampling import SamplingParams
from engine.errors import InfersightError
from engine.loader.load import load_model
from engine.loader.weights import weight_bytes


@dataclass(frozen=True, slots=True)
class BenchConfig:
    prompt_len: int = 32
    new_tokens: int = 128
    repeats: int = 3
    seed: int = 0
    batch: int = 1  # identical requests decoding together


@dataclass(slots=True)
class RunTiming:
    ttft_s: float
    decode_s: float  # first token → last token
    new_tokens: int  # all requests together
    batch: int = 1
    cached_prompt_tokens: int = 0  # of the timed (first) request's prompt: found, not computed


@dataclass(slots=True)
class BenchResult:
    engine: str
    prompt_len: int
    new_tokens: int
    batch: int
    prefill_tok_s: float
    decode_tok_s: float
    ttft_ms: float
    tpot_ms: float
    peak_mem_mib: float

    @classmethod
    def from_runs(
        cls, engine: str, cfg: BenchConfig, runs: list[RunTiming], peak_mib: float
    ) -> BenchResult:
        ttft = statistics.median(r.ttft_s for r in runs)
        # Per request: the gap between its tokens; together: tokens after each first token.
        tpot = statistics.median(r.decode_s / max(r.new_tokens // r.batch - 1, 1) for r in runs)
        decode = statistics.median((r.new_tokens - r.batch) / r.decode_s for r in runs)
        return cls(
            engine=engine,
            prompt_len=cfg.prompt_len,
            new_tokens=cfg.new_tokens,
            batch=cfg.batch,
            prefill_tok_s=cfg.prompt_len / ttft,
            decode_tok_s=decode,
            ttft_ms=ttft * 1e3,
            tpot_ms=tpot * 1e3,
            peak_mem_mib=peak_mib,
        )


def bench_prompt(engine: LLMEngine, length: int, seed: int) -> list[int]:
    """A reproducible prompt of ``length`` ordinary (non-special) token ids."""
    gen = torch.Generator().manual_seed(seed)
    low = max(engine.eos_token_ids | {engine.cfg.bos_token_id or 0}) + 1
    return torch.randint(low, engine.cfg.vocab_size, (length,), generator=gen).tolist()


def run_ours(engine: LLMEngine, prompt: list[int], new_tokens: int, batch: int = 1) -> RunTiming:
    """``batch`` copies of the request at once; TTFT is the first request's, decode spans
    from the first token to the last of all, and ``new_tokens`` counts them all.

    The prefix cache is emptied first, so that the first request computes its whole prompt
    however often this prompt ran before (``cached_prompt_tokens`` counts what it found cached:
    0). With prefix caching on, the other copies share the first's full prompt blocks as they
    are computed (they wait for them): the copies of one run are one prompt, computed once."""
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    engine.update_limits(max_batch_size=max(batch, engine.scheduler.limits.max_batch_size))
    engine.clear_prefix_cache()
    started = time.perf_counter()
    timed = engine.add_request(prompt, params)
    for _ in range(batch - 1):
        engine.add_request(prompt, params)
    first = None
    produced = 0
    while engine.has_work():
        for event in engine.step():
            if event.token_id is not None:
                produced += 1
                if first is None:
                    first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None
    metrics = engine.request_metrics(timed)
    cached = metrics.cached_prompt_tokens if metrics is not None else 0
    return RunTiming(first - started, end - first, produced, batch, cached)


def prefix_cache_state(engine: LLMEngine) -> str:
    """How :func:`run_ours` leaves prefix caching, for a report."""
    return "on, emptied before each run" if engine.kv.manager.prefix_caching else "off"


def _peak_rss_mib() -> float:
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / (2**20 if sys.platform == "darwin" else 2**10)


def _peak_mem_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return _peak_rss_mib()


class _BatchStreamer:
    """transformers' streamer protocol, batch-tolerant: a time stamp per ``put``."""

    def __init__(self, stamps: list[float]) -> None:
        self.stamps = stamps

    def put(self, value: Any) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


class _HFRunner:
    """transformers' own ``generate`` on the same folder: the oracle's speed (dev extra)."""

    def __init__(self, folder: Path, precision: str, device: torch.device) -> None:
        try:
            from transformers import AutoModelForCausalLM
        except ImportError as exc:
            raise InfersightError(
                "--compare-hf needs transformers, a dev extra: pip install -e '.[dev]'"
            ) from exc
        self.device = device
        spec = parse_precision(precision)
        if spec.quantized:
            raise InfersightError(
                f"--compare-hf runs transformers in fp32, bf16 or fp16, not {precision!r}"
            )
        model: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=spec.compute)
        self.model = model.to(device).eval()

    def run(self, prompt: list[int], new_tokens: int) -> RunTiming:
        ids = torch.tensor([prompt], device=self.device)
        stamps = self.run_batch(ids, torch.ones_like(ids), new_tokens)
        started, first, last = stamps[0], stamps[1], stamps[-1]
        return RunTiming(first - started, last - first, len(stamps) - 1)

    def run_batch(self, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int) -> list[float]:
        """Greedy ``generate`` of exactly ``new_tokens`` for a padded batch; returns the start
        time followed by the time each new token (step) arrived."""
        stamps: list[float] = []
        started = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(
                ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                do_sample=False, streamer=_BatchStreamer(stamps), pad_token_id=0,
            )  # fmt: skip
        return [started, *stamps[1:]]


def run_bench(
    folder: Path,
    cfg: BenchConfig,
    *,
    precision: str = "fp32",
    device: str = "cpu",
    compare_hf: bool = False,
    engine_config: Any = None,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    torch_device = torch.device(device)
    if compare_hf and cfg.batch != 1:
        raise InfersightError("--compare-hf times transformers at --batch 1 only")
    engine = load_model(folder, precision=precision, device=device, config=engine_config)
    prompt = bench_prompt(engine, cfg.prompt_len, cfg.seed)
    hf = _HFRunner(folder, precision, torch_device) if compare_hf else None

    ours: list[RunTiming] = []
    theirs: list[RunTiming] = []
    run_ours(engine, prompt, min(8, cfg.new_tokens), cfg.batch)  # warm-up
    if hf is not None:
        hf.run(prompt, min(8, cfg.new_tokens))
    for i in range(cfg.repeats):
        log(f"repeat {i + 1}/{cfg.repeats}: infersight")
        ours.append(run_ours(engine, prompt, cfg.new_tokens, cfg.batch))
        if hf is not None:
            log(f"repeat {i + 1}/{cfg.repeats}: transformers")
            theirs.append(hf.run(prompt, cfg.new_tokens))

    peak = _peak_mem_mib(torch_device)
    results = [BenchResult.from_runs("infersight", cfg, ours, peak)]
    if hf is not None:
        results.append(BenchResult.from_runs("transformers", cfg, theirs, peak))
    report: dict[str, Any] = {
        "model": str(folder),
        "precision": precision,
        "device": device,
        "threads": torch.get_num_threads(),
        "repeats": cfg.repeats,
        "weights_mib": weight_bytes(engine.model) / 2**20,
        "weights_vs_fp16": weight_bytes(engine.model) / (2 * engine.num_parameters),
        "prefix_cache": prefix_cache_state(engine),
        # of the timed requests' prompts over the measured runs, found cached: 0 (run_ours)
        "cached_prompt_tokens": sum(r.cached_prompt_tokens for r in ours),
        "results": [asdict(r) for r in results],
    }
    if hf is not None:
        report["ratio_decode"] = results[0].decode_tok_s / results[1].decode_tok_s
        report["ratio_prefill"] = results[0].prefill_tok_s / results[1].prefill_tok_s
    return report


def format_report(report: dict[str, Any]) -> str:
    head = (
        f"model {report['model']}  precision {report['precision']}  device {report['device']}  "
        f"threads {report['threads']}  median of {report['repeats']}"
    )
    cols = ["engine", "batch", "prompt", "new", "prefill tok/s", "decode tok/s", "TTFT ms",
            "TPOT ms"]  # fmt: skip
    rows = [
        [
            r["engine"], str(r["batch"]), str(r["prompt_len"]), str(r["new_tokens"]),
            f"{r['prefill_tok_s']:.1f}",
            f"{r['decode_tok_s']:.1f}", f"{r['ttft_ms']:.1f}", f"{r['tpot_ms']:.2f}",
        ]
        for r in report["results"]
    ]  # fmt: skip
    lines = [head, *text_table(cols, rows)]
    peak_name = "peak CUDA allocated" if report["device"].startswith("cuda") else "peak RSS"
    lines.append(
        f"weights {report['weights_mib']:.0f} MiB ({report['weights_vs_fp16']:.2f}× fp16); "
        f"process {peak_name} "
        f"{report['results'][0]['peak_mem_mib']:.0f} MiB"
    )
    if "prefix_cache" in report:
        batch = report["results"][0]["batch"]
        lines.append(
            f"prefix cache {report['prefix_cache']}: the timed prefills found "
            f"{report['cached_prompt_tokens']} of their prompt tokens cached"
            + _copies_note(batch, report["prefix_cache"] != "off")
        )
    if "ratio_decode" in report:
        lines.append(
            f"infersight / transformers: decode {report['ratio_decode']:.2f}x, "
            f"prefill {report['ratio_prefill']:.2f}x"
        )
    return "\n".join(lines)


def _copies_note(batch: int, caching: bool) -> str:
    """What the other copies of a ``batch`` run do to the first request's prefill figures."""
    if batch == 1:
        return ""
    others = f"; the {batch - 1} other copies of a run's first request"
    timed = "(prefill and TTFT time the first request)"
    if caching:
        return f"{others} share its prompt blocks as it computes them {timed}"
    return f"{others} compute their prompts in its steps where they fit {timed}"


def text_table(cols: list[str], rows: list[list[str]]) -> list[str]:
    """A header line and one line per row, every column right-aligned to its widest cell."""
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    return ["  ".join(v.rjust(w) for v, w in zip(line, widths, strict=True))
            for line in (cols, *rows)]  # fmt: skip


# -- the mixed workload: continuous batching vs batch 1 vs transformers' static batching -------


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
    hf: _HFRunner, workload: list[WorkloadRequest], batch_size: int
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
) -> dict[str, Any]:
    """The mixed workload through our continuous batching at each of ``batch_sizes`` and,
    with ``compare_hf``, through transformers' static batching at each of ``hf_batch_sizes``
    (default: the same sizes), the two taking turns. ``prefix_cache``: ``on``, ``off`` or
    ``both`` (off, then on, at each batch size)."""
    engine = load_model(folder, precision=precision, device=device, config=engine_config)
    workload = mixed_workload(engine, requests, seed=seed, shared_prefix=shared_prefix)
    caching = {"on": [True], "off": [False], "both": [False, True]}[prefix_cache]
    hf = _HFRunner(folder, precision, torch.device(device)) if compare_hf else None
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
            }  # fmt: skip
    if 1 in ours:
        best_ours = max(ours.values(), key=lambda r: r.output_tok_s)
        ratio = best_ours.output_tok_s / ours[1].output_tok_s
        report["best_vs_batch1"] = {"batch": best_ours.max_batch_size, "ratio": ratio}
    return report


def format_workload_report(report: dict[str, Any]) -> str:
    lines = [
        f"model {report['model']}  precision {report['precision']}  device {report['device']}  "
        f"threads {report['threads']}  {report['requests']} requests (seed {report['seed']}), "
        f"KV pool {report['kv_blocks']} blocks × {report['block_size']}"
        + (f", a shared prefix of {report['shared_prefix']} tokens"
           if report.get("shared_prefix") else "")
    ]  # fmt: skip
    cols = ["engine", "batch", "prefix cache", "out tok/s", "total tok/s", "TTFT p50/p95/p99 s",
            "TPOT p50/p95/p99 ms", "peak KV", "KV waste", "contig. util", "preempt"]  # fmt: skip
    rows = []
    for r in report["results"]:
        kv = r["peak_kv_usage"] is not None
        cache = "-"
        if r["prefix_caching"] is not None:
            hits = r["cached_prompt_tokens"] / r["prompt_tokens"]
            cache = f"on, {hits:.0%} hit" if r["prefix_caching"] else "off"
        rows.append([
            r["engine"], str(r["max_batch_size"]), cache, f"{r['output_tok_s']:.1f}",
            f"{r['total_tok_s']:.1f}",
            f"{r['ttft_p50_s']:.2f}/{r['ttft_p95_s']:.2f}/{r['ttft_p99_s']:.2f}",
            f"{r['tpot_p50_s'] * 1e3:.0f}/{r['tpot_p95_s'] * 1e3:.0f}/{r['tpot_p99_s'] * 1e3:.0f}",
            f"{r['peak_kv_usage']:.0%}" if kv else "-",
            f"{r['mean_kv_waste']:.1%}" if kv else "-",
            f"{r['mean_contiguous_utilisation']:.0%}" if kv else "-",
            str(r["preemptions"]) if kv else "-",
        ])  # fmt: skip
    lines += text_table(cols, rows)
    for key, label in (("speedup_vs_batch1", "vs our batch 1"),
                       ("ratio_vs_transformers", "vs transformers")):  # fmt: skip
        if key in report:
            parts = ", ".join(f"batch {b}: {v:.2f}x" for b, v in report[key].items())
            lines.append(f"output throughput {label}: {parts}")
    for b, ratio in report.get("prefix_cache_on_vs_off", {}).items():
        lines.append(
            f"prefix cache on vs off, batch {b}: output throughput {ratio['output_tok_s']:.2f}x, "
            f"TTFT p50 {ratio['ttft_p50']:.2f}x"
        )
    if "best_vs_batch1" in report:
        b = report["best_vs_batch1"]
        lines.append(f"our best (batch {b['batch']}) vs our batch 1: {b['ratio']:.2f}x")
    if "best_vs_best_transformers" in report:
        b = report["best_vs_best_transformers"]
        lines.append(
            f"our best (batch {b['ours']}) vs transformers' best (static batches of "
            f"{b['transformers']}): {b['ratio']:.2f}x"
        )
    return "\n".join(lines)


# -- the table: each precision against the bandwidth limit and llama.cpp, back to back ---------


def measure_read_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """Memory read bandwidth in bytes/s: the best of ``repeats`` sums over a buffer far larger
    than any cache, on the threads the engine uses (a sum is read-bound on every CPU here)."""
    data = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    data.sum()  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return data.numel() * 4 / best


@dataclass(slots=True)
class TableRow:
    engine: str  # infersight | llama.cpp
    precision: str
    mode: str  # eager | compiled | the GGUF's file type
    read_mib: float  # weights a decode step reads
    decode_tok_s: float
    limit_tok_s: float  # bandwidth / read bytes
    fraction: float  # of the limit
    kernels_tok_s: float | None = None  # the step's matmuls and attention alone


def kernel_floor_ms(engine: LLMEngine, keys: int, repeats: int = 5) -> float:
    """Milliseconds of one batch-1 decode step's kernels with nothing between them: every
    linear of the model (the LM head included) on one token, and one SDPA per layer over
    ``keys`` cached keys, back to back; the best of ``repeats``. No engine built this way can
    decode faster with these kernels: the floor under the Python, dispatch and small ops."""
    from torch.nn.functional import scaled_dot_product_attention

    from engine.loader.weights import linear_modules

    model, cfg = engine.model, engine.cfg
    linears = linear_modules(model)
    widths: list[int] = [getattr(m, "in_features") for m in linears]  # noqa: B009
    inputs = [torch.randn(1, width, dtype=engine.dtype) for width in widths]
    group = cfg.num_heads // cfg.num_kv_heads
    q = torch.randn(1, cfg.num_kv_heads, group, cfg.head_dim, dtype=engine.dtype)
    k = torch.randn(1, cfg.num_kv_heads, keys, cfg.head_dim, dtype=engine.dtype)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first round warms up
            started = time.perf_counter()
            for module, x in zip(linears, inputs, strict=True):
                module(x)
            for _ in range(cfg.num_layers):
                scaled_dot_product_attention(q, k, k)
            best = min(best, time.perf_counter() - started)
    return best * 1e3


class LlamaCppPeer:
    """llama.cpp in its own process and environment (:mod:`engine.bench.llamacpp_peer`): one JSON
    command per line in, one JSON object per line back (other output is passed over); every
    answer has a deadline, and a peer that fails to start or answer is killed."""

    def __init__(self, python: str, gguf: Path, threads: int, timeout_s: float = 600) -> None:
        import queue
        import subprocess
        import threading

        script = Path(__file__).with_name("llamacpp_peer.py")
        self.timeout_s = timeout_s
        try:
            self.proc = subprocess.Popen(
                [python, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
        except OSError as exc:
            raise InfersightError(
                f"cannot start {python} for llama.cpp ({exc.strerror}); give the Python of an "
                "environment with llama-cpp-python (`make bench-peers` builds .peers/venv)"
            ) from None
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.gguf = gguf
        try:
            self.info = str(self._ask("load", str(gguf), threads)["system_info"])
        except BaseException:
            self.close()
            raise

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)  # end of output: the process exited

    def _ask(self, *command: Any) -> dict[str, Any]:
        import json
        import queue
        import time as clock

        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
        except OSError:  # a broken pipe: it has exited already
            raise InfersightError(f"the llama.cpp process exited (asked: {command[0]})") from None
        deadline = clock.monotonic() + self.timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - clock.monotonic()))
            except queue.Empty:  # it hangs: killed at the deadline, not asked to quit
                self.proc.kill()
                self.proc.wait()
                raise InfersightError(
                    f"llama.cpp did not answer {command[0]!r} in {self.timeout_s:.0f} s"
                ) from None
            if line is None:
                raise InfersightError(
                    f"the llama.cpp process exited (asked: {command[0]}); does its Python have "
                    "llama-cpp-python? (`make bench-peers` builds .peers/venv)"
                )
            if line.startswith("{"):
                answer: dict[str, Any] = json.loads(line)
                break
        if "error" in answer:
            raise InfersightError(f"llama.cpp: {answer['error']}")
        return answer

    def quantize(self, dst: Path, ftype: str) -> None:
        self._ask("quantize", str(self.gguf), str(dst), ftype)

    def run(self, prompt: list[int], new_tokens: int) -> RunTiming:
        r = self._ask("run", prompt, new_tokens)
        return RunTiming(r["ttft_s"], r["decode_s"], r["new_tokens"])

    def close(self) -> None:
        """Ask it to quit; kill it if it does not within a few seconds."""
        import subprocess

        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write('["quit"]\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def _decode_tok_s(runs: list[RunTiming]) -> float:
    return statistics.median((r.new_tokens - r.batch) / r.decode_s for r in runs)


def run_table(
    folder: Path,
    precisions: list[str],
    cfg: BenchConfig,
    *,
    engine_config: Any = None,
    llama_python: str | None = None,
    gguf: Path | None = None,
    gguf_types: tuple[str, ...] = ("Q4_1",),
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Batch-1 decode of each precision (eager and, where the load compiled it, compiled),
    llama.cpp on ``gguf`` in each of ``gguf_types`` if ``llama_python`` is given, all in
    turn within every repeat, with the memory read bandwidth measured before and after."""
    from engine.loader.weights import decode_read_bytes

    bandwidth = [measure_read_bandwidth()]
    runners: list[tuple[str, str, str, float, Callable[[list[int], int], RunTiming]]] = []
    prompt: list[int] | None = None
    floors: dict[str, float] = {}
    cache = "off"
    for precision in precisions:
        log(f"loading {precision}")
        engine = load_model(folder, precision=precision, config=engine_config)
        cache = prefix_cache_state(engine)  # the same config for every precision
        prompt = prompt or bench_prompt(engine, cfg.prompt_len, cfg.seed)
        read = float(decode_read_bytes(engine.model))
        floors[precision] = 1e3 / kernel_floor_ms(engine, cfg.prompt_len + cfg.new_tokens // 2)
        modes = ["compiled", "eager"] if engine.graph.compiled else ["eager"]
        for mode in modes:
            runners.append(("infersight", precision, mode, read, _mode_runner(engine, mode)))
    info = None
    with contextlib.ExitStack() as stack:
        if llama_python is not None:
            if gguf is None:
                raise InfersightError("the llama.cpp comparison needs the model's GGUF file")
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="infersight-")))
            threads = torch.get_num_threads()
            for ftype in gguf_types:
                path = gguf
                if ftype != "Q4_1":
                    log(f"llama.cpp: requantizing {gguf.name} to {ftype}")
                    path = tmp / f"{ftype}.gguf"
                    quantizer = LlamaCppPeer(llama_python, gguf, threads)
                    try:
                        quantizer.quantize(path, ftype)
                    finally:
                        quantizer.close()
                peer = LlamaCppPeer(llama_python, path, threads)
                stack.callback(peer.close)
                info = peer.info
                size = float(path.stat().st_size)  # ≈ its weights, each read once per token
                runners.append(("llama.cpp", ftype, "llama.cpp", size, peer.run))
        assert prompt is not None
        timings: list[list[RunTiming]] = [[] for _ in runners]
        for _, _, _, _, run in runners:  # warm-up
            run(prompt, min(8, cfg.new_tokens))
        for i in range(cfg.repeats):
            for (name, precision, mode, _, run), runs in zip(runners, timings, strict=True):
                log(f"repeat {i + 1}/{cfg.repeats}: {name} {precision} {mode}")
                runs.append(run(prompt, cfg.new_tokens))
    bandwidth.append(measure_read_bandwidth())
    best = max(bandwidth)
    rows = []
    for (name, precision, mode, read, _), runs in zip(runners, timings, strict=True):
        tok_s = _decode_tok_s(runs)
        limit = best / read
        floor = floors.get(precision) if name == "infersight" else None
        rows.append(
            TableRow(name, precision, mode, read / 2**20, tok_s, limit, tok_s / limit, floor)
        )
    return {
        "model": str(folder),
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "repeats": cfg.repeats,
        "new_tokens": cfg.new_tokens,
        "bandwidth_gb_s": [b / 1e9 for b in bandwidth],
        "prefix_cache": cache,  # ours (llama.cpp is reset before each run)
        "llama_cpp_system_info": info,
        "rows": [asdict(r) for r in rows],
    }


def _mode_runner(engine: LLMEngine, mode: str) -> Callable[[list[int], int], RunTiming]:
    def run(prompt: list[int], new_tokens: int) -> RunTiming:
        if mode == "eager":
            engine.model.eager_reasons.add("bench: eager row")
        try:
            return run_ours(engine, prompt, new_tokens)
        finally:
            engine.model.eager_reasons.discard("bench: eager row")

    return run


def format_table(report: dict[str, Any]) -> str:
    bw = report["bandwidth_gb_s"]
    lines = [
        f"model {report['model']}  CPU {report['cpu']}  threads {report['threads']}  "
        f"batch 1, {report['new_tokens']} new tokens, median of {report['repeats']}"
        + (f", prefix cache {report['prefix_cache']}" if "prefix_cache" in report else ""),
        f"memory read bandwidth {max(bw):.1f} GB/s (before {bw[0]:.1f}, after {bw[-1]:.1f}); "
        "limit = bandwidth / weights read per token",
    ]
    q4 = [r for r in report["rows"] if r["engine"] == "llama.cpp" and r["precision"] == "Q4_1"]
    cols = ["engine", "precision", "mode", "read MiB", "decode tok/s", "limit tok/s",
            "of limit", "kernels-only tok/s"] + (["vs llama.cpp Q4_1"] if q4 else [])  # fmt: skip
    rows = []
    for r in report["rows"]:
        floor = r.get("kernels_tok_s")
        row = [r["engine"], r["precision"], r["mode"], f"{r['read_mib']:.0f}",
               f"{r['decode_tok_s']:.1f}", f"{r['limit_tok_s']:.0f}",
               f"{r['fraction']:.2f}", "-" if floor is None else f"{floor:.1f}"]  # fmt: skip
        if q4:
            row.append(f"{r['decode_tok_s'] / q4[0]['decode_tok_s']:.2f}x")
        rows.append(row)
    lines += text_table(cols, rows)
    lines.append(
        "kernels-only: the step's matmuls and attention timed back to back with nothing "
        "between them (the floor under Python, dispatch and small ops)"
    )
    if report.get("llama_cpp_system_info"):
        lines.append(f"llama.cpp: {report['llama_cpp_system_info']}")
    return "\n".join(lines)
