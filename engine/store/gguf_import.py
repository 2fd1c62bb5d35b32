"""GGUF → Hugging Face-style model folder.

Reads a llama.cpp GGUF file with the ``gguf`` package, dequantizes every tensor, undoes
llama.cpp's rotary row permutation of Q/K, and writes a folder the engine (and transformers)
load like any other: ``model.safetensors``, ``config.json``, ``generation_config.json``,
``tokenizer.json`` and ``tokenizer_config.json`` (with the chat template).

The folder is built next to its destination and renamed into place at the end, so an
interrupted import never leaves a half model that later loads. Before writing, the import
checks that the destination's disk has room for everything it will write; a progress callback
that raises (say :class:`~engine.errors.CancelledError`) cancels it, leaving nothing behind.

:func:`import_gguf_in_subprocess` runs the same import in a child Python process: the GGUF
reader, the tokenizer's tables and each large tensor's dequantization hold the GIL for 0.1–0.3 s
at a time (2-core CPU), which would freeze a window (or a server) in the process that asked;
the child streams its progress back, and the callback can still cancel it.

:func:`read_gguf_header` reads what a file's header says (architecture, parameter count, the
``config.json`` an import would write) without touching its tensor data.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from engine import errors
from engine.errors import InfersightError, ModelLoadError, UnsupportedModelError
from engine.hardware.isolated import python_command
from engine.model.config import ModelConfig

log = logging.getLogger(__name__)

#: ``progress(stage, done, total)``; stages: ``"dequantize"``, ``"write"``.
Progress = Callable[[str, int, int], None]

SUPPORTED_ARCHS = ("llama", "qwen2")
SUPPORTED_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip
OUTPUT_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}

# Token texts that end a turn or a document in common chat models; llama.cpp treats control
# tokens with these texts as end-of-generation too, even when the file names only one EOS.
_EOG_TEXTS = {
    "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "</s>",
    "<end_of_turn>", "<|end_of_text|>",
}  # fmt: skip

# GPT-2's pre-tokenization regex, and the Llama-3 / Qwen2 ones (llama.cpp's definitions).
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_TOP_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
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


def _open(path: Path) -> Any:
    import gguf  # heavy import, only when a GGUF is actually read

    if not path.is_file():
        raise ModelLoadError(f"{path} does not exist; give the path of a .gguf file")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError, struct.error, IndexError …
        raise ModelLoadError(
            f"{path.name} is not a readable GGUF file ({type(exc).__name__}: {exc}); "
            "check that the download is complete"
        ) from exc


def _fields(reader: Any) -> dict[str, Any]:
    out = {}
    for key, field in reader.fields.items():
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                   "tokenizer.ggml.scores"):  # fmt: skip
            continue
        out[key] = field.contents()
    return out


def _array(reader: Any, key: str) -> list[Any]:
    field = reader.fields.get(key)
    return [] if field is None else list(field.contents())


def _array_length(reader: Any, key: str) -> int:
    """Elements of an array field, without decoding them (a vocabulary has 100k+ strings)."""
    field = reader.fields.get(key)
    return 0 if field is None else len(field.data)


def _architecture(meta: dict[str, Any], src: Path) -> str:
    arch = str(meta.get("general.architecture", ""))
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedModelError(
            f"{src.name} holds a {arch or 'unknown'!r} model; GGUF import supports the "
            f"architectures {', '.join(SUPPORTED_ARCHS)}"
        )
    return arch


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    """What a GGUF file's header says; its tensor data is never read."""

    path: Path
    architecture: str
    name: str
    parameters: int  # elements of every tensor in this file
    split_count: int  # 1, or how many files a split GGUF spans
    config: dict[str, Any]  # the HF-style config.json an fp16 import writes

    def model_config(self) -> ModelConfig:
        return ModelConfig.from_dict(self.config)


def read_gguf_header(path: Path) -> GGUFHeader:
    """The header of the GGUF ``path``; raises :class:`UnsupportedModelError` for an
    architecture the import does not support, :class:`ModelLoadError` for an unreadable file."""
    reader = _open(path)
    meta = _fields(reader)
    arch = _architecture(meta, path)
    return GGUFHeader(
        path=path,
        architecture=arch,
        name=str(meta.get("general.name", path.stem)),
        parameters=sum(int(t.n_elements) for t in reader.tensors),
        split_count=int(meta.get("split.count", 1) or 1),
        config=_config(meta, arch, reader, "fp16"),
    )


def count_gguf_parameters(path: Path) -> int:
    """Elements of every tensor in a GGUF file (any architecture; say, a split file's
    second part, whose header holds no model metadata)."""
    return sum(int(t.n_elements) for t in _open(path).tensors)


def gguf_model_config(path: Path) -> ModelConfig:
    """The :class:`ModelConfig` of the model a GGUF file holds, from its header alone."""
    return read_gguf_header(path).model_config()


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
            f"not enough disk space in {folder}: the import writes {_size_text(needed)} and "
            f"needs {_size_text(wanted)} free (with a margin), but {_size_text(free)} is free "
            f"there; free some space, or point INFERSIGHT_HOME at a larger disk"
        )


