"""Attention scores in base 2, soft-capped where the model caps them (Gemma 2's
``attn_logit_softcapping``): a device function the attention kernels share."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def scores_base2(dots, scale_log2, cap_log2, cap_scale):
    """``q·k`` as the softmax's base-2 scores: ``dots × scale × log2(e)``, or, where
    ``cap_log2`` (the cap × log2(e)) is not 0, ``cap · tanh(dots × scale / cap) × log2(e)``
    (``cap_scale``: the scale over the cap), tanh written with ``exp2`` and saturating to ±1
    where ``exp`` overflows."""
    if cap_log2 != 0.0:  # one exit: Triton 3.6 cannot lower a device function's early return
        e = tl.exp2(dots * (cap_scale * 2.8853900817779268))  # exp(2t), t = dots·scale/cap
        scores = cap_log2 * (1.0 - 2.0 / (e + 1.0))
    else:
        scores = dots * scale_log2
    return scores
