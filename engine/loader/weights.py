"""Load HF safetensors checkpoints into :class:`~engine.model.transformer.Transformer`,
tensor by tensor.

Files are opened with ``safe_open`` (memory-mapped); each tensor is read, converted to the
target dtype and moved to the device on its own, so peak memory stays near the size of the
converted model rather than twice it. The model skeleton is built on the ``meta`` device and
receives real parameters as they arrive. q/k/v and gate/up are fused here, once, at load.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Protocol

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn

from engine.errors import ModelLoadError
from engine.loader.random_weights import drawn_source
from engine.model.config import ModelConfig
from engine.model.moe import MoE
from engine.model.transformer import (
    Transformer,
    VocabParallelEmbedding,
    permute_rotary_rows,
    rotary_permutation,
)
from engine.parallel.shard import Shard
from engine.quant import experts
from engine.quant.calibration import Calibration, SmoothingPlan
from engine.quant.embedding import QuantizedEmbedding, head_channel_scale
from engine.quant.int4 import Int4Linear
from engine.quant.int8 import Int8Linear
from engine.quant.spec import LAYER_PARTS, PrecisionSpec, QuantKind

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
    "self_attn.qkv_proj.weight": ("attn.qkv_proj.weight", None),  # Phi-3: fused already
    "self_attn.o_proj.weight": ("attn.o_proj.weight", None),
    "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", 0),
    "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", 1),
    "mlp.gate_up_proj.weight": ("mlp.gate_up_proj.weight", None),  # Phi-3: gate, then up
    "mlp.down_proj.weight": ("mlp.down_proj.weight", None),
    "input_layernorm.weight": ("input_norm.weight", None),
    "post_attention_layernorm.weight": ("post_attn_norm.weight", None),
    "self_attn.q_norm.weight": ("attn.q_norm_weight", None),  # Qwen3
    "self_attn.k_norm.weight": ("attn.k_norm_weight", None),
}
#: Gemma's four norms of a layer, where they differ from Llama's (see ``DecoderLayer``)
_GEMMA_NAMES: dict[str, tuple[str, int | None]] = {
    "post_attention_layernorm.weight": ("attn_out_norm.weight", None),
    "pre_feedforward_layernorm.weight": ("post_attn_norm.weight", None),
    "post_feedforward_layernorm.weight": ("mlp_out_norm.weight", None),
}
#: a mixture of experts' router and shared expert (Qwen's and Mixtral's names)
_MOE_NAMES: dict[str, tuple[str, int | None]] = {
    "mlp.gate.weight": ("mlp.router.weight", None),
    "block_sparse_moe.gate.weight": ("mlp.router.weight", None),
    "mlp.shared_expert.gate_proj.weight": ("mlp.shared.gate_up_proj.weight", 0),
    "mlp.shared_expert.up_proj.weight": ("mlp.shared.gate_up_proj.weight", 1),
    "mlp.shared_expert.down_proj.weight": ("mlp.shared.down_proj.weight", None),
    "mlp.shared_expert_gate.weight": ("mlp.shared_gate.weight", None),
}
#: an expert's products: Qwen's gate/up/down_proj, Mixtral's w1 (gate), w3 (up), w2 (down)
_EXPERT = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_EXPERT_PARTS: dict[str, tuple[str, int | None]] = {
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None),
    "w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", None),
}  # fmt: skip
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


#: Chooses the quantization of a linear module by name (``None``: keep it in float).
QuantPlan = Callable[[str], "QuantKind | None"]


class TensorSource(Protocol):
    """Checkpoint tensors by HF name, as a safetensors file hands them out (``keys``,
    ``get_tensor``): what :func:`load_transformer` reads instead of a folder's files when it is
    given one (:class:`engine.loader.random_weights.SyntheticCheckpoint`: random weights)."""

    def keys(self) -> Iterable[str]: ...

    def get_tensor(self, name: str) -> Tensor: ...


def load_transformer(
    folder: Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    quant: QuantPlan | None = None,
    *,
    source: TensorSource | None = None,
    smoothing: SmoothingPlan | None = None,
    shard: Shard | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    host_experts: tuple[int, ...] = (),
) -> Transformer:
    """Build the model from a checkpoint folder, one tensor at a time (``progress``: told
    ``("read", done, total)``, or ``"quantize"`` with ``quant``, as each tensor is in place).

    With ``quant``, each linear it names is quantized as soon as its (fused) weight is
    complete, straight from the checkpoint's values in fp32: the model never exists in full
    precision beside its quantized form. The load is bounded: beside the weights loaded so far,
    the device holds at most one fused tensor being assembled (fp32 where it will be
    quantized) and one chunk of quantization temporaries
    (:data:`engine.formats.QUANT_CHUNK_BYTES`);
    the host, one checkpoint tensor read from the mapped file. ``source``: the tensors, in
    place of ``folder``'s safetensors files (``folder`` then only names the model in errors).
    ``smoothing``: SmoothQuant's factors, folded into each parameter they touch (in fp32) as
    it is loaded, before it is quantized (:class:`engine.quant.calibration.SmoothingPlan`).
    ``shard``: this rank's part of a tensor-parallel model (:mod:`engine.parallel.shard`):
    the model is built with the rank's head counts and channels, and each parameter, whole as
    the checkpoint gives it (fused, smoothed), is cut to the rank's rows or columns before it
    is quantized, so INT8's scales are the shard's own and INT4's groups lie within it.
    ``host_experts``: the layers whose routed experts are loaded into host memory, in the
    CPU's formats, and run there (``--cpu-experts``: :mod:`engine.loader.expert_placement`).
    """
    layers = "|".join(map(str, host_experts)) or "-"
    on_host = re.compile(rf"^layers\.({layers})\.mlp\.experts\.")
    with torch.device("meta"):
        model = Transformer(cfg if shard is None else shard.local)
        if shard is not None and shard.vocab is not None:  # the vocabulary's rows, split
            start, stop = shard.vocab
            model.embed = VocabParallelEmbedding(start, stop, cfg.hidden_size)  # type: ignore[assignment]
            model.lm_head = nn.Linear(cfg.hidden_size, stop - start, bias=False)
    model.rope = model.rope.to(device)  # real buffers (built on the CPU), not meta
    if model.rope_local is not None:
        model.rope_local = model.rope_local.to(device)

    tensors: Iterable[tuple[str, Tensor]]
    read: Callable[[str], Tensor]
    if source is None:  # a folder that draws its weights, or one of files
        source = drawn_source(folder, cfg)
    if source is None:
        files = checkpoint_files(folder)
        tensors, read = iter_checkpoint(files), functools.partial(_read_tensor, files)
    else:
        tensors = ((name, source.get_tensor(name)) for name in source.keys())  # noqa: SIM118
        read = source.get_tensor
    expected = _expected_parameters(model, cfg)
    rotary = rotary_permutation(cfg)
    q_scaled = cfg.gemma and not cfg.qk_norm and cfg.query_scale != 1.0
    stage = "quantize" if quant else "read"
    fusing: dict[str, _Fused] = {}
    loaded: set[str] = set()
    head_kind = quant("lm_head") if quant else None
    # Activation-aware channel scaling of a quantized head: its input channels are scaled up
    # where the final norm makes activations large, and the inverse is folded into that norm.
    # Read first, so the head is quantized the moment it arrives, never held in fp32.
    head_scale = (
        head_channel_scale(folded_norm("norm.weight", _final_norm(read, cfg), cfg))
        if head_kind is not None
        else None
    )
    for hf_name, tensor in tensors:
        target = _map_name(hf_name, cfg)
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
        module_name, _, attr = ours.rpartition(".")
        kind = quant(module_name) if quant and attr == "weight" else None
        is_head = head_scale is not None and (
            ours == "lm_head.weight" or (ours == "embed.weight" and cfg.tie_word_embeddings)
        )
        # fp32 where it will be quantized or divided by the head's channel scale
        scaled_norm = ours == "norm.weight" and head_scale is not None
        smooth = smoothing is not None and smoothing.touches(ours)
        store = torch.float32 if kind is not None or is_head or scaled_norm or smooth else dtype
        here = torch.device("cpu") if on_host.match(ours) else device
        if part is not None:
            sizes = _fused_sizes(ours, cfg)  # the whole model's: a shard is cut once complete
            shape = torch.Size([sum(sizes), *expected[ours][1:]])
            fused = fusing.get(ours) or fusing.setdefault(ours, _Fused(sizes, shape, store, here))
            fused.put(part, tensor, hf_name)
            del tensor
            if not fused.complete:
                continue
            tensor = fusing.pop(ours).tensor
        else:
            # converted on the host, then moved: the device never holds a second copy
            tensor = folded_norm(ours, tensor, cfg).to(dtype=store).to(here)
        if rotary is not None and ours.endswith((".qkv_proj.weight", ".qkv_proj.bias")):
            tensor = permute_rotary_rows(tensor, cfg, rotary)  # a partly rotated head's order
        if q_scaled and ours.endswith((".qkv_proj.weight", ".qkv_proj.bias")):
            # Gemma 2's query_pre_attn_scalar (no q norm to hold it): the q rows scaled
            q = tensor[: cfg.q_size]
            q.copy_((q.float() * cfg.query_scale).to(q.dtype))
        if is_head:
            assert head_kind is not None and head_scale is not None
            vocab = shard.vocab if shard is not None else None
            _load_quantized_head(model, cfg, tensor, head_kind, head_scale.to(device), dtype, vocab)
            loaded.add(ours)
            if progress:
                progress(stage, len(loaded), len(expected))
            continue
        if scaled_norm:
            assert head_scale is not None
            tensor = (tensor / head_scale.to(device)).to(dtype)
        if smooth:
            assert smoothing is not None
            tensor = smoothing.apply(ours, tensor)
            tensor = tensor if kind is not None else tensor.to(dtype)
        if shard is not None:
            tensor = shard.slice(ours, tensor).contiguous()
        if kind is not None:
            _quantize_into(model, module_name, tensor, kind, dtype)
        else:
            _assign(model, ours, tensor)
        loaded.add(ours)
        del tensor
        if progress:
            progress(stage, len(loaded), len(expected))

    missing = sorted(set(expected) - loaded)
    if missing:
        shown = ", ".join(missing[:4]) + (" …" if len(missing) > 4 else "")
        raise ModelLoadError(
            f"the checkpoint in {folder} lacks {len(missing)} tensor(s): {shown}; "
            "the download or conversion is incomplete"
        )
    if head_kind is None and cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    for layer in host_experts:
        moe = model.layers[layer].mlp
        if device.type != "cpu" and isinstance(moe, MoE):
            moe.keep_on_host(device)
    for mlp in (m.mlp for m in model.layers):
        if isinstance(mlp, MoE) and quant is not None:  # a decode token's experts in one call
            mlp.set_kernel(experts.plan(mlp, cfg.activation))
    model.eval()
    return model


def _load_quantized_head(
    model: Transformer,
    cfg: ModelConfig,
    weight: Tensor,
    kind: QuantKind,
    scale: Tensor,
    dtype: torch.dtype,
    vocab: tuple[int, int] | None = None,
) -> None:
    """Quantize the LM head ``weight`` (fp32, the checkpoint's values) as ``W·diag(scale)``;
    with tied embeddings the same quantized matrix serves the embedding lookup. ``vocab``:
    the rows ``[start, stop)`` a tensor-parallel rank holds (vocabulary parallelism), cut
    before quantizing: INT8's scales and INT4's groups are per row, so a rank's rows are
    quantized exactly as the whole head's."""
    expected = (cfg.vocab_size, cfg.hidden_size)
    if tuple(weight.shape) != expected:
        raise ModelLoadError(
            f"the LM head has shape {tuple(weight.shape)}, config.json implies {expected}; "
            "config and weights disagree"
        )
    weight = weight.mul_(scale)
    if vocab is not None:
        weight = weight[vocab[0] : vocab[1]].contiguous()
    _quantize_into(model, "lm_head", weight, kind, dtype)
    if cfg.tie_word_embeddings:  # one quantized matrix serves the head and the embedding
        head = model.lm_head
        assert isinstance(head, (Int8Linear, Int4Linear))
        rows = QuantizedEmbedding(head, dtype, 1.0 / scale)
        if vocab is None:
            model.embed = rows
        else:
            model.embed = VocabParallelEmbedding(vocab[0], vocab[1], cfg.hidden_size, lookup=rows)


def _read_tensor(files: list[Path], name: str) -> Tensor:
    """One tensor by its checkpoint name, from whichever file holds it."""
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                if name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    return f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            raise ModelLoadError(
                f"{path.name} is truncated or corrupt ({exc}); re-download or re-convert the model"
            ) from exc
    raise ModelLoadError(f"the checkpoint lacks {name}; the download or conversion is incomplete")


def _fused_sizes(ours: str, cfg: ModelConfig) -> list[int]:
    """Rows each checkpoint part contributes to a fused parameter (q, k, v or gate, up)."""
    if ".qkv_proj." in ours:
        return [cfg.q_size, cfg.kv_size, cfg.kv_size]
    if ".experts." in ours:
        return [cfg.expert_intermediate_size] * 2
    if ".shared." in ours:
        return [cfg.shared_expert_size] * 2
    return [cfg.intermediate_size, cfg.intermediate_size]


class _Fused:
    """A fused parameter (``qkv_proj``, ``gate_up_proj``) assembled in place: allocated once
    at its final size and dtype, each checkpoint part copied into its rows as it arrives (no
    list of parts, no concatenation: one tensor's worth of memory)."""

    def __init__(
        self, sizes: list[int], shape: torch.Size, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        self.tensor = torch.empty(shape, dtype=dtype, device=device)
        self.missing = set(range(len(sizes)))

    def put(self, part: int, tensor: Tensor, hf_name: str) -> None:
        rows = self.tensor[self.offsets[part] : self.offsets[part + 1]]
        if rows.shape != tensor.shape:
            raise ModelLoadError(
                f"tensor {hf_name} has shape {tuple(tensor.shape)}, config.json implies "
                f"{tuple(rows.shape)}; config and weights disagree"
            )
        rows.copy_(tensor.to(rows.dtype))  # converted on the host, then copied in
        self.missing.discard(part)

    @property
    def complete(self) -> bool:
        return not self.missing


def _quantize_into(
    model: nn.Module, module_name: str, weight: Tensor, kind: QuantKind, dtype: torch.dtype
) -> None:
    from engine.quant.linear import quantized_linear

    parent_name, _, attr = module_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    current = getattr(parent, attr)
    if tuple(current.weight.shape) != tuple(weight.shape):
        raise ModelLoadError(
            f"tensor for {module_name}.weight has shape {tuple(weight.shape)}, config.json "
            f"implies {tuple(current.weight.shape)}; config and weights disagree"
        )
    bias = current.bias if current.bias is not None and not current.bias.is_meta else None
    setattr(parent, attr, quantized_linear(weight, bias, kind, dtype))


#: the image side of an image-and-text checkpoint (Gemma 3's), which a text model leaves
_IMAGE_PARTS = re.compile(r"^(model\.)?(vision_tower|multi_modal_projector)\.")
#: where an image-and-text checkpoint keeps its language model's tensors: transformers 4's
#: ``language_model.model.…`` and 5's ``model.language_model.…``, for ``model.…``
_LANGUAGE_MODEL = re.compile(r"^(language_model\.model\.|model\.language_model\.)")


def _map_name(hf_name: str, cfg: ModelConfig) -> tuple[str, int | None] | None:
    if _IGNORED.search(hf_name):
        return None
    if cfg.gemma:
        if _IMAGE_PARTS.match(hf_name):
            return None
        hf_name = _LANGUAGE_MODEL.sub("model.", hf_name).replace(
            "language_model.lm_head", "lm_head"
        )
    if hf_name in _TOP_NAMES:
        return _TOP_NAMES[hf_name], None
    m = _LAYER.match(hf_name)
    names = {**_LAYER_NAMES, **_GEMMA_NAMES} if cfg.gemma else _LAYER_NAMES
    if cfg.num_experts:
        names = {**names, **_MOE_NAMES}
    if m and m.group(2) in names:
        ours, part = names[m.group(2)]
        return f"layers.{m.group(1)}.{ours}", part
    expert = _EXPERT.match(m.group(2)) if m and cfg.num_experts else None
    if m and expert and expert.group(2) in _EXPERT_PARTS:
        ours, part = _EXPERT_PARTS[expert.group(2)]
        return f"layers.{m.group(1)}.mlp.experts.{expert.group(1)}.{ours}.weight", part
    raise ModelLoadError(f"unexpected tensor {hf_name!r}; is this a Llama/Qwen2 checkpoint?")


def _final_norm(read: Callable[[str], Tensor], cfg: ModelConfig) -> Tensor:
    """The final norm's weight as the checkpoint holds it (an image-and-text Gemma's under its
    language model's prefix)."""
    names = ["model.norm.weight"]
    if cfg.gemma:
        names += ["language_model.model.norm.weight", "model.language_model.norm.weight"]
    for name in names[:-1]:
        try:
            return read(name)
        except ModelLoadError:
            continue
    return read(names[-1])


def folded_norm(ours: str, tensor: Tensor, cfg: ModelConfig) -> Tensor:
    """A norm's weight as our RMSNorm multiplies by it: Gemma stores ``w`` of ``(1 + w)``,
    here ``1 + w`` in fp32 (and its q norm times :attr:`ModelConfig.query_scale`, which
    brings attention's 1/sqrt(head_dim) to the model's own scale); any other tensor as it
    is."""
    if not cfg.gemma or not ours.endswith(("norm.weight", "norm_weight")):
        return tensor
    weight = tensor.float() + 1.0
    return weight * cfg.query_scale if ours.endswith("q_norm_weight") else weight


def _expected_parameters(model: Transformer, cfg: ModelConfig) -> dict[str, torch.Size]:
    shapes = {name: p.shape for name, p in model.named_parameters()}
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def _assign(model: nn.Module, name: str, tensor: Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    if getattr(module, "quantized", False) and attr == "bias":  # arrived after its weight
        if tuple(tensor.shape) != (int(getattr(module, "out_features", -1)),):
            raise ModelLoadError(f"tensor for {name} has shape {tuple(tensor.shape)}")
        # in the layer's output dtype: INT8's the compute dtype, INT4's bf16 (or, where our
        # Triton kernels run it, the compute dtype)
        assert isinstance(module, (Int8Linear, Int4Linear))
        module.bias = tensor.to(module.out_dtype)
        return
    current = getattr(module, attr)
    if current.shape != tensor.shape:
        raise ModelLoadError(
            f"tensor for {name} has shape {tuple(tensor.shape)}, config.json implies "
            f"{tuple(current.shape)}; config and weights disagree"
        )
    setattr(module, attr, nn.Parameter(tensor, requires_grad=False))


def smoothing_plan(
    cfg: ModelConfig, spec: PrecisionSpec, cal: Calibration | None,
    alpha: float | dict[str, float] | None = None,
) -> SmoothingPlan | None:  # fmt: skip
    """SmoothQuant's factors for the blocks ``spec`` smooths (``w8a8-sq``), from calibration
    ``cal`` of the model (:func:`engine.quant.calibration.load`: refused with what to do where
    it is missing, made for other weights or by another format); ``alpha`` in place of the one
    it chose (the calibration's sweep)."""
    if not spec.smoothed:
        return None
    assert cal is not None
    blocks = {
        (part, layer)
        for layer in range(cfg.num_layers)
        for part in LAYER_PARTS
        if (kind := spec.block_kind(part, layer)) is not None and kind.smooth
    }
    return SmoothingPlan(cal, cfg, blocks, alpha)