def _size_text(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _output_bytes(reader: Any, dtype: torch.dtype) -> int:
    """Bytes of the tensors an import writes, in ``dtype`` (safetensors headers aside)."""
    elements = sum(int(t.n_elements) for t in reader.tensors if hf_tensor_name(t.name))
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
    reader = _open(src)
    meta = _fields(reader)
    arch = _architecture(meta, src)
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
    config = _config(meta, arch, reader, dtype)
    tokenizer_json, tokenizer_config, eos_ids = _tokenizer(reader, meta)
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


def _refuse_split(meta: dict[str, Any], src: Path) -> None:
    count = int(meta.get("split.count", 1) or 1)
    if count > 1:
        raise UnsupportedModelError(
            f"{src.name} is one of {count} files of a split GGUF, which the import does not "
            "read; merge them into one file first (llama.cpp: llama-gguf-split --merge "
            "FIRST.gguf OUT.gguf)"
        )


def _config(meta: dict[str, Any], arch: str, reader: Any, dtype: str) -> dict[str, Any]:
    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise UnsupportedModelError(f"the GGUF lacks the metadata key {arch}.{name}")
        return value

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    names = {t.name for t in reader.tensors}
    vocab = _array_length(reader, "tokenizer.ggml.tokens") or int(key("vocab_size"))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": int(key("rope.dimension_count", hidden // heads)),
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}[dtype],
    }
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in names
        config["mlp_bias"] = False
    for gguf_key, hf_key in (
        ("bos_token_id", "bos_token_id"),
        ("padding_token_id", "pad_token_id"),
    ):
        if f"tokenizer.ggml.{gguf_key}" in meta:
            config[hf_key] = int(meta[f"tokenizer.ggml.{gguf_key}"])
    return config


def unpermute_rotary(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's convert-time permutation of Q/K rows.

    HF Llama rotates the two *halves* of each head (``rotate_half``); llama.cpp rotates
    *adjacent pairs*, so its converter interleaves each head's rows. This is the inverse.
    """
    rows = weight.shape[0]
    half = rows // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def dequantize_tensor(tensor: Any) -> np.ndarray:
    from gguf.quants import dequantize

    data = dequantize(tensor.data, tensor.tensor_type)
    return np.asarray(data, dtype=np.float32)


def hf_tensor_name(gguf_name: str) -> str | None:
    if gguf_name in _TOP_TENSORS:
        return _TOP_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"
    return None


def _write_tensors(
    reader: Any,
    arch: str,
    config: dict[str, Any],
    dtype: torch.dtype,
    folder: Path,
    progress: Progress | None,
) -> None:
    tensors = [t for t in reader.tensors if hf_tensor_name(t.name) is not None]
    skipped = [t.name for t in reader.tensors if hf_tensor_name(t.name) is None]
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
        name = hf_tensor_name(t.name)
        assert name is not None
        array = dequantize_tensor(t)
        if arch == "llama" and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            array = unpermute_rotary(array, config["num_attention_heads"])
        elif arch == "llama" and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            array = unpermute_rotary(array, config["num_key_value_heads"])
        if not array.flags.writeable:  # F32/F16 tensors come straight from the mmap
            array = array.copy()
        tensor = torch.from_numpy(np.ascontiguousarray(array)).to(dtype)
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


def _pre_tokenizer(pre: str) -> Any:
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("gpt2", "gpt-2", "default"):
        return byte_level
    if pre == "smollm":
        # SmolLM's tokenizer splits every digit into its own pre-token before the GPT-2
        # regex (llama.cpp: "\p{N}" first). Without this, "2024" becomes one or two tokens
        # the model never saw in training.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    regex = {"qwen2": _QWEN2_REGEX, "llama-bpe": _LLAMA3_REGEX}.get(pre)
    if regex is None:
        raise UnsupportedModelError(
            f"tokenizer pre-tokenization {pre!r} is not supported; supported: "
            "gpt2, smollm, qwen2, llama-bpe"
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _tokenizer(reader: Any, meta: dict[str, Any]) -> tuple[str, dict[str, Any], list[int]]:
    """Build ``tokenizer.json`` text, ``tokenizer_config.json`` and the end-of-generation ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedModelError(
            f"tokenizer model {kind!r} is not supported; GGUF import supports byte-level BPE "
            "('gpt2') tokenizers"
        )
    tokens = [str(t) for t in _array(reader, "tokenizer.ggml.tokens")]
    types = [int(t) for t in _array(reader, "tokenizer.ggml.token_type")] or [1] * len(tokens)
    pairs = (str(m).split(" ", 1) for m in _array(reader, "tokenizer.ggml.merges"))
    merges = [(pair[0], pair[1]) for pair in pairs]
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    pre_tokenizer = _pre_tokenizer(pre)

    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    control = [i for i, t in enumerate(types) if t == 3]  # llama.cpp: CONTROL
    user = [i for i, t in enumerate(types) if t == 4]  # USER_DEFINED
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in control])
    if user:
        tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user])

    def token(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

    eos_ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        if f"tokenizer.ggml.{key}" in meta:
            eos_ids.append(int(meta[f"tokenizer.ggml.{key}"]))
    eos_ids += [i for i in control if tokens[i] in _EOG_TEXTS]
    eos_ids = sorted(set(eos_ids))
    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get(f"{meta['general.architecture']}.context_length", 2048)),
        "gguf_pre_tokenizer": pre,
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        tokenizer_config["chat_template"] = str(template)
    return tok.to_str(), tokenizer_config, eos_ids


#: llama.cpp's recommended-sampling keys → ``generation_config.json`` keys
_GGUF_SAMPLING = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def gguf_sampling(meta: dict[str, Any]) -> dict[str, Any]:
    """The sampling a GGUF's author recommends (``general.sampling.*``), as
    ``generation_config.json`` keys; ``{}`` when the file says nothing."""
    out: dict[str, Any] = {}
    for key, name in _GGUF_SAMPLING.items():
        value = meta.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            # GGUF stores float32: 0.9 reads back as 0.8999999761…
            out[name] = int(value) if name == "top_k" else float(f"{value:.6g}")
    if out:
        out["do_sample"] = out.get("temperature", 1.0) > 0
    return out


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
