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
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from engine.core.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.errors import InvalidRequestError
from engine.loader.load import engine_for
from engine.loader.weights import load_transformer
from engine.model.config import ModelConfig
from engine.model.tokenizer import Tokenizer
from engine.quant.spec import parse_precision_spec

#: The spread of the random weights: transformers' ``initializer_range`` for matrices (and
#: biases); norms near 1 (``1 + NORM_STD·N(0, 1)``), as trained models have them.
MATRIX_STD = 0.02
NORM_STD = 0.1
#: A chat template for the word-level tokenizer: the messages' contents, one after another.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


class SyntheticCheckpoint:
    """The tensors of a checkpoint of ``cfg``'s shapes in HF names (``keys``, ``get_tensor``:
    a :class:`engine.loader.weights.TensorSource`), random, drawn on ``device`` from a
    generator seeded by ``seed`` and the tensor's name, in the checkpoint's ``dtype``."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        seed: int = 0,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        self.cfg = cfg
        self.seed = seed
        self.device = torch.device(device)
        self.dtype = dtype
        self.shapes = _shapes(cfg)

    def keys(self) -> list[str]:
        return list(self.shapes)

    def get_tensor(self, name: str) -> torch.Tensor:
        """One tensor on the host, as a checkpoint file hands it to the loader."""
        return self.draw(name).cpu()

    def draw(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """One tensor on :attr:`device` (in ``dtype``: the checkpoint's by default); the same
        values every time it is drawn."""
        shape = self.shapes[name]
        generator = torch.Generator(device=self.device)
        generator.manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        values = torch.randn(shape, generator=generator, device=self.device, dtype=self.dtype)
        norm = name.endswith("norm.weight")
        values = values.mul_(NORM_STD).add_(1.0) if norm else values.mul_(MATRIX_STD)
        return values if dtype is None else values.to(dtype)

    def tensors(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor on :attr:`device`, by HF name (a state dict, one tensor at a time)."""
        for name in self.shapes:
            yield name, self.draw(name, dtype)


def _expert_shapes(cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """A layer's experts and router as the family's checkpoints name them (Qwen's
    ``mlp.experts.E.gate_proj`` …, Mixtral's ``block_sparse_moe.experts.E.w1`` …), and
    Qwen2-MoE's shared expert and its gate."""
    hidden, inner, n = cfg.hidden_size, cfg.expert_intermediate_size, cfg.num_experts
    mixtral = cfg.model_type == "mixtral"
    block = f"{p}block_sparse_moe." if mixtral else f"{p}mlp."
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    shapes: dict[str, tuple[int, ...]] = {f"{block}gate.weight": (n, hidden)}
    for e in range(n):
        gate, up, down = (f"{block}experts.{e}.{name}.weight" for name in names)
        shapes |= {gate: (inner, hidden), up: (inner, hidden), down: (hidden, inner)}
    if cfg.shared_expert_size:
        size = cfg.shared_expert_size
        shapes |= {
            f"{p}mlp.shared_expert.gate_proj.weight": (size, hidden),
            f"{p}mlp.shared_expert.up_proj.weight": (size, hidden),
            f"{p}mlp.shared_expert.down_proj.weight": (hidden, size),
            f"{p}mlp.shared_expert_gate.weight": (1, hidden),
        }
    return shapes


def _shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF names and shapes of a Llama-family checkpoint of ``cfg`` (biases where the config
    has them, Qwen3's and Gemma's q/k norms, Gemma's norms around the MLP, the LM head unless
    tied; Phi-3's q/k/v and gate/up fused, as its checkpoints hold them)."""
    hidden, inner, head_dim = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, hidden)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (cfg.q_size, hidden),
            p + "self_attn.k_proj.weight": (cfg.kv_size, hidden),
            p + "self_attn.v_proj.weight": (cfg.kv_size, hidden),
            p + "self_attn.o_proj.weight": (hidden, cfg.q_size),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (inner, hidden),
            p + "mlp.up_proj.weight": (inner, hidden),
            p + "mlp.down_proj.weight": (hidden, inner),
        }
        if cfg.model_type == "phi3":
            for part in ("q", "k", "v"):
                del shapes[f"{p}self_attn.{part}_proj.weight"]
            del shapes[p + "mlp.gate_proj.weight"], shapes[p + "mlp.up_proj.weight"]
            shapes |= {
                p + "self_attn.qkv_proj.weight": (cfg.q_size + 2 * cfg.kv_size, hidden),
                p + "mlp.gate_up_proj.weight": (2 * inner, hidden),
            }
        if cfg.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (cfg.q_size,),
                p + "self_attn.k_proj.bias": (cfg.kv_size,),
                p + "self_attn.v_proj.bias": (cfg.kv_size,),
            }
        if cfg.is_moe(i):
            for part in ("gate", "up", "down"):
                del shapes[f"{p}mlp.{part}_proj.weight"]
            shapes |= _expert_shapes(cfg, p)
        if cfg.gemma:  # norms after attention and the MLP, and one before the MLP
            shapes |= {p + "pre_feedforward_layernorm.weight": (hidden,),
                       p + "post_feedforward_layernorm.weight": (hidden,)}  # fmt: skip
        if cfg.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (head_dim,),
                       p + "self_attn.k_norm.weight": (head_dim,)}  # fmt: skip
    shapes["model.norm.weight"] = (hidden,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, hidden)
    return shapes


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
    model = load_transformer(Path(name), cfg, spec.compute, torch_device, quant, source=source)
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
) -> Path:
    """A model folder of the config ``raw`` on random weights (``config.json``, one
    safetensors file, the word-level tokenizer with its chat template), for what loads only
    from a folder (the app's worker, the benchmark's peer). ``state``: the tensors to write
    (drawn by :class:`SyntheticCheckpoint` with ``seed`` if not given); the file holds every
    tensor at once."""
    from safetensors.torch import save_file

    cfg = ModelConfig.from_dict(raw)
    folder.mkdir(parents=True, exist_ok=True)
    if state is None:
        state = dict(SyntheticCheckpoint(cfg, seed=seed).tensors())
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    _backend(cfg.vocab_size).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return folder
