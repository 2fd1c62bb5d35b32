"""The families issue 49 brought, on their fast paths: a mixture of experts' routed experts in
the grouped INT4 GEMM (Qwen3-30B-A3B's shapes, two of its layers, at int4-g32+head) against
the same engine with its experts one module at a time and with them in host memory on the
CPU kernels (``--cpu-experts``: the rows crossing once a layer), and Gemma 3's local and
global layers on our Triton attention (Gemma-3-4B's shapes, six of its layers: five local,
one global) against torch's. Greedy ids compared with the tie rule; the paths report says
what ran. The dry run takes tiny widths of both (one layer of experts; a local layer and a
global one), our kernels in Triton's interpreter."""

from __future__ import annotations

import time
from dataclasses import replace
from functools import partial
from typing import Any

import torch

from checks.gpu.common import (
    MiB,
    Scale,
    Skip,
    decode_speed,
    expect,
    greedy,
    kernels,
    our_logprobs,
    parting,
    ran_paths,
    release,
)
from engine.bench.speed import bench_prompt
from engine.core.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.core.sampling import SamplingParams
from engine.kernels import triton_support
from engine.loader.synthetic import build_engine
from engine.model import lanes
from engine.model.moe import MoE
from engine.store.synthetic_store import published_config, with_layers

#: tiny widths of both families for the dry run (heads 64 wide, as our kernels are built for)
DRY_MOE = {"hidden_size": 128, "moe_intermediate_size": 64, "num_experts": 4,
           "num_experts_per_tok": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
           "head_dim": 64,
           "vocab_size": 512, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
DRY_GEMMA = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2,
             "num_key_value_heads": 1, "head_dim": 64, "vocab_size": 512,
             "sliding_window": 8}  # fmt: skip


def batch_speed(engine: LLMEngine, prompts: list[list[int]], tokens: int) -> float:
    """Generated tokens a second of ``prompts`` decoded together, ``tokens`` each (after one
    warm-up run), prefill included."""
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)

    def run() -> float:
        for p in prompts:
            engine.add_request(p, params)
        started, made = time.perf_counter(), 0
        while engine.has_work():
            made += sum(e.token_id is not None for e in engine.step())
        return made / (time.perf_counter() - started)

    run()
    return run()


def check_families(scale: Scale, device: torch.device, dry: bool, figures: dict[str, Any]) -> None:
    if dry and not triton_support.interpreting():
        raise Skip("on a CPU our kernels run only in Triton's interpreter (TRITON_INTERPRET=1)")
    ours = "triton" if dry else "auto"
    # the interpreter runs a tile program in about a tenth of a second: a short prompt
    prompt_len, tokens = (8, 4) if dry else (scale.short_prompt, scale.compare_tokens)
    config = EngineConfig(kv_memory=(16 if dry else 512) * MiB, decode_graph="off")
    moe = with_layers(published_config("qwen3-30b-a3b"), 1 if dry else 2)
    gemma = with_layers(published_config("gemma-3-4b"), 2 if dry else 6)
    if dry:  # one layer of experts; a local layer and a global one
        moe |= DRY_MOE
        text = gemma["text_config"] | DRY_GEMMA
        gemma |= {"text_config": text | {"layer_types": ["sliding_attention", "full_attention"]}}
    with kernels(ours):
        engine = build_engine(moe, "int4-g32+head", str(device), config=config)
    prompt = bench_prompt(engine, prompt_len, seed=3)
    layers = [m.mlp for m in engine.model.layers if isinstance(m.mlp, MoE)]
    runs: dict[str, Any] = {}
    grouped = [layer.kernel for layer in layers]
    for name in ("grouped", "modules"):
        if name == "modules":
            for layer in layers:
                layer.set_kernel("turned off by the check")
        runs[name] = {
            "experts": sorted({row.get("experts", "") for row in engine.paths()["layers"]}),
            "ids": greedy(engine, prompt, tokens),
        }
        if not dry:  # the interpreter's speed says nothing
            runs[name]["decode_tok_s"] = decode_speed(engine, prompt, scale)
    grouped_vs_modules = parting(runs["grouped"]["ids"], runs["modules"]["ids"],
                                 partial(our_logprobs, engine, prompt))  # fmt: skip
    # --cpu-experts: every layer's experts in host memory on the CPU kernels, each layer's rows
    # crossing to them and back once (engine/model/host_crossing.py); on the dry run's CPU
    # both sides are the CPU, the crossing marked as a GPU load marks it
    count = len(layers)
    if dry:
        for layer, kernel in zip(layers, grouped, strict=True):
            layer.set_kernel(kernel or "none was planned")
            layer.keep_on_host(device)
        host = engine
    else:
        host = None
    del engine, layers
    release(device)
    if host is None:
        with kernels(ours):
            host = build_engine(moe, "int4-g32+head", str(device),
                                config=replace(config, cpu_experts=count))  # fmt: skip
    runs["host"] = {
        "experts": sorted({row.get("experts", "") for row in host.paths()["layers"]}),
        "ids": greedy(host, prompt, tokens),
    }
    if not dry:
        runs["host"]["decode_tok_s"] = decode_speed(host, prompt, scale)
        # a batch of eight: each decode step in two lanes (the GPU attends for one while the
        # CPU runs the other's experts: engine/model/lanes.py), then in one
        batch = [bench_prompt(host, prompt_len, seed=10 + i) for i in range(8)]
        runs["host"]["batch8_tok_s"] = batch_speed(host, batch, tokens)
        with lanes.one_lane():
            runs["host"]["batch8_one_lane_tok_s"] = batch_speed(host, batch, tokens)
    host_vs_grouped = parting(runs["host"]["ids"], runs["grouped"]["ids"],
                              partial(our_logprobs, host, prompt))  # fmt: skip
    del host
    release(device)
    figures["moe"] = {k: {f: v for f, v in r.items() if f != "ids"} for k, r in runs.items()}
    figures["moe"]["grouped_vs_modules"] = grouped_vs_modules
    figures["moe"]["host_vs_grouped"] = host_vs_grouped
    expect(grouped_vs_modules["agree"], f"grouped experts part, not at a tie: {grouped_vs_modules}")
    expect(host_vs_grouped["agree"], f"experts on the host part, not at a tie: {host_vs_grouped}")
    want = "grouped Triton GEMM" if device.type == "cuda" or dry else "one C call"
    expect(runs["grouped"]["experts"] == [want], f"the experts ran {runs['grouped']['experts']}")
    gemma_runs: dict[str, Any] = {}
    engines = {}
    for name, choice in (("triton", ours), ("torch", "torch")):
        with kernels(choice):
            engines[name] = build_engine(gemma, "bf16" if not dry else "fp32", str(device),
                                         config=config)  # fmt: skip
        prompt = bench_prompt(engines[name], prompt_len, seed=4)
        gemma_runs[name] = {"ids": greedy(engines[name], prompt, tokens),
                            "paths": ran_paths(engines[name])}  # fmt: skip
    triton_vs_torch = parting(gemma_runs["triton"]["ids"], gemma_runs["torch"]["ids"],
                              partial(our_logprobs, engines["torch"], prompt))  # fmt: skip
    del engines
    release(device)
    figures["gemma3"] = {k: r["paths"] for k, r in gemma_runs.items()}
    figures["gemma3"]["triton_vs_torch"] = triton_vs_torch
    backend = gemma_runs["triton"]["paths"]["attention"]["backend"]
    expect(backend == "triton", f"Gemma 3 attended on {backend}, not our Triton kernels")
    expect(triton_vs_torch["agree"], f"Gemma 3 on Triton parts from torch: {triton_vs_torch}")
