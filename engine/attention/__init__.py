"""The attention backends: what each step's attention runs on, one module per backend.

The interface is :class:`engine.model.attention.AttentionBackend` (below the model, which
calls only the step's :class:`~engine.model.attention.AttentionContext`): a backend builds a
step's context once from the scheduled chunks, says whether a CUDA graph may capture it,
which dtypes and head sizes it takes, and the workspace it needs per token of context. The
memory plan and the pool profile take their workspace term from the backend the load will
choose (:func:`planned`); the executors' compatibility table names backends the same way
(:mod:`engine.executor.table`).

* :mod:`~engine.attention.paged`: the torch paths (a padded gather and SDPA) with the paged
  C kernels wherever they read the pool (``torch`` / ``c``);
* :mod:`~engine.attention.triton`: our Triton kernels through block tables (``triton``),
  and the static context CUDA graphs capture;
* :mod:`~engine.attention.ops`: the decode attention's routing and its torch op (what a
  compiled step calls as one opaque kernel).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.attention.paged import PagedBackend
from engine.attention.triton import TritonBackend
from engine.errors import InfersightError
from engine.formats.kv import KVFormat
from engine.kernels import triton_check, triton_support
from engine.model.attention import AttentionBackend
from engine.model.config import ModelConfig

__all__ = ["AttentionBackend", "PagedBackend", "TritonBackend", "choose", "planned"]


def choose(
    cfg: ModelConfig, dtype: torch.dtype, device: torch.device, failures: list[str],
    kv: KVFormat | None = None,
) -> tuple[AttentionBackend, str]:  # fmt: skip
    """The backend a load attends with for this model, dtype, device and pool format ``kv``
    (None: the compute dtype's), and why (a line of the load report): our Triton kernels
    where :func:`triton_support.attention_chosen` picks them, they take the model's heads,
    dtype and pool, and both pass their check against the torch path
    (:mod:`engine.kernels.triton_check`; a failure appended to ``failures``); else the paged
    torch/C backend."""
    ours, why = triton_support.attention_chosen(device, cfg.head_dim)
    if not ours:
        return PagedBackend(device, kv=kv), why
    refused = TritonBackend().refusal(cfg, dtype, device) or TritonBackend.pool_refusal(kv)
    if refused:
        return PagedBackend(device, kv=kv), f"torch attention ({refused})"
    heads = (cfg.head_dim, cfg.num_heads, cfg.num_kv_heads)
    rows = kv.name if kv is not None and kv.quantized else ""
    failed = triton_check.attention(device, dtype, *heads, rows=rows)
    if not failed:
        return TritonBackend(), why
    if triton_support.requested() == "triton":
        raise InfersightError(f"{triton_support.ENV}=triton, but {failed}")
    failures.append(failed)
    return PagedBackend(device, kv=kv), f"torch attention ({failed})"


def planned(
    device: torch.device, triton: bool, cfg: Any = None, kv: KVFormat | None = None
) -> AttentionBackend:
    """The backend a load on ``device`` would choose, as the plan knows it (``triton``: our
    kernels would attend, :func:`triton_support.planned`, unless they refuse the model of
    ``cfg`` or a pool of format ``kv``), without building or checking anything (on this
    machine either: a plan neither builds the C kernel nor times a path)."""
    ours = cfg is None or not TritonBackend.model_refusal(cfg)
    if triton and ours and not TritonBackend.pool_refusal(kv):
        return TritonBackend()
    return PagedBackend(device, measure=False, kv=kv)
