"""``make eval-serving``: what INT8 and INT4 cost, scored the way quantized models are scored,
by lm-evaluation-harness's ``local-completions`` against ``infersight serve``.

For each precision, a server on a free port and two multiple-choice tasks of our own (no
dataset download): ``infersight_mc`` (the test suite's twelve questions, tests/data/lm_eval)
and ``infersight_sums`` (generated here: "What is a + b?" with four numeric answers, seeded).
Each choice's loglikelihood comes back per document; the table gives, per precision and task,
the accuracy, the picks that differ from fp32's, and the shift of the loglikelihoods against
fp32's (mean |Δ| over every choice, and the mean Δ of the right answer's).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import urllib.request
from datetime import date
from pathlib import Path
from typing import Any

from checks.serve_process import serving

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "lm_eval"


def sums_task(folder: Path, count: int, seed: int = 0) -> None:
    """``infersight_sums``: ``count`` sums of two numbers below 50, four answers each."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randrange(1, 50), rng.randrange(1, 50)
        wrong = rng.sample([x for x in range(2, 99) if x != a + b], 3)
        choices = [str(x) for x in [a + b, *wrong]]
        rng.shuffle(choices)
        rows.append({"question": f"What is {a} + {b}? Answer:", "choices": choices,
                     "answer": choices.index(str(a + b))})  # fmt: skip
    (folder / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = (DATA / "infersight_mc.yaml").read_text()
    task = task.replace("task: infersight_mc", "task: infersight_sums")
    (folder / "infersight_sums.yaml").write_text(
        task.replace("DATA_FILE", str(folder / "sums.jsonl"))
    )
    mc = (DATA / "infersight_mc.yaml").read_text().replace("DATA_FILE", str(DATA / "mc.jsonl"))
    (folder / "infersight_mc.yaml").write_text(mc)


def score(base: str, folder: Path, tasks: list[str]) -> dict[str, Any]:
    """lm-eval through the server: per task, the accuracy and each document's choices'
    loglikelihoods and right answer."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as resp:
        name = json.loads(resp.read())["data"][0]["id"]
    out = simple_evaluate(
        model="local-completions",
        model_args=f"base_url={base}/v1/completions,model={name},batch_size=8,num_concurrent=1,"
        "max_retries=1,tokenized_requests=True",
        tasks=tasks, log_samples=True,
        task_manager=TaskManager(include_path=str(folder), include_defaults=False),
    )  # fmt: skip
    result = {}
    for task in tasks:
        samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
        result[task] = {
            "acc": out["results"][task]["acc,none"],
            "lls": [[float(r[0][0]) for r in s["resps"]] for s in samples],
            "target": [int(s["target"]) for s in samples],
        }
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m checks.eval_serving", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--model", default="default")
    parser.add_argument("--precisions", nargs="+", default=["fp32", "int8+head", "int4-g32+head"])
    parser.add_argument("--sums", type=int, default=100, help="documents of infersight_sums")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    os.environ.setdefault("OPENAI_API_KEY", "none")
    tasks = ["infersight_mc", "infersight_sums"]
    scores: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        sums_task(folder, args.sums)
        for precision in args.precisions:
            with serving(args.model, precision, folder / "serve.log") as base:
                scores[precision] = score(base, folder, tasks)
    ref = scores[args.precisions[0]]
    print(f"\nlm-eval local-completions against infersight serve ({args.model}), {date.today()}\n")
    print(f"| precision | task | documents | accuracy | picks unlike {args.precisions[0]} | "
          f"mean abs Δ loglik | mean Δ loglik of the answer |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for precision, by_task in scores.items():
        for task, got in by_task.items():
            base_lls, lls = ref[task]["lls"], got["lls"]
            picks = sum(
                max(range(len(a)), key=a.__getitem__) != max(range(len(b)), key=b.__getitem__)
                for a, b in zip(base_lls, lls, strict=True)
            )
            deltas = [y - x for a, b in zip(base_lls, lls, strict=True)
                      for x, y in zip(a, b, strict=True)]  # fmt: skip
            right = [b[t] - a[t] for a, b, t in zip(base_lls, lls, got["target"], strict=True)]
            shift = sum(map(abs, deltas)) / len(deltas)
            print(f"| {precision} | {task} | {len(lls)} | {got['acc']:.3f} | {picks} | "
                  f"{shift:.4f} | {sum(right) / len(right):+.4f} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(scores))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
