"""Quantized weights as layers: the precision spec (:mod:`~engine.quant.spec`), the layer each
format becomes (:mod:`~engine.quant.linear`: :mod:`~engine.quant.int8`, :mod:`~engine.quant.int4`,
:mod:`~engine.quant.w8a8`, each choosing the kernel that runs it and so the packing it holds),
the embedding a tied, quantized head serves (:mod:`~engine.quant.embedding`), W8A8's
calibration (:mod:`~engine.quant.calibration`), the bytes a spec's weights take
(:mod:`~engine.quant.sizes`) and what a loaded model holds (:mod:`~engine.quant.inventory`).
The formats themselves (arithmetic, packings, bytes, reading rows back) are
:mod:`engine.formats`'s, one module each.
"""
