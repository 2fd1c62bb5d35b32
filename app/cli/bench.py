"""``infersight bench`` (speed and latency, decode profiles, the precision table) and
``infersight tune`` (the batching tuner's load and sweeps)."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from typing import Any

from app.cli.common import engine_config, progress_printer, set_threads
from engine.errors import InvalidRequestError


def cmd_bench(args: argparse.Namespace) -> int:
    from app.loading import resolve_device, resolve_model_folder
    from engine.bench.report import format_report, format_workload_report
    from engine.bench.speed import BenchConfig, run_bench
    from engine.bench.workload import run_workload_bench
    from engine.quant.spec import parse_precision_spec

    for name in ("prompt_len", "new_tokens", "repeats", "requests", "batch", "turns",
                 "message_tokens", "reply_tokens"):  # fmt: skip
        if getattr(args, name) < 1:
            raise InvalidRequestError(f"--{name.replace('_', '-')} must be at least 1")
    if args.shared_prefix < 0 or args.system_tokens < 0:
        raise InvalidRequestError("--shared-prefix and --system-tokens must be at least 0")
    if any(b < 1 for b in args.max_batch_size):
        raise InvalidRequestError("--max-batch-size values must be at least 1")
    if any(b < 1 for b in args.hf_batch_sizes or ()):
        raise InvalidRequestError("--hf-batch-sizes values must be at least 1")
    device = resolve_device(args.device)
    parse_precision_spec(args.precision, device)
    set_threads(args.threads)
    config = engine_config(args, max_batch_size=max(args.max_batch_size))
    if args.table:
        _check_table_args(args)
    folder = resolve_model_folder(args.model, progress_printer())
    say = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
    if args.prefill_table:
        from engine.bench.prefill import format_prefill_table, run_prefill_table

        for precision in args.prefill_table:
            parse_precision_spec(precision, device)
        report = run_prefill_table(
            folder, args.prefill_table, prompt_len=args.prompt_len, repeats=args.repeats,
            device=device, engine_config=config, log=say, tensor_parallel=args.tensor_parallel,
        )  # fmt: skip
        print(json.dumps(report, indent=2) if args.json else format_prefill_table(report))
        return 0
    if args.profile:
        return _bench_profile(args, folder, device, config)
    if args.table:
        return _bench_table(args, folder, config, say)
    if args.workload == "speculative":
        return _bench_speculative(args, folder, device, config, say)
    if args.workload == "structured":  # the grammar mask's cost (bench --workload structured)
        from engine.bench.structured import format_structured_report, run_structured_bench

        report = run_structured_bench(
            folder, batch=args.batch, new_tokens=args.new_tokens, repeats=args.repeats,
            seed=args.seed, precision=args.precision, device=device, engine_config=config,
            log=say,
        )  # fmt: skip
        print(json.dumps(report, indent=2) if args.json else format_structured_report(report))
        return 0
    if args.workload == "chat":
        from engine.bench.chat import format_chat_report, run_chat_bench

        report = run_chat_bench(
            folder, turns=args.turns, message_tokens=args.message_tokens,
            reply_tokens=args.reply_tokens, system_tokens=args.system_tokens, seed=args.seed,
            precision=args.precision, device=device, engine_config=config, log=say,
            tensor_parallel=args.tensor_parallel,
        )  # fmt: skip
        print(json.dumps(report, indent=2) if args.json else format_chat_report(report))
        return 0
    if args.workload == "mixed":
        report = run_workload_bench(
            folder,
            requests=args.requests,
            batch_sizes=args.max_batch_size,
            precision=args.precision,
            device=device,
            compare_hf=args.compare_hf,
            hf_batch_sizes=args.hf_batch_sizes,
            seed=args.seed,
            engine_config=config,
            shared_prefix=args.shared_prefix,
            prefix_cache=args.prefix_cache,
            log=say,
            tensor_parallel=args.tensor_parallel,
        )
        print(json.dumps(report, indent=2) if args.json else format_workload_report(report))
        return 0
    report = run_bench(
        folder,
        BenchConfig(
            prompt_len=args.prompt_len,
            new_tokens=args.new_tokens,
            repeats=args.repeats,
            batch=args.batch,
        ),
        precision=args.precision,
        device=device,
        compare_hf=args.compare_hf,
        engine_config=config,
        log=say,
        tensor_parallel=args.tensor_parallel,
        kv_dtypes=args.kv_dtypes,
    )
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _bench_speculative(args: argparse.Namespace, folder: Any, device: str, config: Any,
                       say: Any) -> int:  # fmt: skip
    from engine.bench.speculative import format_spec_report, run_spec_bench
    from engine.speculative.config import parse_speculative

    drafters = args.speculative or ["lookup", "self:int4-g32+head"]
    for text in drafters:
        for k in args.draft_k:
            parse_speculative(text, k)  # bad options fail before the load
    from engine.loader.load import load_model

    engine = load_model(folder, precision=args.precision, device=device, config=config,
                        tensor_parallel=getattr(args, "tensor_parallel", 1))  # fmt: skip
    report = run_spec_bench(
        engine, drafters, sorted(set(args.draft_k)), adaptive=args.adaptive_k,
        new_tokens=args.new_tokens, repeats=args.repeats, log=say,
    )  # fmt: skip
    print(json.dumps(report, indent=2) if args.json else format_spec_report(report))
    return 0


def _check_table_args(args: argparse.Namespace) -> None:
    """``bench --table``'s arguments, checked before anything loads."""
    from engine.quant.spec import parse_precision_spec

    for precision in args.table:
        parse_precision_spec(precision, "cpu")
    if args.llama_cpp is None:
        return
    if shutil.which(args.llama_cpp) is None:
        raise InvalidRequestError(
            f"--llama-cpp {args.llama_cpp}: no such program; give the Python of an environment "
            "with llama-cpp-python (`make bench-peers` builds .peers/venv)"
        )


