"""The INT8 linear: per-channel INT8 weights run by ``torch._weight_int8pack_mm``, or by our
Triton kernels where they run (:func:`engine.kernels.triton_support.chosen`: a CUDA GPU with
Triton), on the same int8 matrix and scales.

The torch kernel takes bf16 activations (on CUDA fp16 would do too); where a device has no such
kernel, the weights stay int8 in memory and one matrix is converted per call. Which of the two
runs is probed once per device on a tiny tensor, never decided by a failing call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.errors import InfersightError
from engine.formats import int8
from engine.hardware import gpu, measured
from engine.hardware.cpu_paths import cpu_paths
from engine.kernels import decode_step, gemv, lowbit, lowbit_timing, triton_check, triton_support

log = logging.getLogger(__name__)

_INT8_KERNEL: dict[str, bool] = {}  # device → whether torch._weight_int8pack_mm runs there


def int8_kernel_runs(device: torch.device) -> bool:
    """Whether ``torch._weight_int8pack_mm`` runs, and gives the right answer, on ``device``.

    Tried once per device on a tiny tensor. Only "this build has no such kernel" answers no
    (NotImplementedError, or a RuntimeError such as "not available for build"); running out of
    memory is no answer about the kernel and propagates, so it can never switch layers to the
    slower converting path for good, as a try/except around every call once did.
    """
    key = str(device)
    if key not in _INT8_KERNEL:
        # the activations' dtype a quantized model computes in there (fp16 below sm80)
        dtype = gpu.compute_dtype_for(gpu.capability(device))
        x = torch.ones(1, 32, dtype=dtype, device=device)
        w = torch.full((8, 32), 2, dtype=torch.int8, device=device)
        scales = torch.full((8,), 0.5, dtype=dtype, device=device)
        try:
            y = torch._weight_int8pack_mm(x, w, scales)
            runs = bool(torch.all(y.float() == 32.0))
            why = "" if runs else "it gave wrong results"
        except torch.cuda.OutOfMemoryError:
            raise
        except (NotImplementedError, RuntimeError) as exc:
            runs, why = False, (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if not runs:
            log.info("INT8 on %s: no int8 kernel (%s); weights are converted per call", key, why)
        _INT8_KERNEL[key] = runs
    return _INT8_KERNEL[key]


#: torch's CPU INT8 kernel takes widths (K) in multiples of this: on more than one row of
#: activations, torch 2.13's crashes the process (a segfault) at K = 40, 72 or 136, where
#: multiples of 16 up to 576 gave the right products; other widths convert per call
CPU_KERNEL_K = 16

#: how the load report names the path of a layer our Triton kernels run
TRITON_KERNEL = "Triton GEMM"
#: … and of one our C kernels run, activations quantized per block (engine/kernels/lowbit.py):
#: to int8 for INT4 weights, to int16 for INT8 ones
LOWBIT_KERNEL = "our int8-activation kernel"
LOWBIT16_KERNEL = "our int16-activation kernel"
#: … and of one whose small step shapes our float-activation kernel runs (engine/kernels/gemv.py)
GEMV_KERNEL = "our GEMV"
#: … and of one whose prefill chunks convert the weights to bf16 for oneDNN's GEMM
PREFILL_BF16 = "prefill in bf16 GEMMs"
#: rows of a prefill product each conversion to bf16 covers at most (weights of
#: ``PREFILL_CHUNK`` elements: a bounded copy beside the model, whatever its size)
PREFILL_CHUNK = 4 * 2**20
#: the rows of activations the prefill choice is timed at (a short prefill chunk's: at 256 the
#: first load of Llama-3.2-1B spent 16 s timing its INT8 head alone, at 64 rows 6 s, with the
#: same verdict)
PREFILL_TIMED_ROWS = 64


def bucket_rows(m: int) -> int:
    """The rows a prefill product runs at for ``m`` rows of activations: ``m`` rounded up to a
    multiple of a sixteenth of the power of two at or above it (… 16, 18, 20, …, 32, 36, …,
    256, 288, 320, …): at most eight shapes an octave, at most an eighth more rows. oneDNN
    keeps what it builds for each shape of a GEMM; a server's prefill chunks come in every
    length, and an INT4 server's memory grew by ~0.33 MiB a request when each length was its
    own shape, flat with these; the padding cost the default model's INT4 prefill 6 % at 257
    tokens (→ 288), ~0 at a bucket's own length (docs/reliability.md)."""
    step = 1 << max((m - 1).bit_length() - 4, 0)
    return -(-m // step) * step


def in_row_blocks(x: Tensor, n: int, k: int, product: Callable[[Tensor, slice], Tensor]) -> Tensor:
    """``[M, N]`` from ``product(x, rows)`` (``x`` times those output rows of the weights),
    ``x`` padded with zero rows to :func:`bucket_rows` (the GEMMs see few shapes; the padding
    is sliced off), over blocks of output rows of at most :data:`PREFILL_CHUNK` weights each:
    whatever a quantized layer converts for a GEMM stays a bounded copy beside the model."""
    m, padded = x.shape[0], bucket_rows(x.shape[0])
    if padded > m:
        x = F.pad(x, (0, 0, 0, padded - m))
    rows = max(1, PREFILL_CHUNK // max(k, 1))
    if rows >= n:
        return product(x, slice(0, n))[:m]
    y = x.new_empty(m, n)
    for n0 in range(0, n, rows):
        block = slice(n0, min(n0 + rows, n))
        y[:, block] = product(x, block)[:m]
    return y


def bf16_product(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    """``(x · q) · scales`` for bf16 ``x [M, K]`` and INT8 ``weight [N, K]``: the int8 values
    converted to bf16 (exactly: |q| ≤ 127) a block of output rows at a time
    (:func:`in_row_blocks`), so that oneDNN's bf16 GEMM runs the product, each block's scales
    applied to its output: the values of the converting path (``F.linear`` on the converted
    weights, then the scales)."""
    n, k = weight.shape
    return in_row_blocks(
        x, n, k, lambda xb, rows: F.linear(xb, weight[rows].to(x.dtype)) * scales[rows]
    )


def time_prefill(out_features: int, in_features: int) -> lowbit.Timing:
    """:func:`bf16_product` against ``torch._weight_int8pack_mm`` on a prefill chunk's rows of
    bf16 activations (ms per call; the weights stay in cache: a prefill is bound by compute)."""
    gen = torch.Generator().manual_seed(0)
    q, scales = int8.quantize_int8(torch.randn(out_features, in_features, generator=gen),
                              torch.bfloat16)  # fmt: skip
    x = torch.randn(PREFILL_TIMED_ROWS, in_features, generator=gen).bfloat16()
    ours_ms, torch_ms = measured.best_of_three(
        [lambda: bf16_product(x, q, scales), lambda: torch._weight_int8pack_mm(x, q, scales)], 1
    )
    return lowbit.Timing(ours_ms=ours_ms, torch_ms=torch_ms)


def triton_gemms(device: torch.device, dtype: torch.dtype | None = None) -> tuple[bool, str]:
    """Whether our Triton GEMMs run the quantized linears on ``device``, and why not
    (:func:`engine.kernels.triton_support.chosen`; with the activations' ``dtype``, where they
    also pass their check against the torch path, :mod:`engine.kernels.triton_check`).
    ``INFERSIGHT_KERNELS=triton`` where they cannot run, or fail the check, is an error."""
    ours, why = triton_support.chosen(device)
    if not ours or dtype is None:
        return ours, why
    failed = triton_check.gemms(device, dtype)
    if not failed:
        return ours, why
    if triton_support.requested() == "triton":
        raise InfersightError(f"{triton_support.ENV}=triton, but {failed}")
    return False, f"torch GEMMs ({failed})"


def _triton_int8(device: torch.device, dtype: torch.dtype) -> Callable[..., Tensor] | None:
    """Our INT8 launcher where our GEMMs run on ``device`` (:func:`triton_gemms`; imported
    only there: Triton may not be installed)."""
    if not triton_gemms(device, dtype)[0]:
        return None
    from engine.kernels.triton_kernels.quant_gemm import int8_linear

    return int8_linear


class Int8Linear(nn.Module):
    quantized = True
    weight: Tensor
    scales: Tensor
    bias: Tensor | None

    def __init__(self, weight: Tensor, bias: Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # The kernel applies scales in the activation dtype, so q is computed against the
        # scales rounded to it (once: quantize_int8 rounds before it divides).
        q, scale = int8.quantize_int8(weight, dtype)
        self.register_buffer("weight", q)
        self.register_buffer("scales", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))
        self.out_dtype = dtype  # of the output, the bias and the scales
        self.padded_k = 0
        #: our Triton kernel (:func:`engine.kernels.triton_kernels.quant_gemm.int8_linear`)
        #: where it runs, else None: chosen once, at load
        self.triton = _triton_int8(weight.device, dtype)
        # Probed once per device on a tiny tensor (on a CPU by engine.hardware), never decided
        # by a failing call: only a missing kernel may switch a layer to the converting path.
        cpu = weight.device.type == "cpu"
        if self.triton is not None:
            self.use_kernel = False  # torch's kernel is not asked: ours runs this layer
        elif cpu:
            self.use_kernel = cpu_paths().int8_kernel.ok and self.in_features % CPU_KERNEL_K == 0
        else:
            self.use_kernel = int8_kernel_runs(weight.device)
        #: our C kernel's float32 scales where it runs this layer's small step shapes (up to
        #: :data:`engine.kernels.gemv.MAX_ROWS` rows, activations quantized to int16; torch's
        #: kernel the rest), on a CPU where it measured faster than torch's for this shape
        #: (:func:`engine.kernels.lowbit.chosen`), else None
        self.lowbit_scales = self._lowbit_scales() if cpu and self.triton is None else None
        #: float32 scales where our float-activation kernel runs this layer's small step
        #: shapes (up to :data:`engine.kernels.gemv.MAX_ROWS` rows; torch's kernel the rest:
        #: :func:`engine.kernels.gemv.chosen`), else None
        self.gemv_scales = (
            self._gemv_scales() if cpu and self.triton is None and self.lowbit_scales is None
            else None
        )  # fmt: skip
        #: whether prefill chunks (more than :data:`engine.kernels.gemv.MAX_ROWS` rows) convert
        #: the weights to bf16 for oneDNN's GEMM (:func:`bf16_product`), on a CPU where that
        #: measured faster than torch's INT8 kernel for this shape
        self.prefill_bf16 = cpu and self.triton is None and self.use_kernel and self._prefill()

    def _lowbit_scales(self) -> Tensor | None:
        n, k = self.weight.shape
        if k % lowbit.QK:
            return None
        timer = (lambda: lowbit_timing.time_int8(n, k, self.out_dtype)) if self.use_kernel else None
        fmt = f"int8 {str(self.out_dtype).removeprefix('torch.')}"
        chosen = lowbit.chosen(fmt, n, k, timer, decode_step.slack())
        return self.scales.float() if chosen else None

    def _prefill(self) -> bool:
        mode = lowbit.requested()
        if self.out_dtype != torch.bfloat16 or mode == "torch":
            return False
        if mode == "ours":
            return True
        n, k = self.weight.shape
        key = lowbit.shape_key("prefill int8 bfloat16", n, k)
        return lowbit.faster(f"bf16 GEMM, torch {torch.__version__}", key,
                             lambda: time_prefill(n, k))  # fmt: skip

    def _gemv_scales(self) -> Tensor | None:
        n, k = self.weight.shape
        timer = (lambda: gemv.time_int8(n, k, self.out_dtype)) if self.use_kernel else None
        fmt = f"int8 {str(self.out_dtype).removeprefix('torch.')}"
        chosen = gemv.chosen(fmt, n, k, timer, decode_step.slack())
        return self.scales.float() if chosen else None

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.triton is not None:  # bias fused
            y = self.triton(x2, self.weight, self.scales, self.bias)
            return y.reshape(*shape[:-1], self.out_features)
        if self.lowbit_scales is not None and x2.shape[0] <= gemv.MAX_ROWS:
            y = lowbit.int8_linear(x2, self.weight, self.lowbit_scales, self.out_dtype)
        elif self.gemv_scales is not None and x2.shape[0] <= gemv.MAX_ROWS:
            y = gemv.int8_linear(x2, self.weight, self.gemv_scales, self.out_dtype)
        elif self.prefill_bf16 and x2.shape[0] > gemv.MAX_ROWS:
            y = bf16_product(x2.to(torch.bfloat16), self.weight, self.scales)
        elif self.use_kernel:  # an error here (CUDA out of memory, say) propagates as it is
            y = torch._weight_int8pack_mm(x2, self.weight, self.scales)
        else:  # weights stay int8 in memory; one matrix converted per call
            y = F.linear(x2, self.weight.to(x2.dtype)) * self.scales
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def c_product(self, dtype: torch.dtype) -> decode_step.CProduct | str:
        """This layer in the C decode step (:mod:`engine.executor.c_step`): the kernel
        its small step shapes run."""
        if self.out_dtype != dtype:
            return f"gives {self.out_dtype}, the activations are {dtype}"
        n, k = self.out_features, self.in_features
        if self.lowbit_scales is not None:
            return decode_step.product(
                decode_step.INT8, self.weight, self.lowbit_scales, self.bias, dtype, n=n, k=k
            )
        if self.gemv_scales is not None:
            return decode_step.product(
                decode_step.GEMV, self.weight, self.gemv_scales, self.bias, dtype, n=n, k=k
            )
        return "runs torch's INT8 kernel"

    def read_rows(self, rows: Tensor) -> Tensor:
        """Rows ``rows`` of the weight, dequantized in fp32 ``[T, in_features]``."""
        return int8.read_rows(self.weight, self.scales, rows)

    def unreadable(self) -> str:
        return ""  # one layout, row-major

    @property
    def c_scales(self) -> bool:
        """Whether our C kernels run this layer's decode rows, on scales of their own."""
        return self.lowbit_scales is not None or self.gemv_scales is not None

    def held(self) -> list[Tensor | None]:
        """The tensors the weight holds: the int8 matrix, its scales and our C kernels' fp32
        copy of them (:func:`engine.formats.int8.bytes_held` counts them)."""
        return [self.weight, self.scales, self.lowbit_scales, self.gemv_scales]

    @property
    def nbytes(self) -> int:
        unique = {id(t): t for t in self.held() if t is not None}
        return sum(t.numel() * t.element_size() for t in unique.values())

    @property
    def kernel(self) -> str:
        """The path this layer runs, for the load report."""
        if self.triton is not None:
            return TRITON_KERNEL
        torch_path = "int8 kernel" if self.use_kernel else "int8 converted per call"
        if self.prefill_bf16:
            torch_path = PREFILL_BF16
        if self.lowbit_scales is not None:
            return f"{LOWBIT16_KERNEL} (≤ {gemv.MAX_ROWS} rows), {torch_path}"
        if self.gemv_scales is not None:
            return f"{GEMV_KERNEL} (≤ {gemv.MAX_ROWS} rows), {torch_path}"
        return torch_path

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"
