"""The engine's settings: the KV pool's size, the scheduler's limits, the cache window, the
decode step's mode; and the pool's size in blocks that a load with them allocates."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.core.scheduler import SchedulerLimits
from engine.errors import InvalidRequestError
from engine.hardware.memory import free_memory
from engine.kernels import decode_graph
from engine.kv_cache.paged import PagedKVCache
from engine.kv_cache.window import CacheWindow
from engine.model.config import ModelConfig


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """KV pool size and scheduling. The pool is ``num_blocks`` blocks if given, else
    ``kv_memory`` bytes (> 1) or that fraction of free memory (<= 1), else a default share
    (10% of available RAM on CPU, 50% of free GPU memory), never more than the running set
    can use at full context. ``prefix_caching``: full KV blocks of a prefix already computed
    are shared by the requests that start with it
    (:class:`~engine.kv_cache.block_manager.BlockManager`)."""

    block_size: int = 16
    num_blocks: int | None = None
    kv_memory: float | None = None
    limits: SchedulerLimits = field(default_factory=SchedulerLimits)
    window: CacheWindow | None = None
    metrics_window_s: float = 30.0
    #: ``auto`` / ``on`` / ``off`` (:mod:`engine.kernels.decode_graph`); None:
    #: INFERSIGHT_DECODE_GRAPH
    decode_graph: str | None = None
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        try:
            decode_graph.requested_mode(self.decode_graph)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        if self.block_size < 1:
            raise InvalidRequestError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise InvalidRequestError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_memory is not None and not self.kv_memory > 0:
            raise InvalidRequestError(f"kv_memory must be > 0, got {self.kv_memory}")


def kv_pool_blocks(
    cfg: ModelConfig,
    config: EngineConfig,
    dtype: torch.dtype,
    device: torch.device,
    available: float | None = None,
) -> int:
    """KV blocks of the pool a load with ``config`` allocates: ``num_blocks`` if given, else
    ``kv_memory`` bytes (> 1) or that fraction of ``available`` memory (≤ 1; by default what
    ``device`` has free now), else 10% of it on a CPU and 50% on a GPU; never more than the
    running set can use at full context. The engine sizes its pool with this very function,
    and the memory plan with it too."""
    if config.num_blocks is not None:
        return config.num_blocks
    per_block = PagedKVCache.bytes_per_block(cfg, config.block_size, dtype)
    budget = config.kv_memory
    if budget is None or budget <= 1:
        fraction = budget if budget is not None else (0.5 if device.type == "cuda" else 0.1)
        budget = fraction * (free_memory(device) if available is None else available)
    useful = config.limits.max_batch_size * -(-cfg.max_position_embeddings // config.block_size)
    return min(int(budget // per_block), useful)