def _bench_table(args: argparse.Namespace, folder: Any, config: Any, say: Any) -> int:
    from engine.bench.report import format_table
    from engine.bench.speed import BenchConfig
    from engine.bench.table import run_table
    from engine.store.model_store import default_gguf_path, fetch_default_gguf
    from engine.store.synthetic_store import gguf_path, peer_ggufs

    gguf, ready = None, {}
    if args.llama_cpp and args.model == "default":
        gguf = default_gguf_path() if default_gguf_path().is_file() else fetch_default_gguf()
    elif args.llama_cpp:
        gguf, ready = gguf_path(folder), peer_ggufs(folder)
        if gguf is None and not set(args.gguf_types) <= set(ready):
            have = f"has GGUFs of {', '.join(ready)} only" if ready else "has none"
            raise InvalidRequestError(
                f"--llama-cpp runs the model's GGUF in {', '.join(args.gguf_types)}, and "
                f"{folder} {have}; use --model default or a synthetic model (`infersight "
                "models synth llama-3.2-1b` prints its folder; `--gguf-types` writes others)"
            )
    report = run_table(
        folder,
        args.table,
        BenchConfig(prompt_len=args.prompt_len, new_tokens=args.new_tokens, repeats=args.repeats),
        engine_config=config,
        llama_python=args.llama_cpp,
        gguf=gguf,
        gguf_types=tuple(args.gguf_types),
        ready=ready,
        log=say,
        tensor_parallel=args.tensor_parallel,
    )
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0


def _bench_profile(args: argparse.Namespace, folder: Any, device: str, config: Any) -> int:
    import torch

    from engine.bench.profile import format_profile, profile_decode
    from engine.bench.speed import bench_prompt
    from engine.loader.load import load_model

    engine = load_model(folder, precision=args.precision, device=device, config=config,
                        tensor_parallel=getattr(args, "tensor_parallel", 1))  # fmt: skip
    prompt = bench_prompt(engine, args.prompt_len, args.seed)
    where = device
    if device == "cpu":
        where += f", {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads"
    title = f"{engine.name} · {args.precision} · {where}"
    if args.attention == "compare":
        return _profile_attention_paths(args, engine, prompt, title)
    if engine.runner.executor.c_step is not None:
        return _profile_c_step(args, engine, prompt, title, where)
    result = profile_decode(engine, prompt, steps=args.new_tokens, batch=args.batch)
    if args.json:
        print(json.dumps({"model": engine.name, "precision": args.precision, "device": where,
                          **result.as_dict()}, indent=2))  # fmt: skip
    else:
        print(format_profile(result, title))
    return 0


