"""The kernels, first: the device's read bandwidth; each of our Triton kernels' load-time
check on this GPU (:mod:`engine.kernels.triton_check`, which forces the split paths too), the
quantized layers against their dequantized references and the quantized GEMV's speed; and,
last of the run, what torch's INT8/INT4 kernels do with 0 rows."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from checks.gpu.common import (
    MiB,
    Scale,
    expect,
    kernels,
    relative_error,
    release,
)
from engine.errors import InvalidRequestError
from engine.quant.spec import parse_precision_spec

#: the rows the layers are checked at
ROWS = (1, 5, 16, 80)
#: heads (width, query heads, KV heads) our attention kernels are checked at: the 8B's and
#: the default model's; in the dry run, fewer heads of the same widths (the interpreter)
ATTENTION = ((128, 32, 8), (64, 9, 3))
DRY_ATTENTION = ((128, 4, 2), (64, 3, 1))


def check_bandwidth(
    scale: Scale, device: torch.device, state: dict[str, Any], figures: dict[str, Any]
) -> None:
    from engine.bench.table import measure_read_bandwidth

    bandwidth = measure_read_bandwidth(scale.bandwidth_mib, repeats=10, device=device)
    release(device)
    state["bandwidth"] = bandwidth
    figures.update(buffer_bytes=scale.bandwidth_mib * MiB, read_bytes_per_s=round(bandwidth))
    print(f"     memory read bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    expect(bandwidth > 0, "no bandwidth measured")


def check_layers(device: torch.device, figures: dict[str, Any]) -> None:
    """The INT8 and INT4 layers as the engine builds them here, at 1, 5, 16 and 80 rows (a
    GEMV, a decode batch, the 16-row tile split over K, a prefill tile) against their
    dequantized references, and a tied INT4 head read back as embedding rows, exactly."""
    from engine.formats import int4
    from engine.formats.int4 import dequantize_int4, quantize_int4
    from engine.formats.int8 import dequantize_int8
    from engine.quant.embedding import QuantizedEmbedding
    from engine.quant.int4 import Int4Linear
    from engine.quant.int8 import Int8Linear, int8_kernel_runs
    from engine.quant.spec import INT4_GROUPS

    figures["int8_kernel"] = int8_kernel_runs(device)
    gen = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(256, 576, device=device, generator=gen)  # rows: a multiple of CPU blocks
    xs = {m: torch.randn(m, 576, device=device, generator=gen).to(torch.bfloat16) for m in ROWS}
    int8 = Int8Linear(w, None, torch.bfloat16)
    figures["int8_path"] = int8.kernel
    for m, x in xs.items():
        ref8 = x.float() @ dequantize_int8(int8.weight, int8.scales).T
        err8 = figures[f"int8_error_{m}_rows"] = relative_error(int8(x), ref8)
        expect(err8 <= 1e-2, f"Int8Linear disagrees with its reference at {m} rows ({err8:.2e})")
    try:
        parse_precision_spec("int4-g32", device)
    except InvalidRequestError as exc:
        figures["int4"] = f"not run here: {exc}"
        return
    for group in INT4_GROUPS:
        layer = Int4Linear(w, None, group)
        padded = F.pad(w, (0, layer.padded_k, 0, layer.padded_n))
        dense = dequantize_int4(*quantize_int4(padded, group), group)[:256, :576]
        figures[f"int4_g{group}_path"] = layer.kernel
        for m, x in xs.items():
            err = relative_error(layer(x), x.float() @ dense.T)
            figures[f"int4_g{group}_error_{m}_rows"] = err
            expect(err <= 1e-2, f"Int4Linear g{group} disagrees at {m} rows ({err:.2e})")
        embed = QuantizedEmbedding(layer, torch.float32, torch.ones(576, device=device))
        ids = torch.tensor([0, 1, 7, 8, 9, 63, 64, 199, 255], device=device)
        expect(torch.equal(embed(ids), dense[ids]), f"tied INT4 g{group} rows are not exact")
        figures[f"int4_g{group}_packing"] = layer.packing.name
        if layer.packing is int4.TORCH_CUDA:  # torch's tiles, as probed on this build
            layout = int4.cuda_int4_layout(device, layer.inner_k_tiles)
            if layout is not None:
                figures[f"int4_g{group}_layout"] = f"{layout.tile_rows}×{layout.tile_cols} tiles"


def check_triton_kernels(
    device: torch.device, dry: bool, state: dict[str, Any], figures: dict[str, Any]
) -> None:
    """Our kernels' own load-time checks on this device, for each dtype it computes in and
    both head sizes (a failure is what makes a load fall back to torch), then the layers
    (:func:`check_layers`) and the quantized GEMV's speed."""
    from engine.hardware import gpu
    from engine.kernels import triton_check, triton_support

    interpreted = dry and triton_support.interpreting()  # the dry run: ours, interpreted
    with kernels("triton" if interpreted else triton_support.requested()):
        ours, why = triton_support.chosen(device)
    figures["chosen"] = why
    if device.type == "cuda":
        expect(ours, f"our Triton kernels are not chosen on {device}: {why}")
    if ours:
        dtypes = [torch.float16]  # the dry run: one dtype (the interpreter takes seconds a check)
        if not dry and gpu.runs_bf16(gpu.capability(device)):
            dtypes.append(torch.bfloat16)
        verdicts: dict[str, str] = {}
        caches = (triton_check._attention, triton_check._gemms, triton_check._fused,
                  triton_check._grouped_verdict)  # fmt: skip
        for cache in caches:
            cache.cache_clear()  # checked now, not remembered from an earlier load
        for dtype in dtypes:
            name = str(dtype).removeprefix("torch.")
            for head_dim, heads, kv_heads in DRY_ATTENTION if dry else ATTENTION:
                at = f"{name} d{head_dim}"
                verdicts[f"attention {at}"] = triton_check.attention(
                    device, dtype, head_dim, heads, kv_heads
                )
                verdicts[f"norms and RoPE {at}"] = triton_check.fused(
                    device, dtype, heads * head_dim, heads, kv_heads, head_dim
                )
            verdicts[f"GEMMs {name}"] = triton_check.gemms(device, dtype)
            verdicts[f"grouped GEMM {name}"] = triton_check.grouped(device, dtype)
        figures["load_checks"] = {k: v or "passed" for k, v in verdicts.items()}
        failed = {k: v for k, v in verdicts.items() if v}
        expect(not failed, f"our kernels failed their checks: {failed}")
    check_layers(device, figures)
    if device.type == "cuda" and not dry:
        gemv_speed(device, state, figures)


