"""The decode step's fast paths: CUDA graphs and our Triton kernels against eager steps and
torch's kernels (issue 28's targets), and the decode step compiled by TorchInductor where the
engine compiles it. Every comparison of greedy ids takes the tie rule
(:func:`checks.gpu.common.parting`): a graph replay splits decode attention over its wide
block tables where an eager step runs one pass, and fp16 rounds the two orders apart."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import replace
from functools import partial
from typing import Any

import torch

from checks.gpu.common import (
    GRAPH_GAIN,
    LONG,
    LONG_CONTEXT,
    SHORT,
    MiB,
    Scale,
    Skip,
    decode_figures,
    decode_speed,
    expect,
    expect_ours,
    greedy,
    kernels,
    native_choice,
    our_logprobs,
    parting,
    plan_for,
    pool_config,
    ran,
    ran_paths,
    release,
    smollm2,
    wide_tiny,
)
from engine.bench.speed import RunTiming, bench_prompt, run_ours
from engine.core.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.executor import inductor
from engine.kernels import triton_support
from engine.loader.memory_terms import kv_bytes_per_token
from engine.loader.synthetic import build_engine
from engine.model.config import ModelConfig


def check_triton(
    scale: Scale, device: torch.device, dry: bool, quick: bool, figures: dict[str, Any]
) -> None:
    """Our kernels against torch's, and CUDA graphs against eager steps, on the default
    model's shapes in fp16; then (not with ``quick``) decode at 8k tokens of context against
    512 (attention reads in place, so a long context should cost little) on the 8B at the
    12 GB card's precision. The dry run forces our kernels on in Triton's interpreter, on
    tiny shapes."""
    if dry and not triton_support.interpreting():
        raise Skip("on a CPU our kernels run only in Triton's interpreter (TRITON_INTERPRET=1)")
    ours = "triton" if dry else "auto"
    raw, precision = (wide_tiny(), "fp32") if dry else (smollm2(), "fp16")
    config = EngineConfig(kv_memory=256 * MiB if not dry else 16 * MiB, decode_graph="off")
    runs: dict[str, Any] = {}
    engines: dict[str, LLMEngine] = {}
    prompt: list[int] = []
    for name, choice, graphs in (("graphs", ours, "on"), ("eager", ours, "off"),
                                 ("torch", "torch", "off")):  # fmt: skip
        with kernels(choice):
            engine = build_engine(raw, precision, str(device),
                                  config=replace(config, cuda_graphs=graphs))  # fmt: skip
        prompt = bench_prompt(engine, scale.short_prompt, seed=1)
        runs[name] = {
            "ran": ran(engine), "decode_tok_s": decode_speed(engine, prompt, scale),
            "ids": greedy(engine, prompt, scale.compare_tokens),
        }  # fmt: skip
        runs[name]["paths"] = ran_paths(engine)  # after its steps: what they ran
        engines[name] = engine
    eager_engine = engines["eager"]
    with_graphs = parting(
        runs["graphs"]["ids"], runs["eager"]["ids"], partial(our_logprobs, eager_engine, prompt)
    )
    with_torch = parting(
        runs["eager"]["ids"], runs["torch"]["ids"], partial(our_logprobs, engines["torch"], prompt)
    )
    del engine, eager_engine, engines
    release(device)
    gain = runs["graphs"]["decode_tok_s"] / runs["eager"]["decode_tok_s"]
    figures.update(
        small={k: {f: v for f, v in r.items() if f != "ids"} for k, r in runs.items()},
        graph_gain=round(gain, 2),
        ours_over_torch=round(runs["eager"]["decode_tok_s"] / runs["torch"]["decode_tok_s"], 2),
        graphs_vs_eager=with_graphs,
        ours_vs_torch=with_torch,
        targets={"graphs ≥ 1.5× eager": gain >= GRAPH_GAIN},
    )
    expect(with_graphs["agree"], f"graph replays changed greedy ids, not at a tie: {with_graphs}")
    expect(with_torch["agree"], f"our kernels part from torch's, not at a tie: {with_torch}")
    # what each run's decode steps may run on: graphs all on CUDA graphs; the others eagerly
    # (a CPU's dry run may take its C step, which a GPU never settles)
    step_kinds = {"eager"} if device.type == "cuda" else {"eager", "c-step"}
    for name, allowed in (
        ("graphs", {"cuda-graphs"}),
        ("eager", step_kinds),
        ("torch", step_kinds),
    ):
        paths = runs[name]["paths"]
        decoded = set(paths["steps"].get("decode", {}))
        expect(not paths["fallbacks"], f"{name}: fell back: {paths['fallbacks']}")
        expect(bool(decoded) and decoded <= allowed,
               f"{name}: decode steps ran {paths['steps']}, not on {sorted(allowed)}")  # fmt: skip
    graphs_ran = runs["graphs"]["ran"]["cuda_graphs"]
    expect(graphs_ran.startswith(("captured", "static")), f"no CUDA graphs: {graphs_ran}")
    if device.type == "cuda":
        expect(graphs_ran.startswith("captured"), f"no CUDA graphs captured: {graphs_ran}")
    for name in ("graphs", "eager"):
        expect(runs[name]["ran"]["triton_attention"], f"{name}: {runs[name]['ran']['kernels']}")
    torch_ran = runs["torch"]["ran"]["kernels"]
    expect(torch_ran.startswith("torch"), f"the torch side ran {torch_ran}")
    if dry or quick:
        return  # the interpreter's speed says nothing, and the 8B is a GPU's
    precision = native_choice(device)
    short, long = SHORT, LONG
    tokens = long + scale.decode_tokens * (scale.repeats + 2) + 64
    per_token = kv_bytes_per_token(ModelConfig.from_dict(scale.raw), torch.float16)
    long_config = EngineConfig(kv_memory=2 * tokens * per_token, decode_graph="off")
    if not plan_for(scale, scale.raw, precision, device, long_config).fits:
        raise Skip(f"the 8B at {precision} with {long} tokens of context does not fit here")
    engine = build_engine(scale.raw, precision, str(device), config=long_config, name=scale.name)
    expect_ours(engine, device, figures)
    long_prompt = bench_prompt(engine, long, seed=2)
    at = {n: decode_speed(engine, long_prompt[:n], scale) for n in (short, long)}
    # the same weights behind an int8 KV cache (the pool swapped, not beside): its rows read
    # at half the bytes through the same kernels
    engine = engine.with_pool(kv_memory=long_config.kv_memory, kv_dtype="int8")
    int8_long = decode_speed(engine, long_prompt, scale)
    del engine
    release(device)
    ratio = at[long] / at[short]
    figures.update(long_context={"precision": precision, "short_tok_s": at[short],
                                 "long_tok_s": at[long], "ratio": round(ratio, 2),
                                 "int8_kv_long_tok_s": int8_long,
                                 "int8_kv_over_float": round(int8_long / at[long], 2)})  # fmt: skip
    figures["targets"][f"decode at {long} ≥ 0.85× at {short}"] = ratio >= LONG_CONTEXT


@contextlib.contextmanager
def eager(engine: LLMEngine, on: bool) -> Iterator[None]:
    """Decode steps eager for the context (the compiled graph stays)."""
    if on:
        engine.runner.executor.eager_reasons.add("gpu-check")
    try:
        yield
    finally:
        engine.runner.executor.eager_reasons.discard("gpu-check")


def check_compiled(
    scale: Scale,
    device: torch.device,
    dry_run: bool,
    figures: dict[str, Any],
    mode: str | None = None,
) -> None:
    """The decode step compiled (``--decode-graph on``; the dry run ``off``: compiling takes
    minutes on a CPU) where the engine compiles it: with torch's attention. Under our Triton
    attention, the GPU's default, the engine refuses; the check asks that of
    :func:`engine.executor.inductor.choose`, the one place the load asks too. Then speed
    and greedy ids, compiled against eager, on 4 of the 8B's layers."""
    precision = native_choice(device)
    raw = scale.raw | {"num_hidden_layers": scale.compiled_layers}
    mode = mode or ("off" if dry_run else "on")
    under_triton = inductor.choose(mode, device, backend="triton")
    figures["under_triton_attention"] = under_triton.summary()
    expect(not under_triton.compiled, f"compiling under our attention: {under_triton.summary()}")
    started = time.perf_counter()
    with kernels("torch"):
        engine = build_engine(
            raw, precision, str(device), name=scale.name,
            config=pool_config(scale, raw, precision, device, decode_graph=mode),
        )  # fmt: skip
    figures.update(
        precision=precision,
        layers=scale.compiled_layers,
        load_s=round(time.perf_counter() - started, 2),
        ran=ran(engine),
    )
    summary = engine.graph.summary()
    print(f"     {summary}", flush=True)
    expect(mode != "on" or engine.graph.compiled, f"the step was not compiled: {summary}")
    expect(mode == "on" or not engine.graph.compiled, f"compiled though {mode}: {summary}")
    prompt = bench_prompt(engine, scale.short_prompt, seed=2)
    run_ours(engine, prompt, min(8, scale.decode_tokens))  # warm-up
    runs: dict[str, list[RunTiming]] = {"compiled": [], "eager": []}
    for _ in range(scale.repeats):  # in turn, so that noise hurts both alike
        for side, timings in runs.items():
            with eager(engine, side == "eager"):
                timings.append(run_ours(engine, prompt, scale.decode_tokens))
    ids = {}
    for side in runs:
        with eager(engine, side == "eager"):
            ids[side] = greedy(engine, prompt, scale.compare_tokens)
    with eager(engine, True):
        part = parting(ids["compiled"], ids["eager"], partial(our_logprobs, engine, prompt))
    for side, timings in runs.items():
        figures[side] = decode_figures(scale, timings, len(prompt))
    figures["greedy"] = part
    del engine
    release(device)
    expect(
        part["agree"],
        f"compiled and eager greedy ids part at token {part['same']}, not at a tie: {part}",
    )
