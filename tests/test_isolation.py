"""What a lowered CPU level compiles stays apart from the CPU's own cache, and a probe that
crashes natively is a verdict, not the end of the process (engine/hardware/cpu_paths.py,
engine/hardware/isolated.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.executor import inductor
from engine.hardware import cpu_paths, isolated
from engine.hardware.cpu_paths import LEVELS, native_level
from engine.kernels import native, paged_decode

ROOT = Path(__file__).resolve().parent.parent

#: A level below this CPU's own: AVX2 on an AVX-512 CPU, DEFAULT on an AVX2 one.
LOWER = (
    LEVELS[LEVELS.index(native_level()) - 1]
    if native_level() in LEVELS and native_level() != "DEFAULT"
    else None
)

COMPILE = """
import json, torch
from engine.executor.inductor import compile_forward
from torch._inductor.runtime.cache_dir_utils import cache_dir
def f(x):
    return torch.nn.functional.silu(x) * x + 1
x = torch.linspace(-2, 2, 16)
try:
    same = bool(torch.allclose(compile_forward(f)(x), f(x)))
except Exception as exc:  # Inductor's own error, raised in Python: the engine then runs eagerly
    same = repr(exc)[:300]
print(json.dumps({"same": same, "cache": cache_dir()}))
"""


def _compile_in_child(env: dict[str, str]) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", COMPILE], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(LOWER is None, reason=f"no level below this CPU's ({native_level()})")
def test_a_lowered_level_compiles_into_a_cache_of_its_own(tmp_path: Path) -> None:
    """The order that corrupted the heap on an AVX-512 CPU (torch 2.13): a process at a
    lowered level compiles first, then one at the CPU's own level finds the same cache root."""
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY",
           cpu_paths.FORCE_ENV)}  # fmt: skip
    env[cpu_paths.INDUCTOR_CACHE_ENV] = str(tmp_path / "inductor")
    env["INFERSIGHT_HOME"] = str(tmp_path / "home")
    assert LOWER is not None
    lowered = _compile_in_child(
        {**env, "ATEN_CPU_CAPABILITY": LOWER.lower(), cpu_paths.FORCE_ENV: LOWER}
    )
    native = _compile_in_child(env)
    assert native["same"] is True
    # At DEFAULT (the level below an AVX2 CPU's) torch 2.13's Inductor has been seen to emit
    # code it cannot compile: an error in Python, which the engine's probe turns into "eager"
    # (never a crash). Anything else must compile and be right.
    assert lowered["same"] is True or (LOWER == "DEFAULT" and "Error" in str(lowered["same"]))
    assert native["cache"] == str(tmp_path / "inductor")
    assert lowered["cache"] == f"{tmp_path / 'inductor'}-cpu-{LOWER.lower()}"


def test_the_cache_follows_the_level_torch_compiles_for(monkeypatch, tmp_path) -> None:
    """The cache's level is the one TorchInductor generates code for: ``ATEN_CPU_CAPABILITY``
    as torch reads it (exact lowercase names), below the CPU's own. Our switch alone lowers
    the probes' answers, not the generated code, so it keeps the user's cache."""
    monkeypatch.setenv(cpu_paths.INDUCTOR_CACHE_ENV, str(tmp_path / "c"))
    monkeypatch.delenv(cpu_paths.FORCE_ENV, raising=False)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    assert cpu_paths.compile_cache_dir() == str(tmp_path / "c")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", native_level().lower())  # its own level
    assert cpu_paths.forced_level() is None
    assert cpu_paths.compile_cache_dir() == str(tmp_path / "c")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "DEFAULT")  # torch ignores this spelling
    assert cpu_paths.forced_level() is None
    assert cpu_paths.compile_cache_dir() == str(tmp_path / "c")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    if native_level() != "DEFAULT":
        assert cpu_paths.forced_level() == "DEFAULT"
        assert cpu_paths.compile_cache_dir() == f"{tmp_path / 'c'}-cpu-default"
    monkeypatch.setenv(cpu_paths.FORCE_ENV, "AVX2")  # the lower of the two holds
    assert cpu_paths.forced_level() == "DEFAULT"
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    assert cpu_paths.forced_level() == "AVX2"
    assert cpu_paths.compile_cache_dir() == str(tmp_path / "c")  # the CPU's own code
    # a child of a lowered process inherits its folder; at its own level it goes back
    monkeypatch.setenv(cpu_paths.INDUCTOR_CACHE_ENV, f"{tmp_path / 'c'}-cpu-avx2")
    monkeypatch.delenv(cpu_paths.FORCE_ENV)
    assert cpu_paths.compile_cache_dir() == str(tmp_path / "c")


# -- probes that crash -------------------------------------------------------------------


def crash() -> str:
    """A probe that dies as a corrupted heap does: SIGABRT."""
    os.abort()


def fine() -> str:
    return ""


def killed() -> str:
    """A probe the machine stops (the OOM killer's SIGKILL): not the probe's fault."""
    os.kill(os.getpid(), signal.SIGKILL)
    return "never"


@pytest.fixture()
def probe_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("INFERSIGHT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_a_crashing_probe_is_a_verdict_kept_for_the_next_load(probe_home: Path) -> None:
    why = isolated.verdict("crash", f"{__name__}:crash", "machine A")
    assert why.startswith("the probe crashed (SIGABRT)")
    kept = json.loads((probe_home / isolated.FILE).read_text())
    assert kept == {"machine A": {"crash": why}}
    assert isolated.verdict("fine", f"{__name__}:fine", "machine A") == ""
    # read back, not run again: a probe that would now pass keeps the kept verdict
    assert isolated.verdict("crash", f"{__name__}:fine", "machine A") == why


def test_a_probe_the_machine_stopped_is_asked_again_at_the_next_load(probe_home: Path) -> None:
    why = isolated.verdict("k", f"{__name__}:killed", "machine B")
    assert why == "the probe was stopped (SIGKILL)"
    assert not (probe_home / isolated.FILE).exists()  # nothing kept
    assert isolated.verdict("k", f"{__name__}:fine", "machine B") == ""  # asked again


def test_a_compiler_crash_is_reported_and_the_load_stays_eager(
    probe_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(inductor.PROBE, "cpu", f"{__name__}:crash")
    inductor.compiler_problem.cache_clear()
    try:
        choice = inductor.choose("on", torch.device("cpu"))
    finally:
        inductor.compiler_problem.cache_clear()
    assert not choice.compiled
    assert choice.why.startswith("cannot compile here (the probe crashed (SIGABRT)")


def test_a_paged_kernel_that_crashes_its_check_leaves_the_portable_path(
    probe_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if native.compiler() is None or cpu_paths.forced_level() == "DEFAULT":
        pytest.skip("no paged kernel is built here")
    monkeypatch.setattr(paged_decode, "PROBE", f"{__name__}:crash")
    paged_decode.kernel.cache_clear()
    try:
        found = paged_decode.kernel()
    finally:
        paged_decode.kernel.cache_clear()
    assert not found.available
    assert "the paged kernel failed its check: the probe crashed (SIGABRT)" in found.why
