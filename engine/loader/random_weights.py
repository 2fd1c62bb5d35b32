"""Random weights of a config's shapes, as a checkpoint would hold them (by HF name, in the
checkpoint's dtype), drawn on demand from a generator seeded per tensor: drawing a name again
gives the same values, on any device, so transformers can be given the very weights the
engine runs and a peer's GGUF the very values the engine loads.

A model folder may hold :data:`DRAWN` in place of its ``*.safetensors`` files: its weights are
drawn as the load reads them (:func:`drawn_source`), which is how a synthetic model too large
for the disk in float16 is still loaded through the real loader
(:mod:`engine.store.synthetic_store`).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch

from engine.errors import ModelLoadError
from engine.model.config import ModelConfig

#: the file, in a model folder, that says its weights are drawn at load: ``{"seed", "dtype"}``
DRAWN = "drawn.json"
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

#: The spread of the random weights: transformers' ``initializer_range`` for matrices (and
#: biases); norms near 1 (``1 + NORM_STD·N(0, 1)``), as trained models have them.
MATRIX_STD = 0.02
NORM_STD = 0.1


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


def drawn_source(folder: Path, cfg: ModelConfig) -> SyntheticCheckpoint | None:
    """The weights of a folder that draws them (:data:`DRAWN`), or None for any other."""
    path = folder / DRAWN
    if not path.is_file():
        return None
    try:
        spec = json.loads(path.read_text())
        seed, dtype = int(spec["seed"]), _DTYPES[spec["dtype"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(
            f"{path} does not say how to draw the weights ({exc}); write the model again "
            "(`infersight models synth`)"
        ) from exc
    return SyntheticCheckpoint(cfg, seed=seed, dtype=dtype)


def write_drawn(folder: Path, seed: int, dtype: torch.dtype) -> None:
    """Mark ``folder``'s weights as drawn at load with ``seed`` in ``dtype``."""
    name = next(k for k, v in _DTYPES.items() if v == dtype)
    (folder / DRAWN).write_text(json.dumps({"seed": seed, "dtype": name}))
