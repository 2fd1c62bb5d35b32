"""Linear layers laid out for the device they run on, chosen once at load.

On a CPU, decode is a chain of matrix-vector products that stream every weight from memory
once per token. oneDNN's blocked weight layout streamed about 1.7× faster than the row-major
``nn.Linear`` weight through MKL's GEMV on one 2-core AMD EPYC (40 vs 23 GB/s), so the engine
repacks fp32/bf16 weights into it at load time where :func:`engine.hardware.cpu_paths` found
that this CPU runs the packed op for that dtype (bf16 needs AVX-512 or AVX-NE-CONVERT) *and*
it measured faster for that shape on this machine (:func:`packs`): each (dtype, shape) is timed
once, both layouts streaming from memory as in decode, and the verdict is kept per machine in
``<cache>/kernels.json`` (:mod:`engine.hardware.verdicts`). Elsewhere, and on other devices,
the module stays ``nn.Linear``. The packed path uses ``torch.ops.mkldnn``, the same private
ops TorchInductor emits for CPU linears.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.hardware import measured, verdicts
from engine.hardware.cpu_paths import cpu_paths
from engine.hardware.verdicts import Timing
from engine.kernels import decode_step, gemv

log = logging.getLogger(__name__)

# oneDNN picks the blocked layout for this batch size. 16 measured faster than 1 for both
# decode at batch 1 (10.7 vs 13.5 ms for SmolLM2's 30 layers) and batch 16 (15.4 vs 20.7 ms).
PACK_BATCH_HINT = 16


@torch.library.custom_op("infersight::packed_linear", mutates_args=())
def packed_linear(x: Tensor, weight: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    """oneDNN's packed linear as one opaque op for compiled graphs."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@packed_linear.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