def _profile_c_step(
    args: argparse.Namespace, engine: Any, prompt: Any, title: str, where: str
) -> int:
    """``bench --profile`` where decode steps run in one C call
    (:mod:`engine.executor.c_step`): that step and the eager one, taking turns on the same
    requests (``--repeats`` times), the fastest repeat of each (in JSON the C step's
    profile, with the eager one under ``"eager"``)."""
    from contextlib import nullcontext

    from engine.bench.profile import format_profile, profile_decode_variants
    from engine.kernels import decode_step

    runs = profile_decode_variants(
        engine, prompt, {"C step": nullcontext, "eager": decode_step.eager},
        steps=args.new_tokens, batch=args.batch, repeats=args.repeats,
    )  # fmt: skip
    best = {name: min(ps, key=lambda p: p.step_ms) for name, ps in runs.items()}
    if args.json:
        print(json.dumps({"model": engine.name, "precision": args.precision, "device": where,
                          **best["C step"].as_dict(), "eager": best["eager"].as_dict()},
                         indent=2))  # fmt: skip
        return 0
    for name, p in best.items():
        print(format_profile(p, f"{title} · decode step: {name}"), end="\n\n")
    c, eager = best["C step"], best["eager"]
    print(
        f"decode step {c.step_ms:.2f} ms in one C call against {eager.step_ms:.2f} ms eager "
        f"({eager.step_ms / c.step_ms:.2f}×; fastest of {args.repeats} each); outside matrix "
        f"products and attention: {c.outside:.0%} against {eager.outside:.0%} under the "
        "profiler"
        + (f", {c.outside_unprofiled:.0%} by the C step's own clocks unprofiled"
           if c.outside_unprofiled is not None else "")
    )  # fmt: skip
    return 0


def _profile_attention_paths(args: argparse.Namespace, engine: Any, prompt: Any, title: str) -> int:
    """``bench --profile --attention compare``: the decode step with the paged kernel and
    with the portable gather + SDPA, taking turns on the same requests."""
    import statistics
    from contextlib import nullcontext

    from engine.bench.profile import format_profile, profile_decode_variants
    from engine.kernels import paged_decode

    if not paged_decode.kernel().available:
        raise InvalidRequestError(
            f"the paged decode kernel is not available here: {paged_decode.status()}"
        )
    runs = profile_decode_variants(
        engine, prompt, {"paged": nullcontext, "gather": paged_decode.portable},
        steps=args.new_tokens, batch=args.batch, repeats=args.repeats,
    )  # fmt: skip
    # the fastest repeat of each: the one least disturbed by the machine's other work; the
    # ratio is the median of each repeat's own (the two paths ran back to back in it)
    best = {name: min(ps, key=lambda p: p.step_ms) for name, ps in runs.items()}
    attention = {name: p.kind_total("attention") for name, p in best.items()}
    ratios = [
        paged.kind_total("attention") / gather.kind_total("attention")
        for paged, gather in zip(runs["paged"], runs["gather"], strict=True)
    ]
    report = {
        "title": title, "batch": args.batch, "context": args.prompt_len,
        "paths": {name: p.as_dict() for name, p in best.items()},
        "attention_ms": attention,
        "attention_ms_each_repeat": {
            name: [p.kind_total("attention") for p in ps] for name, ps in runs.items()
        },
        "step_ms": {name: p.step_ms for name, p in best.items()},
        "attention_ratio": statistics.median(ratios),
        "attention_ratio_each_repeat": ratios,
    }  # fmt: skip
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for name, p in best.items():
        path = "paged kernel" if name == "paged" else "gather + SDPA"
        print(format_profile(p, f"{title} · attention: {path}"), end="\n\n")
    print(
        f"attention incl. its K/V reads: {attention['paged']:.1f} ms per step with the paged "
        f"kernel, {attention['gather']:.1f} ms with gather + SDPA "
        f"(fastest of {args.repeats} each); paged / gather in each repeat: "
        + ", ".join(f"{r:.2f}" for r in ratios)
        + f" (median {report['attention_ratio']:.2f}); decode step "
        f"{best['paged'].step_ms:.1f} against {best['gather'].step_ms:.1f} ms (batch "
        f"{args.batch}, {args.prompt_len}-token contexts)"
    )
    return 0


