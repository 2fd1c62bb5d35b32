"""Synthetic models in the model store: random weights of a published config, written once
per machine as a model folder and, with the very same values, as an F16 GGUF for llama.cpp.

No machine here reaches a model hub, and the speed of a decode step does not depend on what
its weights hold. ``make bench-peers`` measures a real-size model this way
(``resources/configs/llama-3.2-1b.json``: Meta's config for Llama-3.2-1B): the engine loads
the folder's safetensors, llama.cpp the GGUF next to them (requantized by llama.cpp itself to
Q4_1, Q8_0 …), so both read the same weights. The values are drawn in float16 and written as
such to both files: nothing is rounded between them.

``infersight models synth llama-3.2-1b`` writes ``<home>/models/synthetic-llama-3.2-1b``.

A model whose float16 does not fit the disk (Qwen3-30B-A3B: 61 GB a file) is written with
``--gguf-types Q4_1 Q8_0``: the folder holds no weights but draws them at load, the same
values every time (:mod:`engine.loader.random_weights`), and the peer's GGUFs are written
already quantized, a tensor at a time (:func:`engine.store.gguf_writer.write_gguf`), every
matrix in the file's type, the head included (llama.cpp's own requantizer would keep the head
in Q6_K). ``--layers N`` keeps the config's first N layers, their shapes unchanged.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from engine.errors import ModelLoadError
from engine.loader.random_weights import DRAWN, SyntheticCheckpoint
from engine.loader.synthetic import write_folder
from engine.model.config import ModelConfig
from engine.store.gguf_import import Progress, check_free_space
from engine.store.gguf_writer import FILE_TYPES, write_gguf
from engine.store.model_store import models_dir, store_lock

#: published configs, by the name ``models synth`` takes (``<name>.json``)
CONFIGS = Path(__file__).resolve().parents[2] / "resources" / "configs"
#: the GGUF beside the folder's safetensors
GGUF_NAME = "model-f16.gguf"
PREFIX = "synthetic-"


def synthetic_names() -> list[str]:
    """The configs a synthetic model can be written of."""
    return sorted(p.stem for p in CONFIGS.glob("*.json"))


def published_config(name: str) -> dict[str, Any]:
    """The config ``name`` as published (our comments left out), with float16 weights."""
    if name not in synthetic_names():
        raise ModelLoadError(
            f"no published config named {name!r}; known: {', '.join(synthetic_names())}"
        )
    raw = json.loads((CONFIGS / f"{name}.json").read_text())
    return {k: v for k, v in raw.items() if not k.startswith("_")} | {"torch_dtype": "float16"}


def synthetic_path(name: str, layers: int | None = None) -> Path:
    return models_dir() / (f"{PREFIX}{name}" + (f"-{layers}l" if layers else ""))


def gguf_path(folder: Path) -> Path | None:
    """The F16 GGUF of a synthetic model folder, or None where the folder has none."""
    path = folder / GGUF_NAME
    return path if path.is_file() else None


def peer_ggufs(folder: Path) -> dict[str, Path]:
    """The GGUFs beside a synthetic model's weights, by the type of their matrices (``F16``,
    ``Q4_1``, ``Q8_0``)."""
    return {t: folder / _gguf_name(t) for t in FILE_TYPES if (folder / _gguf_name(t)).is_file()}


def _gguf_name(ftype: str) -> str:
    return f"model-{ftype.lower()}.gguf"


def with_layers(raw: dict[str, Any], layers: int | None) -> dict[str, Any]:
    """The config ``raw`` with its first ``layers`` layers only (its layer shapes kept)."""
    if layers is None:
        return raw
    text = raw.get("text_config")
    total = (text or raw).get("num_hidden_layers")
    if not isinstance(total, int) or not 1 <= layers <= total:
        raise ModelLoadError(f"--layers {layers}: this config has layers 1 to {total}")
    if text is not None:
        return raw | {"text_config": text | {"num_hidden_layers": layers}}
    return raw | {"num_hidden_layers": layers}


def synthesize(
    name: str,
    *,
    seed: int = 0,
    layers: int | None = None,
    gguf_types: tuple[str, ...] = (),
    progress: Progress | None = None,
) -> Path:
    """The folder of the synthetic model ``name`` (written now where it is not in the store),
    built in a temporary folder beside it and renamed into place when complete.

    Without ``gguf_types``: float16 safetensors and an F16 GGUF of the same values, which
    llama.cpp requantizes itself. With them: the folder draws its weights at load
    (:data:`engine.loader.random_weights.DRAWN`: nothing of them on disk) and holds a GGUF of
    each type, its matrices quantized as it is written, one tensor at a time, so a model
    whose float16 would not fit the disk (or memory) is still compared. ``layers``: the
    config's first layers only."""
    for ftype in gguf_types:
        if ftype not in FILE_TYPES:
            raise ModelLoadError(f"no GGUF of {ftype!r} is written; one of {list(FILE_TYPES)}")
    dest = synthetic_path(name, layers)
    raw = with_layers(published_config(name), layers)
    wanted = [_gguf_name(t) for t in gguf_types] or [GGUF_NAME]

    def complete() -> bool:
        weights = (dest / DRAWN).is_file() or any(dest.glob("*.safetensors"))
        have = (dest / "config.json").is_file() and weights
        return have and all((dest / w).is_file() for w in wanted)

    if complete():
        return dest
    with store_lock(dest.name, progress=progress, stage="synthesize"):
        if complete():
            return dest
        if not gguf_types:
            return write_synthetic(raw, dest, seed=seed, progress=progress)
        return write_drawn_synthetic(raw, dest, gguf_types, seed=seed, progress=progress)


