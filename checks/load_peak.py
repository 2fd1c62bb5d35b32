"""``make load-peak``: the load's peak memory against the plan's bound, on a real-size model.

A synthetic checkpoint with Llama-3.2-3B's shapes (``resources/configs/llama-3.2-3b.json``:
28 layers, hidden 3072, vocabulary 128256, tied embeddings; random bf16 weights, 6.4 GB) is
written once under ``build/load-peak`` (not committed), with the default model's tokenizer.
Each precision then loads in a fresh process while a thread samples memory every 2 ms:

* on a CPU, the process's anonymous resident memory (``RssAnon``: what the load allocated; the
  checkpoint's mapped pages are file-backed and not counted), above the figure before loading;
* on CUDA, ``torch.cuda.max_memory_allocated`` over the load.

The bound is the plan's (:func:`engine.loader.memory_plan.plan_memory`): the final weights plus
the load overhead (:func:`engine.loader.memory_terms.load_overhead_bytes`: the largest tensor in
fp32, on a CPU its checkpoint copy too, four quantization chunks and 64 MiB of allocator slack).
Exits 1 if a peak passes its bound or the loaded weights differ from the plan's by more than 1%.

Run: ``python -m checks.load_peak [--device cpu|cuda] [--precision int8 ...] [--folder DIR]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = ROOT / "resources" / "configs" / "llama-3.2-3b.json"
FOLDER = ROOT / "build" / "load-peak" / "llama-3.2-3b-synthetic"
PRECISIONS = ("int8", "int4-g32", "int4-g32+head")
SHARD_BYTES = 2 * 2**30
MiB = 2**20


def write_checkpoint(folder: Path) -> None:
    """Random bf16 weights in HF names and Llama-3.2-3B's shapes, one shard (≤ 2 GiB) in
    memory at a time; skipped when the folder is complete."""
    import torch
    from safetensors.torch import save_file

    from engine.store.model_store import pull_default

    if (folder / "model.safetensors.index.json").is_file():
        return
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    cfg = json.loads(SHAPES.read_text())
    hidden, inner = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim, heads, kv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg["vocab_size"], hidden)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (inner, hidden),
            p + "mlp.up_proj.weight": (inner, hidden),
            p + "mlp.down_proj.weight": (hidden, inner),
        }
    shapes["model.norm.weight"] = (hidden,)
    generator = torch.Generator().manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    shards = 0

    def flush() -> None:
        nonlocal shard, shards
        shards += 1
        name = f"model-{shards:05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard = {}

    for name, shape in shapes.items():
        if len(shape) == 1:
            shard[name] = (1 + 0.1 * torch.randn(shape, generator=generator)).bfloat16()
        else:
            shard[name] = (0.02 * torch.randn(shape, generator=generator)).bfloat16()
        if sum(t.numel() * 2 for t in shard.values()) >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    default = pull_default()
    for extra in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default / extra, folder / extra)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def rss_anon() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status (not Linux?)")


def measure(folder: Path, precision: str, device: str) -> dict[str, object]:
    """One load in this process; the peak above the figure before it."""
    import torch

    from engine.core.config import EngineConfig
    from engine.hardware.cpu_paths import cpu_paths
    from engine.loader.load import load_model
    from engine.loader.memory_plan import plan_for_folder

    config = EngineConfig(num_blocks=16, decode_graph="off")
    plan = plan_for_folder(folder, precision, device, config=config)
    cpu_paths()  # the probes' tensors are not the load's
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.init()  # type: ignore[no-untyped-call]
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if cuda else rss_anon()
    peak = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.002):
            peak[0] = max(peak[0], rss_anon())

    sampler = threading.Thread(target=sample, daemon=True)
    if not cuda:
        sampler.start()
    started = time.perf_counter()
    engine = load_model(folder, precision=precision, device=device, config=config)
    took = time.perf_counter() - started
    done.set()
    if cuda:
        peak[0] = torch.cuda.max_memory_allocated(device)
    else:
        sampler.join()
        peak[0] = max(peak[0], rss_anon())
    bound = plan.weight_bytes + plan.load_overhead_bytes + engine.kv.nbytes
    return {
        "precision": precision,
        "device": device,
        "measured": "max_memory_allocated" if cuda else "RssAnon",
        "load_s": round(took, 1),
        "planned_weights": plan.weight_bytes,
        "loaded_weights": engine.weights_bytes,
        "peak_above_base": peak[0] - base,
        "bound": bound,
        "within": peak[0] - base <= bound
        and abs(plan.weight_bytes - engine.weights_bytes) <= 0.01 * engine.weights_bytes,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", nargs="+", default=list(PRECISIONS))
    parser.add_argument("--folder", type=Path, default=FOLDER)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # child process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.folder, args.precision[0], args.device)))
        return 0
    print(f"synthetic checkpoint: {args.folder}", flush=True)
    started = time.perf_counter()
    write_checkpoint(args.folder)
    print(f"  ready in {time.perf_counter() - started:.0f} s", flush=True)
    rows = []
    for precision in args.precision:
        out = subprocess.run(
            [sys.executable, "-m", "checks.load_peak", "--one", "--device", args.device,
             "--precision", precision, "--folder", str(args.folder)],
            capture_output=True, text=True, cwd=ROOT,
        )  # fmt: skip
        if out.returncode != 0:
            print(out.stderr[-3000:])
            return 1
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(
            f"  {precision:<14} load {r['load_s']:>6} s  weights {r['loaded_weights'] / MiB:>8.0f}"
            f" MiB (plan {r['planned_weights'] / MiB:.0f})  peak {r['peak_above_base'] / MiB:>8.0f}"
            f" MiB ≤ bound {r['bound'] / MiB:.0f} MiB ({r['measured']}): "
            f"{'ok' if r['within'] else 'EXCEEDED'}",
            flush=True,
        )
    return 0 if all(r["within"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
