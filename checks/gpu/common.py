"""What the GPU checks share: the shapes and workloads (:data:`GPU`, :data:`QUICK`, :data:`DRY`),
the device's memory (its peak, the 12 GB card emulated), plans and pools, greedy ids and the
tie rule every comparison of them takes (:func:`parting`), and the record of what ran
(:func:`ran`: the kernels and step path of an engine, checked against what a check claims)."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import platform
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from engine.bench.speed import BenchConfig, BenchResult, RunTiming, run_ours
from engine.core.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.core.sampling import SamplingParams
from engine.errors import InvalidRequestError
from engine.loader.memory_plan import CUDA_RUNTIME_BYTES, MemoryPlan, plan_memory
from engine.loader.memory_terms import kv_bytes_per_token
from engine.model.config import ModelConfig
from engine.quant.spec import parse_precision_spec

ROOT = Path(__file__).resolve().parents[2]
SHAPES = ROOT / "resources" / "configs" / "llama-3.1-8b.json"
#: The whole run's budget: a lent GPU's time is 15 minutes in all, starts and reruns
#: included, and one command runs at most 10; ``--quick`` fits 5 minutes.
BUDGET_S = 480
QUICK_BUDGET_S = 300
#: The card the 12 GB checks emulate on a bigger GPU
#: (``torch.cuda.set_per_process_memory_fraction``): an RTX 3060/4070's 12 GiB.
CARD_BYTES = 12 * 2**30
#: The 12 GB card's choice first, then by size; what the device refuses or cannot fit is skipped.
PRECISIONS = ("int4-g32+head", "int4-g32", "int8+head", "int8", "bf16", "fp16", "fp32")
#: The precision the one-engine checks (out of memory, compiled, worker) run: the first native.
TWELVE_GB = ("int4-g32+head", "int8+head")
PLAN_TOLERANCE = 0.10  # the plan's peak against max_memory_allocated
BANDWIDTH_SLACK = 1.05  # decode above the bandwidth limit by more: a figure is wrong
BATCH_GAIN = 2.0  # a batch of 16 decodes at least this many times batch 1's tokens a second
#: Greedy ids part at a tie when the two tokens' log-probabilities differ by less than this
#: share of the logits' standard deviation at that position.
TIE_FRACTION = 0.05
GiB, MiB = 2**30, 2**20


def eight_b() -> dict[str, Any]:
    raw = json.loads(SHAPES.read_text())
    return {k: v for k, v in raw.items() if not k.startswith("_")}


def tiny() -> dict[str, Any]:
    """Llama-3.1-8B's config at tiny widths (its RoPE scaling kept, scaled down)."""
    rope = {**eight_b()["rope_scaling"], "original_max_position_embeddings": 256}
    return eight_b() | dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_scaling=rope,
        bos_token_id=0,
        eos_token_id=[1],
    )


@dataclass(frozen=True, slots=True)
class Scale:
    """What a run uses: the model's shapes and the workload."""

    name: str
    raw: dict[str, Any]  # config.json's contents
    prompt_tokens: int  # the long prompt, prefilled with batch - 1 copies of it
    batch: int
    batch_tokens: int  # new tokens of each request of the batch
    short_prompt: int  # batch-1 decode's prompt
    decode_tokens: int  # batch-1 decode's new tokens, per repeat
    repeats: int
    bandwidth_mib: int
    compare_tokens: int  # greedy ids compared between two runs
    compiled_layers: int
    margin_mib: int  # the server's margin for recovering from running out of memory

    def describe(self) -> dict[str, Any]:
        cfg = ModelConfig.from_dict(self.raw)
        return {
            "model": self.name,
            "layers": cfg.num_layers,
            "hidden": cfg.hidden_size,
            "intermediate": cfg.intermediate_size,
            "heads": cfg.num_heads,
            "kv_heads": cfg.num_kv_heads,
            "vocab": cfg.vocab_size,
            "prompt_tokens": self.prompt_tokens,
            "batch": self.batch,
            "batch_new_tokens": self.batch_tokens,
            "decode_prompt_tokens": self.short_prompt,
            "decode_new_tokens": self.decode_tokens,
            "repeats": self.repeats,
        }


GPU = Scale(
    "llama-3.1-8b (synthetic)",
    eight_b(),
    prompt_tokens=4096,
    batch=16,
    batch_tokens=32,
    short_prompt=128,
    decode_tokens=64,
    repeats=3,
    bandwidth_mib=2048,
    compare_tokens=32,
    compiled_layers=4,
    margin_mib=256,
)
DRY = Scale(
    "tiny llama (synthetic, dry run)",
    tiny(),
    prompt_tokens=64,
    batch=4,
    batch_tokens=8,
    short_prompt=16,
    decode_tokens=4,
    repeats=1,
    bandwidth_mib=64,
    compare_tokens=8,
    compiled_layers=2,
    margin_mib=1,
)


class Skip(Exception):
    """A check that does not apply here (a precision the device refuses or cannot fit, a
    package not installed): reported as skipped, with why."""


