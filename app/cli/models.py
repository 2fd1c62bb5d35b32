"""``infersight models`` (pull, list), ``plan`` (a model's memory plan before loading it)
and ``import-gguf``."""

from __future__ import annotations

import argparse
import json

from app.cli.common import progress_printer


def cmd_models_pull(args: argparse.Namespace) -> int:
    from engine.store.model_store import pull_default

    path = pull_default(progress=progress_printer())
    print(path)
    return 0


def cmd_models_synth(args: argparse.Namespace) -> int:
    from engine.store.synthetic_store import synthesize

    print(synthesize(args.name, progress=progress_printer()))
    return 0


def cmd_models_list(args: argparse.Namespace) -> int:
    from engine.store.model_store import known_models

    rows = [("name", "arch", "params", "on disk", "path")]
    for m in known_models():
        if m.present:
            rows.append(
                (
                    m.name,
                    m.architecture,
                    f"{m.parameters / 1e6:.1f}M",
                    f"{m.disk_bytes / 2**20:.0f} MiB",
                    str(m.path),
                )
            )
        else:
            rows.append((m.name, "-", "-", "not pulled", "run `infersight models pull`"))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())
    return 0


PLAN_PRECISIONS = ("fp16", "int8", "int8+head", "int4-g32", "int4-g32+head", "int4-g128+head")


def cmd_plan(args: argparse.Namespace) -> int:
    from pathlib import Path

    from app.loading import resolve_device, resolve_model_folder
    from engine.core.config import EngineConfig
    from engine.errors import InvalidRequestError
    from engine.hardware.gpu import parse_capability
    from engine.loader.memory_plan import MemoryPlan, parse_bytes, plan_memory
    from engine.model.config import ModelConfig

    memory = parse_bytes(args.memory) if args.memory else None
    capability = parse_capability(args.capability) if args.capability else None
    device = args.device if memory is not None and args.device != "auto" else None
    if capability is not None and args.device == "auto":  # a capability is a CUDA GPU's
        device = "cuda"
    device = device or resolve_device(args.device)
    path = Path(args.model).expanduser()
    if path.suffix.lower() == ".json" and path.is_file():
        cfg, name = ModelConfig.from_file(path), path.stem
    elif path.suffix.lower() == ".gguf":  # its header: nothing is imported to plan it
        from engine.store.gguf_reader import gguf_model_config

        cfg, name = gguf_model_config(path), path.stem
    else:
        folder = resolve_model_folder(args.model, progress_printer())
        cfg, name = ModelConfig.from_file(folder / "config.json"), folder.name
    world = args.tensor_parallel
    if world > 1:  # rank 0 holds the largest shard where heads do not divide evenly
        from dataclasses import replace

        from engine.parallel.shard import plan as shard_plan
        from engine.parallel.shard import vocab_rows

        # the embedding and the head (float or quantized) split by vocabulary rows too
        rows = vocab_rows(cfg.vocab_size, 0, world)
        local = replace(shard_plan(cfg, 0, world).local, vocab_size=rows[1] - rows[0])
        cfg, name = local, f"{name}, one rank of {world}"
    config = EngineConfig(
        kv_memory=args.kv_memory, gpu_memory_utilization=args.gpu_memory_utilization
    )
    texts = [t.strip() for t in (args.precision or ",".join(PLAN_PRECISIONS)).split(",")]
    plans: list[MemoryPlan] = []
    skipped: list[str] = []
    refusals: list[InvalidRequestError] = []
    for text in filter(None, texts):
        try:
            plan = plan_memory(cfg, text, device, memory=memory, config=config, name=name,
                               capability=capability)  # fmt: skip
        except InvalidRequestError as exc:
            if args.precision:  # asked for by name: say why it cannot run
                raise
            skipped.append(text)  # the default table: only what the device runs natively
            refusals.append(exc)
        else:
            plans.append(plan)
    if not plans:  # nothing could be planned: say why the first one could not
        raise refusals[0]
    if args.json:
        print(json.dumps([p.as_json() for p in plans], indent=2))
    elif len(plans) == 1:
        print("\n".join(plans[0].lines()))
    else:
        print(
            f"Memory plan: {name} on {plans[0].where}, {plans[0].budget_source} "
            f"{plans[0].budget_bytes / 2**30:.2f} GiB"
        )
        for plan in plans:
            print(f"  {plan.one_line()}")
        if skipped:
            print(f"  not planned: {', '.join(skipped)}: {refusals[0]}")
    return 0 if any(p.fits for p in plans) else 3


def cmd_import_gguf(args: argparse.Namespace) -> int:
    from pathlib import Path

    from engine.store.gguf_import import import_gguf

    summary = import_gguf(
        Path(args.gguf), Path(args.outdir), dtype=args.dtype, progress=progress_printer()
    )
    types = ", ".join(f"{k}×{v}" for k, v in sorted(summary.tensor_types.items()))
    print(f"imported {summary.name} ({summary.architecture}; {types}) into {args.outdir}")
    return 0
