"""A GPU's KV pool: what the largest step leaves of the memory the engine may take, measured.

As vLLM (``determine_available_memory``) and nano-vllm (``allocate_kv_cache``) do: once the
weights are in, one forward of the largest step the scheduler can make runs against a scratch
KV pool just big enough for it (:func:`warm_up`), between ``reset_peak_memory_stats`` and
``max_memory_allocated``. The pool then takes what is left (:func:`size_pool`)::

    pool + gather = total × utilization − peak − non-torch

* **total**: the device's memory; **utilization**: ``EngineConfig.gpu_memory_utilization``
  (0.9 by default: the rest is margin);
* **peak**: the most the warm-up's tensors took at once, its scratch pool left out: the
  weights, a prefill chunk of ``max_tokens_per_step`` tokens in one sequence (its attention
  the largest temporaries), the logits of ``max_batch_size`` rows and their sampling, and any
  tensor this process holds beside them;
* **non-torch**: memory in use that torch's allocator does not hold (``mem_get_info``'s used
  minus ``memory_reserved``): the CUDA context, cuBLAS/cuDNN workspaces, other processes;
* **gather** (an analytic term, stated as such, not measured): the warm-up's prompt starts at
  position 0, so the temporaries that grow with the context a step reads are counted by
  formula, the attention backend's (``workspace_bytes_per_token``, :mod:`engine.attention`):
  the decode step's K/V gathered into padded rows of ``max_batch_size`` sequences
  (:mod:`engine.kernels.gather_attention`, the torch decode path) or a prefill chunk's
  gathered K/V and its mask, the larger; at ``min(context, pool tokens)`` tokens, as no
  sequence reads more than the pool holds. Where our Triton kernels attend (the default on a
  CUDA GPU: :func:`engine.kernels.triton_support.planned`), both read the paged pool in place
  and the term is 0.

The pool is never more than the running set can use at full context, and a budget that holds
no block is refused with the figures (:meth:`PoolSizing.refusal`). The memory plan
(:mod:`engine.loader.memory_plan`) sizes its pool with this same :func:`size_pool`, its peak
the weights, RoPE's tables and its workspace estimate (it cannot run a forward before
loading), and the same answer to whether our Triton kernels attend
(:func:`engine.kernels.triton_support.planned`), so the two cannot drift. A CPU's pool
stays a share of its RAM (:func:`~engine.core.config.kv_pool_blocks`).

The memory figures come through :func:`engine.hardware.memory.device_memory`, the seam where
tests put a fake GPU: the sizing and its warm-up forward then run on a CPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from engine.core.config import EngineConfig, blocks_for_budget, kv_format, pool_bytes
from engine.core.sampling import SamplingParams, make_generator, sample
from engine.errors import OutOfMemoryError
from engine.hardware import memory as device_memory
from engine.kv_cache.paged import PagedKVCache, SeqChunk
from engine.model.attention import AttentionBackend
from engine.model.config import ModelConfig
from engine.model.transformer import Transformer

log = logging.getLogger(__name__)

GiB = 2**30
#: the warm-up's scratch sequence (no request id starts with a NUL)
SCRATCH_ID = "\0profile"
#: the warm-up samples as a costly request does: every filter and the penalty on
WARM_SAMPLING = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05,
                               repetition_penalty=1.1, seed=0)  # fmt: skip


@dataclass(frozen=True, slots=True)
class PoolSizing:
    """Why a GPU's KV pool has its size: the figures of :func:`size_pool`, in bytes."""

    total: int
    utilization: float
    peak: int  # the warm-up's measured peak, or the plan's weights, RoPE tables, workspace
    non_torch: int
    gather_per_token: int  # the analytic gather term, per token of context read
    context: int  # the most tokens one sequence reads (the model's context length)
    block_size: int  # tokens
    block_bytes: int
    blocks: int
    measured: bool  # a warm-up measured the peak (the load), or it is an estimate (the plan)

    @property
    def room(self) -> int:
        """total × utilization − peak − non-torch: what the pool and the gather share."""
        return int(self.total * self.utilization) - self.peak - self.non_torch

    #: the pool's bytes at ``blocks`` (with the local layers' own pool where it has one)
    pool_bytes: int = 0

    @property
    def gather_tokens(self) -> int:
        """The context the gather term is counted at: the model's, or the pool's if less."""
        return min(self.context, max(0, self.blocks) * self.block_size)

    @property
    def gather_bytes(self) -> int:
        return self.gather_per_token * self.gather_tokens

    def summary(self) -> str:
        """The figures as one line (the load report)."""
        peak = "measured in a warm-up" if self.measured else "weights + RoPE + workspace, estimated"
        return (
            f"{self.utilization:.2f} × {_gib(self.total)} total − {_gib(self.peak)} peak "
            f"({peak}) − {_gib(self.non_torch)} not torch's = {_gib(self.room)}: "
            f"{_gib(self.gather_bytes)} for the K/V a step gathers at {self.gather_tokens} "
            f"tokens (analytic), {_gib(self.pool_bytes)} for the pool"
        )

    def refusal(self) -> str:
        """Why no KV block fits, with the figures and what to change."""
        return (
            f"the GPU's memory leaves no room for a KV block ({self.block_bytes / 2**20:.2f} MiB "
            f"each): {self.summary()}; raise --gpu-memory-utilization, lower "
            "--max-tokens-per-step or the batch size, or choose a smaller precision"
        )


