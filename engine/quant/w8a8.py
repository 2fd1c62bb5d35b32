"""W8A8: INT8 weights per output channel and INT8 activations per token, multiplied in int32.

Weight-only INT8 (:class:`~engine.quant.int8.Int8Linear`) keeps the activations float, so a
prefill chunk or a large batch runs float GEMMs, and those are bound by compute on a CPU. Here
a product of more rows than a decode step's (:data:`engine.kernels.gemv.MAX_ROWS`) quantizes
each row of its activations to int8 with its own scale (``absmax / 127``, dynamic: nothing to
calibrate), multiplies int8 × int8 → int32 exactly with ``torch._int_mm`` (oneDNN on a CPU,
VNNI where it has it; cuBLASLt on CUDA), and applies the two scales to the int32 sums:

    y[m, n] = (Σ_k xq[m, k] · wq[n, k]) · sx[m] · sw[n]

Decode steps (up to ``MAX_ROWS`` rows) keep the weight-only path where it is faster there:
reading the weights is their cost, and our C kernels (the decode step in one C call) run it.
That is measured per machine and layer shape at load (int8 × int8 against weight-only on one
row, kept in ``kernels.json``); the load report names the path of each step shape.

Quantizing the activations is an approximation the weights' quantization does not make: an
activation channel with outliers takes the whole row's scale. SmoothQuant's per-channel
factors (``w8a8-sq``: :mod:`engine.quant.calibration`) move that range into the weights,
folded in at load so that nothing runs for them at inference.

On a CPU, a layer whose four products are all W8A8 runs a prefill's rows through
:func:`fused_layer`: between the products, the norms, the residual adds, SiLU · up and each
quantization and scaling meet in three C calls (:mod:`engine.kernels.layer_ops`) instead of a
dozen passes over the rows.
"""

from __future__ import annotations

import logging
from typing import cast

import torch
from torch import Tensor

from engine.formats.int8 import quantize_int8
from engine.hardware import measured
from engine.kernels import amx, decode_step, gemv, layer_ops, lowbit, lowbit_rows, native
from engine.model.attention import AttentionContext
from engine.model.mlp import MLP
from engine.model.transformer import DecoderLayer, FusedLayer, Transformer
from engine.quant.int8 import Int8Linear

log = logging.getLogger(__name__)

#: how the load report names the int8 × int8 paths
INT_MM = "int8 × int8 GEMM (torch._int_mm, activations per token)"
AMX_GEMM = "int8 × int8 GEMM on AMX tiles (ours, activations per token; the weights packed twice)"
#: the rows the AMX kernel is timed on against torch._int_mm: a prefill chunk's
TIMED_ROWS = 512


def quantize_rows(x: Tensor, fixed: float | None = None) -> tuple[Tensor, Tensor]:
    """Per-row (per-token) symmetric INT8: ``(q int8 [M, K], scale fp32 [M, 1])`` with
    ``x ≈ q · scale``, ``scale = max|row| / 127`` (or ``fixed`` for every row: static scales,
    values past it saturate); a row of zeros gets scale 1e-12 and zeros. One pass of our C
    where it runs, torch's operators otherwise, the same values either way
    (:func:`engine.kernels.lowbit_rows.quantize_rows`)."""
    return lowbit_rows.quantize_rows(x, fixed)


