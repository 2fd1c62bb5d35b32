"""The weight formats (engine/formats), one module each: for every packing a CPU can run, the
bytes a weight holds and the temporaries packing it holds are the formulas the memory plan
counts, rows read back are the values quantized, and every quantized layer holds what its
format says for the kernels it took."""

from __future__ import annotations

import pytest
import torch

from engine import formats
from engine.formats import int4, int8, w8a8
from engine.formats.int4 import padded_width, quantize_int4
from engine.hardware.cpu_paths import cpu_paths
from engine.kernels import lowbit
from engine.quant.int4 import Int4Linear
from engine.quant.int8 import Int8Linear
from engine.quant.w8a8 import W8A8Linear
from tests.probed import needs_int4
from tests.test_memory_plan_paths import peak_allocated

#: N not a multiple of 16 (torch's packings pad it), K not one of the group (every kernel pads)
SHAPES = [(200, 100, 64), (1040, 576, 32), (48, 128, 128), (256, 96, 32)]


def cpu_packings() -> list[int4.Packing]:
    """The INT4 packings a CPU runs: ours, and torch's where its layout was found."""
    block = cpu_paths().int4_block_rows
    return [int4.OURS] + ([int4.torch_cpu(block)] if block is not None else [])


@needs_int4
@pytest.mark.parametrize(("n", "k", "group"), SHAPES)
def test_each_int4_packing_holds_its_bytes_and_reads_back_its_values(n, k, group):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n))
    width = padded_width(k, group)
    for packing in cpu_packings():
        packed, scale, zero = packing.pack(w, group)
        rows = packing.rows(n)
        held = sum(t.numel() * t.element_size() for t in (packed, scale, zero))
        assert held == packing.bytes_held(n, k, group), packing.name
        padded = torch.nn.functional.pad(w, (0, width - k, 0, rows - n))
        values, want_scale, want_zero = quantize_int4(padded, group)
        assert torch.equal(scale, want_scale) and torch.equal(zero, want_zero)
        ids = torch.tensor([0, n - 1, n // 2, 1, n - 1])
        why = packing.unreadable(w.device, width, rows)
        if packing.block is not None and rows % packing.block:  # a part block: not read
            assert "cannot read" in why
            continue
        assert why == ""
        assert torch.equal(packing.read_rows(packed, ids, width), values[ids]), packing.name


@needs_int4
@pytest.mark.parametrize(("n", "k", "group"), SHAPES)
def test_packing_holds_no_more_than_the_plan_counts(monkeypatch, n, k, group):
    """Beside the packed result, packing holds its format's temporaries (the packed chunks
    before they are joined) and one chunk's quantization temporaries: what the memory plan
    counts (``load_temporaries`` and four chunks of :data:`engine.formats.QUANT_CHUNK_BYTES`,
    a chunk at least one of the layout's interleaved blocks of rows: 64 of them in torch's CPU
    layout on an AVX-512 build, past a chunk this small)."""
    chunk = 64 * 1024
    monkeypatch.setattr(formats, "QUANT_CHUNK_BYTES", chunk)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0))
    for packing in cpu_packings():
        result, peak, _ = peak_allocated(lambda p=packing: p.pack(w, group))
        final = sum(t.numel() * t.element_size() for t in result)
        assert final == packing.bytes_held(n, k, group)
        beside = peak - final
        chunk_bytes = max(chunk, (packing.block or 1) * k * 4)  # fp32 rows of whole blocks
        assert beside <= packing.load_temporaries(n, k, group) + 4 * chunk_bytes, packing.name


def test_torchs_cuda_packing_pads_rows_and_needs_three_bytes_a_value_to_load():
    assert int4.TORCH_CUDA.rows(200) == 208 and int4.OURS.rows(200) == 200
    assert int4.TORCH_CUDA.bytes_held(200, 100, 64) == 208 * 128 // 2 + 2 * 208 * 4
    assert int4.TORCH_CUDA.load_temporaries(200, 100, 64) == 208 * 128 * 3


@pytest.mark.parametrize("mode", ["torch", "ours"])
def test_each_quantized_layer_holds_its_formats_bytes(mode):
    """Whichever kernels a layer took, its tensors are what its format counts for them: the
    C kernels' fp32 scales (shared with W8A8's own), our INT4 layout or torch's, AMX's copy."""
    w = torch.randn(200, 128, generator=torch.Generator().manual_seed(1))
    with lowbit.choosing(mode):
        i8 = Int8Linear(w, None, torch.bfloat16)
        a8 = W8A8Linear(w, None, torch.bfloat16)
        i4 = Int4Linear(w, None, 32) if cpu_paths().int4_kernel.ok else None
    held = int8.bytes_held(200, 128, torch.bfloat16, c_scales=i8.c_scales)
    assert i8.nbytes == held and i8.c_scales == (mode == "ours")
    amx = a8.amx_weight is not None
    assert a8.nbytes == w8a8.bytes_held(200, 128, torch.bfloat16, c_scales=a8.c_scales, amx=amx)
    if i4 is not None:
        assert i4.packing is (int4.OURS if mode == "ours" else i4.packing)
        assert i4.nbytes == i4.packing.bytes_held(200, 128, 32)


def test_a_layers_rows_read_back_are_its_dequantized_weight():
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([3, 63, 0, 17])
    i8 = Int8Linear(w, None, torch.bfloat16)
    want8 = int8.dequantize_int8(i8.weight, i8.scales)
    assert torch.equal(i8.read_rows(ids), want8[ids])
    if not cpu_paths().int4_kernel.ok:
        return
    for mode in ("torch", "ours"):
        with lowbit.choosing(mode):
            i4 = Int4Linear(w, None, 64)
        if i4.unreadable():  # torch's CPU layout in blocks of more than 64 rows
            continue
        q, s, z = quantize_int4(torch.nn.functional.pad(w, (0, 32)), 64)
        want4 = int4.dequantize_int4(q, s, z, 64)[:, :96]
        assert torch.equal(i4.read_rows(ids), want4[ids]), mode
