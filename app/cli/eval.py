"""``infersight eval``: perplexity (``ppl``), two precisions compared token by token
(``compare``) and the per-block sensitivity scan that plans a mixed precision (``scan``)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from app.cli.common import load_engine, progress_printer, set_threads
from engine.errors import InvalidRequestError


def _read_text_file(path: str) -> str:
    from pathlib import Path

    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InvalidRequestError(f"{path} does not exist; give a UTF-8 text file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"cannot read {path} as UTF-8 text: {exc}") from exc


def cmd_eval_ppl(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from engine.evals.perplexity import default_text, perplexity

    for name in ("max_tokens", "context", "stride"):
        if getattr(args, name) < 1:
            raise InvalidRequestError(f"--{name.replace('_', '-')} must be at least 1")
    text_path = args.text or str(default_text())
    text = _read_text_file(text_path)
    engine = load_engine(args)
    result = perplexity(
        engine,
        text,
        text_name=text_path,
        max_tokens=args.max_tokens,
        context=args.context,
        stride=args.stride,
    )
    if args.json:
        print(json.dumps(asdict(result), indent=2))
    else:
        print(
            f"{engine.name} {result.precision}, KV {result.kv_dtype}: perplexity "
            f"{result.perplexity:.3f} over "
            f"{result.scored} tokens of {result.text} (context {result.context}, "
            f"stride {result.stride})"
        )
    return 0


def cmd_eval_compare(args: argparse.Namespace) -> int:
    from app.loading import resolve_device
    from engine.core.sampling import SamplingParams
    from engine.evals.compare import compare_prompt
    from engine.evals.compare_file import document
    from engine.evals.perplexity import DEFAULT_PROMPTS
    from engine.evals.sides import Side
    from engine.quant.spec import parse_precision_spec

    device = resolve_device(args.device)
    parse_precision_spec(args.a, device)
    parse_precision_spec(args.b, device)
    if args.new_tokens < 1:
        raise InvalidRequestError("--new-tokens must be at least 1")
    prompts = DEFAULT_PROMPTS
    if args.prompt is not None:
        prompts = [args.prompt] if args.prompt.strip() else []
    elif args.prompts:
        prompts = [line.strip() for line in _read_text_file(args.prompts).splitlines()]
        prompts = [p for p in prompts if p]
    if not prompts:
        raise InvalidRequestError(f"{args.prompts or '--prompt'} holds no prompt (one per line)")
    side = Side(
        SamplingParams(max_new_tokens=args.new_tokens, temperature=args.temperature,
                       seed=args.seed)
    )  # fmt: skip
    # a KV pool for the longest prompt's answer, not a share of memory: A leaves room for B
    from engine.core.config import EngineConfig

    tokens = max(len(p.encode()) for p in prompts) + 256 + args.new_tokens
    blocks = -(-tokens // 16) + 2
    pool_a = EngineConfig(num_blocks=blocks, kv_dtype=args.a_kv_dtype)
    pool_b = EngineConfig(num_blocks=blocks, kv_dtype=args.b_kv_dtype)
    from engine.kernels import lowbit

    with lowbit.choosing(args.a_lowbit):
        a = load_engine(args, args.a, pool_a)
    b_side = (args.b_model or args.model, args.b, args.b_lowbit)
    same = b_side == (args.model, args.a, args.a_lowbit) and args.a_kv_dtype != args.b_kv_dtype
    if same:  # the same weights, another KV cache: B shares A's model
        b = a.sibling(pool_b)
    else:
        with lowbit.choosing(args.b_lowbit):
            b = load_engine(
                argparse.Namespace(**{**vars(args), "model": args.b_model or args.model}),
                args.b, pool_b,
            )  # fmt: skip
    reports = []
    for i, prompt in enumerate(prompts):
        report = compare_prompt(
            a, b, prompt, side, side, noise=not args.no_noise, speculate=args.speculation
        )
        for name, mode in (("a", args.a_lowbit), ("b", args.b_lowbit)):
            if mode:  # the kernels asked for: the A/B lab's header names them
                report[name]["lowbit"] = mode
        reports.append(report)
        print(f"compared {i + 1}/{len(prompts)}", file=sys.stderr)
    if args.json:
        print(json.dumps(document(reports), indent=1, ensure_ascii=False))
        return 0
    kernels = {side: f" (low-bit kernels: {mode})" if mode else ""
               for side, mode in (("a", args.a_lowbit), ("b", args.b_lowbit))}  # fmt: skip
    kv = {side: f" KV {reports[0][side]['kv_dtype']}" for side in ("a", "b")}
    print(f"A = {reports[0]['a']['precision']}{kv['a']}{kernels['a']}, "
          f"B = {reports[0]['b']['precision']}{kv['b']}{kernels['b']}, "
          f"{args.new_tokens} tokens a prompt; figures on A's output, KL in nats")  # fmt: skip
    print(f"{'KL mean':>9} {'KL p99':>9} {'noise':>9} {'top-1':>6} {'1st diff':>8}  prompt")
    for r in reports:
        s, d = r["summary"], r["divergence"]
        diff = "-" if d["index"] is None else str(d["index"])
        noise = "-" if s["noise_kl_mean"] is None else f"{s['noise_kl_mean']:9.2e}"
        print(f"{s['kl_mean']:9.4f} {s['kl_p99']:9.4f} {noise:>9} {s['top1_agreement']:6.1%} "
              f"{diff:>8}  {r['prompt']}")  # fmt: skip
    n = len(reports)
    mean_kl = sum(r["summary"]["kl_mean"] for r in reports) / n
    top1 = sum(r["summary"]["top1_agreement"] for r in reports) / n
    flips = sum(r["summary"]["flips"] for r in reports)
    print(f"mean KL {mean_kl:.4f} nats, top-1 agreement {top1:.1%}, answers differ in {flips}/{n}")
    for r in reports:
        print(f"\n## {r['prompt']}\nA: {r['a']['text']!r}\nB: {r['b']['text']!r}")
        spec = r["summary"].get("speculative", {})
        if "measured" in spec:
            m = spec["measured"]
            key = "greedy_acceptance" if m["mode"] == "greedy" else "sampling_acceptance"
            print(f"B drafting for A (k = {m['k']}): {m['token_acceptance'] or 0:.1%} of drafted "
                  f"tokens accepted (predicted {spec.get(key) or 0:.1%}), "
                  f"{m['mean_acceptance_length'] or 1:.2f} tokens a step")  # fmt: skip
        elif "not_measured" in spec:
            print(f"B drafting for A: not measured ({spec['not_measured']})")
    return 0


def cmd_eval_scan(args: argparse.Namespace) -> int:
    from app.loading import resolve_device, resolve_model_folder
    from engine.evals.perplexity import default_text, perplexity
    from engine.evals.sensitivity import plan_mixed, scan_sensitivity
    from engine.model.config import ModelConfig
    from engine.model.tokenizer import Tokenizer
    from engine.quant.sizes import estimate_weight_bytes
    from engine.quant.spec import parse_precision_spec

    if args.tokens < 2 or args.ppl_tokens < 2:
        raise InvalidRequestError("--tokens and --ppl-tokens must be at least 2")
    if args.ppl and not args.budget_like:
        raise InvalidRequestError("--ppl compares the plan with --budget-like's spec; give both")
    if args.tensor_parallel != 1:
        raise InvalidRequestError(
            "eval scan runs in one process: it quantizes one block at a time in a model held "
            "whole; drop --tensor-parallel (the mixed: spec it plans loads with "
            "--tensor-parallel too)"
        )
    device = resolve_device(args.device)
    set_threads(args.threads)
    folder = resolve_model_folder(args.model, progress_printer())
    cfg = ModelConfig.from_file(folder / "config.json")
    budget = None
    if args.budget_mib is not None:
        budget = int(args.budget_mib * 2**20)
    elif args.budget_like:
        packed = None if device == "cpu" else False  # as the scan counts a tied head's copy
        budget = estimate_weight_bytes(
            cfg, parse_precision_spec(args.budget_like, device), packed=packed
        )
    text = default_text().read_text(encoding="utf-8")
    ids = Tokenizer.from_folder(folder).encode(text)[: args.tokens]
    scan = scan_sensitivity(
        folder, args.low, high=args.high, text_ids=ids, device=device,
        progress=lambda i, n: print(f"scanned {i}/{n}", file=sys.stderr),
        experts=getattr(args, "experts", False),
    )  # fmt: skip
    out: dict[str, Any] = {"scan": scan.to_dict()}
    plan = plan_mixed(scan, budget) if budget is not None else None
    if plan is not None:
        out["plan"] = plan.to_dict()
    if args.ppl and plan is not None:
        held = default_text()
        ppl = {}
        for spec in (plan.spec, args.budget_like):
            engine = load_engine(argparse.Namespace(**{**vars(args), "model": str(folder)}), spec)
            result = perplexity(engine, held.read_text(encoding="utf-8"), text_name=held.name,
                                max_tokens=args.ppl_tokens)  # fmt: skip
            ppl[spec] = {"perplexity": result.perplexity, "weights_bytes": engine.weights_bytes}
            del engine
        out["perplexity"] = ppl
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    mib = 2**-20
    print(f"{scan.model}: KL(fp32 ‖ one block at {scan.low}) on {scan.text_tokens} tokens, nats")
    print(f"{'layer':>5} {'attn':>10} {'mlp':>10}")
    by_layer: dict[int, dict[str, float]] = {}
    for b in scan.blocks:
        by_layer.setdefault(b.layer, {})[b.part] = b.kl
    for layer, kls in sorted(by_layer.items()):
        print(f"{layer:5d} {kls.get('attn', 0.0):10.2e} {kls.get('mlp', 0.0):10.2e}")
    print(f"every block at {scan.low}: KL {scan.all_low_kl:.4f}; sizes "
          f"{scan.min_bytes * mib:.1f}–{scan.max_bytes * mib:.1f} MiB")  # fmt: skip
    if scan.experts:
        print(f"the costliest experts at {scan.low} (KL from their layer on; share of the "
              "layer's routed tokens):")  # fmt: skip
        for e in scan.experts[:10]:
            print(f"  layer {e.layer:3d} expert {e.expert:4d}  KL {e.kl:.2e}  {e.share:6.1%}")
    if plan is not None:
        print(f"plan for {plan.budget_bytes * mib:.1f} MiB: {plan.spec}")
        print(f"  {plan.bytes * mib:.1f} MiB, {len(plan.upgraded)} blocks at {scan.high}, "
              f"predicted KL {plan.predicted_kl:.4f} (first-order)")  # fmt: skip
    if "perplexity" in out and plan is not None:
        mixed, uniform = (out["perplexity"][s]["perplexity"] for s in (plan.spec, args.budget_like))
        verdict = "beats" if mixed < uniform else "does NOT beat"
        print(f"perplexity over {args.ppl_tokens} tokens of {default_text().name}: plan "
              f"{mixed:.3f}, {args.budget_like} {uniform:.3f}: the plan {verdict} "
              f"{args.budget_like}, the spec of its size")  # fmt: skip
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from app.loading import resolve_device, resolve_model_folder
    from engine.evals.calibrate import Recipe, calibrate
    from engine.loader.load import load_model

    source = "file" if args.from_file else "random" if args.random else "self"
    recipe = Recipe(
        source=source, prompts=args.prompts, samples=args.samples, min_tokens=args.min_tokens,
        max_tokens=args.max_tokens, seed=args.seed, file=args.from_file,
    )  # fmt: skip
    recipe.check()  # bad options fail before the load
    if args.tensor_parallel != 1:
        raise InvalidRequestError(
            "calibrate runs in one process: its statistics need every input channel of each "
            "product, and a split model's ranks each see a part; drop --tensor-parallel (the "
            "calibration file then serves w8a8-sq loads with --tensor-parallel too)"
        )
    text = _read_text_file(args.from_file) if args.from_file and not args.sweep else None
    set_threads(args.threads)
    folder = resolve_model_folder(args.model, progress_printer())
    device = resolve_device(args.device)

    def load(path: Any, **kwargs: Any) -> Any:
        return load_model(path, device=device, **kwargs)

    if args.sweep:
        from engine.evals.calibrate import report_of, sweep
        from engine.model.config import ModelConfig
        from engine.quant import calibration

        cal = calibration.load(folder, recipe.name, ModelConfig.from_file(folder / "config.json"))
        if not cal.held or "float_loss" not in cal.meta:
            raise InvalidRequestError(
                f"calibration {recipe.name!r} of {folder.name} keeps no held text to sweep α "
                "on (it predates that); run `infersight calibrate` again without --sweep"
            )
        sweep(folder, recipe.name, cal, load=load, alphas=recipe.alphas,
              progress=progress_printer())  # fmt: skip
        report = report_of(folder, recipe.name, cal, 0.0)
    else:
        report = calibrate(
            folder, recipe, load=load, precision=args.precision, text=text,
            progress=progress_printer(),
        )  # fmt: skip
    if args.json:
        print(json.dumps(asdict(report), indent=2))
        return 0
    alphas = ", ".join(f"{k.split('.')[-1]} {v:g}" for k, v in report.alphas.items())
    best = ",".join(f"{report.alphas[k]:g}" for k in report.alphas)
    print(
        f"calibration {report.name!r} of {folder.name}: {report.sequences} sequences, "
        f"{report.tokens} tokens ({report.seconds_generating:.0f} s writing); α: {alphas}; "
        f"held loss {report.losses[best]:.4f} against the float model's "
        f"{report.losses['float']:.4f}\n"
        f"saved in {report.path}; load it with --precision w8a8-sq"
        + ("" if report.name == "self" else f"@{report.name}")
    )
    return 0
