"""Weight-only INT8/INT4: the precision spec, the formats and the quantized layers."""
