"""The KV cache's dtype, as ``--kv-dtype`` names it: which :mod:`engine.formats.kv` format a
load's pool takes, and where it is refused.

``auto`` is the compute dtype's float pool; ``fp16`` / ``bf16`` name that float pool (it must
be the compute dtype: the kernels read K/V as the model computes them); ``int8`` works on
every device (head sizes a multiple of four: a row's scale sits aligned after its values);
``fp8`` (e4m3) needs a GPU with native FP8, sm_89 or later.
"""

from __future__ import annotations

import torch

from engine.errors import InvalidRequestError
from engine.formats.kv import FP8, INT8, SCALE_BYTES, KVFormat, float_format

#: what ``--kv-dtype`` takes
CHOICES = ("auto", "fp16", "bf16", "int8", "fp8")
#: the CUDA capability from which FP8 e4m3 is native (Ada, Hopper and later)
FP8_CAPABILITY = (8, 9)


def planned(kv_dtype: str, compute: torch.dtype) -> KVFormat:
    """The format ``--kv-dtype kv_dtype`` gives a model computing in ``compute``, refused
    (:class:`InvalidRequestError`, saying what to do) where the name is unknown or names a
    float other than the compute dtype; no device is consulted (a plan's; a load also calls
    :func:`refusal`)."""
    if kv_dtype not in CHOICES:
        raise InvalidRequestError(
            f"unknown KV cache dtype {kv_dtype!r}: choose one of {', '.join(CHOICES)}"
        )
    if kv_dtype == "int8":
        return INT8
    if kv_dtype == "fp8":
        return FP8
    own = float_format(compute)
    if kv_dtype not in ("auto", own.name):
        raise InvalidRequestError(
            f"a float KV cache holds the model's compute dtype ({own.name} here), not "
            f"{kv_dtype}: run with --precision {kv_dtype}, or choose --kv-dtype auto, or int8 "
            "for half the bytes"
        )
    return own


def refusal(
    fmt: KVFormat, head_dim: int, device: str, capability: tuple[int, int] | None = None
) -> str:
    """Why a pool of ``fmt`` cannot serve heads ``head_dim`` wide on a ``device`` of that
    kind (``cpu``, ``cuda``) and CUDA ``capability`` (None: not known, planned as 8.0); ""
    where it can."""
    if fmt.quantized and head_dim % SCALE_BYTES:
        return (
            f"a quantized KV cache keeps each row's fp32 scale after its values, aligned: head "
            f"size {head_dim} is not a multiple of {SCALE_BYTES}; use --kv-dtype auto"
        )
    if fmt is not FP8:
        return ""
    if device != "cuda":
        return (
            "an FP8 (e4m3) KV cache needs a GPU with native FP8 (sm_89 or later: Ada, Hopper); "
            f"this device is a {device.upper()}: use --kv-dtype int8 (the same bytes)"
        )
    if capability is None:
        return (
            "an FP8 (e4m3) KV cache needs native FP8 (sm_89 or later), and this GPU's compute "
            "capability is not known: plan with --capability 8.9 (or 9.0), or use --kv-dtype "
            "int8 (the same bytes)"
        )
    major, minor = capability
    if (major, minor) < FP8_CAPABILITY:
        return (
            f"an FP8 (e4m3) KV cache needs native FP8 (sm_89 or later); this GPU is "
            f"sm_{major}{minor}: use --kv-dtype int8 (the same bytes)"
        )
    return ""


def device_refusal(fmt: KVFormat, head_dim: int, device: torch.device) -> str:
    """:func:`refusal` for ``device`` as it is (a GPU asked its capability)."""
    capability = None
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
    return refusal(fmt, head_dim, device.type, capability)
