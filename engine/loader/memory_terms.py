"""The terms of a memory plan that depend on the model and the precision alone (no device,
no budget): KV bytes per token, a step's workspace, what a load holds beside its weights,
RoPE's tables. :mod:`engine.loader.memory_plan` adds them up against a device's memory."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.formats import QUANT_CHUNK_BYTES
from engine.model.config import ModelConfig
from engine.quant.sizes import Backends, linear_load_temporaries
from engine.quant.spec import PrecisionSpec

if TYPE_CHECKING:
    from engine.core.config import EngineConfig

#: Allocator slack a load may hold beyond its tensors (freed blocks not yet reused).
LOAD_SLACK_BYTES = 64 * 2**20
#: An upper estimate of the sampler's temporaries alive at once, per logit of a batch: a
#: full-vocabulary sort's values and int64 order, softmaxes, masks (all rows at once).
SAMPLER_BYTES_PER_LOGIT = 32


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """K and V of one token in every layer, in the cache's dtype (the compute dtype)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize


def workspace_bytes(cfg: ModelConfig, dtype: torch.dtype, config: EngineConfig) -> int:
    """What the load's warm-up forward measures beside the weights, estimated: the
    activations of one step of ``max_tokens_per_step`` tokens (an upper estimate: fp32, every
    intermediate of one layer alive at once), the logits of a full batch (in the compute
    dtype and fp32) and their sampling (:data:`SAMPLER_BYTES_PER_LOGIT`). No attention scores:
    SDPA's fused kernels do not keep them (and below compute capability 8.0, where bf16's
    would fall back to the math path, the policy computes in fp16). The temporaries that grow
    with the context a step reads are the plan's gather term, added at the pool's reach."""
    tokens = min(config.limits.max_tokens_per_step, cfg.max_position_embeddings)
    batch = config.limits.max_batch_size
    widths = cfg.hidden_size * 3 + cfg.q_size * 2 + cfg.kv_size * 2 + _widest_mlp(cfg) * 3
    activations = tokens * widths * 4
    logits = batch * cfg.vocab_size * (4 * 2 + SAMPLER_BYTES_PER_LOGIT)
    return activations + logits


def load_overhead_bytes(cfg: ModelConfig, spec: PrecisionSpec, backends: Backends) -> int:
    """The most :func:`engine.loader.weights.load_transformer` holds beside the weights already
    loaded: the largest tensor being assembled (the embedding or head, or a fused gate/up or
    q/k/v projection) in fp32 where it will be quantized, else in the compute dtype; on a CPU
    also its copy read from the checkpoint (in the checkpoint's dtype, fp32 when the config
    does not say); the packing temporaries of the largest quantized matrix in its format and
    packing on ``backends`` (:meth:`engine.formats.int4.Packing.load_temporaries`,
    :func:`engine.formats.int8.load_temporaries`); and four chunks of quantization
    temporaries with allocator slack."""
    compute = torch.empty((), dtype=spec.compute).element_size()
    shapes = {
        "qkv": (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size),
        "gate_up": (2 * _widest_mlp(cfg), cfg.hidden_size),
        "down": (cfg.hidden_size, _widest_mlp(cfg)),
        "o": (cfg.hidden_size, cfg.q_size),
    }
    layer_elems = max(shapes["qkv"][0] * shapes["qkv"][1], shapes["gate_up"][0] * cfg.hidden_size)
    head_elems = cfg.vocab_size * cfg.hidden_size
    layer_kinds = {spec.block_kind(p, i) for p in ("attn", "mlp") for i in range(cfg.num_layers)}
    head = spec.parts.get("head")
    largest = max(
        layer_elems * (4 if layer_kinds - {None} else compute),
        head_elems * (4 if head is not None else compute),
    )
    extra = 0
    if not backends.triton and not backends.cuda:  # a CPU reads the checkpoint's copy
        extra = max(layer_elems, head_elems) * CHECKPOINT_ITEMSIZE.get(cfg.torch_dtype or "", 4)
    matrices = [(kind, n, k) for kind in layer_kinds if kind for n, k in shapes.values()]
    if head is not None:
        matrices.append((head, cfg.vocab_size, cfg.hidden_size))
    packing = max(
        (linear_load_temporaries(n, k, kind, backends) for kind, n, k in matrices), default=0
    )
    return largest + extra + packing + 4 * QUANT_CHUNK_BYTES + LOAD_SLACK_BYTES


#: bytes per value of a checkpoint by its config's ``torch_dtype``
CHECKPOINT_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def rope_bytes(cfg: ModelConfig) -> int:
    """RoPE's tables (:class:`engine.model.transformer.RotaryEmbedding`): fp32 cos and sin of
    every position up to the model's context, ``[max_position_embeddings, head_dim]`` each,
    moved to the device at the load's start and kept (128 MiB for Llama-3.1-8B); twice that
    with LongRoPE, whose long factors have tables of their own (Phi-3's), or with local
    layers that turn by a base of their own (Gemma's)."""
    tables = 2 if cfg.rope_scaling.kind == "longrope" else 1
    tables += bool(cfg.local_layers and cfg.local_rope_theta is not None)
    return tables * 2 * cfg.max_position_embeddings * cfg.head_dim * 4


def _widest_mlp(cfg: ModelConfig) -> int:
    """The widest MLP a layer runs: the dense one, an expert, or a shared expert."""
    return max(cfg.intermediate_size, cfg.expert_intermediate_size, cfg.shared_expert_size)