def gemv_speed(device: torch.device, state: dict[str, Any], figures: dict[str, Any]) -> None:
    """Batch-1 INT8 and INT4 products of the 8B's MLP down projection (4096 × 14336), timed
    with CUDA events: the weight bytes read a second as a share of the bandwidth."""
    from engine.quant.int4 import Int4Linear
    from engine.quant.int8 import Int8Linear

    weight = torch.randn(4096, 14336, device=device, dtype=torch.float16)
    x = torch.randn(1, 14336, device=device, dtype=torch.float16)
    bandwidth = state.get("bandwidth")
    for name in ("int8", "int4-g32"):
        layer: Int8Linear | Int4Linear = (
            Int8Linear(weight, None, torch.float16)
            if name == "int8"
            else Int4Linear(weight, None, 32, torch.float16)
        )
        for _ in range(3):
            layer(x)
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        for _ in range(50):
            layer(x)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / 50
        rate = layer.nbytes / seconds
        figures[f"{name}_gemv"] = {
            "path": layer.kernel, "us": round(seconds * 1e6, 1), "read_bytes_per_s": round(rate),
            "of_bandwidth": round(rate / bandwidth, 3) if bandwidth else None,
        }  # fmt: skip
        del layer
    del weight
    release(device)


def check_empty_kernels(device: torch.device, figures: dict[str, Any]) -> None:
    """What the INT8 and INT4 layers do with 0 rows, recorded for both paths: ours (Triton on
    a GPU) and torch's kernels (``INFERSIGHT_KERNELS=torch``), which are what the head's 0-row
    guard in :class:`engine.model.transformer.Transformer` is for (the engine never gives
    either an empty input). Each launch is waited for and followed by another, so that an
    error it left surfaces here."""
    from engine.quant.int4 import Int4Linear
    from engine.quant.int8 import Int8Linear

    w = torch.randn(256, 512, device=device)
    layers: dict[str, Callable[[], torch.nn.Module]] = {
        "int8": lambda: Int8Linear(w, None, torch.bfloat16)
    }
    with contextlib.suppress(InvalidRequestError):
        parse_precision_spec("int4-g32", device)
        layers["int4-g32"] = lambda: Int4Linear(w, None, 32)
    paths = ("torch",) if device.type == "cpu" else ("auto", "torch")
    for (base, make), choice in ((item, c) for item in layers.items() for c in paths):
        name = f"{base} ({choice} kernels)"
        try:
            with kernels(choice):
                layer = make()
            name = f"{base} ({layer.kernel})"
            out = layer(torch.empty(0, 512, dtype=torch.bfloat16, device=device))
            release(device)
            figures[name] = f"returns {tuple(out.shape)}"
        except Exception as exc:
            figures[name] = f"raises {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        try:
            torch.ones(1, device=device).add_(1)
            release(device)
        except Exception as exc:
            figures[name] += f"; the next launch raised {type(exc).__name__}: {exc}"
        print(f"     {name} at 0 rows: {figures[name]}", flush=True)
