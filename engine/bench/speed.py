"""The harness behind ``infersight bench``: prefill and decode speed, latency and memory,
optionally side by side with transformers' ``generate`` on the same folder and prompt ids.

Runs alternate (ours, theirs, ours, theirs, …) so that a noisy shared machine hurts both
alike, and each figure is the median over the repeats. Every run of ours starts with an empty
prefix cache (:func:`run_ours`): the single workload repeats one prompt, which prefix caching
would otherwise find cached from the second run on and time a prefill it did not compute. The
mixed workload empties it before each run too (:func:`engine.bench.workload.run_workload`); its
``--prefix-cache`` and ``--shared-prefix``, like the chat workload (:mod:`engine.bench.chat`),
measure caching itself, and their reports say so.

This module holds the single workload (:func:`run_bench`) and what the other workloads share
with it: the timing of one run, the prompt, transformers' runner. The mixed workload is
:mod:`engine.bench.workload`, the table against llama.cpp :mod:`engine.bench.table`, and the
reports' text :mod:`engine.bench.report`.
"""

from __future__ import annotations

import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from engine.core.engine import LLMEngine
from engine.core.sampling import SamplingParams
from engine.errors import InfersightError
from engine.hardware import verdicts
from engine.loader.load import load_model
from engine.model.inventory import weight_bytes
from engine.quant.spec import parse_precision_spec


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


def _kv_sibling(engine: LLMEngine, kv_dtype: str) -> LLMEngine:
    """The same weights behind a pool of ``kv_dtype`` of ``engine``'s bytes (not one profiled
    beside it), its decode steps set up as ``engine``'s were (CUDA graphs captured where they
    are on)."""
    config = replace(engine.config, kv_dtype=kv_dtype, kv_memory=float(engine.kv.nbytes),
                     num_blocks=None)  # fmt: skip
    sibling = engine.sibling(config)
    sibling.settle_cuda_graphs()
    return sibling


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


class HFRunner:
    """transformers' own ``generate`` on the same folder: the oracle's speed (dev extra)."""

    def __init__(self, folder: Path, precision: str, device: torch.device) -> None:
        try:
            from transformers import AutoModelForCausalLM
        except ImportError as exc:
            raise InfersightError(
                "--compare-hf needs transformers, a dev extra: pip install -e '.[dev]'"
            ) from exc
        self.device = device
        spec = parse_precision_spec(precision)
        #: what transformers runs: the same float precision, and for a quantized one fp32, the
        #: model as published (it has none of our formats: the baseline a user starts from)
        self.precision = "fp32" if spec.quantized else spec.text
        dtype = torch.float32 if spec.quantized else spec.compute
        model: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
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
    tensor_parallel: int = 1,
    kv_dtypes: list[str] | None = None,
) -> dict[str, Any]:
    """The single workload: one prompt's prefill and decode, medians over ``cfg.repeats``
    runs; with ``compare_hf``, transformers' ``generate`` in turn with ours; with ``kv_dtypes``
    (``--kv-dtypes auto int8``), the same weights behind a KV cache of each dtype, in turn
    within each repeat (the ratios: each against the first)."""
    torch_device = torch.device(device)
    if compare_hf and cfg.batch != 1:
        raise InfersightError("--compare-hf times transformers at --batch 1 only")
    if kv_dtypes and engine_config is not None:
        engine_config = replace(engine_config, kv_dtype=kv_dtypes[0])
    engine = load_model(folder, precision=precision, device=device, config=engine_config,
                        tensor_parallel=tensor_parallel)  # fmt: skip
    engines = [engine] + [_kv_sibling(engine, name) for name in (kv_dtypes or [])[1:]]
    prompt = bench_prompt(engine, cfg.prompt_len, cfg.seed)
    hf = HFRunner(folder, precision, torch_device) if compare_hf else None

    ours: list[list[RunTiming]] = [[] for _ in engines]
    theirs: list[RunTiming] = []
    for e in engines:
        run_ours(e, prompt, min(8, cfg.new_tokens), cfg.batch)  # warm-up
    if hf is not None:
        hf.run(prompt, min(8, cfg.new_tokens))
    for i in range(cfg.repeats):
        for e, runs in zip(engines, ours, strict=True):
            log(f"repeat {i + 1}/{cfg.repeats}: infersight, KV {e.kv.format.name}")
            runs.append(run_ours(e, prompt, cfg.new_tokens, cfg.batch))
        if hf is not None:
            log(f"repeat {i + 1}/{cfg.repeats}: transformers")
            theirs.append(hf.run(prompt, cfg.new_tokens))

    peak = _peak_mem_mib(torch_device)
    name = "infersight" if len(engines) == 1 else "infersight, KV {}"
    results = [
        BenchResult.from_runs(name.format(e.kv.format.name), cfg, runs, peak)
        for e, runs in zip(engines, ours, strict=True)
    ]
    if hf is not None:
        results.append(BenchResult.from_runs("transformers", cfg, theirs, peak))
    report: dict[str, Any] = {
        "model": str(folder),
        "precision": precision,
        "device": device,
        "threads": torch.get_num_threads(),
        "tensor_parallel": tensor_parallel,
        "repeats": cfg.repeats,
        "weights_mib": weight_bytes(engine.model) / 2**20,
        "weights_vs_fp16": weight_bytes(engine.model) / (2 * engine.num_parameters),
        "prefix_cache": prefix_cache_state(engine),
        # of the timed requests' prompts over the measured runs, found cached: 0 (run_ours)
        "cached_prompt_tokens": sum(r.cached_prompt_tokens for runs in ours for r in runs),
        # the kernel verdicts kept on this machine, every build (`infersight kernels`)
        "kernel_verdicts": verdicts.this_machine(),
        "results": [asdict(r) for r in results],
    }
    if len(engines) > 1:  # each KV cache's decode and prefill against the first's
        report["kv_ratios"] = {
            e.kv.format.name: {
                "decode": r.decode_tok_s / results[0].decode_tok_s,
                "prefill": r.prefill_tok_s / results[0].prefill_tok_s,
            }
            for e, r in zip(engines[1:], results[1 : len(engines)], strict=True)
        }
    if hf is not None:  # transformers' figures are the last row
        report["ratio_decode"] = results[0].decode_tok_s / results[-1].decode_tok_s
        report["ratio_prefill"] = results[0].prefill_tok_s / results[-1].prefill_tok_s
    return report
