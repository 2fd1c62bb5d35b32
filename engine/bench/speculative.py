"""``infersight bench --workload speculative``: speculative decoding against plain decoding,
side by side in one run, per drafter and k, on two kinds of prompt:

* ``chat``: short questions answered in free prose, where a drafter must guess new text;
* ``grounded``: "fix the bug in this code" with the code in the prompt, where most of the
  answer copies the input (the case prompt lookup is made for).

One engine is loaded once and every drafter is built once (a self-draft's second copy of the
weights, a draft model); each repeat runs every prompt plainly and then under every
(drafter, k) in turn, so a noisy machine hurts all of them alike. Requests are greedy, so each
speculative output must equal the plain one token for token, which the report checks. Each run
starts with an empty prefix cache (else every run after the first would skip its prefill).
Speeds are decode speeds: the tokens after the first over the time from the first to the last
(speculation does not touch the prefill), summed over a workload's prompts, medians over
repeats; ``speedup`` is the ratio of the medians to plain decoding's on the same prompts.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from engine.bench.report import text_table
from engine.core.engine import LLMEngine
from engine.core.sampling import SamplingParams
from engine.loader.drafter import build_drafter
from engine.loader.load import load_model
from engine.speculative.adaptive import measure_costs
from engine.speculative.drafters import Drafter
from engine.speculative.speculator import Speculator

CHAT_PROMPTS = (
    "What is the capital of France? Answer in two sentences.",
    "Explain in a short paragraph why the sky is blue.",
    "Give three tips for writing clear emails.",
)

BUGGY_CODE = (
    """import json


def load_scores(path):
    with open(path) as f:
        data = json.load(f)
    scores = {}
    for entry in data["entries"]:
        name = entry["name"]
        scores[name] = entry["score"]
    return scores


def average(scores):
    total = 0
    for value in scores.values():
        total += value
    return total / len(score)


def best(scores):
    return max(scores, key=scores.get)
""",
    """def parse_line(line):
    parts = line.strip().split(",")
    return {"id": int(parts[0]), "name": parts[1], "qty": int(parts[2])}


def read_orders(lines):
    orders = []
    for line in lines:
        if not line.strip():
            continue
        orders.append(parse_line(line))
    return order


def total_quantity(orders):
    return sum(o["qty"] for o in orders)
""",
)

GROUNDED_PROMPTS = tuple(
    "Fix the bug in this code. Reply with the whole corrected code only.\n\n```python\n"
    + code
    + "```"
    for code in BUGGY_CODE
)

WORKLOADS = {"chat": CHAT_PROMPTS, "grounded": GROUNDED_PROMPTS}


@dataclass(slots=True)
class _Run:
    tokens: int = 0
    seconds: float = 0.0
    draft_tokens: int = 0
    accepted: int = 0
    drafts: int = 0
    per_pos: list[int] | None = None
    per_pos_drafted: list[int] | None = None
    same: bool = True


def run_spec_bench(
    engine: LLMEngine,
    drafters: list[str],
    ks: list[int],
    *,
    adaptive: bool = True,
    new_tokens: int = 128,
    repeats: int = 2,
    workloads: tuple[str, ...] = ("chat", "grounded"),
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Plain decoding and each drafter at each k, on each workload (see the module)."""
    from engine.speculative.config import parse_speculative

    params = SamplingParams(max_new_tokens=new_tokens)
    built: dict[str, Drafter] = {}
    for text in drafters:
        log(f"building the drafter {text} …")
        built[text] = build_drafter(parse_speculative(text, max(ks)), engine, load_model)
    costs = {name: measure_costs(engine.model, engine.kv, d, max(ks)) for name, d in built.items()}
    verify = next(iter(costs.values()))[0]
    log(f"verify cost: {verify.fixed:.2f} + {verify.per_token:.3f}·k of a decode step")
    configs = [(text, k) for text in drafters for k in ks]
    results: dict[tuple[str, str, int], list[_Run]] = {}
    plain_out: dict[tuple[str, int], list[int]] = {}
    try:
        for repeat in range(repeats):
            for workload in workloads:
                for pi, text in enumerate(WORKLOADS[workload]):
                    prompt = engine.chat_prompt_ids([{"role": "user", "content": text}])
                    engine.speculator = None
                    plain_run, plain_tokens = _generate(engine, prompt, params)
                    plain_out.setdefault((workload, pi), plain_tokens)
                    results.setdefault((workload, "plain", 0), []).append(plain_run)
                    for name, k in configs:
                        config = replace(
                            parse_speculative(name, k), adaptive=adaptive, verify_cost=verify
                        )
                        engine.speculator = Speculator(config, built[name], verify,
                                                       costs[name][1])  # fmt: skip
                        got, tokens = _generate(engine, prompt, params)
                        got.same = tokens == plain_out[(workload, pi)]
                        results.setdefault((workload, name, k), []).append(got)
                    log(f"repeat {repeat + 1}/{repeats}: {workload} prompt {pi + 1} done")
    finally:
        engine.speculator = None
        for drafter in built.values():
            drafter.close()
    return _report(results, engine, drafters, ks, adaptive, new_tokens, repeats, verify)