class PackedLinear(nn.Module):
    """``y = x Wᵀ + b`` with ``W`` held in oneDNN's blocked layout (CPU only)."""

    weight: Tensor
    bias: Tensor | None

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        dense = linear.weight.detach()
        self.dtype = dense.dtype
        self.nbytes = dense.numel() * dense.element_size()
        packed = torch.ops.mkldnn._reorder_linear_weight(dense, batch_size=PACK_BATCH_HINT)
        self.register_buffer("weight", packed, persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling():  # opaque to TorchInductor, which cannot lower it
            return packed_linear(x, self.weight, self.bias, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=onednn"


#: How much slower than ``nn.Linear`` the packed layout may measure for a shape and still be
#: chosen: within 5% (noise on a shared machine) the packed layout, measured faster on the CPUs
#: we have, keeps its place.
PACKED_SLACK = 1.05
#: the layout verdicts' build in ``kernels.json`` (oneDNN's, as this torch ships it)
PACKED_BUILD = f"oneDNN packed layout, torch {torch.__version__}"


#: bytes of weights each timing streams through: far beyond any last-level cache
STREAM_BYTES = 96 * 2**20


def time_layouts(dtype: torch.dtype, out_features: int, in_features: int) -> Timing:
    """Time ``y = x Wᵀ`` for one token in both layouts over enough distinct matrices of this
    shape that every call reads its weights from memory, as decode does; the best of three
    (ours: the packed layout; torch's: ``nn.Linear``)."""
    weights, x = _streamed(dtype, out_features, in_features)
    packed = [
        torch.ops.mkldnn._reorder_linear_weight(w, batch_size=PACK_BATCH_HINT) for w in weights
    ]

    def plain_run() -> None:
        for w in weights:
            F.linear(x, w)

    def packed_run() -> None:
        for w in packed:
            torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    plain_ms, packed_ms = measured.best_of_three([plain_run, packed_run], len(weights))
    return Timing(ours_ms=packed_ms, torch_ms=plain_ms)


def _streamed(
    dtype: torch.dtype, out_features: int, in_features: int
) -> tuple[list[Tensor], Tensor]:
    """Enough distinct random matrices of this shape that a pass over them reads each from
    memory (:data:`STREAM_BYTES`), and one row of activations."""
    nbytes = out_features * in_features * torch.empty((), dtype=dtype).element_size()
    copies = max(1, min(64, STREAM_BYTES // max(nbytes, 1)))
    gen = torch.Generator().manual_seed(0)
    weights = [
        torch.randn(out_features, in_features, generator=gen).to(dtype) for _ in range(copies)
    ]
    return weights, torch.randn(1, in_features, generator=gen).to(dtype)


def layout_key(dtype: torch.dtype, out_features: int, in_features: int) -> verdicts.Key:
    """What a layout verdict holds for: this machine, torch's oneDNN and the shape (not the
    thread count: a memory plan asks before a load has settled it)."""
    shape = f"{str(dtype).removeprefix('torch.')} {out_features}x{in_features}"
    return verdicts.Key(PACKED_BUILD, shape)


LAYOUT_ENV = "INFERSIGHT_LAYOUT"


def packs(dtype: torch.dtype, out_features: int, in_features: int, *, measure: bool = True) -> bool:
    """Whether a CPU linear of this dtype and shape is laid out for oneDNN at load: the CPU
    runs the packed op (:func:`engine.hardware.cpu_paths`) and it measured faster here.
    ``INFERSIGHT_LAYOUT=packed`` (or ``plain``) skips the timing: every packable linear is
    packed (or none is), as the tests do to take one path whatever the machine's noise.
    ``measure=False`` (a memory plan) never times: a shape not timed yet counts as packed,
    the layout that takes more memory where it copies a tied head."""
    if not cpu_paths().packed(dtype).ok:
        return False
    forced = os.environ.get(LAYOUT_ENV, "").strip().lower()
    if forced in ("packed", "plain"):
        return forced == "packed"
    key = layout_key(dtype, out_features, in_features)
    if not measure:
        known = verdicts.known(key, PACKED_SLACK)
        return True if known is None else known
    return verdicts.faster(key, lambda: time_layouts(dtype, out_features, in_features),
                           PACKED_SLACK, ("oneDNN packed", "nn.Linear"))  # fmt: skip


class GemvLinear(nn.Linear):
    """``nn.Linear`` (the same weight and bias tensors, row-major) whose small step shapes, up
    to :data:`engine.kernels.gemv.MAX_ROWS` rows of activations (decode, verification, small
    batches), run our GEMV kernel; prefill chunks take ``F.linear``, as compiled graphs do."""

    @classmethod
    def of(cls, linear: nn.Linear) -> GemvLinear:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias  # shared: a tied head stays tied
        return new

    def forward(self, x: Tensor) -> Tensor:
        rows = x.numel() // x.shape[-1]
        if rows > gemv.MAX_ROWS or torch.compiler.is_compiling():
            return F.linear(x, self.weight, self.bias)
        y = gemv.product(gemv.library(), x.reshape(rows, -1), self.weight, None, x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def c_product(self, dtype: torch.dtype) -> decode_step.CProduct | str:
        """This layer in the C decode step (:mod:`engine.executor.c_step`)."""
        if self.weight.dtype != dtype:
            return f"holds {self.weight.dtype} weights, the activations are {dtype}"
        return decode_step.product(
            decode_step.GEMV, self.weight, None, self.bias, dtype,
            n=self.out_features, k=self.in_features,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"ours ≤ {gemv.MAX_ROWS} rows"
        )


def time_gemv(dtype: torch.dtype, out_features: int, in_features: int) -> Timing:
    """Our GEMV against the best of torch's layouts (``nn.Linear``, and oneDNN's packed one
    where this CPU runs it) for one token, every call reading its weights from memory."""
    weights, x = _streamed(dtype, out_features, in_features)
    lib = gemv.library()

    def ours() -> None:
        for w in weights:
            gemv.product(lib, x, w, None, dtype)

    def plain() -> None:
        for w in weights:
            F.linear(x, w)

    runs = [ours, plain]
    if cpu_paths().packed(dtype).ok:
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, batch_size=PACK_BATCH_HINT)
                  for w in weights]  # fmt: skip

        def packed_run() -> None:
            for w in packed:
                torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

        runs.append(packed_run)
    tiny_w, tiny_x = _tiny(dtype)

    def calls() -> None:  # ours on the smallest problem: what a call from Python costs
        for _ in weights:
            gemv.product(lib, tiny_x, tiny_w, None, dtype)

    ours_ms, call_ms, *theirs = measured.best_of_three([runs[0], calls, *runs[1:]], len(weights))
    return Timing(ours_ms=ours_ms, torch_ms=min(theirs), call_ms=call_ms)


def _tiny(dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """A weight and a row of activations of :mod:`engine.kernels.lowbit_timing`'s smallest
    problem."""
    from engine.kernels.lowbit_timing import TINY_K, TINY_ROWS

    gen = torch.Generator().manual_seed(1)
    return (torch.randn(TINY_ROWS, TINY_K, generator=gen).to(dtype),
            torch.randn(1, TINY_K, generator=gen).to(dtype))  # fmt: skip


def takes_gemv(dtype: torch.dtype, out_features: int, in_features: int) -> bool:
    """Whether a CPU linear of this dtype (fp32, bf16) and shape runs our GEMV for its small
    step shapes (:func:`engine.kernels.gemv.chosen`: timed once per machine against torch's
    layouts, under ``INFERSIGHT_LOWBIT``'s modes)."""
    if dtype not in (torch.float32, torch.bfloat16):
        return False
    fmt = str(dtype).removeprefix("torch.")
    return gemv.chosen(fmt, out_features, in_features,
                       lambda: time_gemv(dtype, out_features, in_features),
                       decode_step.slack())  # fmt: skip


def pack_linears(model: nn.Module, *, timed: bool = True) -> int:
    """Swap every CPU ``nn.Linear`` in ``model`` that :func:`takes_gemv` for a
    :class:`GemvLinear` (``timed`` only), and of the others each that :func:`packs` (or, with
    ``timed=False``, whose dtype this CPU packs at all) for a :class:`PackedLinear`. Returns
    the number of modules swapped (0 where neither applies)."""
    paths = cpu_paths()

    def chosen(m: nn.Linear) -> type[nn.Module] | None:
        w = m.weight
        if timed and takes_gemv(w.dtype, m.out_features, m.in_features):
            return GemvLinear
        if timed:
            return PackedLinear if packs(w.dtype, m.out_features, m.in_features) else None
        return PackedLinear if paths.packed(w.dtype).ok else None

    swaps = [
        (name, module, kind)
        for name, module in model.named_modules()
        if type(module) is nn.Linear
        and module.weight.device.type == "cpu"
        and (kind := chosen(module)) is not None
    ]
    for name, module, kind in swaps:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, GemvLinear.of(module) if kind is GemvLinear else PackedLinear(module))
    return len(swaps)
