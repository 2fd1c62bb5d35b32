"""The harness behind ``infersight bench``: prefill and decode speed, latency and memory,
optionally side by side with transformers' ``generate`` on the same folder and prompt ids.

Runs alternate (ours, theirs, ours, theirs, …) so that a noisy shared machine hurts both
alike, and each figure is the median over the repeats.
"""

from __future__ import annotations

import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from engine.engine import LLMEngine, parse_precision
from engine.errors import InfersightError
from engine.sampling import SamplingParams
from engine.weights import weight_bytes


@dataclass(frozen=True, slots=True)
class BenchConfig:
    prompt_len: int = 32
    new_tokens: int = 128
    repeats: int = 3
    seed: int = 0


@dataclass(slots=True)
class RunTiming:
    ttft_s: float
    decode_s: float  # first token → last token
    new_tokens: int


@dataclass(slots=True)
class BenchResult:
    engine: str
    prompt_len: int
    new_tokens: int
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
        tpot = statistics.median(r.decode_s / max(r.new_tokens - 1, 1) for r in runs)
        return cls(
            engine=engine,
            prompt_len=cfg.prompt_len,
            new_tokens=cfg.new_tokens,
            prefill_tok_s=cfg.prompt_len / ttft,
            decode_tok_s=1.0 / tpot,
            ttft_ms=ttft * 1e3,
            tpot_ms=tpot * 1e3,
            peak_mem_mib=peak_mib,
        )


def bench_prompt(engine: LLMEngine, length: int, seed: int) -> list[int]:
    """A reproducible prompt of ``length`` ordinary (non-special) token ids."""
    gen = torch.Generator().manual_seed(seed)
    low = max(engine.eos_token_ids | {engine.cfg.bos_token_id or 0}) + 1
    return torch.randint(low, engine.cfg.vocab_size, (length,), generator=gen).tolist()


def run_ours(engine: LLMEngine, prompt: list[int], new_tokens: int) -> RunTiming:
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    gen = engine.generate(prompt, params)
    started = time.perf_counter()
    first = None
    for _ in gen:
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None
    return RunTiming(first - started, end - first, len(gen.result.token_ids))


def _peak_rss_mib() -> float:
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / (2**20 if sys.platform == "darwin" else 2**10)


def _peak_mem_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return _peak_rss_mib()


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
        model: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=parse_precision(precision))
        self.model = model.to(device).eval()

    def run(self, prompt: list[int], new_tokens: int) -> RunTiming:
        stamps: list[float] = []

        class Stamp:  # transformers' streamer protocol: put() per step, end() at the end
            def put(self, value: Any) -> None:
                stamps.append(time.perf_counter())

            def end(self) -> None:
                pass

        ids = torch.tensor([prompt], device=self.device)
        started = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                streamer=Stamp(),
                pad_token_id=0,
            )
        end = time.perf_counter()
        first = stamps[1]  # stamps[0] is the prompt being "put"
        return RunTiming(first - started, end - first, len(stamps) - 1)


def run_bench(
    folder: Path,
    cfg: BenchConfig,
    *,
    precision: str = "fp32",
    device: str = "cpu",
    compare_hf: bool = False,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    torch_device = torch.device(device)
    engine = LLMEngine.load(folder, precision=precision, device=device)
    prompt = bench_prompt(engine, cfg.prompt_len, cfg.seed)
    hf = _HFRunner(folder, precision, torch_device) if compare_hf else None

    ours: list[RunTiming] = []
    theirs: list[RunTiming] = []
    run_ours(engine, prompt, min(8, cfg.new_tokens))  # warm-up: allocator, kernels, caches
    if hf is not None:
        hf.run(prompt, min(8, cfg.new_tokens))
    for i in range(cfg.repeats):
        log(f"repeat {i + 1}/{cfg.repeats}: infersight")
        ours.append(run_ours(engine, prompt, cfg.new_tokens))
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
    cols = ["engine", "prompt", "new", "prefill tok/s", "decode tok/s", "TTFT ms", "TPOT ms"]
    rows = [
        [
            r["engine"], str(r["prompt_len"]), str(r["new_tokens"]), f"{r['prefill_tok_s']:.1f}",
            f"{r['decode_tok_s']:.1f}", f"{r['ttft_ms']:.1f}", f"{r['tpot_ms']:.2f}",
        ]
        for r in report["results"]
    ]  # fmt: skip
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    lines = [head, "  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in rows]
    peak_name = "peak CUDA allocated" if report["device"].startswith("cuda") else "peak RSS"
    lines.append(
        f"weights {report['weights_mib']:.0f} MiB; process {peak_name} "
        f"{report['results'][0]['peak_mem_mib']:.0f} MiB"
    )
    if "ratio_decode" in report:
        lines.append(
            f"infersight / transformers: decode {report['ratio_decode']:.2f}x, "
            f"prefill {report['ratio_prefill']:.2f}x"
        )
    return "\n".join(lines)