def tune_settings(args: argparse.Namespace, limits: bool = True) -> tuple[list[Any], Any]:
    """``tune``'s grid and SLO from its arguments, every value checked before a load
    (``limits=False``: the loads alone, for a remote server whose limits are its own)."""
    from engine.bench.load_spec import SLO, LoadSpec, PromptMix, Traffic
    from engine.bench.sweep_analysis import grid

    mix = PromptMix(
        documents=args.documents, conversations=args.conversations,
        output_median=args.output_median, output_max=args.output_max,
        output_min=min(16, args.output_median),
    )  # fmt: skip
    base = LoadSpec(
        mode=args.mode, burstiness=args.burstiness, seed=args.seed, mix=mix,
        requests=None if args.duration is not None else args.requests,
        duration_s=args.duration, traffic=Traffic.parse(args.traffic),
    )  # fmt: skip
    loads = args.users if args.mode == "closed" else args.rate
    for value in loads:  # checks each one, as users or as a rate
        if args.mode == "closed":
            LoadSpec(mode="closed", users=int(value))
        else:
            LoadSpec(mode=args.mode, rate=float(value))
    for name in ("max_batch_size", "max_tokens_per_step", "kv_blocks"):
        if any(v < 1 for v in getattr(args, name) or ()):
            raise InvalidRequestError(f"--{name.replace('_', '-')} values must be at least 1")
    if any(not w >= 0 for w in args.max_wait_ms):
        raise InvalidRequestError("--max-wait-ms values must be >= 0")
    settings = grid(
        base, max_batch_size=args.max_batch_size, max_tokens_per_step=args.max_tokens_per_step,
        max_wait_ms=args.max_wait_ms, kv_blocks=args.kv_blocks or (), loads=loads,
    ) if limits else grid(base, loads=loads)  # fmt: skip
    slo = SLO.parse(args.slo) if args.slo else None
    return settings, slo


def cmd_tune(args: argparse.Namespace) -> int:
    if args.endpoint:
        from app.cli.tune_endpoint import tune_endpoint

        return tune_endpoint(args, *tune_settings(args, limits=False))
    for given, what in (
        (args.guidellm, "--guidellm writes a server's runs as GuideLLM's report"),
        (args.traffic, "--traffic is how requests go to a server"),
    ):
        if given:
            raise InvalidRequestError(f"{what}: give --endpoint URL too")
    import torch

    from app.loading import resolve_device, resolve_model_folder
    from engine.bench.loadgen import drive
    from engine.bench.sweep_analysis import format_reading, sweep_report
    from engine.bench.tuning import Sweep
    from engine.quant.spec import parse_precision_spec

    settings, slo = tune_settings(args)
    device = resolve_device(args.device)
    parse_precision_spec(args.precision, device)
    set_threads(args.threads)
    config = engine_config(
        args, max_batch_size=max(args.max_batch_size),
        max_tokens_per_step=max(args.max_tokens_per_step),
    )  # fmt: skip
    folder = resolve_model_folder(args.model, progress_printer())
    from engine.loader.load import load_model

    engine = load_model(folder, precision=args.precision, device=device, config=config,
                        tensor_parallel=getattr(args, "tensor_parallel", 1))  # fmt: skip
    sweep = Sweep(engine, settings, slo=slo)
    shown = [0]

    def progress() -> None:
        if len(sweep.points) > shown[0]:
            shown[0] = len(sweep.points)
            p = sweep.points[-1]
            r = p.result
            line = f"{r.output_throughput:.1f} out tok/s, p95 TTFT {r.ttft_ms['p95']:.0f} ms"
            print(f"[{shown[0]}/{len(settings)}] {p.label}: {line}", file=sys.stderr)

    try:
        drive(engine, sweep, on_step=progress)
    except KeyboardInterrupt:
        sweep.stop()
        print("stopped: the settings measured so far follow", file=sys.stderr)
    progress()
    report = sweep_report(
        sweep.points, slo, target_rate=args.capacity, peak_factor=args.peak_factor,
        headroom=args.headroom, model=args.model, precision=args.precision,
    )  # fmt: skip
    where = str(device)
    if engine.device.type == "cpu":
        where += f", {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads"
    report = {"model": engine.name, "precision": args.precision, "device": where,
              "kv_blocks": engine.kv.manager.num_blocks, **report}  # fmt: skip
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{engine.name} · {args.precision} · {where} · KV pool {engine.kv.manager.num_blocks} "
          f"blocks × {engine.kv.block_size}")  # fmt: skip
    print(format_reading(sweep.points, report, slo, args.capacity, replicas=True))
    return 0
