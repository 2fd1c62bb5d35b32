"""Which of our kernels an engine runs, and why: the lines of the load report that name them,
and the load-time checks that failed (a kernel that fails its check against the torch path
leaves its work to torch, :mod:`engine.kernels.triton_check`)."""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.paged import PagedBackend
from engine.executor import c_step, c_step_check, table
from engine.executor import step as step_executor
from engine.formats.kv import KVFormat
from engine.kernels import layer_ops, paged_decode, triton_check, triton_support
from engine.model.config import ModelConfig
from engine.model.transformer import TORCH_OPS, Transformer
from engine.quant import w8a8
from engine.quant.int4 import Int4Linear
from engine.quant.int8 import Int8Linear


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


def layers(
    model: Transformer,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    triton: bool,
    failures: list[str],
    kv: KVFormat | None = None,
) -> str:
    """The layers' own kernels, set on ``model``, and the load report's lines for them
    (``"; …"``): where our Triton attention runs, its fused norms and RoPE + K/V write if
    they pass their check (a failure appended to ``failures``); on a CPU, the norms in C
    where our CPU kernels are allowed, the paged prefill kernel or SDPA as measured, W8A8's
    fused prefill rows, and the decode step's layers in one C call where every part runs a
    kernel of ours and the step passed its check."""
    if triton:
        failed = triton_check.fused(
            device, dtype, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            int8=kv is not None and kv.storage == torch.int8,  # fp8: the step's store
        )  # fmt: skip
        if failed:
            failures.append(failed)
            model.set_ops(TORCH_OPS)  # not an engine's sharing the model that passed
            return f"; norms and RoPE in torch ({failed})"
        fused_ops = layer_ops.triton_ops()
        model.set_ops(fused_ops)
        return f"; {fused_ops.name}"
    if device.type != "cpu":
        return ""
    ops, why = layer_ops.cpu_ops()
    model.set_ops(ops or TORCH_OPS)
    report = f"; {why}"
    if dtype in paged_decode.DTYPES:  # the paged prefill kernel or SDPA, as measured
        heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        report += f"; {paged_decode.prefill_choice(dtype, *heads)[1]}"
    # one device's fused paths: under tensor parallelism each layer's products end in an
    # all-reduce, which neither the fused W8A8 layer nor the C step makes
    parallel = model.all_reduce is not None
    fused = 0 if parallel else w8a8.fuse_layers(model)
    if fused:
        report += f"; W8A8 prefill rows fused in C ({fused} layers)"
    backend = "c" if PagedBackend(device).kernel(dtype) else "torch"
    refused = table.refusal(
        "c-step", backend, tensor_parallel=parallel, experts=model.cfg.num_experts > 0
    )
    step, why = (None, f"decode steps eager ({refused})") if refused else c_step.plan(model, dtype)
    problem = c_step_check.verdict() if step is not None else ""
    if problem:
        step, why = None, f"decode steps eager (the C step failed its check: {problem})"
    executor = step_executor.of(model)
    executor.c_step = step
    executor.c_step_why = why
    return report + f"; {why}"
