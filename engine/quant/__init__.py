"""Weight-only INT8/INT4: the precision spec (:mod:`~engine.quant.spec`), the quantized layers
(:mod:`~engine.quant.int8`, :mod:`~engine.quant.int4`, :mod:`~engine.quant.embedding`) and the
bytes a spec's weights take (:mod:`~engine.quant.sizes`); the formats themselves are
:mod:`engine.formats`."""
