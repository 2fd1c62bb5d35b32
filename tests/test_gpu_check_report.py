"""gpu-check's record (checks/gpu/report.py): a lent GPU's run is cut at its limit, so each check
has a time limit of its own, the JSON says which check is running and holds every result as it
ends, and a check stuck where no signal handler runs (native code) still leaves the JSON
behind."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from checks.gpu.common import Skip
from checks.gpu.report import Report

ROOT = Path(__file__).resolve().parent.parent


def test_each_check_is_written_as_it_starts_and_ends_and_a_slow_one_is_stopped(tmp_path):
    path = tmp_path / "gpu-check.json"
    report = Report(path, dry_run=True, budget_s=60, mode="full")
    seen: list[dict[str, Any]] = []

    def looks(figures: dict[str, Any]) -> None:
        seen.append(json.loads(path.read_text()))
        figures["x"] = 1

    def slow(figures: dict[str, Any]) -> None:
        figures["before"] = "kept"
        try:  # as the engine's own steps do (a kernel's check, a capture): not the timeout
            time.sleep(30)
        except Exception:
            figures["swallowed"] = True
        time.sleep(30)

    def skips(figures: dict[str, Any]) -> None:
        raise Skip("not here")

    report.run("looks", looks, 10)
    started = time.perf_counter()
    report.run("slow", slow, 1.0)
    assert time.perf_counter() - started < 5
    report.run("skips", skips, 10)
    assert seen[0]["gpu_check"]["running"]["name"] == "looks" and seen[0]["checks"] == []
    data = json.loads(path.read_text())
    assert data["gpu_check"]["running"] is None and not data["gpu_check"]["finished"]
    looks_, slow_, skips_ = data["checks"]
    assert looks_["status"] == "passed" and looks_["figures"] == {"x": 1}
    assert slow_["status"] == "failed" and slow_["why"].startswith("timed out")
    assert slow_["figures"] == {"before": "kept"}
    assert skips_["status"] == "skipped" and skips_["why"] == "not here"
    assert not report.finish()
    assert json.loads(path.read_text())["gpu_check"]["finished"]


def test_a_check_past_the_budget_is_skipped_and_says_so(tmp_path):
    report = Report(tmp_path / "r.json", dry_run=True, budget_s=0.0, mode="quick")
    ran: list[bool] = []
    report.run("late", lambda figures: ran.append(True), 30)
    assert not ran
    entry = report.data["checks"][0]
    assert entry["status"] == "skipped" and "budget" in entry["why"]


def test_a_check_stuck_in_native_code_leaves_the_json_and_ends_the_run(tmp_path):
    """The alarm is blocked in the check (as in a CUDA call that never returns): the watchdog
    records it, marks the run finished and exits 124, what earlier checks measured kept."""
    path = tmp_path / "gpu-check.json"
    script = textwrap.dedent(f"""
        import signal, time
        from pathlib import Path
        from checks.gpu.report import Report
        report = Report(Path({str(path)!r}), True, 60, "full", grace_s=0.5)
        report.run("first", lambda figures: figures.update(a=1), 10)
        def stuck(figures):
            figures["got"] = "this far"
            signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGALRM}})
            time.sleep(30)
        report.run("stuck", stuck, 0.5)
        print("not reached")
    """)
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert run.returncode == 124, run.stdout + run.stderr
    assert "not reached" not in run.stdout
    data = json.loads(path.read_text())
    assert [c["status"] for c in data["checks"]] == ["passed", "failed"]
    stuck = data["checks"][1]
    assert "stuck in native code" in stuck["why"] and stuck["figures"] == {"got": "this far"}
    assert data["gpu_check"]["finished"] and not data["gpu_check"]["passed"]
    assert 'gpu-check-result {"name": "stuck"' in run.stdout


def test_only_a_check_that_does_not_exist_is_refused_by_name(capsys):
    from checks.gpu import run

    assert run.main(["--dry-run", "--only", "nothing"]) == 2
    out = capsys.readouterr().out
    assert "no check is named like ['nothing']" in out and "triton kernels" in out
