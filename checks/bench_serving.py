"""``make bench-serving``: GuideLLM, the standard load generator, against ``infersight serve``.

For each precision, a server on a free port; for each route (``/v1/completions`` and
``/v1/chat/completions``) GuideLLM's synchronous profile and its concurrent one at each
number of streams, on synthetic prompts of ``--prompt-tokens`` asking ``--output-tokens`` with
``ignore_eos`` (as GuideLLM sends it). It prints one table (and writes it as JSON with
``--json``): requests, errors, the output tokens every request got (each must be the number
asked: a load generator's counts are only true if ``ignore_eos`` holds), TTFT and ITL medians,
output tokens per second, and whether ``/metrics`` counted exactly the tokens GuideLLM saw.

GuideLLM lives in a venv of its own (``.peers/guidellm``, built by the make target); it is a
client here, never imported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import urllib.request
from datetime import date
from pathlib import Path
from typing import Any

from checks.serve_process import serving

ROUTES = ("/v1/completions", "/v1/chat/completions")


def generation_tokens(base: str) -> float:
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("vllm:generation_tokens_total"))  # fmt: skip


def guidellm(
    exe: str, base: str, route: str, profile: str, count: int, tokenizer: str, args: Any,
    out: Path,
) -> dict[str, Any]:  # fmt: skip
    """One GuideLLM run; its report's first benchmark."""
    cmd = [
        exe, "run", "--backend", f"kind=openai_http,target={base},request_format={route}",
        "--profile", profile, "--constraint", f"kind=max_requests,count={count}",
        "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},"
        f"output_tokens={args.output_tokens}",
        "--tokenizer", f"kind=hf_auto,model={tokenizer}",
        "--output", f"kind=json,path={out}", "--disable-progress",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"guidellm failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return json.loads(out.read_text())["benchmarks"][0]


def row(
    precision: str, route: str, profile: str, bench: dict[str, Any], counted: float
) -> dict[str, Any]:
    reqs = bench["requests"]
    ok = reqs["successful"]
    outputs = sorted({r["output_tokens"] for r in ok})
    ttft = [r["time_to_first_token_ms"] for r in ok if r["time_to_first_token_ms"] is not None]
    itl = [r["inter_token_latency_ms"] for r in ok if r["inter_token_latency_ms"] is not None]
    seen = sum(r["output_tokens"] for r in ok)
    return {
        "precision": precision, "route": route, "profile": profile, "requests": len(ok),
        "errors": len(reqs["errored"]) + len(reqs["incomplete"]),
        "output_tokens_per_request": outputs,
        "ttft_ms_p50": round(statistics.median(ttft), 1) if ttft else None,
        "itl_ms_p50": round(statistics.median(itl), 2) if itl else None,
        "output_tok_s": round(seen / bench["duration"], 1),
        "metrics_equal": counted == seen,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m checks.bench_serving", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--guidellm", required=True, help="GuideLLM's executable")
    parser.add_argument("--model", default="default")
    parser.add_argument("--precisions", nargs="+", default=["fp32", "int8+head", "int4-g32+head"])
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--requests", type=int, default=8, help="per synchronous run")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    from app.loading import resolve_model_folder

    tokenizer = str(resolve_model_folder(args.model))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for precision in args.precisions:
            with serving(args.model, precision, Path(tmp) / "serve.log") as base:
                for route in ROUTES:
                    profiles = [("kind=synchronous", args.requests)] + [
                        (f"kind=concurrent,streams={n}", 2 * n) for n in args.streams
                    ]
                    for profile, count in profiles:
                        before = generation_tokens(base)
                        bench = guidellm(args.guidellm, base, route, profile, count, tokenizer,
                                         args, Path(tmp) / "out.json")  # fmt: skip
                        counted = generation_tokens(base) - before
                        rows.append(row(precision, route, profile.split("=", 1)[1], bench,
                                        counted))  # fmt: skip
                        print(json.dumps(rows[-1]), flush=True)
    print(f"\nGuideLLM against infersight serve, {date.today()}, {args.prompt_tokens} prompt / "
          f"{args.output_tokens} output tokens, ignore_eos\n")  # fmt: skip
    print("| precision | route | profile | requests | errors | output tokens each | TTFT p50 ms "
          "| ITL p50 ms | output tok/s | /metrics equal |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['precision']} | {r['route']} | {r['profile']} | {r['requests']} | "
              f"{r['errors']} | {r['output_tokens_per_request']} | {r['ttft_ms_p50']} | "
              f"{r['itl_ms_p50']} | {r['output_tok_s']} | {r['metrics_equal']} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    exact = all(r["output_tokens_per_request"] == [args.output_tokens] and not r["errors"]
                and r["metrics_equal"] for r in rows)  # fmt: skip
    print(
        "\nevery request got exactly the tokens asked, and /metrics agrees"
        if exact
        else "\nSOME REQUESTS DID NOT GET THE TOKENS ASKED (or /metrics disagrees): see the rows"
    )
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