def expect(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


# -- the device ---------------------------------------------------------------------------------


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "device": str(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "transformers": _version("transformers"),
        "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        free, total = torch.cuda.mem_get_info(device)
        env.update(
            name=props.name,
            capability=f"{props.major}.{props.minor}",
            cuda=torch.version.cuda,
            multiprocessors=props.multi_processor_count,
            total_bytes=total,
            free_bytes=free,
        )
    else:
        from engine.hardware.cpu_paths import cpu_paths

        env.update(
            name=platform.machine(),
            cpu_paths=cpu_paths().summary(),
            threads=torch.get_num_threads(),
        )
    return env


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def release(device: torch.device) -> None:
    """Hand back what the last check left (its engine, the allocator's cached blocks)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak(device: torch.device) -> int | None:
    """``max_memory_allocated`` since the last reset (None on a CPU: no allocator to ask)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device))


@contextlib.contextmanager
def card(device: torch.device, card_bytes: int | None) -> Iterator[dict[str, Any]]:
    """The allocator held to what a ``card_bytes`` card leaves torch (its memory less the CUDA
    runtime's, as the plan estimates it) for the context; nothing on a CPU or with ``None``."""
    if device.type != "cuda" or card_bytes is None:
        yield {"card_bytes": None}
        return
    total = torch.cuda.get_device_properties(device).total_memory
    allowed = min(1.0, (card_bytes - CUDA_RUNTIME_BYTES) / total)
    release(device)
    torch.cuda.set_per_process_memory_fraction(allowed, device)
    try:
        yield {"card_bytes": card_bytes, "allocator_fraction": round(allowed, 4)}
    finally:
        release(device)
        torch.cuda.set_per_process_memory_fraction(1.0, device)


def ran(engine: LLMEngine) -> dict[str, Any]:
    """What an engine runs, as its load report says: the attention and layer kernels, the
    decode step (compiled or eager), the CUDA graphs, and the path of each quantized layer
    (counted by kernel)."""
    from engine.quant.int4 import Int4Linear
    from engine.quant.int8 import Int8Linear

    layers: dict[str, int] = {}
    off_triton = 0
    for module in engine.model.modules():
        if isinstance(module, (Int8Linear, Int4Linear)):
            key = f"{type(module).__name__}: {module.kernel}"
            layers[key] = layers.get(key, 0) + 1
            off_triton += module.triton is None
    return {
        "kernels": engine.kernels,
        "triton_attention": bool(engine.triton),
        "decode_step": engine.graph.summary(),
        "cuda_graphs": engine.graphs.why,
        "quantized_layers": layers,
        "quantized_off_triton": off_triton,
    }


def ran_paths(engine: LLMEngine) -> dict[str, Any]:
    """What ``engine``'s steps ran so far, from its paths report: the attention backend, the
    steps by kind and executor, and every fallback with its reason."""
    paths = engine.paths()
    return {k: paths[k] for k in ("attention", "steps", "fallbacks")}


def expect_ours(engine: LLMEngine, device: torch.device, figures: dict[str, Any]) -> None:
    """Record what ``engine`` runs (:func:`ran`) and, on a GPU, fail where it is not what the
    GPU checks claim to test: no kernel fallen back after failing its load-time check, our
    Triton attention at fp16/bf16 (fp32 attends in torch by design) and our Triton GEMMs for
    every quantized layer."""
    what = figures["ran"] = ran(engine)
    if device.type != "cuda":
        return
    expect(not engine.kernel_failures, f"kernels failed their checks: {engine.kernel_failures}")
    if engine.dtype != torch.float32:
        expect(what["triton_attention"], f"the attention is not ours: {what['kernels']}")
    expect(
        what["quantized_off_triton"] == 0,
        f"quantized layers off our Triton GEMMs: {what['quantized_layers']} ({what['kernels']})",
    )


def native_choice(device: torch.device) -> str:
    """The 12 GB card's precision where the device runs it natively, else the next."""
    for precision in TWELVE_GB:
        with contextlib.suppress(InvalidRequestError):
            parse_precision_spec(precision, device)
            return precision
    raise Skip(f"{device} runs none of {', '.join(TWELVE_GB)} natively")


def pool_config(
    scale: Scale, raw: dict[str, Any], precision: str, device: torch.device, **changes: Any
) -> EngineConfig:
    """A KV pool twice what the workload holds at once (the long prompt, the batch's new
    tokens with a spare block each, batch-1 decode), so that the plan and the load agree on
    it and it makes sense on a 12 GB card."""
    cfg = ModelConfig.from_dict(raw)
    block = EngineConfig().block_size
    tokens = scale.prompt_tokens + scale.batch * (scale.batch_tokens + 2 * block)
    tokens += scale.short_prompt + scale.decode_tokens
    per_token = kv_bytes_per_token(cfg, parse_precision_spec(precision, device).compute)
    settings: dict[str, Any] = {"kv_memory": 2 * tokens * per_token, "decode_graph": "off"}
    return EngineConfig(**(settings | changes))


