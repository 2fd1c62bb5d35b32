"""One precision of the 8B: the load, the workload (a 4k-token prompt with 15 copies decoding
beside it, batch-1 decode), the plan's peak against ``max_memory_allocated``, decode against
the bandwidth limit and the batch's gain; on the 12 GB card emulated, the plan made for that
card and, after the run, the KV pool the engine profiles itself there."""

from __future__ import annotations

import time
from typing import Any

import torch

from checks.gpu.common import (
    BANDWIDTH_SLACK,
    BATCH_GAIN,
    PLAN_TOLERANCE,
    GiB,
    Scale,
    Skip,
    card,
    expect,
    expect_ours,
    peak,
    plan_for,
    pool_config,
    release,
    reset_peak,
)
from engine.bench.speed import BenchConfig, BenchResult, bench_prompt, run_ours
from engine.core.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.errors import InvalidRequestError
from engine.loader.synthetic import build_engine
from engine.quant import sizes
from engine.quant.int8 import Int8Linear
from engine.quant.inventory import decode_read_bytes
from engine.quant.spec import parse_precision_spec

# -- 3. each precision --------------------------------------------------------------------------


def check_precision(
    scale: Scale,
    device: torch.device,
    precision: str,
    state: dict[str, Any],
    card_bytes: int | None,
    figures: dict[str, Any],
) -> None:
    with card(device, card_bytes) as emulated:
        figures["card"] = emulated
        measure_precision(scale, device, precision, state, card_bytes, figures)
        if card_bytes is not None:
            profiled_pool(scale, device, precision, card_bytes, figures)


def measure_precision(
    scale: Scale,
    device: torch.device,
    precision: str,
    state: dict[str, Any],
    card_bytes: int | None,
    figures: dict[str, Any],
) -> None:
    try:
        parse_precision_spec(precision, device)
    except InvalidRequestError as exc:
        raise Skip(f"not native on {device}: {exc}") from None
    config = pool_config(scale, scale.raw, precision, device)
    plan = plan_for(scale, scale.raw, precision, device, config, memory=card_bytes)
    figures["plan"] = {
        "weights_bytes": plan.weight_bytes,
        "kv_pool_bytes": plan.kv_pool_bytes,
        "workspace_bytes": plan.workspace_bytes,
        "load_overhead_bytes": plan.load_overhead_bytes,
        "load_bytes": plan.weight_bytes + plan.runtime_bytes + plan.load_overhead_bytes,
        "steady_bytes": plan.steady_bytes,
        "runtime_bytes": plan.runtime_bytes,
        # what the allocator will hold at the peak: the runtime is the CUDA context's, beside it
        "peak_bytes": plan.peak_bytes - plan.runtime_bytes,
        "budget_bytes": plan.budget_bytes,
        "fits": plan.fits,
    }
    if not plan.fits:
        raise Skip(f"does not fit: {plan.refusal()}")
    release(device)
    reset_peak(device)
    started = time.perf_counter()
    engine = build_engine(scale.raw, precision, str(device), config=config, name=scale.name)
    figures["load_s"] = round(time.perf_counter() - started, 2)
    expect_ours(engine, device, figures)
    load_peak = peak(device)
    reset_peak(device)
    figures.update(weights_bytes=engine.weights_bytes, read_bytes=decode_read_bytes(engine.model))
    # a plan made before a CPU load's timings counts our C kernels' fp32 scales for every INT8
    # layer (the larger of its two forms: engine.quant.sizes.Backends); those whose decode
    # rows the load left to torch's kernel hold none (W8A8 holds fp32 scales either way)
    planned_c = sizes.Backends(triton=plan.triton_gemms, cuda=device.type == "cuda").c_scales()
    unplanned = planned_c * sum(
        4 * m.out_features
        for m in engine.model.modules()
        if type(m) is Int8Linear and not m.c_scales and m.scales.dtype != torch.float32
    )
    workload(engine, scale, figures)
    run_peak = peak(device)
    if device.type == "cuda" and "cuda_runtime_bytes" not in state:
        state["cuda_runtime_bytes"] = cuda_runtime_bytes(device)
    del engine
    release(device)

    weights = figures["weights_bytes"]
    expect(
        abs(plan.weight_bytes - unplanned - weights) <= 0.01 * weights,
        f"the plan counts {plan.weight_bytes} B of weights ({unplanned} B of them for C "
        f"kernels the load did not take), the load holds {weights} B",
    )
    bandwidth = state.get("bandwidth")
    if bandwidth:
        figures["bandwidth_fraction"] = figures["decode_tok_s"] * figures["read_bytes"] / bandwidth
    if load_peak is None or run_peak is None:
        return  # a CPU: no allocator peak to hold the plan to, and no GPU's speeds
    measured, planned = max(load_peak, run_peak), figures["plan"]["peak_bytes"]
    error = (measured - planned) / planned
    figures.update(
        load_peak_bytes=load_peak,
        run_peak_bytes=run_peak,
        peak_bytes=measured,
        peak_error=round(error, 4),
    )
    expect(
        abs(error) <= PLAN_TOLERANCE,
        f"max_memory_allocated {measured / GiB:.2f} GiB (load {load_peak / GiB:.2f}, run "
        f"{run_peak / GiB:.2f}) is {error:+.1%} off the plan's peak {planned / GiB:.2f} GiB, "
        f"more than {PLAN_TOLERANCE:.0%} (the plan: {plan.weight_bytes / GiB:.2f} GiB of "
        f"weights, the load's bound {figures['plan']['load_bytes'] / GiB:.2f}, running "
        f"{plan.steady_bytes / GiB:.2f}, the CUDA runtime's {plan.runtime_bytes / GiB:.2f} "
        "beside the allocator in both)",
    )
    fraction = figures.get("bandwidth_fraction")
    expect(
        fraction is None or fraction <= BANDWIDTH_SLACK,
        f"batch-1 decode ran at {fraction:.2f}× the bandwidth limit: the bandwidth or the "
        "bytes a step reads are wrong",
    )
    gain = figures["batch_decode_tok_s"] / figures["decode_tok_s"]
    expect(
        gain >= BATCH_GAIN,
        f"a batch of {scale.batch} decodes only {gain:.1f}× batch 1's tokens a second "
        f"(at least {BATCH_GAIN:.0f}× expected on a GPU: per-row work in the step?)",
    )


