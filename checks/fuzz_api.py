"""schemathesis against ``infersight serve``'s OpenAPI document, at length: every operation,
``--examples`` cases each in the fuzzing phase (plus its coverage phase), checked for no 5xx,
no hang (30 s a request) and every 4xx in OpenAI's error shape (:mod:`checks.fuzz_hooks`).
The server runs with small limits (``max_tokens`` 8, ``n`` 2, 64 KiB bodies) so that each
generated request is short and what is past them is refused at once.

``python -m checks.fuzz_api --examples 1000 --out build/fuzz`` (``make fuzz-api``); prints
schemathesis's summary and writes its JSON report; exit status schemathesis's."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from checks.serve_process import serving_process

KEY = "fuzz-key"
LIMITS = ("--api-key", KEY, "--max-tokens", "8", "--max-n", "2", "--max-body-bytes", "65536",
          "--max-waiting", "16")  # fmt: skip
ROOT = Path(__file__).resolve().parents[1]


def st_run(base: str, examples: int, report: Path) -> list[str]:
    """schemathesis's command line on ``base``'s OpenAPI document with our checks (run it
    with :func:`st_env`): ``examples`` cases an operation, its JSON report in ``report``."""
    return [str(Path(sys.executable).with_name("st")), "run", f"{base}/openapi.json",
            "-H", f"Authorization: Bearer {KEY}", "-c", "not_a_server_error,openai_error_shape",
            "-n", str(examples), "--request-timeout", "30", "--report", "json",
            "--report-dir", str(report), "--no-color"]  # fmt: skip


def st_env() -> dict[str, str]:
    """The environment schemathesis finds our check in (:mod:`checks.fuzz_hooks`)."""
    return {**os.environ, "SCHEMATHESIS_HOOKS": "checks.fuzz_hooks", "PYTHONPATH": str(ROOT)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m checks.fuzz_api", description=__doc__.split("\n")[0]
    )
    p.add_argument("--examples", type=int, default=1000, help="cases per operation (fuzzing)")
    p.add_argument("--model", default="default")
    p.add_argument("--out", type=Path, default=Path("build/fuzz"))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with serving_process(args.model, "fp32", args.out / "serve.log", extra=LIMITS) as (base, _):
        done = subprocess.run(st_run(base, args.examples, args.out), env=st_env(), check=False)
    report = max(args.out.glob("json-*.json"), key=lambda f: f.stat().st_mtime)
    r = json.loads(report.read_text())
    print(f"schemathesis {r['schemathesis_version']}: {r['operations']['tested']} operations, "
          f"{r['test_cases']['generated']} cases, {r['test_cases']['with_failures']} with "
          f"failures, {r['test_cases']['errored']} errored; report {report}")  # fmt: skip
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
