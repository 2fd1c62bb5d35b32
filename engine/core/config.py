"""The engine's settings: the KV pool's size, the scheduler's limits, the cache window, the
decode step's mode; and the pool's size in blocks that a load with them allocates."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.core.scheduler import SchedulerLimits
from engine.errors import InvalidRequestError
from engine.executor import cuda_graphs, inductor
from engine.formats.kv import KVFormat
from engine.hardware.memory import free_memory
from engine.kv_cache import dtypes as kv_dtypes
from engine.kv_cache.layered import local_pool_blocks, local_window_under
from engine.kv_cache.paged import PagedKVCache
from engine.kv_cache.window import CacheWindow
from engine.model.config import ModelConfig


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """KV pool size and scheduling. The pool is ``num_blocks`` blocks if given, else
    ``kv_memory`` bytes (> 1) or that fraction of free memory (<= 1), else on a CPU 10% of
    the available RAM, and on a GPU what a profiled warm-up leaves of
    ``gpu_memory_utilization`` × its memory (:mod:`engine.core.pool_profile`); never more than
    the running set can use at full context. ``prefix_caching``: full KV blocks of a prefix
    already computed are shared by the requests that start with it
    (:class:`~engine.kv_cache.block_manager.BlockManager`)."""

    block_size: int = 16
    num_blocks: int | None = None
    kv_memory: float | None = None
    #: the share of a GPU's memory the engine may take in all (weights, a step's peak, the
    #: KV pool) when its pool is profiled; the rest is margin (vLLM's default, 0.9)
    gpu_memory_utilization: float = 0.9
    limits: SchedulerLimits = field(default_factory=SchedulerLimits)
    window: CacheWindow | None = None
    metrics_window_s: float = 30.0
    #: ``auto`` / ``on`` / ``off`` (:mod:`engine.executor.inductor`); None:
    #: INFERSIGHT_DECODE_GRAPH
    decode_graph: str | None = None
    #: ``auto`` / ``on`` / ``off`` (:mod:`engine.executor.cuda_graphs`); None:
    #: INFERSIGHT_CUDA_GRAPHS
    cuda_graphs: str | None = None
    prefix_caching: bool = True
    #: layers of a mixture of experts whose experts stay on the CPU, or ``auto``
    #: (:mod:`engine.loader.expert_placement`)
    cpu_experts: int | str = 0
    #: what the KV pool holds (:mod:`engine.kv_cache.dtypes`: ``auto``, the compute dtype;
    #: ``int8`` / ``fp8``, quantized rows at about half a 16-bit pool's bytes)
    kv_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_dtype not in kv_dtypes.CHOICES:
            raise InvalidRequestError(
                f"unknown KV cache dtype {self.kv_dtype!r}: choose one of "
                f"{', '.join(kv_dtypes.CHOICES)}"
            )
        if self.cpu_experts != "auto" and (
            not isinstance(self.cpu_experts, int) or self.cpu_experts < 0
        ):
            raise InvalidRequestError(
                f"cpu_experts must be a count of layers (>= 0) or auto, got {self.cpu_experts!r}"
            )
        try:
            inductor.requested_mode(self.decode_graph)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        cuda_graphs.requested_mode(self.cuda_graphs)
        if self.block_size < 1:
            raise InvalidRequestError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise InvalidRequestError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_memory is not None and not self.kv_memory > 0:
            raise InvalidRequestError(f"kv_memory must be > 0, got {self.kv_memory}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise InvalidRequestError(
                "gpu_memory_utilization must be in (0, 1], the share of the GPU's memory the "
                f"engine may take; got {self.gpu_memory_utilization}"
            )


def kv_pool_blocks(
    cfg: ModelConfig,
    config: EngineConfig,
    dtype: torch.dtype,
    device: torch.device,
    available: float | None = None,
) -> int:
    """KV blocks of the pool a load with ``config`` allocates: ``num_blocks`` if given, else
    ``kv_memory`` bytes (> 1) or that fraction of ``available`` memory (≤ 1; by default what
    ``device`` has free now), else 10% of it on a CPU; never more than the running set can use
    at full context. The engine sizes its pool with this very function, and the memory plan
    with it too. A GPU's default pool is sized otherwise, from a profiled warm-up
    (:func:`engine.core.pool_profile.size_pool`), and is refused here."""
    if config.num_blocks is not None:
        return config.num_blocks
    budget = config.kv_memory
    if budget is None and device.type == "cuda":
        raise ValueError(
            "a GPU's default KV pool is sized by engine.core.pool_profile.size_pool, from a "
            "profiled warm-up; give num_blocks or kv_memory to size it here"
        )
    if budget is None or budget <= 1:
        fraction = 0.1 if budget is None else budget
        budget = fraction * (free_memory(device) if available is None else available)
    return blocks_for_budget(cfg, config, dtype, budget)


def blocks_for_budget(
    cfg: ModelConfig, config: EngineConfig, dtype: torch.dtype, budget: float,
    per_token: int = 0,
) -> int:  # fmt: skip
    """The KV blocks ``budget`` bytes hold (fewer than one where it holds none), with
    ``per_token`` more bytes for each token the pool reaches up to the model's context (a
    step's gather on the torch path), never more than the running set can use at full
    context (``max_batch_size`` sequences of the model's context length). A model whose
    local layers keep a pool of their own (:func:`local_blocks`) holds it in the same
    budget."""
    bs, context = config.block_size, cfg.max_position_embeddings
    useful = config.limits.max_batch_size * -(-context // bs)

    def cost(blocks: int) -> int:
        return pool_bytes(cfg, config, dtype, blocks) + per_token * min(context, blocks * bs)

    low, high = 0, useful  # the most blocks that fit: the cost grows with them
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if cost(mid) <= budget else (low, mid - 1)
    return low


def local_blocks(cfg: ModelConfig, config: EngineConfig, num_blocks: int) -> int | None:
    """The blocks of the local layers' own pool beside ``num_blocks`` for the full layers
    (:mod:`engine.kv_cache.layered`; None: the model has no local layers)."""
    if cfg.local_window is None or not cfg.local_layers:
        return None
    limits, local = config.limits, len(cfg.local_layers)
    kept = local_window_under(config.window, cfg.local_window)
    return local_pool_blocks(
        kept.window, config.block_size, num_blocks, max_batch=limits.max_batch_size,
        step_tokens=limits.max_tokens_per_step, layers=(cfg.num_layers - local, local),
        sink=kept.sink,
    )  # fmt: skip


def layer_block_bytes(
    cfg: ModelConfig, block_size: int, kv: torch.dtype | KVFormat
) -> tuple[int, int]:
    """A block's bytes over the full layers, and over the local layers (0 without), in a
    pool of format ``kv`` (a dtype: its float pool)."""
    local = len(cfg.local_layers) if cfg.local_window is not None else 0
    per_layer = PagedKVCache.bytes_per_block(cfg, block_size, kv, layers=1)
    return per_layer * (cfg.num_layers - local), per_layer * local


def kv_format(config: EngineConfig, dtype: torch.dtype) -> KVFormat:
    """The pool's format under ``config`` for a model computing in ``dtype``
    (:func:`engine.kv_cache.dtypes.planned`: refused where it names another float)."""
    return kv_dtypes.planned(config.kv_dtype, dtype)


def pool_bytes(cfg: ModelConfig, config: EngineConfig, dtype: torch.dtype, blocks: int) -> int:
    """The bytes of a pool of ``blocks`` blocks for the full layers (and the local layers'
    own pool beside it), pad slots left out, in the format ``config`` gives a model
    computing in ``dtype``."""
    full, local = layer_block_bytes(cfg, config.block_size, kv_format(config, dtype))
    return full * blocks + local * (local_blocks(cfg, config, blocks) or blocks)