def workload(engine: LLMEngine, scale: Scale, figures: dict[str, Any]) -> None:
    """Batch-1 decode of a short prompt (``repeats`` times after a warm-up, as ``infersight
    bench``), then the long prompt with ``batch - 1`` copies decoding after it, through the
    bench's harness."""
    prompt = bench_prompt(engine, scale.prompt_tokens, seed=0)
    short = prompt[: scale.short_prompt]
    run_ours(engine, short, min(8, scale.decode_tokens))  # warm-up
    ones = [run_ours(engine, short, scale.decode_tokens) for _ in range(scale.repeats)]
    batch = run_ours(engine, prompt, scale.batch_tokens, scale.batch)
    one = BenchResult.from_runs(
        "infersight", BenchConfig(len(short), scale.decode_tokens, scale.repeats), ones, 0.0
    )
    many = BenchResult.from_runs(
        "infersight",
        BenchConfig(len(prompt), scale.batch_tokens, 1, batch=scale.batch),
        [batch],
        0.0,
    )
    figures.update(
        decode_tok_s=one.decode_tok_s,
        tpot_ms=one.tpot_ms,
        prefill_tok_s=many.prefill_tok_s,
        ttft_ms=many.ttft_ms,
        batch_decode_tok_s=many.decode_tok_s,
    )
    expected = scale.batch * scale.batch_tokens
    expect(batch.new_tokens == expected, f"the batch produced {batch.new_tokens}, not {expected}")
    expect(engine.kv.manager.num_used == 0, "KV blocks were left in use")


def cuda_runtime_bytes(device: torch.device) -> int | None:
    """What the CUDA runtime holds beside torch's allocator (NVML's used − reserved; every
    process on the GPU, so this one's alone there): what the plan estimates for another
    machine's GPU as ``CUDA_RUNTIME_BYTES``."""
    from engine.hardware.nvml import device_memory

    nvml = device_memory(device)
    return None if nvml is None else nvml.used_bytes - torch.cuda.memory_reserved(device)


def profiled_pool(
    scale: Scale, device: torch.device, precision: str, card_bytes: int, figures: dict[str, Any]
) -> None:
    """The engine loaded on the card with no pool given: it profiles a warm-up and sizes the
    pool itself (:mod:`engine.core.pool_profile`, as ``serve --device cuda`` does); the pool
    must be what the plan for that card says within 10%, and a workload must run in it."""
    config = EngineConfig(decode_graph="off")
    plan = plan_for(scale, scale.raw, precision, device, config, memory=card_bytes)
    release(device)
    engine = build_engine(scale.raw, precision, str(device), config=config, name=scale.name)
    sizing = engine.pool_sizing
    got: dict[str, Any] = {
        "planned_pool_bytes": plan.kv_pool_bytes,
        "pool_bytes": engine.kv.nbytes,
        "sizing": None if sizing is None else sizing.summary(),
    }
    figures["profiled_pool"] = got
    prompt = bench_prompt(engine, scale.prompt_tokens, seed=3)
    run_ours(engine, prompt, 8)
    del engine
    release(device)
    if device.type == "cuda":
        error = (got["pool_bytes"] - plan.kv_pool_bytes) / max(plan.kv_pool_bytes, 1)
        got["pool_error"] = round(error, 4)
        expect(
            abs(error) <= PLAN_TOLERANCE,
            f"the profiled pool {got['pool_bytes'] / GiB:.2f} GiB is {error:+.1%} off the "
            f"plan's {plan.kv_pool_bytes / GiB:.2f} GiB for the card",
        )
