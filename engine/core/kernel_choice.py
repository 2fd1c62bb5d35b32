"""Which of our kernels an engine runs, and why: the lines of the load report that name them,
and the load-time checks that failed (a kernel that fails its check against the torch path
leaves its work to torch, :mod:`engine.kernels.triton_check`)."""

from __future__ import annotations

import torch
from torch import nn

from engine.errors import InfersightError
from engine.kernels import triton_check, triton_support
from engine.model.config import ModelConfig
from engine.quant.int4 import Int4Linear
from engine.quant.int8 import Int8Linear


def attention(
    cfg: ModelConfig, dtype: torch.dtype, device: torch.device, failures: list[str]
) -> tuple[bool, str]:
    """Whether attention runs our Triton kernels for this model, dtype and device, and why
    (:func:`engine.kernels.triton_support.attention_chosen`, then what the prefill kernel
    runs: not fp32 on a GPU, nor bf16 below sm80; then both kernels' check against the torch
    path, :mod:`engine.kernels.triton_check`)."""
    ours, why = triton_support.attention_chosen(device, cfg.head_dim)
    if not ours:
        return ours, why
    from engine.kernels.triton_kernels import prefill_attention

    refused = prefill_attention.unsupported(
        dtype, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, device
    )
    if refused:
        return False, f"torch attention ({refused})"
    failed = triton_check.attention(device, dtype, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads)
    if not failed:
        return True, why
    if triton_support.requested() == "triton":
        raise InfersightError(f"{triton_support.ENV}=triton, but {failed}")
    failures.append(failed)
    return False, f"torch attention ({failed})"


def gemms(model: nn.Module, device: torch.device, dtype: torch.dtype, failures: list[str]) -> str:
    """A line for the load report (``""`` or ``"; …"``) where our Triton GEMMs should run the
    quantized layers on ``device`` but failed their check, each layer then on torch's kernel;
    the failure appended to ``failures``."""
    layers = [m for m in model.modules() if isinstance(m, (Int8Linear, Int4Linear))]
    if all(layer.triton is not None for layer in layers) or not triton_support.chosen(device)[0]:
        return ""
    failed = triton_check.gemms(device, dtype)
    if not failed:
        return ""
    failures.append(failed)
    return f"; quantized GEMMs in torch ({failed})"