def size_pool(
    cfg: ModelConfig,
    config: EngineConfig,
    dtype: torch.dtype,
    *,
    total: int,
    peak: int,
    non_torch: int,
    measured: bool,
    attention: AttentionBackend,
) -> PoolSizing:
    """A GPU's KV pool from its figures: ``pool + gather = total × utilization − peak −
    non-torch`` (the module's docstring), never more than the running set can use at full
    context. The load passes the warm-up's measured peak, the memory plan its weights plus
    its workspace estimate. ``attention``: the backend the engine attends with, whose workspace
    per token of context is the gather term (none through our Triton kernels)."""
    block_bytes = PagedKVCache.bytes_per_block(cfg, config.block_size, kv_format(config, dtype))
    token_bytes = block_bytes // config.block_size
    sizing = PoolSizing(
        total=total,
        utilization=config.gpu_memory_utilization,
        peak=peak,
        non_torch=non_torch,
        gather_per_token=attention.workspace_bytes_per_token(
            cfg, dtype, config.limits.max_batch_size, config.limits.max_tokens_per_step
        ),
        context=cfg.max_position_embeddings,
        block_size=config.block_size,
        block_bytes=block_bytes,
        blocks=0,
        measured=measured,
    )
    # the pool's tensors are its blocks and one zero pad slot; the gather grows with its reach
    blocks = blocks_for_budget(
        cfg, config, dtype, sizing.room - token_bytes, sizing.gather_per_token
    )
    return replace(sizing, blocks=blocks, pool_bytes=pool_bytes(cfg, config, dtype, max(0, blocks)))


def profile_pool(
    model: Transformer,
    cfg: ModelConfig,
    config: EngineConfig,
    dtype: torch.dtype,
    device: torch.device,
    *,
    held: int = 0,
    attention: AttentionBackend,
) -> PoolSizing | None:
    """The KV pool of an engine on ``device`` with ``config``, sized from a warm-up forward
    (:func:`warm_up`); None where it is not profiled: ``config`` gives the size
    (``num_blocks`` or ``kv_memory``), or the device is not a GPU (a CPU's pool is a share of
    its RAM). ``attention``: the backend the engine attends with (the warm-up's too).
    ``held``: bytes allocated now that the new pool replaces (an engine's own pool, freed
    once the new one is built), left out of the peak. A warm-up that runs out of memory
    is refused as :class:`~engine.errors.OutOfMemoryError`, with what to lower."""
    memory = device_memory.device_memory(device)
    if memory is None or config.num_blocks is not None or config.kv_memory is not None:
        return None
    try:
        peak, figures = warm_up(model, cfg, config, dtype, device, memory, attention=attention)
    except torch.OutOfMemoryError:
        memory.release()
        limits = config.limits
        raise OutOfMemoryError(
            f"the largest step ({limits.max_tokens_per_step} tokens of prompt, the logits of "
            f"{limits.max_batch_size} rows) does not fit on {device} beside the weights; lower "
            "--max-tokens-per-step or the batch size, or choose a smaller precision"
        ) from None
    memory.release()  # the warm-up's activations, cached: the pool takes that room
    sizing = size_pool(
        cfg, config, dtype,
        total=figures.total, peak=peak - held, non_torch=figures.non_torch, measured=True,
        attention=attention,
    )  # fmt: skip
    log.info("KV pool profiled: %s", sizing.summary())
    return sizing


def warm_up(
    model: Transformer,
    cfg: ModelConfig,
    config: EngineConfig,
    dtype: torch.dtype,
    device: torch.device,
    memory: device_memory.DeviceMemory,
    *,
    attention: AttentionBackend,
) -> tuple[int, device_memory.MemoryFigures]:
    """The largest step the scheduler can make, run once: ``max_tokens_per_step`` tokens of
    prompt in one sequence (at most the model's context) through a scratch KV pool just big
    enough for them, the logits of ``max_batch_size`` rows, and their sampling with every
    filter on. Returns the peak allocated over it less the scratch pool (the real pool takes
    its place), and the figures read after it. The scratch pool is freed on return."""
    limits = config.limits
    chunk = min(limits.max_tokens_per_step, cfg.max_position_embeddings)
    rows = limits.max_batch_size
    memory.reset_peak()
    scratch = PagedKVCache(
        cfg, num_blocks=-(-chunk // config.block_size), block_size=config.block_size,
        dtype=dtype, device=device, prefix_caching=False, attention=attention,
        kv_format=kv_format(config, dtype),
    )  # fmt: skip
    scratch.manager.grow(SCRATCH_ID, chunk)
    logits = model(
        torch.zeros(chunk, dtype=torch.long, device=device),
        torch.arange(chunk, device=device),
        scratch.context([SeqChunk(SCRATCH_ID, 0, chunk)]),
        torch.arange(chunk - rows, chunk, device=device) % chunk,  # rows repeat past a chunk
    )
    history = torch.zeros(chunk, dtype=torch.long, device=device)
    generators = [make_generator(0, device) for _ in range(rows)]
    sample(logits, [WARM_SAMPLING] * rows, [history] * rows, generators)
    figures = memory.read()
    return figures.peak - scratch.nbytes, figures


def _gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f} GiB"
