"""``infersight bench --workload structured``: what holding replies to a JSON schema costs.

A batch of requests at temperature 1 (where a grammar masks most) runs twice on one engine,
interleaved ``repeats`` times: free, and held to the schema (:mod:`engine.core.structured`).
Per pass: decode steps, their mean time, tokens per second, and for the held pass the mask's
own time per step (llguidance filling the bit rows plus our masking), and its share of the
step. Replies held to a schema end where the schema does, so the passes are compared per
step, not per reply.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.bench.report import text_table
from engine.core.engine import LLMEngine
from engine.core.sampling import SamplingParams
from engine.core.structured import Constraint
from engine.loader.load import load_model

#: the schema benched when none is given: a small record, as tools and extractors ask
DEFAULT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "population": {"type": "integer", "minimum": 0},
        "coastal": {"type": "boolean"},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 24},
                      "maxItems": 3},
    },
    "required": ["city", "population", "coastal", "landmarks"],
    "additionalProperties": False,
}  # fmt: skip


def _pass(engine: LLMEngine, prompt: list[int], params: list[SamplingParams]) -> dict[str, float]:
    """One batch to its end: steps, seconds, tokens, and the mask's seconds and steps."""
    grammars = engine.grammars
    mask_s, mask_steps = grammars.mask_s, grammars.mask_steps
    for p in params:
        engine.add_request(prompt, p)
    steps = tokens = 0
    started = time.perf_counter()
    while engine.has_work():
        events = engine.step()
        steps += 1
        tokens += sum(1 for e in events if e.token_id is not None)
    seconds = time.perf_counter() - started
    return {"steps": steps, "seconds": seconds, "tokens": tokens,
            "mask_s": grammars.mask_s - mask_s,
            "mask_steps": grammars.mask_steps - mask_steps}  # fmt: skip


def run_structured_bench(
    folder: Path, *, schema: dict[str, Any] | None = None, batch: int = 8, new_tokens: int = 96,
    repeats: int = 3, seed: int = 0, precision: str = "fp32", device: str = "cpu",
    engine_config: Any = None, log: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:  # fmt: skip
    engine = load_model(folder, precision=precision, device=device, config=engine_config)
    held = Constraint.json_schema(schema or DEFAULT_SCHEMA)
    prompt = engine.chat_prompt_ids([{"role": "user", "content": "Describe a city as JSON."}])
    passes: dict[str, list[dict[str, float]]] = {"free": [], "schema": []}
    _pass(engine, prompt, [SamplingParams(max_new_tokens=4)])  # warm-up
    for r in range(repeats):
        for label, constraint in (("free", None), ("schema", held)):
            params = [
                SamplingParams(
                    max_new_tokens=new_tokens,
                    temperature=1.0,
                    seed=seed + 1000 * r + i,
                    constraint=constraint,
                )
                for i in range(batch)
            ]
            passes[label].append(_pass(engine, prompt, params))
            log(f"{label} pass {r + 1}/{repeats}: {passes[label][-1]['steps']} steps")

    def summary(runs: list[dict[str, float]]) -> dict[str, float]:
        step_ms = statistics.median(1e3 * p["seconds"] / p["steps"] for p in runs)
        mask = [1e3 * p["mask_s"] / p["mask_steps"] for p in runs if p["mask_steps"]]
        return {"steps": statistics.median(p["steps"] for p in runs), "step_ms": step_ms,
                "tok_s": statistics.median(p["tokens"] / p["seconds"] for p in runs),
                "mask_ms_per_step": statistics.median(mask) if mask else 0.0}  # fmt: skip

    return {"model": engine.name, "precision": engine.precision.text, "device": str(engine.device),
            "batch": batch, "new_tokens": new_tokens, "repeats": repeats,
            "schema": json.dumps(schema or DEFAULT_SCHEMA),
            "free": summary(passes["free"]), "held": summary(passes["schema"])}  # fmt: skip


def format_structured_report(report: dict[str, Any]) -> str:
    rows = []
    for label in ("free", "held"):
        r = report[label]
        share = r["mask_ms_per_step"] / r["step_ms"] if r["step_ms"] else 0.0
        rows.append([label, f"{r['steps']:.0f}", f"{r['step_ms']:.2f}", f"{r['tok_s']:.1f}",
                     f"{r['mask_ms_per_step']:.3f}", f"{100 * share:.1f}%"])  # fmt: skip
    head = (f"model {report['model']}  precision {report['precision']}  device "
            f"{report['device']}  batch {report['batch']} at temperature 1, up to "
            f"{report['new_tokens']} tokens, median of {report['repeats']}")  # fmt: skip
    cols = ["pass", "steps", "ms/step", "tok/s", "mask ms/step", "mask share"]
    return "\n".join([head, *text_table(cols, rows)])