def plan_for(
    scale: Scale,
    raw: dict[str, Any],
    precision: str,
    device: torch.device,
    config: EngineConfig,
    memory: int | None = None,
) -> MemoryPlan:
    """The plan of the run's model on ``device``, or on a card of ``memory`` bytes."""
    return plan_memory(
        ModelConfig.from_dict(raw), precision, str(device), config=config, name=scale.name,
        memory=memory,
    )  # fmt: skip


def fitting(scale: Scale, precision: str, device: torch.device) -> dict[str, Any]:
    """The run's config, with its layers halved until the plan says ``precision`` fits (the
    8B in fp16 on a 12 GB card, say); skipped where not even one layer does."""
    raw = scale.raw
    while True:
        plan = plan_for(scale, raw, precision, device, pool_config(scale, raw, precision, device))
        if plan.fits:
            return raw
        if raw["num_hidden_layers"] == 1:
            raise Skip(f"does not fit: {plan.refusal()}")
        raw = raw | {"num_hidden_layers": raw["num_hidden_layers"] // 2}


# -- greedy ids ---------------------------------------------------------------------------------


def greedy(engine: LLMEngine, prompt: list[int], tokens: int) -> list[int]:
    gen = engine.generate(prompt, SamplingParams(max_new_tokens=tokens, temperature=0.0))
    for _ in gen:
        pass
    return gen.result.token_ids


LogProbs = Callable[[list[int]], torch.Tensor]  # output so far → next token's log-probabilities


def parting(ours: list[int], theirs: list[int], logprobs: LogProbs) -> dict[str, Any]:
    """Where two greedy continuations of one prompt part, and whether at a tie: the two
    tokens' log-probabilities there (``logprobs`` of the common output) lie within
    :data:`TIE_FRACTION` of the logits' standard deviation."""
    compared = min(len(ours), len(theirs))
    same = next((i for i in range(compared) if ours[i] != theirs[i]), compared)
    out: dict[str, Any] = {"compared": compared, "same": same, "agree": same == compared}
    if same < compared:
        lp = logprobs(ours[:same]).float()
        gap = float((lp[ours[same]] - lp[theirs[same]]).abs())
        spread = float(lp[torch.isfinite(lp)].std())
        out.update(gap=round(gap, 5), spread=round(spread, 5))
        out["agree"] = gap <= TIE_FRACTION * spread
    return out


def our_logprobs(engine: LLMEngine, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The engine's next-token log-probabilities after ``prompt + output`` (teacher-forced)."""
    from engine.evals.scoring import score

    return score(engine, prompt, [*output, 0])[-1]


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm())


# -- our Triton kernels and CUDA graphs (issue 28's targets) ---------------------------------

#: Targets, reported as met or not (a figure below one is a finding, not a failed check).
GRAPH_GAIN = 1.5  # CUDA graphs against eager steps, batch-1 decode of the 135M shapes
LONG_CONTEXT = 0.85  # decode at LONG tokens of context against SHORT, the 8B at int4-g32+head
SHORT, LONG = 512, 8192


def smollm2() -> dict[str, Any]:
    """SmolLM2-135M's shapes (the default model's): 30 layers, heads 64 wide, tied."""
    return eight_b() | dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
        tie_word_embeddings=True, rope_theta=100000.0, rope_scaling=None, bos_token_id=1,
        eos_token_id=[2],
    )  # fmt: skip


def wide_tiny() -> dict[str, Any]:
    """The dry run's model with heads 64 wide, as our attention kernels are built for."""
    return tiny() | dict(num_attention_heads=2, num_key_value_heads=1, head_dim=64)


@contextlib.contextmanager
def kernels(choice: str) -> Iterator[None]:
    """Loads inside take ``INFERSIGHT_KERNELS=choice``."""
    before = os.environ.get("INFERSIGHT_KERNELS")
    os.environ["INFERSIGHT_KERNELS"] = choice
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("INFERSIGHT_KERNELS", None)
        else:
            os.environ["INFERSIGHT_KERNELS"] = before


def decode_speed(engine: LLMEngine, prompt: list[int], scale: Scale) -> float:
    """Batch-1 decode tok/s after a warm-up, the median of the scale's repeats."""
    run_ours(engine, prompt, min(8, scale.decode_tokens))
    runs = [run_ours(engine, prompt, scale.decode_tokens) for _ in range(scale.repeats)]
    config = BenchConfig(len(prompt), scale.decode_tokens, scale.repeats)
    return BenchResult.from_runs("infersight", config, runs, 0.0).decode_tok_s


def decode_figures(scale: Scale, runs: list[RunTiming], prompt_len: int) -> dict[str, Any]:
    result = BenchResult.from_runs(
        "", BenchConfig(prompt_len, scale.decode_tokens, scale.repeats), runs, 0.0
    )
    return {
        "decode_tok_s": result.decode_tok_s,
        "tpot_ms": result.tpot_ms,
        "ttft_ms": result.ttft_ms,
    }