def write_drawn_synthetic(
    raw: dict[str, Any],
    dest: Path,
    gguf_types: tuple[str, ...],
    *,
    seed: int = 0,
    progress: Progress | None = None,
) -> Path:
    """The folder ``dest`` of the config ``raw`` whose weights are drawn at load (float16,
    ``seed``), with a GGUF of each of ``gguf_types`` beside them, the same values written
    (each GGUF written to a temporary name and renamed when complete; those already there
    kept)."""
    cfg = ModelConfig.from_dict(raw)
    source = SyntheticCheckpoint(cfg, seed=seed, dtype=torch.float16)
    if not (dest / DRAWN).is_file() and dest.exists():
        raise ModelLoadError(f"{dest} holds a synthetic model of float16 files; remove it first")
    elements = sum(math.prod(shape) for shape in source.shapes.values())
    drawn = dest / DRAWN
    if drawn.is_file() and json.loads(drawn.read_text()).get("seed") != seed:
        for path in peer_ggufs(dest).values():  # another seed's values: written again
            path.unlink()
    missing = [t for t in gguf_types if not (dest / _gguf_name(t)).is_file()]
    check_free_space(dest.parent, int(sum(elements * _BYTES_PER_VALUE[t] for t in missing)))
    dest.mkdir(parents=True, exist_ok=True)
    write_folder(raw, dest, drawn=(seed, torch.float16))
    tokens = [f"t{i}" for i in range(cfg.vocab_size)]  # the folder's tokenizer's words
    for done, ftype in enumerate(missing):
        if progress:
            progress("synthesize", done, len(missing))
        path = dest / _gguf_name(ftype)
        partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
        try:
            write_gguf(partial, cfg, source.tensors(), name=dest.name, tokens=tokens,
                       ftype=ftype, shapes=source.shapes)  # fmt: skip
            partial.rename(path)
        finally:
            partial.unlink(missing_ok=True)
    if progress:
        progress("synthesize", len(missing), len(missing))
    return dest


#: bytes a value takes in a GGUF of each type (its blocks' scales included)
_BYTES_PER_VALUE = {"F16": 2.0, "Q4_1": 20 / 32, "Q8_0": 34 / 32}


def write_synthetic(
    raw: dict[str, Any], dest: Path, *, seed: int = 0, progress: Progress | None = None
) -> Path:
    """Write the model folder ``dest`` of the config ``raw`` (float16 random weights, the
    word-level tokenizer) with :data:`GGUF_NAME` beside its safetensors, the same values in
    both; replaces what ``dest`` held."""
    cfg = ModelConfig.from_dict(raw)
    source = SyntheticCheckpoint(cfg, seed=seed, dtype=torch.float16)
    elements = sum(math.prod(shape) for shape in source.shapes.values())
    check_free_space(dest.parent, 2 * 2 * elements)  # two files of float16
    partial = dest.parent / f".{dest.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        if progress:
            progress("synthesize", 0, 2)
        state = dict(source.tensors())
        write_folder(raw, partial, state=state)
        if progress:
            progress("synthesize", 1, 2)
        tokens = [f"t{i}" for i in range(cfg.vocab_size)]  # the folder's tokenizer's words
        write_gguf(partial / GGUF_NAME, cfg, state.items(), name=dest.name, tokens=tokens)
        del state
        if progress:
            progress("synthesize", 2, 2)
        if dest.exists():
            shutil.rmtree(dest)
        partial.rename(dest)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return dest
