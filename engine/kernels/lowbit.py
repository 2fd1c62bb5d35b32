"""Low-bit matrix products of our own on the CPU, with integer dot products
(``csrc/lowbit.c``): INT4 weights against activations quantized to int8 per block of 32, INT8
weights against activations quantized to int16 per block of 128.

torch's CPU kernels for our formats (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``)
multiply float activations by dequantized weights. llama.cpp instead quantizes each block of
32 activations to int8 (one scale per block) and multiplies integers: ``vpmaddubsw`` on AVX2,
``vpdpbusd`` with VNNI, ``sdot`` on arm64. Our INT4 kernel does the same on our INT4 values
(group-wise, zero points) packed two to a byte in llama.cpp's block order, with the same bf16
scales and zeros. For INT8 weights int8 activations cost too much accuracy (0.77 of the weight
quantization's own KL on the default model), so that kernel quantizes them to int16
(``vpdpwssd`` with VNNI, ``vpmaddwd`` on AVX2) and keeps our INT8 matrix and per-row scales as
they are. Quantizing the activations is an approximation the float paths do not make (in
int8 about 0.4% of a block's largest value, in int16 256 times less); everything after it is
exact integer arithmetic, then float scaling.

The library is built once per machine and CPU level (:mod:`engine.kernels.native`): which
instruction set a build uses is the compiler's (:func:`isa`), and the portable C is built at
``INFERSIGHT_CPU_CAPABILITY=DEFAULT``. Its first check runs in a child process
(:mod:`engine.hardware.isolated`): each product against the same product computed in float64
from the dequantized operands.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from engine.errors import InfersightError
from engine.formats.int4 import pack_int4
from engine.hardware import measured, verdicts
from engine.hardware.verdicts import Allowance
from engine.hardware.verdicts import Timing as Timing  # the verdicts' figures, as ours time them
from engine.kernels import native, verify

log = logging.getLogger(__name__)

SOURCE = native.CSRC / "lowbit.c"
#: activations per int8 quantization block (INT4 weights), and the granule of K the kernels take
QK = 32
#: activations per int16 quantization block (INT8 weights; a row's last block may be shorter)
QK16 = 128
ENV = "INFERSIGHT_LOWBIT"
#: ``auto``: ours where it measured faster than torch's kernel for the shape; ``ours``: ours
#: wherever it builds (an error where it does not), for every shape it serves (INT8: up to
#: :data:`engine.kernels.gemv.MAX_ROWS` rows; the prefill chunks of INT8 and INT4 layers then
#: take bf16 GEMMs on converted weights, a path of ours too); ``torch``: torch's kernels,
#: float activations
MODES = ("auto", "ours", "torch")


#: The formats whose layers ``auto`` may hand to our kernels: those where quantizing the
#: activations costs under a tenth of the weight quantization's own KL, measured on the default
#: model over 1,024 tokens of the evaluation text, one decode step per token
#: (``checks/lowbit_kl.py``, ``docs/cpu-kernels.md``). INT4-g32+head, int8 activations: 0.0052
#: against its own 0.085 (0.06×). INT8+head: int8 activations cost 0.77× its own KL, so its
#: kernel takes int16 ones; computed in fp32 (where kernels that only add in another order
#: agree to KL 1e-8) they cost 2e-7 against 0.0048 (4e-5×).
ADMITTED = frozenset({"int4", "int8"})


#: The mode of the loads inside :func:`choosing` (this thread's), over ``INFERSIGHT_LOWBIT``.
_CHOSEN: contextvars.ContextVar[str | None] = contextvars.ContextVar("lowbit_mode", default=None)


def requested() -> str:
    mode = _CHOSEN.get() or os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise InfersightError(f"{ENV}={mode!r}: use one of {', '.join(MODES)}")
    return mode


@contextlib.contextmanager
def choosing(mode: str | None) -> Iterator[None]:
    """Loads inside this block (in this thread) take ``mode`` (one of :data:`MODES`; None:
    ``INFERSIGHT_LOWBIT`` as set) instead of the environment's: ``eval compare`` loads the
    same weights with torch's kernels on one side and ours on the other."""
    if mode is not None and mode not in MODES:
        raise InfersightError(f"low-bit kernels {mode!r}: use one of {', '.join(MODES)}")
    token = _CHOSEN.set(mode)
    try:
        yield
    finally:
        _CHOSEN.reset(token)


