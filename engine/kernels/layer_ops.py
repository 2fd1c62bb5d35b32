"""The decoder layer's fused operations on our Triton kernels
(:mod:`engine.kernels.triton_kernels.fused`): RMSNorm, the residual add with the norm after
it, and RoPE with the K/V write, one pass each, in place of the model's torch code
(:class:`engine.model.transformer.LayerOps`, which stays the reference). A load that attends
through our kernels hands its layers these too, once they pass their check against the torch
code (:func:`engine.kernels.triton_check.fused`)."""

from __future__ import annotations

from engine.model.transformer import LayerOps


def triton_ops() -> LayerOps:
    """Our fused kernels as the layers' operations."""
    from engine.kernels.triton_kernels import fused

    return LayerOps(
        rms_norm=fused.rms_norm,
        add_rms_norm=fused.add_rms_norm,
        rope_store=fused.rope_store,
        name="Triton: RMSNorm, residual add + RMSNorm, RoPE + KV write",
    )