def int8_product(
    xq: Tensor, x_scale: Tensor, weight: Tensor, w_scales: Tensor, dtype: torch.dtype,
    bias: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """``(xq · weightᵀ) · x_scale · w_scales + bias`` in ``dtype``: the int32 sums exact, the
    scales and the bias applied in fp32, one rounding to ``dtype`` at the end. ``xq [M, K]``
    and ``weight [N, K]`` int8, ``x_scale [M, 1]`` and ``w_scales [N]`` fp32."""
    return lowbit_rows.scale_rows(int8_sums(xq, weight), x_scale, w_scales, bias, dtype)


def int8_sums(xq: Tensor, weight: Tensor) -> Tensor:
    """``xq [M, K] · weight [N, K]ᵀ`` (int8) in exact int32 through ``torch._int_mm``."""
    m, k = xq.shape
    if xq.is_cuda and (m <= 16 or k % 8 or weight.shape[0] % 8):  # outside cuBLASLt's int8 GEMM
        return (xq.float() @ weight.float().t()).int()  # the same integers below 2^24
    return torch._int_mm(xq, weight.t())


def dequantized_product(x: Tensor, weight: Tensor, w_scales: Tensor) -> Tensor:
    """What :func:`int8_product` computes, in float64 from the dequantized operands (the
    tests' reference)."""
    xq, sx = quantize_rows(x)
    return (xq.double() * sx.double()) @ (weight.double() * w_scales.double()[:, None]).t()


def time_prefill(out_features: int, in_features: int) -> lowbit.Timing:
    """Our AMX GEMM (:mod:`engine.kernels.amx`) against ``torch._int_mm`` on
    :data:`TIMED_ROWS` rows of one shape (ms per call)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randint(-127, 128, (out_features, in_features), generator=gen, dtype=torch.int8)
    x = torch.randint(-127, 128, (TIMED_ROWS, in_features), generator=gen, dtype=torch.int8)
    packed = amx.pack(w)
    ours_ms, theirs_ms = measured.best_of_three(
        [lambda: amx.gemm(x, packed, out_features), lambda: torch._int_mm(x, w.t())], 5
    )
    return lowbit.Timing(ours_ms=ours_ms, torch_ms=theirs_ms)


def time_decode(out_features: int, in_features: int, weight_only: Int8Linear) -> lowbit.Timing:
    """The int8 × int8 path (quantizing the activation included) against the weight-only
    layer's own path on one row, a batch-1 decode step's (ms per call)."""
    gen = torch.Generator().manual_seed(0)
    q, scales = quantize_int8(torch.randn(out_features, in_features, generator=gen))
    x = torch.randn(1, in_features, generator=gen).to(weight_only.out_dtype)
    dtype = weight_only.out_dtype

    def ours() -> None:
        xq, sx = quantize_rows(x)
        int8_product(xq, sx, q, scales, dtype)

    ours_ms, theirs_ms = measured.best_of_three(
        [ours, lambda: Int8Linear.forward(weight_only, x)], 20
    )
    return lowbit.Timing(ours_ms=ours_ms, torch_ms=theirs_ms)


class W8A8Linear(Int8Linear):
    """INT8 weights (per output channel, as :class:`Int8Linear`) and INT8 activations per
    token, multiplied int8 × int8, in products of more than :data:`engine.kernels.gemv.MAX_ROWS`
    rows. Up to that (decode steps) the weight-only path runs unless int8 × int8 measured
    faster on one row here (``decode_int_mm``; None: timed at load, :func:`time_decode`, and
    kept in ``kernels.json``; never on CUDA, whose int8 GEMM takes more than 16 rows)."""

    w_scales: Tensor

    def __init__(
        self, weight: Tensor, bias: Tensor | None, dtype: torch.dtype, *,
        decode_int_mm: bool | None = None,
    ) -> None:  # fmt: skip
        super().__init__(weight, bias, dtype)
        #: the weights' scales in fp32, as the int32 sums take them (our C kernels' copy where
        #: they run the decode rows: the same values)
        c_scales = self.lowbit_scales if self.lowbit_scales is not None else self.gemv_scales
        self.register_buffer("w_scales", self.scales.float() if c_scales is None else c_scales)
        self.decode_int_mm = self._decode_int_mm() if decode_int_mm is None else decode_int_mm
        #: one activation scale for every token (``w8a8-static``: from the calibration, set by
        #: :func:`engine.quant.calibration.set_static_scales`), or None: per token
        self.act_scale: float | None = None
        #: the weights packed for our AMX GEMM, where it runs here and measured faster than
        #: torch._int_mm for this shape, or ``INFERSIGHT_LOWBIT=ours`` asks for it
        #: (:meth:`_amx_packed`); None: torch._int_mm
        self.amx_weight: Tensor | None
        self.register_buffer("amx_weight", self._amx_packed(), persistent=False)

    @property
    def bias_f32(self) -> Tensor | None:
        """The bias as the int32 sums' scaling adds it (fp32; kept once made)."""
        if self.bias is None:
            return None
        source, cached = getattr(self, "_bias_f32", (None, None))
        if source is not self.bias or cached is None:
            cached = self.bias.float()
            self._bias_f32 = (self.bias, cached)
        return cached

    def _amx_packed(self) -> Tensor | None:
        n, k = self.out_features, self.in_features
        if self.weight.device.type != "cpu" or lowbit.requested() == "torch" or not amx.fits(n, k):
            return None
        lib = amx.library()
        if not lib.available:
            return None
        build = lib.path.name if lib.path is not None else "?"
        key = lowbit.shape_key(f"prefill w8a8 {TIMED_ROWS} rows", n, k)
        ours = f"AMX int8 GEMM {build}, torch {torch.__version__}"
        if lowbit.requested() != "ours" and not lowbit.faster(
            ours, key, lambda: time_prefill(n, k)
        ):
            return None
        return amx.pack(self.weight, lib)

    def product(self, xq: Tensor, x_scale: Tensor, residual: Tensor | None = None) -> Tensor:
        """The layer's output (in its dtype) from its activations quantized (``xq``,
        ``x_scale``), plus ``residual`` where one is given: on our AMX GEMM with the scaling
        in its tiles' epilogue where this layer took it, else :meth:`sums` then
        :func:`engine.kernels.lowbit_rows.scale_rows`; the same values either way."""
        if self.amx_weight is not None and xq.device.type == "cpu":
            return amx.gemm_scaled(
                xq, self.amx_weight, self.out_features, x_scale, self.w_scales, self.bias_f32,
                self.out_dtype, residual,
            )  # fmt: skip
        return lowbit_rows.scale_rows(
            self.sums(xq), x_scale, self.w_scales, self.bias_f32, self.out_dtype,
            residual=residual,
        )  # fmt: skip

    def sums(self, xq: Tensor) -> Tensor:
        """``xq [M, K] int8 · weightᵀ`` in exact int32: on our AMX GEMM where this layer took
        it, else ``torch._int_mm`` (or its float emulation on CUDA where cuBLASLt's int8 GEMM
        does not take the shape)."""
        if self.amx_weight is not None and xq.device.type == "cpu":
            return amx.gemm(xq, self.amx_weight, self.out_features)
        return int8_sums(xq, self.weight)

    def _decode_int_mm(self) -> bool:
        if self.weight.device.type != "cpu":
            return False
        n, k = self.out_features, self.in_features
        key = lowbit.shape_key(f"decode w8a8 {str(self.out_dtype).removeprefix('torch.')}", n, k)
        return lowbit.faster(f"torch._int_mm, torch {torch.__version__}", key,
                             lambda: time_decode(n, k, self))  # fmt: skip

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.shape[0] <= gemv.MAX_ROWS and not self.decode_int_mm:
            return super().forward(x)
        xq, sx = quantize_rows(x2, self.act_scale)
        return self.product(xq, sx).reshape(*shape[:-1], self.out_features)

    def c_product(self, dtype: torch.dtype) -> decode_step.CProduct | str:
        if self.decode_int_mm:
            return "multiplies decode rows int8 × int8 (torch._int_mm measured faster)"
        return super().c_product(dtype)

    def held(self) -> list[Tensor | None]:
        """INT8's tensors, the fp32 weight scales and the AMX packing
        (:func:`engine.formats.w8a8.bytes_held` counts them)."""
        return [*super().held(), self.w_scales, self.amx_weight]

    @property
    def kernel(self) -> str:
        """The path of each step shape, for the load report."""
        product = INT_MM if self.amx_weight is None else f"{AMX_GEMM}, measured faster here"
        if self.decode_int_mm:
            return f"w8a8: {product} at every row count (measured faster on one row here)"
        return (
            f"w8a8: over {gemv.MAX_ROWS} rows {product}; up to {gemv.MAX_ROWS} weight-only "
            f"(measured faster on one row here): {super().kernel}"
        )

    def extra_repr(self) -> str:
        scales = "per token" if self.act_scale is None else f"static {self.act_scale:.4g}"
        return f"in_features={self.in_features}, out_features={self.out_features}, w8a8 ({scales})"


# -- a W8A8 layer's prefill rows, fused ----------------------------------------------------------


def _hooked(*modules: torch.nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def fused_layer(lib: native.Library) -> FusedLayer:
    """A decoder layer's forward on a prefill's rows (more than
    :data:`engine.kernels.gemv.MAX_ROWS`, contiguous fp32 or bf16 on a CPU) where its four
    products are W8A8: the same products, with what lies between them fused into C calls of
    ``lib`` (:mod:`engine.kernels.layer_ops`): the input norm with the qkv product's
    quantization; the o product's scaling with the residual add, the post-attention norm and
    the gate/up product's quantization; its scaling with SiLU · up and the down product's
    quantization; the down product's scaling with the residual add. Products on our AMX GEMM
    (:meth:`W8A8Linear.product`) scale their sums as the tiles are stored, and the gate/up
    product makes SiLU · up there too (:func:`engine.kernels.amx.silu_quantize`). The values
    are the unfused layer's but for SiLU, whose ``exp`` is ours (a few ulp from torch's).
    None (the layer's own code runs) for other steps, and where a hook watches a product."""

    def run(
        layer: DecoderLayer, x: Tensor, cos: Tensor, sin: Tensor, ctx: AttentionContext
    ) -> Tensor | None:
        attn, mlp = layer.attn, cast(MLP, layer.mlp)  # a dense layer's (fuse_layers)
        qkv_p, o_p = attn.qkv_proj, attn.o_proj
        gu_p, down_p = mlp.gate_up_proj, mlp.down_proj
        if (
            x.dim() != 2 or x.shape[0] <= gemv.MAX_ROWS or x.device.type != "cpu"
            or x.dtype not in (torch.float32, torch.bfloat16) or not x.is_contiguous()
            or torch.compiler.is_compiling() or mlp.gate_up_proj.bias is not None
            or _hooked(layer.attn, layer.mlp, qkv_p, o_p, gu_p, down_p)
        ):  # fmt: skip
            return None
        assert isinstance(qkv_p, W8A8Linear) and isinstance(o_p, W8A8Linear)
        assert isinstance(gu_p, W8A8Linear) and isinstance(down_p, W8A8Linear)
        dtype, eps = x.dtype, layer.input_norm.eps
        xq, sx = layer_ops.w8a8_norm_quantize(lib, x, layer.input_norm.weight, eps, qkv_p.act_scale)
        qkv = qkv_p.product(xq, sx)
        attended = attn.attend_qkv(qkv, cos, sin, ctx)
        xq, sx = lowbit_rows.quantize_rows(attended.reshape(x.shape[0], -1), o_p.act_scale)
        x, xq, sx = layer_ops.w8a8_add_norm_quantize(
            lib, o_p.sums(xq), sx, o_p.w_scales, o_p.bias_f32, x,
            layer.post_attn_norm.weight, layer.post_attn_norm.eps, gu_p.act_scale,
        )  # fmt: skip
        inter = mlp.intermediate_size
        if gu_p.amx_weight is not None and inter % 16 == 0:  # SiLU as the tiles are stored
            xq, sx = amx.silu_quantize(
                xq, gu_p.amx_weight, inter, sx, gu_p.w_scales, dtype, down_p.act_scale
            )
        else:
            xq, sx = layer_ops.w8a8_silu_quantize(
                lib, gu_p.sums(xq), sx, gu_p.w_scales, dtype, down_p.act_scale
            )
        return down_p.product(xq, sx, residual=x)

    return run


def fuse_layers(model: Transformer, lib: native.Library | None = None) -> int:
    """Hand :func:`fused_layer` to every layer of ``model`` whose four products are W8A8
    (and take it back from the others) where our C layer operations run (``lib``, else this
    machine's build where ``INFERSIGHT_LOWBIT`` allows our kernels); how many took it."""
    if lib is None and lowbit.requested() != "torch":
        lib = layer_ops.library()
    run = fused_layer(lib) if lib is not None and lib.available else None
    count = 0
    for module in model.layers:
        layer = cast(DecoderLayer, module)
        if model.cfg.layer_extras:  # it runs Llama's layer
            layer.fused = None
            continue
        products = (layer.attn.qkv_proj, layer.attn.o_proj, *layer.mlp.linears())
        ours = run is not None and all(isinstance(p, W8A8Linear) for p in products)
        layer.fused = run if ours else None
        count += ours
    return count
