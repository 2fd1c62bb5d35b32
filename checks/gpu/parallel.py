"""Tensor parallelism over two GPUs against one (NCCL; skipped on one GPU, the dry run over
gloo on the CPU)."""

from __future__ import annotations

import os
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from checks.gpu.common import (
    DRY,
    Scale,
    Skip,
    decode_speed,
    expect,
    greedy,
    our_logprobs,
    parting,
    release,
    smollm2,
)
from engine.bench.speed import bench_prompt
from engine.loader.synthetic import write_folder

# -- 8. kernels at 0 rows -----------------------------------------------------------------------


def check_tensor_parallel(
    scale: Scale, device: torch.device, dry: bool, figures: dict[str, Any]
) -> None:
    """Tensor parallelism over two GPUs (NCCL; docs/tensor-parallel.md) against one: the tiny
    model's greedy ids equal and its fp32 logits close, SmolLM2's shapes decoding at fp16 on
    both, and a killed rank named as an error within 30 s, with nothing left behind. It needs
    two GPUs; the dry run runs the same code on the CPU over gloo."""
    import signal

    from engine.loader.load import load_model
    from engine.parallel.executor import RankFailed

    count = torch.cuda.device_count()
    figures["gpus"] = count
    if not dry and count < 2:
        raise Skip(f"needs two or more GPUs; this machine has {count}")
    where = str(device.type)  # every rank on its own GPU: cuda:0, cuda:1
    root = Path(tempfile.mkdtemp(prefix="gpu-check-tp-"))
    folder = write_folder(DRY.raw, root / "tiny")
    prompt = [(7 * i + 3) % 200 for i in range(40)]
    logits: dict[int, torch.Tensor] = {}
    runs: dict[int, dict[str, Any]] = {}
    for world in (1, 2):
        engine = load_model(folder, device=where, tensor_parallel=world)
        try:
            ids = greedy(engine, prompt, 16)
            cache = engine.runner.new_cache(len(prompt))
            logits[world] = engine.runner.forward_logits(prompt, cache, 0).float().cpu()
            runs[world] = {"ids": ids, "kernels": engine.kernels}
            if world == 2:  # two ranks' ids against one's, by the tie rule
                runs[2]["part"] = parting(
                    ids, runs[1]["ids"], partial(our_logprobs, engine, prompt)
                )
        finally:
            if engine.parallel is not None:
                engine.parallel.close()
        del engine
        release(device)
    part = runs[2]["part"]
    expect(part["agree"], f"two ranks changed the tiny model's greedy ids, not at a tie: {part}")
    diff = (logits[2] - logits[1]).abs().max().item()
    expect(diff < 1e-3, f"two ranks' fp32 logits differ from one's by {diff:.2e}")
    expect("tensor parallel: 2 ranks" in runs[2]["kernels"], runs[2]["kernels"])
    figures.update(greedy=part, max_logit_diff=diff,
                   kernels=runs[2]["kernels"].split("; tensor parallel: ")[-1])  # fmt: skip
    if not dry:  # SmolLM2's shapes at fp16: batch-1 decode on one GPU and on two
        big = write_folder(smollm2(), root / "smollm2")
        speed: dict[int, float] = {}
        for world in (1, 2):
            engine = load_model(big, precision="fp16", device=where, tensor_parallel=world)
            try:
                p = bench_prompt(engine, 128, seed=1)
                speed[world] = decode_speed(engine, p, scale)
            finally:
                if engine.parallel is not None:
                    engine.parallel.close()
            del engine
            release(device)
        figures["smollm2_fp16_decode_tok_s"] = {"one": speed[1], "two": speed[2]}
    # a rank killed between steps: rank 0's next step names it, no hang, nothing left
    engine = load_model(folder, device=where, tensor_parallel=2)
    process = engine.parallel.processes[0]
    os.kill(process.pid, signal.SIGKILL)
    process.join(timeout=10)
    started = time.perf_counter()
    try:
        greedy(engine, prompt, 4)
        expect(False, "a step ran with a rank killed")
    except RankFailed as exc:
        took = time.perf_counter() - started
        expect(took < 30, f"the killed rank was named after {took:.0f} s")
        expect("rank 1" in str(exc), f"the error does not name rank 1: {exc}")
        figures["killed_rank"] = {"named_after_s": round(took, 2), "error": str(exc)[:120]}
    finally:
        engine.parallel.close()
    expect(not process.is_alive(), "the killed rank's process is still there")
    del engine
    release(device)
