"""What a CUDA GPU runs natively, by its compute capability: the one place that asks, and the
policy, as pure functions of the answer.

Below compute capability 8.0 (Volta, Turing: V100, T4, the RTX 20xx) bf16 has no tensor-core
path: cuBLAS emulates it, and SDPA has no bf16 flash or memory-efficient kernel there, so
attention falls back to its math path with fp32 scores (about 1 GiB per prefill chunk at 16k
context: out of memory on an 11 GB card). fp16 is the fast path on those GPUs. torch's INT4
kernel (tinygemm) needs 8.0 too, and takes bf16 activations only; our Triton INT4 kernels
(:mod:`engine.kernels.triton_kernels.quant_gemm`, built from sm_75) take fp16, so on 7.5 INT4
runs where they do (Triton installed, not turned off). So, as vLLM does ("Bfloat16 is only
supported on GPUs with compute capability of at least 8.0 … use float16"):

==============  ====  ====  =======  =================  =======================
capability      fp32  fp16  bf16     quantized compute  int4
==============  ====  ====  =======  =================  =======================
below 7.5       runs  runs  refused  fp16               refused
7.5             runs  runs  refused  fp16               our Triton kernels only
8.0 and newer   runs  runs  runs     bf16               runs
==============  ====  ====  =======  =================  =======================

The INT8 path takes fp16 activations: torch's CUDA ``_weight_int8pack_mm`` casts its inputs to
fp32 whatever their dtype, and its fallback (:class:`~engine.quant.int8.Int8Linear`) converts
the int8 matrix to the activations' dtype, its scales and bias kept in that dtype.

:func:`capability` is the seam (tests monkeypatch it); ``None`` stands for "no CUDA GPU, or
one not known": the functions below then keep what the engine did before it asked (bf16
compute; the CPU's own paths are :mod:`engine.hardware.cpu_paths`' business).
"""

from __future__ import annotations

import re

import torch

from engine.errors import InvalidRequestError

#: ``(major, minor)``: 7.5 is Turing (RTX 20xx), 8.6 Ampere (RTX 30xx), 8.9 Ada (RTX 40xx)
Capability = tuple[int, int]
#: The first capability with bf16 tensor cores and torch's INT4 kernel (Ampere, the A100)
AMPERE: Capability = (8, 0)
#: The oldest capability our Triton kernels are built for (Turing: T4, RTX 20xx)
TURING: Capability = (7, 5)


def capability(device: torch.device | str) -> Capability | None:
    """The compute capability of a CUDA ``device``; ``None`` for any other (CPU, ``meta``).

    Only a CUDA device is asked, so a CPU-only build never touches ``torch.cuda`` here.
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(dev)
    return int(major), int(minor)


def present(device: torch.device | str) -> bool:
    """Whether ``device`` is a CUDA GPU of this machine (so :func:`capability` can ask it)."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return False
    return dev.index is None or dev.index < torch.cuda.device_count()


def runs_bf16(cap: Capability | None) -> bool:
    """Whether bf16 runs natively (tensor cores, SDPA's fused kernels)."""
    return cap is None or cap >= AMPERE


def runs_int4(cap: Capability | None, triton: bool = False) -> bool:
    """Whether INT4 runs: torch's CUDA INT4 kernel needs 8.0, ours (``triton``: they run on
    this GPU) 7.5; a CPU's is probed elsewhere."""
    return cap is None or cap >= AMPERE or (triton and cap >= TURING)


def compute_dtype_for(cap: Capability | None) -> torch.dtype:
    """The dtype a quantized model computes in: bf16 where it runs natively, else fp16 (the
    INT8 kernels take either; INT4 runs there only through our Triton kernels, in fp16)."""
    return torch.bfloat16 if runs_bf16(cap) else torch.float16


def capability_text(cap: Capability) -> str:
    return f"{cap[0]}.{cap[1]}"


_CAPABILITY = re.compile(r"(?:sm_?)?(\d)\.?(\d)", re.ASCII)


def parse_capability(text: str) -> Capability:
    """``7.5``, ``8.6``, ``sm_75`` or ``sm89`` as ``(major, minor)``."""
    match = _CAPABILITY.fullmatch(text.strip().lower())
    if match is None or int(match.group(1)) < 3:
        raise InvalidRequestError(
            f"compute capability {text!r} is not one; write it as major.minor, e.g. 7.5 for an "
            "RTX 20xx, 8.6 for an RTX 30xx, 8.9 for an RTX 40xx (nvidia-smi "
            "--query-gpu=compute_cap --format=csv prints it)"
        )
    return int(match.group(1)), int(match.group(2))
