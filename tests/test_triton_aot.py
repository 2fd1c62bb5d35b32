"""Every configuration of our Triton kernels builds for sm_75, 80, 86, 89 and 90 with no GPU
present, within each architecture's shared memory (``python -m engine.kernels.triton_aot``,
run without the interpreter the other tests use)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from engine.kernels import triton_aot, triton_support

ROOT = Path(__file__).resolve().parent.parent


def test_every_kernel_configuration_builds_for_every_target():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "engine.kernels.triton_aot", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert run.returncode in (0, 1), run.stderr[-4000:]
    report = json.loads(run.stdout)
    bad = [r for r in report["results"] if not r["ok"]]
    assert not bad, bad
    built = {(r["kernel"], r["target"]) for r in report["results"]}
    configs = triton_aot.configurations()
    assert configs  # the kernels declare what they launch
    want = {
        (c.name, f"sm_{t}") for c in configs for t in triton_support.TARGETS if t >= c.min_target
    }
    assert built == want  # every configuration, every architecture it is for


def test_the_build_refuses_the_interpreter():
    run = subprocess.run(
        [sys.executable, "-m", "engine.kernels.triton_aot"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )  # fmt: skip
    assert run.returncode == 2 and "unset TRITON_INTERPRET" in run.stderr
