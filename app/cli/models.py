"""``infersight models`` (pull, list), ``plan`` (a model's memory plan before loading it)
and ``import-gguf``."""

from __future__ import annotations

import argparse
import json
from typing import Any

from app.cli.common import progress_printer


def cmd_models_pull(args: argparse.Namespace) -> int:
    """The default model, or with ``repo`` a model from the Hugging Face Hub (into its
    cache; the folder printed is what ``--model`` takes)."""
    if getattr(args, "repo", None):
        from engine.store import hub

        print(hub.pull(args.repo, weights=args.file, progress=progress_printer()))
        return 0
    from engine.store.model_store import pull_default

    path = pull_default(progress=progress_printer())
    print(path)
    return 0


def cmd_models_search(args: argparse.Namespace) -> int:
    from engine.store import hub

    found = hub.search(args.query, limit=args.limit)
    print("\n".join(found) if found else f"no model on the Hub matches {args.query!r}")
    return 0


def cmd_models_files(args: argparse.Namespace) -> int:
    """A Hub repo's weight files with their sizes, and each precision's verdict on this
    machine from its config.json alone (nothing else is downloaded)."""
    from app.loading import resolve_device
    from engine.store import hub

    repo = hub.repo(args.repo)
    rows = [(f.path, "-" if f.size is None else f"{f.size / 2**20:,.1f} MiB") for f in repo.weights]
    print(
        f"{repo.repo_id} @ {repo.revision[:12]}{' (gated: needs your token)' if repo.gated else ''}"
    )
    width = max((len(p) for p, _ in rows), default=0)
    for path, size in rows:
        print(f"  {path.ljust(width)}  {size:>14}")
    device = resolve_device(args.device)
    precisions = args.precision.split(",") if args.precision else ["fp32", "bf16", *PLAN_PRECISIONS]
    print(f"on this machine's {device}:")
    for v in hub.verdicts(hub.config(args.repo), precisions, device):
        print(f"  {v.precision:<16} {v.text}")
    return 0


def cmd_models_token(args: argparse.Namespace) -> int:
    """Keep a Hugging Face access token in the system keyring (``--forget``: drop it)."""
    import getpass

    from engine.store import hub

    value = None if args.forget else getpass.getpass("Hugging Face access token: ").strip()
    hub.save_token(value)
    print("token forgotten" if not value else "token kept in the system keyring")
    return 0


def cmd_models_synth(args: argparse.Namespace) -> int:
    from engine.store.synthetic_store import synthesize

    gguf_types = tuple(args.gguf_types or ())
    print(synthesize(args.name, layers=args.layers, gguf_types=gguf_types,
                     progress=progress_printer()))  # fmt: skip
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
    from engine.loader import expert_placement
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
        kv_memory=args.kv_memory, gpu_memory_utilization=args.gpu_memory_utilization,
        cpu_experts=expert_placement.parse(args.cpu_experts), kv_dtype=args.kv_dtype,
    )  # fmt: skip
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


def add_models_parser(sub: Any, device_help: str) -> None:
    """``infersight models``: pull, list, synth, and the Hub's search, files and token."""
    p = sub.add_parser("models", help="the default model and the models in the cache")
    msub = p.add_subparsers(metavar="ACTION", required=True)
    mp = msub.add_parser(
        "pull", help="fetch and convert the default model (once), or a model from the Hub"
    )
    mp.add_argument("repo", nargs="?", help="a Hub repo, e.g. HuggingFaceTB/SmolLM2-360M-Instruct")
    mp.add_argument("--file", help="one weights file of the repo (a .gguf, say)")
    mp.set_defaults(handler=cmd_models_pull)
    mp = msub.add_parser("search", help="models on the Hugging Face Hub whose name matches")
    mp.add_argument("query")
    mp.add_argument("--limit", type=int, default=20)
    mp.set_defaults(handler=cmd_models_search)
    mp = msub.add_parser(
        "files", help="a Hub repo's weight files and what fits here, from its config alone"
    )
    mp.add_argument("repo")
    mp.add_argument("--device", default="auto", help=device_help)
    mp.add_argument("--precision", help="comma-separated precisions (default: the usual ones)")
    mp.set_defaults(handler=cmd_models_files)
    mp = msub.add_parser("token", help="keep your Hugging Face token in the system keyring")
    mp.add_argument("--forget", action="store_true", help="drop the kept token")
    mp.set_defaults(handler=cmd_models_token)
    mp = msub.add_parser("list", help="known models: size on disk, parameters, architecture")
    mp.set_defaults(handler=cmd_models_list)
    mp = msub.add_parser(
        "synth",
        help="write random weights of a published config (once), as a model folder and an "
        "F16 GGUF of the same values: real-size benchmarks without a download",
    )
    mp.add_argument("name", help="a config in resources/configs, e.g. llama-3.2-1b")
    mp.add_argument("--layers", type=int, metavar="N",
                    help="the config's first N layers only (its layer shapes kept)")  # fmt: skip
    mp.add_argument(
        "--gguf-types", nargs="+", choices=("F16", "Q4_1", "Q8_0"), metavar="TYPE",
        help="no float16 files: the weights are drawn at load, and llama.cpp's GGUFs are "
        "written already quantized, one per TYPE (Q4_1, Q8_0, F16), for models whose "
        "float16 does not fit the disk",
    )  # fmt: skip
    mp.set_defaults(handler=cmd_models_synth)
