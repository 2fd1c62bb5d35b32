"""Models people already have: the model store, the Hugging Face cache, LM Studio's folder and
any folders the user adds.

:func:`discover_models` lists every model found that this engine can run, read from headers
only (``config.json`` and safetensors headers, GGUF headers; no weights are loaded or
dequantized). It can take seconds on a big cache, so the app calls it off the UI thread.

* **store**: the model store's folders (:func:`engine.store.model_store.known_models`).
* **hf-cache**: snapshots in the Hugging Face cache, found with ``huggingface_hub``'s own
  scanner; the cache folder follows ``HF_HUB_CACHE`` / ``HF_HOME`` as the hub does.
* **lmstudio**: ``.gguf`` files in LM Studio's models folder (``~/.lmstudio/models``, the LM
  Studio home a ``~/.lmstudio-home-pointer`` file names, or the older
  ``~/.cache/lm-studio/models``); ``INFERSIGHT_LMSTUDIO_DIR`` overrides them all (LM Studio
  itself documents no variable for it).
* **folder**: ``.gguf`` files and Hugging Face model folders in the folders the user added.

A broken entry (an unreadable config, a truncated GGUF, an architecture we do not run) is
skipped with a debug line; it never hides the others. :func:`engine.store.planning.plan_models`
adds each model's memory plan for a device and precision.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from engine.model.config import ModelConfig
from engine.store.catalog import DiscoveredModel

if TYPE_CHECKING:
    from huggingface_hub import CachedRepoInfo, CachedRevisionInfo


log = logging.getLogger(__name__)

SOURCES = ("store", "hf-cache", "lmstudio", "folder")
LMSTUDIO_ENV = "INFERSIGHT_LMSTUDIO_DIR"
#: how deep below a scanned folder GGUF files and model folders are looked for
MAX_DEPTH = 4
#: ``name-00001-of-00003.gguf``: one file of a split GGUF
_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)

T = TypeVar("T")


def discover_models(
    folders: Iterable[Path] = (),
    *,
    hf_cache: Path | None = None,
    lmstudio: Iterable[Path] | None = None,
) -> list[DiscoveredModel]:
    """Every runnable model in the store, the Hugging Face cache (``hf_cache``, default
    :func:`hf_cache_dir`), LM Studio's folders (default :func:`lmstudio_dirs`) and
    ``folders``; each file or folder once, in that order."""
    found = store_models() + hf_cache_models(hf_cache)
    for folder in lmstudio_dirs() if lmstudio is None else lmstudio:
        found += folder_models(folder, "lmstudio", gguf_only=True)
    for folder in folders:
        found += folder_models(Path(folder).expanduser(), "folder")
    return _unique(found)


def _unique(models: list[DiscoveredModel]) -> list[DiscoveredModel]:
    seen: set[Path] = set()
    out = []
    for m in models:
        key = m.path.resolve()
        if key not in seen:
            seen.add(key)
            out.append(m)
    return out


def _skipping(what: object, action: Callable[[], T]) -> T | None:
    """``action()``, or ``None`` with a debug line when it raises: one bad entry is skipped."""
    try:
        return action()
    except Exception as exc:  # any failure of one entry: skip it, keep scanning
        log.debug("discovery: skipping %s: %s: %s", what, type(exc).__name__, exc)
        return None


# -- the model store -------------------------------------------------------------------------


def store_models() -> list[DiscoveredModel]:
    """The store's model folders that are there (the default model once pulled)."""
    from engine.store.model_store import known_models

    infos = _skipping("the model store", known_models) or []
    found = []
    for info in infos:
        config = _skipping(info.path, partial(_folder_config, info.path)) if info.present else None
        if config is None:
            continue
        model = DiscoveredModel(
            info.name, info.path, "store", "safetensors", info.architecture, info.parameters,
            info.disk_bytes, config,
        )  # fmt: skip
        found.append(model)
    return found


def _folder_config(folder: Path) -> ModelConfig:
    """The folder's config, if this engine runs it; raises otherwise (unsupported
    architecture, a pre-quantized checkpoint, missing weight shards)."""
    raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if not isinstance(raw, dict):
        raise ValueError("config.json is not a JSON object")
    for key in ("quantization_config", "quantization"):
        if key in raw:
            raise ValueError(f"a pre-quantized checkpoint ({key}), which the engine does not read")
    config = ModelConfig.from_dict(raw)
    _check_shards(folder)
    return config


def _check_shards(folder: Path) -> None:
    """Every shard a ``model.safetensors.index.json`` names is there (else the download is
    incomplete)."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return
    weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
    missing = sorted({name for name in weight_map.values() if not (folder / name).is_file()})
    if missing:
        raise ValueError(f"incomplete download: {', '.join(missing)} missing")


def _has_weights(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


# -- the Hugging Face cache ------------------------------------------------------------------


def hf_cache_dir() -> Path:
    """The hub's cache folder, read from the environment now (``huggingface_hub`` reads it
    once, when imported): ``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
    ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return _expand(os.environ[var])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface"
    )
    return _expand(home) / "hub"


def _expand(path: str) -> Path:
    return Path(os.path.expandvars(path)).expanduser()


def hf_cache_models(cache_dir: Path | None = None) -> list[DiscoveredModel]:
    """Model snapshots in the Hugging Face cache that hold safetensors weights and a
    ``config.json`` of an architecture this engine runs (one snapshot per repository: the one
    ``main`` points to, else the newest)."""
    from huggingface_hub import scan_cache_dir

    root = cache_dir or hf_cache_dir()
    if not root.is_dir():
        return []
    info = _skipping(f"the Hugging Face cache {root}", partial(scan_cache_dir, root))
    if info is None:
        return []
    for warning in info.warnings:
        log.debug("discovery: the hub's scanner skipped %s", warning)
    found = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id.lower()):
        if repo.repo_type != "model":
            continue
        model = _skipping(repo.repo_id, partial(_hf_model, repo))
        if model is not None:
            found.append(model)
    return found


