"""The weight formats, one module each: what a quantized weight *is*, whichever kernel reads it.

* :mod:`~engine.formats.int8`: per output channel, symmetric INT8;
* :mod:`~engine.formats.int4`: group-wise, asymmetric INT4, in each of the layouts a kernel
  reads it in (ours, torch's CPU and CUDA packings);
* :mod:`~engine.formats.w8a8`: INT8 weights that meet INT8 activations (the weights are
  :mod:`~engine.formats.int8`'s; what W8A8 adds is held beside them).

Each module holds a format's arithmetic (quantize, dequantize), its packing for each backend,
reading rows back (what a tied, quantized LM head serves the embedding from), the bytes a
weight holds once loaded and the temporaries its packing holds while loading. The quantized
layers (:mod:`engine.quant`), the memory plan (:mod:`engine.quant.sizes`,
:mod:`engine.loader.memory_plan`) and the kernels' checks all take them from here, so a size
or a layout is written once. This room is pure tensor math, below everything else in the
engine: the CPU probes (:mod:`engine.hardware.cpu_paths`) and the kernels build on it.

Quantizing runs a chunk of rows at a time (:func:`row_chunks`): beside the float weight, only
the result and one chunk's fp32 temporaries exist.
"""

from __future__ import annotations

#: fp32 bytes of weight rows quantized at once: bounds a quantization's temporaries
QUANT_CHUNK_BYTES = 32 * 2**20


def row_chunks(n: int, k: int, multiple: int = 1) -> list[slice]:
    """Slices of ``n`` rows of width ``k``, each about :data:`QUANT_CHUNK_BYTES` in fp32 and
    a multiple of ``multiple`` rows long (the last one may be shorter)."""
    rows = max(multiple, QUANT_CHUNK_BYTES // (4 * k) // multiple * multiple)
    return [slice(start, min(start + rows, n)) for start in range(0, n, rows)]
