"""A model of a config's shapes with random weights, built without a checkpoint or the hub.

``make gpu-check`` runs Llama-3.1-8B's shapes (``resources/configs/llama-3.1-8b.json``) at
every precision that fits, and writing its 16 GB of bf16 to disk once per machine would take
longer than the check itself. :class:`SyntheticCheckpoint` hands out the tensors a checkpoint of
those shapes would hold, by HF name, drawn on demand from a generator seeded per tensor: a GPU
draws them in milliseconds, and drawing a name again gives the same values (so transformers can
be given the very weights the engine runs). The load itself is the real one
(:func:`engine.loader.weights.load_transformer` with ``source=``): tensors arrive on the host in
the checkpoint's dtype, one at a time, are converted, moved and quantized there as from a file,
so the memory plan's load bound holds for them as for a real checkpoint. Token ids go in and
out; the tokenizer is a word-level one of ``t0`` … ``tN`` (:func:`synthetic_tokenizer`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from engine.core.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.errors import InvalidRequestError
from engine.loader import expert_placement
from engine.loader.load import engine_for
from engine.loader.memory_plan import plan_memory
from engine.loader.random_weights import SyntheticCheckpoint, write_drawn
from engine.loader.weights import load_transformer
from engine.model.config import ModelConfig
from engine.model.tokenizer import Tokenizer
from engine.quant.spec import parse_precision_spec

#: A chat template for the word-level tokenizer: the messages' contents, one after another.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def synthetic_tokenizer(vocab_size: int) -> Tokenizer:
    """A word-level tokenizer of ``vocab_size`` words ``t0`` … (unknown words are ``t0``),
    with :data:`CHAT_TEMPLATE`: ids in, ids out, and text that names them."""
    return Tokenizer(_backend(vocab_size), chat_template=CHAT_TEMPLATE)


def _backend(vocab_size: int) -> HFTokenizer:
    vocab = {f"t{i}": i for i in range(vocab_size)}
    backend = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return backend


def build_engine(
    raw: dict[str, Any],
    precision: str = "fp32",
    device: str = "cpu",
    *,
    config: EngineConfig | None = None,
    seed: int = 0,
    name: str = "synthetic",
) -> LLMEngine:
    """An engine on random weights of the HF ``config.json`` contents ``raw`` at ``precision``,
    loaded as :func:`engine.loader.load.load_model` loads a folder (the same tensor-by-tensor
    load, CPU threads and weight layout, decode graph), from a :class:`SyntheticCheckpoint`
    drawn on ``device``."""
    torch_device = torch.device(device)
    spec = parse_precision_spec(precision, torch_device)
    if spec.smoothed:
        raise InvalidRequestError(
            f"{precision} smooths with a calibration of the model's own text, and random "
            "weights have none; write the model as a folder (`infersight models synth`), "
            "calibrate it, or use w8a8"
        )
    cfg = ModelConfig.from_dict(raw)
    spec.check_layers(cfg.num_layers)
    source = SyntheticCheckpoint(cfg, seed=seed, device=torch_device)
    quant = spec.kind_for if spec.quantized else None
    engine_config = config or EngineConfig()
    host = expert_placement.resolve(  # --cpu-experts, as a load of a folder places them
        cfg, torch_device, engine_config,
        lambda: plan_memory(cfg, precision, device, config=engine_config),
    )  # fmt: skip
    model = load_transformer(
        Path(name), cfg, spec.compute, torch_device, quant, source=source, host_experts=host
    )
    tokenizer = synthetic_tokenizer(cfg.vocab_size)
    return engine_for(
        model, tokenizer, cfg, spec, torch_device,
        name=name, eos_token_ids=list(cfg.eos_token_ids), config=config,
    )  # fmt: skip


def write_folder(
    raw: dict[str, Any],
    folder: Path,
    *,
    seed: int = 0,
    state: dict[str, torch.Tensor] | None = None,
    drawn: tuple[int, torch.dtype] | None = None,
) -> Path:
    """A model folder of the config ``raw`` on random weights (``config.json``, one
    safetensors file, the word-level tokenizer with its chat template), for what loads only
    from a folder (the app's worker, the benchmark's peer). ``state``: the tensors to write
    (drawn by :class:`SyntheticCheckpoint` with ``seed`` if not given); the file holds every
    tensor at once. ``drawn``: no file of weights, but the seed and dtype the load draws them
    with (:func:`engine.loader.random_weights.drawn_source`)."""
    from safetensors.torch import save_file

    cfg = ModelConfig.from_dict(raw)
    folder.mkdir(parents=True, exist_ok=True)
    if drawn is not None:
        write_drawn(folder, *drawn)
    else:
        if state is None:
            state = dict(SyntheticCheckpoint(cfg, seed=seed).tensors())
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    _backend(cfg.vocab_size).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return folder
