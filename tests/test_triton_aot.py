"""The ahead-of-time build of our Triton kernels (``python -m engine.kernels.triton_aot``, run
whole by ``make test`` beside the tests): it builds for real GPUs with no GPU here, refuses
what a GPU's compiler refuses, and fails a kernel that needs more shared memory than an
architecture has. These run Triton's real compiler, so in a child process without the
interpreter the other tests use."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from engine.kernels import triton_aot, triton_support

ROOT = Path(__file__).resolve().parent.parent


def compiler(code: str, tmp_path: Path, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    """Run ``code`` with Triton's real compiler (no interpreter)."""
    script = tmp_path / "build.py"
    script.write_text(textwrap.dedent(code))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{tmp_path}"
    return subprocess.run(
        [sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True,
        timeout=timeout, env=env,
    )  # fmt: skip


def test_one_configuration_of_each_kernel_builds_for_turing_and_hopper(tmp_path):
    """The full build (every configuration, every architecture) runs in ``make test``; here
    the first configuration of each kernel module, for the oldest and the newest target."""
    run = compiler(
        """
        import json
        from engine.kernels import triton_aot
        firsts = {}
        for c in triton_aot.configurations():
            firsts.setdefault(c.fn.fn.__module__, c)
        rows = [triton_aot.build(c.name, t) for c in firsts.values() for t in (75, 90)
                if t >= c.min_target]
        print(json.dumps(rows))
        """,
        tmp_path,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    rows = json.loads(run.stdout.strip().splitlines()[-1])
    modules = {c.fn.fn.__module__ for c in triton_aot.configurations()}
    assert len(modules) >= 4  # decode, prefill, the GEMMs, the fused norm and RoPE
    assert rows and all("error" not in r and r["cubin_bytes"] > 0 for r in rows), rows


def test_the_build_refuses_what_a_gpus_compiler_refuses(tmp_path):
    """A ``tl.dot`` of fp32 by fp16, which the interpreter runs, is refused by the build."""
    (tmp_path / "bad_kernel.py").write_text(
        textwrap.dedent(
            """
            import triton
            import triton.language as tl

            @triton.jit
            def mixed_dot(a, b, out):
                i = tl.arange(0, 16)
                x = tl.load(a + i[:, None] * 16 + i[None, :])
                y = tl.load(b + i[:, None] * 16 + i[None, :])
                tl.store(out + i[:, None] * 16 + i[None, :], tl.dot(x, y))
            """
        )
    )
    run = compiler(
        """
        from bad_kernel import mixed_dot
        from engine.kernels.triton_aot import build
        from engine.kernels.triton_support import KernelConfig
        import engine.kernels.triton_aot as aot
        config = KernelConfig("mixed_dot", mixed_dot,
                              {"a": "*fp32", "b": "*fp16", "out": "*fp32"})
        aot.configurations = lambda: [config]
        print(build("mixed_dot", 80))
        """,
        tmp_path,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert "'ok': False" in run.stdout and "error" in run.stdout


def test_a_kernel_over_an_architectures_shared_memory_fails_there_only():
    row = {"kernel": "k", "target": "sm_80", "shared_bytes": 120 * 1024}
    assert triton_aot.judged(row, 80)["ok"]  # Ampere (A100): 163 KiB
    rtx = triton_aot.judged(row, 86)  # an RTX 30xx: 99 KiB
    assert not rtx["ok"] and "has 101376" in rtx["error"]
    assert triton_support.SHARED_MEMORY[75] < triton_support.SHARED_MEMORY[86]


def test_the_build_refuses_the_interpreter():
    run = subprocess.run(
        [sys.executable, "-m", "engine.kernels.triton_aot"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )  # fmt: skip
    assert run.returncode == 2 and "unset TRITON_INTERPRET" in run.stderr
