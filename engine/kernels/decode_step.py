"""The C decode step's ABI (``infersight_decode_step`` in ``csrc/layer_ops.c``): each
linear's :class:`Product` as the C call takes it (a linear's ``c_product`` gives its
:class:`CProduct`), the layers' and the model's structures, the switch that turns the step
off for side-by-side measurements (:data:`eager`), the slack a layer's kernel choice gives
ours where the step can run, and the builds it calls into. The step itself, an executor of
decode steps, is :mod:`engine.executor.c_step`.

An eager decode step calls about fifteen Python functions per layer (the norms, four
products, RoPE with the K/V write, the attention, SiLU·up, the residual adds), and each costs
Python's call and, for torch's operators, their dispatch: on the 135M default model that is
about a third of an INT8 step, more than the attention. Only the loops between kernels are new
C (the bias, SiLU·up, the residual add, the query heads' widening to fp32 for the attention),
each rounded where torch's operator rounds; SiLU's ``exp`` is ours (``exp8``, csrc/vec8.h)
where torch uses its own vectorized one, so the two steps agree within a few ulp of fp32, not
bit for bit (in bf16 they rounded to the same bits on every model tested)."""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from engine.hardware import verdicts
from engine.kernels import gemv, layer_ops, lowbit, native, paged_decode

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

#: a product's kernel (csrc/layer_ops.c: PRODUCT_*)
GEMV, INT8, INT4 = 0, 1, 2
#: the GEMV's weight types (csrc/gemv.c: W_*)
GEMV_TYPES = {torch.int8: 0, torch.bfloat16: 1, torch.float32: 2}
#: the activations' dtypes the step runs in
DTYPES = (torch.float32, torch.bfloat16)


#: How much slower than torch's kernel ours may measure on a one-row product and still run the
#: layer, where the C decode step can run: a layer left on torch's kernel sends every decode
#: step back to the eager code, which costs more per layer than the kernels differ by (on the
#: 2-core EPYC, the eager step of the 135M model took 5–7 ms more than the C step over its 30
#: layers, 0.2 ms a layer; torch's INT4 kernel was 6% faster on its 0.14 ms gate/up product).
SLACK = 1.25


def slack() -> verdicts.Allowance:
    """What a layer's kernel choice allows ours over torch's
    (:func:`engine.kernels.lowbit.chosen`): where the C decode step can run on this machine
    (its library and the paged attention kernel built and passed their checks), up to
    :data:`SLACK` × torch's time, not counting what a call from Python costs ours (the step
    calls it from C); else ours must be faster, calls and all."""
    if lowbit.requested() == "torch":
        return verdicts.Allowance()
    if layer_ops.library().available and paged_decode.kernel().available:
        return verdicts.Allowance(SLACK, in_c=True)
    return verdicts.Allowance()


class Product(ctypes.Structure):
    """One linear as the C step calls it: its kernel (:data:`GEMV`, :data:`INT8`,
    :data:`INT4`), the GEMV's weight type, ``[n, k]``, the INT4 group, and pointers to the
    weights, the scales (or the INT4 scales and zeros) and the bias (NULL: none)."""

    _fields_ = [
        ("kind", ctypes.c_int32), ("wtype", ctypes.c_int32), ("n", ctypes.c_int64),
        ("k", ctypes.c_int64), ("group", ctypes.c_int64), ("weight", ctypes.c_void_p),
        ("scales", ctypes.c_void_p), ("bias", ctypes.c_void_p),
    ]  # fmt: skip


class Layer(ctypes.Structure):
    _fields_ = [
        ("qkv", Product), ("o", Product), ("gate_up", Product), ("down", Product),
        ("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
    ]  # fmt: skip


class Model(ctypes.Structure):
    _fields_ = [
        ("gemv", ctypes.c_void_p), ("int8", ctypes.c_void_p), ("int4", ctypes.c_void_p),
        ("attend", ctypes.c_void_p), ("hidden", ctypes.c_int64), ("heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64), ("head_dim", ctypes.c_int64),
        ("intermediate", ctypes.c_int64), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
        ("bf16", ctypes.c_int32), ("threads", ctypes.c_int32), ("kv_fmt", ctypes.c_int32),
    ]  # fmt: skip


@dataclass(frozen=True, slots=True)
class CProduct:
    """What a linear hands the C step: its :class:`Product` and the tensors whose memory it
    points into (kept alive with the plan)."""

    product: Product
    tensors: tuple[Tensor, ...]


def product(
    kind: int, weight: Tensor, scales: Tensor | None, bias: Tensor | None, dtype: torch.dtype,
    *, n: int, k: int, group: int = 0,
) -> CProduct | str:  # fmt: skip
    """A linear's :class:`CProduct` on activations of ``dtype``, or why it cannot be one (a
    bias of another dtype, operands not contiguous)."""
    if bias is not None and (bias.dtype != dtype or not bias.is_contiguous()):
        return f"its bias is {bias.dtype}, the activations {dtype}"
    held = tuple(t for t in (weight, scales, bias) if t is not None)
    if not all(t.is_contiguous() and t.device.type == "cpu" for t in held):
        return "its operands are not contiguous CPU tensors"
    wtype = GEMV_TYPES.get(weight.dtype, -1) if kind == GEMV else 0
    if wtype < 0:
        return f"our GEMV takes no {weight.dtype} weights"
    p = Product(kind, wtype, n, k, group, weight.data_ptr(), _pointer(scales), _pointer(bias))
    return CProduct(p, held)


def _pointer(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


#: off inside :func:`eager`, for side-by-side measurements
SWITCH = native.Switch()
#: run decode steps through the model's modules inside this block (``bench --profile``
#: measures both)
eager = SWITCH.turned_off


def address(fn: Any) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value or 0


def builds() -> str:
    """The builds a C step calls into (its check, :mod:`engine.executor.c_step_check`, holds for
    these)."""
    paths = [layer_ops.library().path, gemv.library().path, lowbit.library().path]
    cc = native.compiler()
    if cc is not None:
        paths.append(native.library_path(paged_decode.SOURCE, cc, native.isa_flags()))
    return " | ".join(str(p) for p in paths)
