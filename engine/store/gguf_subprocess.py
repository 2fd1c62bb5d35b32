"""The GGUF import (:func:`engine.store.gguf_import.import_gguf`) run in a child Python
process: the GGUF reader, the tokenizer's tables and each large tensor's dequantization hold the
GIL for 0.1–0.3 s at a time (2-core CPU), which would freeze a window (or a server) in the
process that asked; the child streams its progress back, and the callback can still cancel it.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine import errors
from engine.errors import InfersightError, ModelLoadError
from engine.hardware.isolated import python_command
from engine.store.gguf_import import GGUFSummary, Progress, import_gguf

#: seconds without a word from the child after which the progress callback is called again
#: with the last progress (so that a cancel is seen while one long step runs)
_SILENCE_S = 0.5
#: seconds a cancelled child gets to end by itself before it is killed
_TERMINATE_S = 5.0


def import_gguf_in_subprocess(
    src: Path,
    dest: Path,
    *,
    dtype: str = "fp16",
    progress: Progress | None = None,
    sampling: Mapping[str, Any] | None = None,
) -> GGUFSummary:
    """:func:`import_gguf`, run by a child Python process, so that this process keeps its GIL
    (a window stays responsive while a model converts).

    The child reports each progress step on a pipe and this process calls ``progress`` with
    it (and again with the last one after each :data:`_SILENCE_S` of silence); a callback that
    raises stops the child and the import, leaving nothing behind, and the exception goes on.
    The child converts into a folder of this process (``.<dest name>.partial-*`` beside
    ``dest``), renamed into place once it is complete, so a child that is killed or dies
    leaves no half model either. The child's :class:`~engine.errors.InfersightError` is
    raised here as the same class with the same message; anything else it meets becomes a
    :class:`~engine.errors.ModelLoadError` saying what happened. A frozen build (PyInstaller),
    where ``sys.executable`` is the app and not Python, converts in this process."""
    if getattr(sys, "frozen", False):
        return import_gguf(src, dest, dtype=dtype, progress=progress, sampling=sampling)
    if dest.exists() and any(dest.iterdir()):
        raise ModelLoadError(f"{dest} already exists and is not empty; remove it or pick another")
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
    try:
        job = {
            "src": str(Path(src).absolute()),
            "dest": str(work / dest.name),
            "dtype": dtype,
            "sampling": None if sampling is None else dict(sampling),
        }
        summary = _run_child(job, src, progress)
        if dest.exists():
            dest.rmdir()  # empty (checked above)
        os.replace(work / dest.name, dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return summary


def _run_child(job: dict[str, Any], src: Path, progress: Progress | None) -> GGUFSummary:
    """Run :func:`_child_main` on ``job`` in a fresh Python and follow its reports to the end."""
    cmd = python_command(f"{__name__}:_child_main", json.dumps(job))
    with tempfile.TemporaryFile() as stderr:
        try:
            child = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr
            )
        except OSError as exc:
            raise ModelLoadError(
                f"could not start Python ({sys.executable}) to convert {src.name}: {exc}"
            ) from exc
        with child:  # its pipe closed and the child waited for, whatever happens
            try:
                result = _follow_child(child, progress)
            except BaseException:
                _stop_child(child)
                raise
        if result is None:  # it ended without a word: killed, or crashed in native code
            stderr.seek(0)
            lines = stderr.read().decode("utf-8", "replace").strip().splitlines()
            said = f"; it said: {lines[-1]}" if lines else ""
            raise ModelLoadError(
                f"converting {src.name} stopped unexpectedly (exit status {child.returncode})"
                f"{said}. Check the free memory and disk space, then try again"
            )
    if "error" in result:
        name, message = result["error"]
        cls = getattr(errors, str(name), None)
        if not (isinstance(cls, type) and issubclass(cls, InfersightError)):
            cls = ModelLoadError
        raise cls(str(message))
    done = result["done"]
    return GGUFSummary(done["architecture"], done["name"], done["tensor_types"], done["config"])


def _follow_child(child: subprocess.Popen[bytes], progress: Progress | None) -> Any:
    """Pass the child's progress to ``progress`` until it ends; its last report (``{"done":
    …}`` or ``{"error": …}``), or ``None`` when it ended without one."""
    assert child.stdout is not None
    lines: queue.Queue[bytes | None] = queue.Queue()

    def read() -> None:  # a thread, so that waiting here is never stuck in a blocking read
        assert child.stdout is not None
        for line in child.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, name="gguf-import-child", daemon=True).start()
    last: tuple[str, int, int] | None = None
    result: Any = None
    while True:
        try:
            line = lines.get(timeout=_SILENCE_S)
        except queue.Empty:
            if progress and last:
                progress(*last)  # where a cancel is noticed while a long step runs
            continue
        if line is None:
            break
        try:
            report = json.loads(line)
        except ValueError:
            continue
        if not isinstance(report, dict):
            continue
        if "progress" in report:
            stage, done, total = report["progress"]
            last = (str(stage), int(done), int(total))
            if progress:
                progress(*last)
        elif "done" in report or "error" in report:
            result = report
    child.wait()
    return result


def _stop_child(child: subprocess.Popen[bytes]) -> None:
    """End the child: asked first, killed if it does not go within :data:`_TERMINATE_S`."""
    if child.poll() is None:
        child.terminate()
        try:
            child.wait(_TERMINATE_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _child_main(job_json: str) -> int:
    """The child of :func:`import_gguf_in_subprocess`: one import, reported as JSON lines on
    stdout (anything else that writes to stdout is sent to stderr)."""
    out = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(report: dict[str, Any]) -> None:
        out.write(json.dumps(report) + "\n")
        out.flush()

    job = json.loads(job_json)
    try:
        summary = import_gguf(
            Path(job["src"]),
            Path(job["dest"]),
            dtype=job["dtype"],
            progress=lambda stage, done, total: send({"progress": [stage, done, total]}),
            sampling=job["sampling"],
        )
    except InfersightError as exc:
        send({"error": [type(exc).__name__, str(exc)]})
        return 1
    except Exception as exc:  # a bug or a broken file the reader did not expect
        traceback.print_exc()  # to stderr, which the parent keeps to itself
        what = f"converting {Path(job['src']).name} failed: {type(exc).__name__}: {exc}"
        send({"error": ["ModelLoadError", f"{what}; check the file, or report this message"]})
        return 1
    done = {
        "architecture": summary.architecture,
        "name": summary.name,
        "tensor_types": summary.tensor_types,
        "config": summary.config,
    }
    send({"done": done})
    return 0