#: A loaded build of ``lowbit.c``, or why there is none.
Library = native.Library


def load(path: Path) -> Library:
    """Load a build of ``lowbit.c`` and declare its functions."""

    def declare(lib: Any) -> None:
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.infersight_quantize_q8.restype = None
        lib.infersight_quantize_q8.argtypes = [p, i64, i64, p, p, p]
        lib.infersight_quantize_q16.restype = None
        lib.infersight_quantize_q16.argtypes = [p, i64, i64, p, p]
        lib.infersight_int8_gemm.restype = None
        lib.infersight_int8_gemm.argtypes = [p, p, i64, i64, p, p, i64, p, i32]
        lib.infersight_int4_gemm.restype = None
        lib.infersight_int4_gemm.argtypes = [p, p, p, i64, i64, i64, p, p, i64, p, p, i32]
        lib.infersight_int8_linear.restype = ctypes.c_int
        lib.infersight_int8_linear.argtypes = [p, i32, i64, i64, p, p, i64, p, i32, i32]
        lib.infersight_int4_dequantize.restype = None
        lib.infersight_int4_dequantize.argtypes = [p, p, i64, i64, i64, i64, p, i32]
        lib.infersight_int4_linear.restype = ctypes.c_int
        lib.infersight_int4_linear.argtypes = [p, i32, i64, i64, i64, p, p, i64, p, i32, i32]
        lib.infersight_int4_rows.restype = i32
        lib.infersight_int4_rows.argtypes = [p, p, i64, i64, i64, p, i64, p, i64, p, i32]
        lib.infersight_quantize_rows.restype = None
        lib.infersight_quantize_rows.argtypes = [p, i32, i64, i64, ctypes.c_float, p, p, i32]
        lib.infersight_scale_rows.restype = None
        lib.infersight_scale_rows.argtypes = [p, i64, i64, p, p, p, p, p, i32, i32]
        lib.infersight_experts.restype = i32  # csrc/experts.h (engine/kernels/experts.py)
        lib.infersight_experts.argtypes = [p, i32, i64, i64, i64, i32, i64, i64, p, p, i64, p,
                                           p, p, p, i32, p, i32]  # fmt: skip

    return native.load(path, "infersight_lowbit_isa", declare)


def build(level: str | None = None) -> Library:
    """Build (once per machine) and load the library for ``level``, without the child's
    check: for tests, which check each level themselves."""
    return native.build_library(SOURCE, "the low-bit kernels", level, load)


@cache
def library() -> Library:
    """This machine's build at the current CPU level, checked once in a child process."""
    return native.checked(build(), "low-bit kernels", PROBE)


# -- the operands --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Q8:
    """Activations ``[M, K]`` quantized per block of 32: ``q`` int8 ``[M, K]``, the blocks'
    scales ``d`` float32 ``[M, K/32]`` and sums ``s`` int32 ``[M, K/32]``."""

    q: Tensor
    d: Tensor
    s: Tensor

    def dequantized(self) -> Tensor:
        m, k = self.q.shape
        return (self.q.double().view(m, -1, QK) * self.d.double()[..., None]).view(m, k)


@dataclass(frozen=True, slots=True)
class Q16:
    """Activations ``[M, K]`` quantized to int16 per block of :data:`QK16` (the last block of a
    row may be shorter): ``q`` int16 ``[M, K]``, the blocks' scales ``d`` float32
    ``[M, ⌈K/128⌉]``."""

    q: Tensor
    d: Tensor

    def dequantized(self) -> Tensor:
        k = self.q.shape[1]
        d = self.d.double().repeat_interleave(QK16, dim=1)[:, :k]
        return self.q.double() * d


def padded(x: Tensor, k: int) -> Tensor:
    """``x [M, K0]`` as contiguous float32 ``[M, k]``, zero columns added (k ≥ K0)."""
    x = x.float()
    if x.shape[1] != k:
        x = torch.nn.functional.pad(x, (0, k - x.shape[1]))
    return x.contiguous()


