"""GGUF → Hugging Face-style model folder.

Reads a llama.cpp GGUF file with the ``gguf`` package (:mod:`engine.store.gguf_reader`),
dequantizes every tensor, undoes llama.cpp's rotary row permutation of Q/K, and writes a folder
the engine (and transformers) load like any other: ``model.safetensors``, ``config.json``,
``generation_config.json``, ``tokenizer.json`` and ``tokenizer_config.json`` (with the chat
template; :mod:`engine.store.gguf_tokenizer`).

The folder is built next to its destination and renamed into place at the end, so an
interrupted import never leaves a half model that later loads. Before writing, the import
checks that the destination's disk has room for everything it will write; a progress callback
that raises (say :class:`~engine.errors.CancelledError`) cancels it, leaving nothing behind.

:func:`engine.store.gguf_subprocess.import_gguf_in_subprocess` runs the same import in a child
Python process, so that the process that asked keeps its GIL.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from engine.errors import ModelLoadError, UnsupportedModelError
from engine.store.gguf_reader import (
    NORM_SHIFT,
    dequantize_tensor,
    gguf_metadata,
    gguf_sampling,
    hf_config,
    hf_tensor_name,
    model_arch,
    open_gguf,
    supported_architecture,
    unpermute_rotary,
)
from engine.store.gguf_tokenizer import hf_tokenizer
from engine.units import format_size

log = logging.getLogger(__name__)

#: ``progress(stage, done, total)``; stages: ``"dequantize"``, ``"write"``.
Progress = Callable[[str, int, int], None]

SUPPORTED_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip
OUTPUT_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}

_SHARD_BYTES = 2 * 2**30
#: an import needs this much free space beyond what it writes, or this share of it if more
DISK_MARGIN_BYTES = 64 * 2**20
DISK_MARGIN_SHARE = 0.05


@dataclass(frozen=True, slots=True)
class GGUFSummary:
    architecture: str
    name: str
    tensor_types: dict[str, int]
    config: dict[str, Any]


def check_free_space(folder: Path, needed: int) -> None:
    """Refuse, with :class:`ModelLoadError`, to write ``needed`` bytes into ``folder`` (which
    may not exist yet) when its disk lacks that much free space plus a margin."""
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    wanted = needed + max(DISK_MARGIN_BYTES, int(needed * DISK_MARGIN_SHARE))
    if free < wanted:
        raise ModelLoadError(
            f"not enough disk space in {folder}: the import writes {format_size(needed)} and "
            f"needs {format_size(wanted)} free (with a margin), but {format_size(free)} is free "
            f"there; free some space, or point INFERSIGHT_HOME at a larger disk"
        )


def _output_bytes(reader: Any, dtype: torch.dtype) -> int:
    """Bytes of the tensors an import writes, in ``dtype`` (safetensors headers aside)."""
    meta = gguf_metadata(reader)
    arch = model_arch(meta, str(meta.get("general.architecture", "llama")))
    elements = sum(int(t.n_elements) for t in reader.tensors if hf_tensor_name(t.name, arch))
    return elements * dtype.itemsize


def import_gguf(
    src: Path,
    dest: Path,
    *,
    dtype: str = "fp16",
    progress: Progress | None = None,
    sampling: Mapping[str, Any] | None = None,
) -> GGUFSummary:
    """Convert ``src`` into the model folder ``dest`` (which must not exist yet).

    ``sampling`` (``generation_config.json`` keys such as ``do_sample``, ``temperature``,
    ``top_p``) is the model's recommended sampling; without it, the file's own
    ``general.sampling.*`` keys are used if it has them, else the model generates greedily."""
    if dtype not in OUTPUT_DTYPES:
        raise UnsupportedModelError(
            f"output dtype {dtype!r} is not supported; choose one of {', '.join(OUTPUT_DTYPES)}"
        )
    if dest.exists() and any(dest.iterdir()):
        raise ModelLoadError(f"{dest} already exists and is not empty; remove it or pick another")
    reader = open_gguf(src)
    meta = gguf_metadata(reader)
    arch = model_arch(meta, supported_architecture(meta, src))
    _refuse_split(meta, src)
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    unsupported = sorted(set(types) - set(SUPPORTED_TYPES))
    if unsupported:
        raise UnsupportedModelError(
            f"{src.name} uses tensor type(s) {', '.join(unsupported)}; GGUF import supports "
            f"{', '.join(SUPPORTED_TYPES)}"
        )
    config = hf_config(meta, arch, reader, dtype)
    tokenizer_json, tokenizer_config, eos_ids = hf_tokenizer(reader, meta)
    generation_config = {
        "bos_token_id": config.get("bos_token_id"),
        "eos_token_id": eos_ids,
        "do_sample": False,
        **(gguf_sampling(meta) if sampling is None else sampling),
    }
    config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    json_bytes = len(tokenizer_json.encode()) + 2**20  # tokenizer.json, then the small JSONs
    check_free_space(dest.parent, _output_bytes(reader, OUTPUT_DTYPES[dtype]) + json_bytes)

    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
    try:
        _write_tensors(reader, arch, config, OUTPUT_DTYPES[dtype], work, progress)
        _write_json(work / "config.json", config)
        _write_json(work / "generation_config.json", generation_config)
        _write_json(work / "tokenizer_config.json", tokenizer_config)
        (work / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
        if dest.exists():
            dest.rmdir()  # empty (checked above)
        os.replace(work, dest)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return GGUFSummary(arch, str(meta.get("general.name", src.stem)), types, config)


def _refuse_split(meta: dict[str, Any], src: Path) -> None:
    count = int(meta.get("split.count", 1) or 1)
    if count > 1:
        raise UnsupportedModelError(
            f"{src.name} is one of {count} files of a split GGUF, which the import does not "
            "read; merge them into one file first (llama.cpp: llama-gguf-split --merge "
            "FIRST.gguf OUT.gguf)"
        )


def _write_tensors(
    reader: Any,
    arch: str,
    config: dict[str, Any],
    dtype: torch.dtype,
    folder: Path,
    progress: Progress | None,
) -> None:
    tensors = [t for t in reader.tensors if hf_tensor_name(t.name, arch) is not None]
    skipped = [t.name for t in reader.tensors if hf_tensor_name(t.name, arch) is None]
    if skipped:
        log.info("not imported (derived at run time): %s", ", ".join(skipped))
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = 0
    shards: list[dict[str, torch.Tensor]] = []
    written: list[str] = []
    weight_map: dict[str, str] = {}

    def flush() -> None:
        nonlocal shard, shard_bytes
        if shard:
            name = f"model-{len(written) + 1:05d}.safetensors"
            save_file(shard, str(folder / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
            written.append(name)
            shards.append({})
            shard, shard_bytes = {}, 0

    if progress:  # a cancel requested before the first (possibly huge) tensor stops here
        progress("dequantize", 0, len(tensors))
    for i, t in enumerate(tensors):
        name = hf_tensor_name(t.name, arch)
        assert name is not None
        array = dequantize_tensor(t)
        permuted = arch in ("llama", "mixtral")  # llama.cpp's rotation on adjacent pairs
        if permuted and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            array = unpermute_rotary(array, config["num_attention_heads"])
        elif permuted and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            array = unpermute_rotary(array, config["num_key_value_heads"])
        if t.name.endswith("ffn_gate_inp_shexp.weight"):  # llama.cpp's [H], HF's [1, H]
            array = array.reshape(1, -1)
        if arch in NORM_SHIFT and t.name.endswith("norm.weight"):  # back to HF's ``w``
            array = array.astype(np.float32) - NORM_SHIFT[arch]
        if not array.flags.writeable:  # F32/F16 tensors come straight from the mmap
            array = array.copy()
        tensor = torch.from_numpy(np.ascontiguousarray(array)).to(dtype)
        if "{e}" in name:  # one tensor per expert, as the checkpoint holds them
            shard.update((name.format(e=e), part.clone()) for e, part in enumerate(tensor))
        else:
            shard[name] = tensor
        shard_bytes += tensor.numel() * tensor.element_size()
        if progress:
            progress("dequantize", i + 1, len(tensors))
        if shard_bytes >= _SHARD_BYTES:
            flush()
    if progress:
        progress("write", 0, 1)
    flush()
    if len(written) == 1:
        os.replace(folder / written[0], folder / "model.safetensors")
    else:
        index = {"metadata": {}, "weight_map": weight_map}
        _write_json(folder / "model.safetensors.index.json", index)
    if progress:
        progress("write", 1, 1)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