def _current_revision(repo: CachedRepoInfo) -> CachedRevisionInfo | None:
    revisions = sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True)
    main = [r for r in revisions if "main" in r.refs]
    candidates = main or revisions
    return candidates[0] if candidates else None


def _hf_model(repo: CachedRepoInfo) -> DiscoveredModel | None:
    from engine.store.model_store import count_parameters

    revision = _current_revision(repo)
    if revision is None:
        return None
    folder = revision.snapshot_path
    if not _has_weights(folder):
        log.debug("discovery: skipping %s: no config.json and *.safetensors", repo.repo_id)
        return None
    config = _folder_config(folder)
    return DiscoveredModel(
        repo.repo_id, folder, "hf-cache", "safetensors", config.model_type,
        count_parameters(folder), revision.size_on_disk, config,
    )  # fmt: skip


# -- LM Studio and the user's folders --------------------------------------------------------


def lmstudio_dirs() -> list[Path]:
    """LM Studio's models folders that exist: ``$INFERSIGHT_LMSTUDIO_DIR`` alone when set;
    else the current layout (``~/.lmstudio/models``, or ``models`` in the LM Studio home that
    ``~/.lmstudio-home-pointer`` names) and the older ``~/.cache/lm-studio/models``."""
    override = os.environ.get(LMSTUDIO_ENV)
    if override:
        candidates = [_expand(override)]
    else:
        user = Path.home()
        candidates = [user / ".lmstudio" / "models", user / ".cache" / "lm-studio" / "models"]
        pointer = user / ".lmstudio-home-pointer"
        pointed = _skipping(pointer, partial(_read_pointer, pointer)) if pointer.is_file() else ""
        if pointed:
            candidates.insert(0, _expand(pointed) / "models")
    out: list[Path] = []
    for path in candidates:
        if path.is_dir() and path.resolve() not in {p.resolve() for p in out}:
            out.append(path)
    return out


def _read_pointer(path: Path) -> str:
    return path.read_text(encoding="utf-8").strip()


def folder_models(folder: Path, source: str, *, gguf_only: bool = False) -> list[DiscoveredModel]:
    """GGUF files (the first file of a split GGUF; no vision projectors) and, unless
    ``gguf_only``, Hugging Face model folders, at most :data:`MAX_DEPTH` levels below
    ``folder``."""
    found = []
    for directory, files in _walk(folder):
        if not gguf_only and "config.json" in files and _has_weights(directory):
            model = _skipping(directory, partial(_folder_model, directory, source))
            if model is not None:
                found.append(model)
        for name in sorted(files):
            if _is_model_gguf(name):
                path = directory / name
                model = _skipping(path, partial(_gguf_model, path, source))
                if model is not None:
                    found.append(model)
    return found


def _walk(folder: Path) -> Iterator[tuple[Path, list[str]]]:
    """``(folder, file names)`` below ``folder``, hidden folders skipped, depth-limited (so a
    symlink loop ends too); an unreadable folder is skipped."""
    if not folder.is_dir():
        return
    base = len(folder.parts)
    for root, dirs, files in os.walk(folder, followlinks=True, onerror=_log_walk_error):
        here = Path(root)
        depth = len(here.parts) - base
        dirs[:] = sorted(d for d in dirs if not d.startswith(".")) if depth < MAX_DEPTH else []
        yield here, files


def _log_walk_error(exc: OSError) -> None:
    log.debug("discovery: cannot read %s: %s", exc.filename, exc)


def _is_model_gguf(name: str) -> bool:
    lower = name.lower()
    if not lower.endswith(".gguf") or "mmproj" in lower:  # vision projectors, not models
        return False
    split = _SPLIT.match(name)
    return split is None or int(split["index"]) == 1


def _split_files(path: Path) -> list[Path]:
    """All files of the split GGUF whose first file is ``path`` (just ``[path]`` if it is not
    split); only those present."""
    split = _SPLIT.match(path.name)
    if split is None:
        return [path]
    count = int(split["count"])
    names = (f"{split['stem']}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1))
    return [path.with_name(n) for n in names if path.with_name(n).is_file()]


def _gguf_model(path: Path, source: str) -> DiscoveredModel:
    from engine.store.gguf_reader import count_gguf_parameters, read_gguf_header

    header = read_gguf_header(path)
    files = _split_files(path) if header.split_count > 1 else [path]
    parameters = header.parameters + sum(count_gguf_parameters(f) for f in files[1:])
    return DiscoveredModel(
        _gguf_name(path), path, source, "gguf", header.architecture, parameters,
        sum(f.stat().st_size for f in files), header.model_config(),
    )  # fmt: skip


def _gguf_name(path: Path) -> str:
    """The file's name without ``.gguf`` (and without a split file's ``-00001-of-0000N``)."""
    split = _SPLIT.match(path.name)
    return split["stem"] if split else path.stem


def _folder_model(folder: Path, source: str) -> DiscoveredModel:
    from engine.store.model_store import describe

    config = _folder_config(folder)
    info = describe(folder)
    return DiscoveredModel(
        folder.name, folder, source, "safetensors", config.model_type, info.parameters,
        info.disk_bytes, config,
    )  # fmt: skip