def quantize(lib: Library, x: Tensor) -> Q8:
    """``x`` (float32, contiguous, K a multiple of 32) quantized by the kernel."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    d = torch.empty(m, k // QK)
    s = torch.empty(m, k // QK, dtype=torch.int32)
    lib.lib.infersight_quantize_q8(x.data_ptr(), m, k, q.data_ptr(), d.data_ptr(), s.data_ptr())
    return Q8(q, d, s)


def quantize16(lib: Library, x: Tensor) -> Q16:
    """``x`` (float32, contiguous, K a multiple of 32) quantized to int16 by the kernel."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int16)
    d = torch.empty(m, -(-k // QK16))
    lib.lib.infersight_quantize_q16(x.data_ptr(), m, k, q.data_ptr(), d.data_ptr())
    return Q16(q, d)


def quantize16_reference(x: Tensor) -> Q16:
    """The same quantization in torch: ``d = max|x| / 32767``, ``q = round(x / d)`` (ties to
    even), per block of :data:`QK16`."""
    k = x.shape[1]
    blocks = [x[:, c : c + QK16].float() for c in range(0, k, QK16)]
    d = torch.stack([b.abs().amax(dim=1) / 32767 for b in blocks], dim=1)
    dk = d.repeat_interleave(QK16, dim=1)[:, :k]
    q = torch.where(dk == 0, 0.0, torch.round((x.float() / dk).clamp(-32767, 32767)))
    return Q16(q.to(torch.int16), d)


def quantize_reference(x: Tensor) -> Q8:
    """The same quantization in torch: ``d = max|x| / 127``, ``q = round(x / d)`` (ties to
    even), per block of 32."""
    m, k = x.shape
    blocks = x.float().view(m, k // QK, QK)
    d = blocks.abs().amax(dim=2) / 127
    q = torch.where(d[..., None] == 0, 0.0, torch.round(blocks / d[..., None]))
    return Q8(q.to(torch.int8).view(m, k), d, q.sum(dim=2).to(torch.int32))


def int8_gemm(lib: Library, x: Q16, weight: Tensor, scales: Tensor, threads: int) -> Tensor:
    """``y [M, N]`` float32 from int16-quantized activations and INT8 weights ``[N, K]`` with
    float32 per-row ``scales``."""
    m, k = x.q.shape
    n = weight.shape[0]
    y = torch.empty(m, n)
    lib.lib.infersight_int8_gemm(
        x.q.data_ptr(), x.d.data_ptr(), m, k, weight.data_ptr(), scales.data_ptr(), n,
        y.data_ptr(), threads,
    )  # fmt: skip
    return y


def int4_gemm(
    lib: Library, x: Q8, packed: Tensor, scales_zeros: Tensor, group: int, threads: int
) -> Tensor:
    """``y [M, N]`` float32 from quantized activations and INT4 weights: ``packed`` from
    :func:`engine.formats.int4.pack_int4`, ``scales_zeros`` bf16 ``[N, K/group, 2]`` (scale, zero)
    per group."""
    m, k = x.q.shape
    n = packed.shape[0]
    y = torch.empty(m, n)
    groups = torch.empty(m, k // group)
    lib.lib.infersight_int4_gemm(
        x.q.data_ptr(), x.d.data_ptr(), x.s.data_ptr(), m, k, group, packed.data_ptr(),
        scales_zeros.data_ptr(), n, y.data_ptr(), groups.data_ptr(), threads,
    )  # fmt: skip
    return y


# -- the check -------------------------------------------------------------------------------

#: The check :func:`library` runs in a child process (``module:function``; tests swap it):
#: the products' (:func:`check`), then W8A8's rows' (:func:`engine.kernels.lowbit_rows.check_rows`)
PROBE = "engine.kernels.lowbit_rows:probe_build"


def check(lib: Library) -> str:
    """Each product of ``lib`` on small ragged shapes against float64 on the dequantized
    operands, within the policy's bound for fp32 sums of K (:func:`_compare`), and its
    quantization against :func:`quantize_reference`, bit for bit: "" if all agree."""
    from engine.formats.int4 import quantize_int4
    from engine.formats.int8 import quantize_int8

    gen = torch.Generator().manual_seed(0)
    for m, k, n in ((1, 64, 7), (5, 96, 19), (6, 128, 33), (2, 160, 9)):
        x = torch.randn(m, k, generator=gen)
        x[0, :QK] = 0  # an all-zero block
        qx = quantize(lib, x)
        want = quantize_reference(x)
        if not (torch.equal(qx.q, want.q) and torch.equal(qx.d, want.d)):
            return f"quantizing [{m}, {k}] differs from torch's rounding"
        if not torch.equal(qx.s, want.s):
            return f"the block sums of [{m}, {k}] differ"
        q16 = quantize16(lib, x)
        want16 = quantize16_reference(x)
        if not (torch.equal(q16.q, want16.q) and torch.equal(q16.d, want16.d)):
            return f"quantizing [{m}, {k}] to int16 differs from torch's rounding"
        w = torch.randn(n, k, generator=gen)
        wq, ws = quantize_int8(w)
        reference = q16.dequantized() @ (wq.double() * ws.double()[:, None]).T
        problem = _compare("int8", int8_gemm(lib, q16, wq, ws, 2), reference, k)
        if problem:
            return problem
        for group in (32, 64):
            if k % group:
                continue
            q4, scale, zero = quantize_int4(w, group)
            sz = torch.stack([scale, zero], dim=2).contiguous()
            dense = (q4.double().view(n, -1, group) - 8) * scale.double()[..., None]
            dense = (dense + zero.double()[..., None]).view(n, k)
            got = int4_gemm(lib, qx, pack_int4(q4), sz, group, 2)
            problem = _compare(f"int4 g{group}", got, qx.dequantized() @ dense.T, k)
            if problem:
                return problem
    return ""


def _compare(name: str, got: Tensor, want: Tensor, k: int) -> str:
    """A product of ``k`` terms against float64 (:func:`engine.kernels.verify.tolerance`):
    the integer sums are exact, the scaling and the blocks' sum fp32, K bounding how many
    fp32 additions lie behind a result."""
    return verify.differs(name, got, want, verify.tolerance(torch.float32, k))


# -- the choice, per layer shape ---------------------------------------------------------------


#: bytes of weights each timing streams through: far beyond any last-level cache
STREAM_BYTES = 64 * 2**20


def shape_key(fmt: str, out_features: int, in_features: int) -> str:
    return f"lowbit {fmt} {out_features}x{in_features}"


def time_kernels(
    ours: Callable[[Tensor, int], object], theirs: Callable[[Tensor, int], object],
    copies: int, in_features: int, dtype: torch.dtype,
    call: Callable[[], object] | None = None,
) -> Timing:  # fmt: skip
    """Time one-row products over ``copies`` distinct weights of one shape (``fn(x, i)``
    multiplies by copy ``i``), so that every call reads its weights from memory as decode
    does, from activations in the model's ``dtype`` (each path's conversions are its cost):
    the best of three, interleaved so that a noisy moment hurts both. ``call``: ours on the
    smallest problem, timed beside them as the cost of a call from Python
    (:attr:`Timing.call_ms`)."""
    x = torch.randn(1, in_features, generator=torch.Generator().manual_seed(0)).to(dtype)

    def every_copy(fn: Callable[[Tensor, int], object]) -> Callable[[], None]:
        def run() -> None:
            for i in range(copies):
                fn(x, i)

        return run

    runs = [every_copy(ours), every_copy(theirs)]
    if call is not None:
        runs.append(every_copy(lambda _x, _i: call()))
    ours_ms, torch_ms, *call_ms = measured.best_of_three(runs, copies)
    return Timing(ours_ms=ours_ms, torch_ms=torch_ms, call_ms=min(call_ms, default=0.0))


def chosen(
    fmt: str, out_features: int, in_features: int, timer: Callable[[], Timing] | None,
    slack: float | Allowance = 1.0,
) -> bool:  # fmt: skip
    """Whether a CPU layer of this format (``int4-g32 bfloat16``: the weights' format and the
    activations' dtype) and shape runs our kernels: the library builds and
    passed its check, and (``auto``) it measured faster than torch's for this shape on this
    machine (or within ``slack`` × its time: :func:`engine.kernels.decode_step.slack`), timed
    once by ``timer`` and kept in ``kernels.json`` (no ``timer``: torch has no kernel here to
    time against)."""
    mode = requested()
    family = fmt.split()[0].split("-")[0]  # "int4-g32 bfloat16" -> "int4"
    if mode == "torch" or (mode == "auto" and family not in ADMITTED):
        return False
    return decided(library, "lowbit", shape_key(fmt, out_features, in_features), timer, slack)


def decided(
    built: Callable[[], Library], name: str, key: str, timer: Callable[[], Timing] | None,
    slack: float | Allowance = 1.0,
) -> bool:  # fmt: skip
    """Whether our kernel ``built()`` runs the layer shape ``key`` in ``INFERSIGHT_LOWBIT``'s
    mode (``auto`` or ``ours``; callers answer ``torch`` themselves): it builds and passed its
    check, and (``auto``) it measured faster than torch's, timed once by ``timer`` and kept in
    ``kernels.json`` under this machine, the ``name`` build (its instruction set and source)
    and the thread count (no ``timer``: torch has no kernel here to time against); ``slack``:
    as for :func:`faster`."""
    mode = requested()
    found = built()
    if not found.available:
        if mode == "ours":
            raise InfersightError(f"{ENV}=ours, but {found.why}; unset it to fall back")
        return False
    if mode == "ours" or timer is None:
        return True
    # the build's name carries a hash of its source and flags: a changed kernel is timed anew
    build = found.path.stem if found.path is not None else name
    return faster(f"{build} {found.isa}", key, timer, slack)


def faster(
    ours: str, key: str, timer: Callable[[], Timing], slack: float | Allowance = 1.0
) -> bool:
    """Whether ``ours`` (a build of our kernel, or a path of ours through torch's operators,
    with what makes it that version) measured faster than torch's kernel for the layer shape
    ``key`` (or within ``slack`` × its time): timed once by ``timer`` and kept in
    ``kernels.json`` under this machine, ``ours`` and the thread count
    (:func:`engine.hardware.verdicts.faster`)."""
    return verdicts.faster(verdicts.Key(ours, key, threads()), timer, slack)


def threads() -> int:
    """The threads our kernels run on: torch's, as the thread probe settled them."""
    return torch.get_num_threads()


# -- the layers' products ----------------------------------------------------------------------
# Called directly in eager steps (a custom op's dispatch would cost more than a small GEMV);
# as opaque custom ops inside a compiled decode step.


_BF16 = {torch.float32: 0, torch.bfloat16: 1}


def _operands(x: Tensor, n: int, out: torch.dtype) -> tuple[Tensor, Tensor]:
    """``x`` as the kernels take it (fp32 or bf16, contiguous) and ``y [M, n]`` to fill (in
    ``out`` where it is fp32 or bf16, else fp32): no operator where none is needed (a decode
    step calls this for every linear)."""
    if x.dtype not in _BF16:
        x = x.float()
    if not x.is_contiguous():
        x = x.contiguous()
    return x, torch.empty(x.shape[0], n, dtype=out if out in _BF16 else torch.float32)


def int8_linear(
    x: Tensor, weight: Tensor, scales: Tensor, out: torch.dtype = torch.float32
) -> Tensor:
    """``x [M, K]`` (any float dtype; K a multiple of 32) times INT8 ``weight [N, K]`` with
    float32 ``scales [N]``: ``[M, N]`` in ``out``."""
    if torch.compiler.is_compiling():
        return torch.ops.infersight.lowbit_int8(x, weight, scales).to(out)
    x, y = _operands(x, weight.shape[0], out)
    rc = native.call(
        "infersight::lowbit_int8", library().lib.infersight_int8_linear,
        x.data_ptr(), _BF16[x.dtype], x.shape[0], x.shape[1], weight.data_ptr(),
        scales.data_ptr(), weight.shape[0], y.data_ptr(), _BF16[y.dtype], threads(),
    )  # fmt: skip
    if rc:
        raise MemoryError("our INT8 kernel ran out of memory for its scratch space")
    return y if y.dtype == out else y.to(out)


def int4_linear(
    x: Tensor, packed: Tensor, scales_zeros: Tensor, group: int,
    out: torch.dtype = torch.float32,
) -> Tensor:  # fmt: skip
    """``x [M, K]`` (K a multiple of the group) times INT4 weights
    (:func:`engine.formats.int4.pack_int4`, bf16 ``scales_zeros [N, K/group, 2]``): ``[M, N]`` in
    ``out``."""
    if torch.compiler.is_compiling():
        return torch.ops.infersight.lowbit_int4(x, packed, scales_zeros, group).to(out)
    x, y = _operands(x, packed.shape[0], out)
    rc = native.call(
        "infersight::lowbit_int4", library().lib.infersight_int4_linear,
        x.data_ptr(), _BF16[x.dtype], x.shape[0], x.shape[1], group, packed.data_ptr(),
        scales_zeros.data_ptr(), packed.shape[0], y.data_ptr(), _BF16[y.dtype], threads(),
    )  # fmt: skip
    if rc:
        raise MemoryError("our INT4 kernel ran out of memory for its scratch space")
    return y if y.dtype == out else y.to(out)


def int4_dequantized(
    packed: Tensor, scales_zeros: Tensor, group: int, rows: slice, lib: Library | None = None
) -> Tensor:
    """Rows ``rows`` of INT4 weights (:func:`engine.formats.int4.pack_int4`, bf16
    ``scales_zeros [N, K/group, 2]``) as bf16 ``[rows, K]``: ``(q − 8)·s + z`` in fp32,
    rounded to nearest even (``lib``: this machine's build, or another level's)."""
    n0, n1 = rows.start or 0, min(rows.stop, packed.shape[0])
    k = 2 * packed.shape[1]
    out = torch.empty(n1 - n0, k, dtype=torch.bfloat16)
    native.call(
        "infersight::int4_dequantize", (lib or library()).lib.infersight_int4_dequantize,
        packed.data_ptr(), scales_zeros.data_ptr(), k, group, n0, n1, out.data_ptr(), threads(),
    )  # fmt: skip
    return out


def int4_rows(
    packed: Tensor, scales_zeros: Tensor, group: int, ids: Tensor, inverse_scale: Tensor,
    width: int, out: torch.dtype,
) -> Tensor:  # fmt: skip
    """Rows ``ids`` of INT4 weights (:func:`engine.formats.int4.pack_int4`, bf16
    ``scales_zeros [N, K/group, 2]``), each column times fp32 ``inverse_scale [width]``, the
    first ``width`` columns, in ``out`` (fp32 or bf16): a tied INT4 head's embedding lookup in
    one call, computed as its torch code computes it
    (:class:`engine.quant.embedding.QuantizedEmbedding`)."""
    ids = ids if ids.dtype == torch.long and ids.is_contiguous() else ids.long().contiguous()
    rows = torch.empty(ids.numel(), width, dtype=out)
    rc = native.call(
        "infersight::int4_rows", library().lib.infersight_int4_rows,
        packed.data_ptr(), scales_zeros.data_ptr(), packed.shape[0], 2 * packed.shape[1], group,
        ids.data_ptr(), ids.numel(), inverse_scale.data_ptr(), width, rows.data_ptr(),
        _BF16[out],
    )  # fmt: skip
    if rc:
        raise IndexError(f"token ids {ids.tolist()} outside the vocabulary of {packed.shape[0]}")
    return rows


@torch.library.custom_op("infersight::lowbit_int8", mutates_args=())
def _int8_op(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    return int8_linear(x, weight, scales)


@_int8_op.register_fake
def _(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)


@torch.library.custom_op("infersight::lowbit_int4", mutates_args=())
def _int4_op(x: Tensor, packed: Tensor, scales_zeros: Tensor, group: int) -> Tensor:
    return int4_linear(x, packed, scales_zeros, group)


@_int4_op.register_fake
def _(x: Tensor, packed: Tensor, scales_zeros: Tensor, group: int) -> Tensor:
    return x.new_empty(x.shape[0], packed.shape[0], dtype=torch.float32)
