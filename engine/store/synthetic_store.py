"""Synthetic models in the model store: random weights of a published config, written once
per machine as a model folder and, with the very same values, as an F16 GGUF for llama.cpp.

No machine here reaches a model hub, and the speed of a decode step does not depend on what
its weights hold. ``make bench-peers`` measures a real-size model this way
(``resources/configs/llama-3.2-1b.json``: Meta's config for Llama-3.2-1B): the engine loads
the folder's safetensors, llama.cpp the GGUF next to them (requantized by llama.cpp itself to
Q4_1, Q8_0 …), so both read the same weights. The values are drawn in float16 and written as
such to both files: nothing is rounded between them.

``infersight models synth llama-3.2-1b`` writes ``<home>/models/synthetic-llama-3.2-1b``.
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
from engine.loader.synthetic import SyntheticCheckpoint, write_folder
from engine.model.config import ModelConfig
from engine.store.gguf_import import Progress, check_free_space
from engine.store.gguf_writer import write_gguf
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


def synthetic_path(name: str) -> Path:
    return models_dir() / f"{PREFIX}{name}"


def gguf_path(folder: Path) -> Path | None:
    """The GGUF of a synthetic model folder, or None where the folder has none."""
    path = folder / GGUF_NAME
    return path if path.is_file() else None


def synthesize(name: str, *, seed: int = 0, progress: Progress | None = None) -> Path:
    """The folder of the synthetic model ``name`` (written now if it is not in the store):
    built in a temporary folder beside it and renamed into place when complete."""
    dest = synthetic_path(name)
    if (dest / "config.json").is_file() and gguf_path(dest):
        return dest
    raw = published_config(name)
    with store_lock(dest.name, progress=progress, stage="synthesize"):
        if (dest / "config.json").is_file() and gguf_path(dest):
            return dest
        return write_synthetic(raw, dest, seed=seed, progress=progress)


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
