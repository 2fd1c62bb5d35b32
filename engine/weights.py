"""Load HF safetensors checkpoints into :class:`~engine.model.Transformer`, tensor by tensor.

Files are opened with ``safe_open`` (memory-mapped); each tensor is read, converted to the
target dtype and moved to the device on its own, so peak memory stays near the size of the
converted model rather than twice it. The model skeleton is built on the ``meta`` device and
receives real parameters as they arrive. q/k/v and gate/up are fused here, once, at load.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.linear import PackedLinear
from engine.model import RotaryEmbedding, Transformer

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
#: HF tensor name (within a layer) → (our parameter, part index of a fused parameter or None).
_LAYER_NAMES: dict[str, tuple[str, int | None]] = {
    "self_attn.q_proj.weight": ("attn.qkv_proj.weight", 0),
    "self_attn.k_proj.weight": ("attn.qkv_proj.weight", 1),
    "self_attn.v_proj.weight": ("attn.qkv_proj.weight", 2),
    "self_attn.q_proj.bias": ("attn.qkv_proj.bias", 0),
    "self_attn.k_proj.bias": ("attn.qkv_proj.bias", 1),
    "self_attn.v_proj.bias": ("attn.qkv_proj.bias", 2),
    "self_attn.o_proj.weight": ("attn.o_proj.weight", None),
    "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", 0),
    "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", 1),
    "mlp.down_proj.weight": ("mlp.down_proj.weight", None),
    "input_layernorm.weight": ("input_norm.weight", None),
    "post_attention_layernorm.weight": ("post_attn_norm.weight", None),
}
_PARTS = {"attn.qkv_proj.weight": 3, "attn.qkv_proj.bias": 3, "mlp.gate_up_proj.weight": 2}
_TOP_NAMES = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.rotary_emb\.)")


def checkpoint_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"no *.safetensors file in {folder}; convert the model to safetensors "
            "(or import a GGUF with `infersight import-gguf`)"
        )
    return files


def iter_checkpoint(files: list[Path]) -> Iterator[tuple[str, Tensor]]:
    """Yield ``(name, tensor)`` pairs, one tensor in memory at a time."""
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            raise ModelLoadError(
                f"{path.name} is truncated or corrupt ({exc}); re-download or re-convert the model"
            ) from exc


def load_transformer(
    folder: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device
) -> Transformer:
    with torch.device("meta"):
        model = Transformer(cfg)
    model.rope = RotaryEmbedding(cfg).to(device)  # real buffers, not meta

    expected = _expected_parameters(model, cfg)
    pending: dict[str, list[Tensor | None]] = {}
    loaded: set[str] = set()
    for hf_name, tensor in iter_checkpoint(checkpoint_files(folder)):
        target = _map_name(hf_name)
        if target is None:
            continue
        ours, part = target
        if ours == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if ours not in expected:
            raise ModelLoadError(
                f"{hf_name} does not fit a {cfg.model_type} model of {cfg.num_layers} layers; "
                "config.json and the weights disagree"
            )
        tensor = tensor.to(device=device, dtype=dtype)
        if part is None:
            _assign(model, ours, tensor)
            loaded.add(ours)
            continue
        parts = pending.setdefault(ours, [None] * _PARTS[ours.split(".", 2)[2]])
        parts[part] = tensor
        if all(p is not None for p in parts):
            _assign(model, ours, torch.cat([p for p in parts if p is not None]))
            loaded.add(ours)
            del pending[ours]

    missing = sorted(set(expected) - loaded)
    if missing:
        shown = ", ".join(missing[:4]) + (" …" if len(missing) > 4 else "")
        raise ModelLoadError(
            f"the checkpoint in {folder} lacks {len(missing)} tensor(s): {shown}; "
            "the download or conversion is incomplete"
        )
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    model.eval()
    return model


def _map_name(hf_name: str) -> tuple[str, int | None] | None:
    if _IGNORED.search(hf_name):
        return None
    if hf_name in _TOP_NAMES:
        return _TOP_NAMES[hf_name], None
    m = _LAYER.match(hf_name)
    if m and m.group(2) in _LAYER_NAMES:
        ours, part = _LAYER_NAMES[m.group(2)]
        return f"layers.{m.group(1)}.{ours}", part
    raise ModelLoadError(f"unexpected tensor {hf_name!r}; is this a Llama/Qwen2 checkpoint?")


def _expected_parameters(model: Transformer, cfg: ModelConfig) -> dict[str, torch.Size]:
    shapes = {name: p.shape for name, p in model.named_parameters()}
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def _assign(model: nn.Module, name: str, tensor: Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    current = getattr(module, attr)
    if current.shape != tensor.shape:
        raise ModelLoadError(
            f"tensor for {name} has shape {tuple(tensor.shape)}, config.json implies "
            f"{tuple(current.shape)}; config and weights disagree"
        )
    setattr(module, attr, nn.Parameter(tensor, requires_grad=False))


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights occupy in memory, packed copies included (each tensor once)."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        tensors: list[Tensor] = list(module.parameters(recurse=False))
        if isinstance(module, PackedLinear):
            total += module.nbytes
            tensors += [module.bias] if module.bias is not None else []
        for t in tensors:
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


def parameter_count(model: nn.Module) -> int:
    """Distinct parameters (tied weights once), before any packing."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