def _generate(
    engine: LLMEngine, prompt: list[int], params: SamplingParams
) -> tuple[_Run, list[int]]:
    spec = engine.speculator
    before = None
    if spec is not None:
        s = spec.stats
        before = (s.num_draft_tokens, s.num_accepted_tokens, s.num_drafts,
                  list(s.accepted_tokens_per_pos), list(s.draft_tokens_per_pos))  # fmt: skip
    engine.clear_prefix_cache()
    gen = engine.generate(prompt, params)
    for _ in gen:
        pass
    n = len(gen.result.token_ids)
    run = _Run(tokens=n - 1, seconds=(gen.result.tpot_s or 0.0) * (n - 1))
    if spec is not None and before is not None:
        s = spec.stats
        run.draft_tokens = s.num_draft_tokens - before[0]
        run.accepted = s.num_accepted_tokens - before[1]
        run.drafts = s.num_drafts - before[2]
        run.per_pos = _minus(s.accepted_tokens_per_pos, before[3])
        run.per_pos_drafted = _minus(s.draft_tokens_per_pos, before[4])
    return run, gen.result.token_ids


def _minus(now: list[int], before: list[int]) -> list[int]:
    return [n - (before[i] if i < len(before) else 0) for i, n in enumerate(now)]


def _report(
    results: dict[tuple[str, str, int], list[_Run]], engine: LLMEngine, drafters: list[str],
    ks: list[int], adaptive: bool, new_tokens: int, repeats: int, verify: Any,
) -> dict[str, Any]:  # fmt: skip
    rows: list[dict[str, Any]] = []
    for (workload, name, k), runs in results.items():
        per_repeat = _per_repeat(runs, repeats)
        tps = statistics.median(t / s for t, s in per_repeat)
        drafted = sum(r.draft_tokens for r in runs)
        accepted = sum(r.accepted for r in runs)
        drafts = sum(r.drafts for r in runs)
        pos_acc: list[int] = []
        pos_all: list[int] = []
        for r in runs:
            for i, (a, d) in enumerate(zip(r.per_pos or [], r.per_pos_drafted or [], strict=True)):
                if i >= len(pos_acc):
                    pos_acc.append(0)
                    pos_all.append(0)
                pos_acc[i] += a
                pos_all[i] += d
        rows.append({
            "workload": workload, "drafter": name, "k": k, "tokens_per_s": tps,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "acceptance_per_pos": [a / d if d else 0.0 for a, d in zip(pos_acc, pos_all,
                                                                        strict=True)],
            "same_output": all(r.same for r in runs),
        })  # fmt: skip
    plain = {r["workload"]: r["tokens_per_s"] for r in rows if r["drafter"] == "plain"}
    for row in rows:
        row["speedup"] = row["tokens_per_s"] / plain[row["workload"]]
    best = {}
    for workload in plain:
        for name in drafters:
            mine = [r for r in rows if r["workload"] == workload and r["drafter"] == name]
            if mine:
                top = max(mine, key=lambda r: r["tokens_per_s"])
                best[f"{workload}/{name}"] = {"k": top["k"], "speedup": top["speedup"]}
    return {
        "model": engine.name,
        "precision": engine.precision.text,
        "device": str(engine.device),
        "new_tokens": new_tokens,
        "repeats": repeats,
        "adaptive": adaptive,
        "verify_cost": {"fixed": verify.fixed, "per_token": verify.per_token},
        "rows": rows,
        "best_k": best,
    }


def _per_repeat(runs: list[_Run], repeats: int) -> list[tuple[int, float]]:
    """Each repeat's total tokens and seconds over the workload's prompts."""
    per = len(runs) // repeats
    return [
        (sum(r.tokens for r in runs[i * per : (i + 1) * per]),
         sum(r.seconds for r in runs[i * per : (i + 1) * per]))
        for i in range(repeats)
    ]  # fmt: skip


def format_spec_report(report: dict[str, Any]) -> str:
    def pct(v: float | None) -> str:
        return "" if v is None else f"{100 * v:.0f}%"

    lines = [
        f"speculative decoding: {report['model']} {report['precision']} on {report['device']}, "
        f"greedy, {report['new_tokens']} new tokens, decode speed, median of {report['repeats']}, "
        f"k {'adaptive up to' if report['adaptive'] else 'fixed at'} the k shown; verifying "
        f"costs {report['verify_cost']['fixed']:.2f} + {report['verify_cost']['per_token']:.3f}·k "
        "of a decode step here",
    ]
    cols = ["workload", "drafter", "k", "decode tok/s", "speedup", "accepted", "tokens/step",
            "per position", "same output"]  # fmt: skip
    rows = []
    for r in report["rows"]:
        plain = r["drafter"] == "plain"
        rows.append([
            r["workload"], _short(r["drafter"]), "" if plain else str(r["k"]),
            f"{r['tokens_per_s']:.1f}", f"{r['speedup']:.2f}×",
            pct(r["acceptance_rate"]),
            "" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.2f}",
            " ".join(f"{100 * a:.0f}" for a in r["acceptance_per_pos"][:8]),
            "" if plain else ("yes" if r["same_output"] else "NO"),
        ])  # fmt: skip
    lines += text_table(cols, rows)
    lines.append("best k: " + ", ".join(
        f"{_short(key)} k={v['k']} ({v['speedup']:.2f}×)" for key, v in report["best_k"].items()
    ))  # fmt: skip
    return "\n".join(lines)


def _short(name: str) -> str:
    """``model:/long/path/NAME`` as ``model:NAME``."""
    head, sep, path = name.rpartition("model:")
    return f"{head}model:{path.rstrip('/').rsplit('/', 1)[-1]}" if sep else name
