"""A CPU decode step's decoder layers in one C call (``infersight_decode_step`` in
``csrc/layer_ops.c``).

An eager decode step calls about fifteen Python functions per layer (the norms, four
products, RoPE with the K/V write, the attention, SiLU·up, the residual adds), and each costs
Python's call and, for torch's operators, their dispatch: on the 135M default model that is
about a third of an INT8 step, more than the attention. Where every product of every layer
runs one of our C kernels, :func:`plan` describes the layers once, at load (each linear's
kernel and operands: :class:`Product`, from the linear's own ``c_product``), and each decode
step then runs them all in one call, on the very kernels the eager step would call. Only the
loops between kernels are new C (the bias, SiLU·up, the residual add, the query heads' widening
to fp32 for the attention), each rounded where torch's operator rounds; SiLU's ``exp`` is ours
(``exp8``, csrc/vec8.h) where torch uses its own vectorized one, so the two steps agree within
a few ulp of fp32, not bit for bit (in bf16 they rounded to the same bits on every model
tested).

The step falls back to the eager code, as a compiled decode step does, wherever this does not
apply: a step that prefills, more rows than our kernels take
(:data:`engine.kernels.gemv.MAX_ROWS`), attention not on the paged C kernel, a reason in
the model's ``eager_reasons`` (a benchmark's eager row, a check), a kernel that fails (the step
is run again eagerly, and every later one). Layer timings do not stop it: it times each layer's
attention block and MLP itself, as the eager step's hooks do."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from engine.kernels import gemv, layer_ops, lowbit, native, paged_decode

if TYPE_CHECKING:
    from engine.model.attention import DecodeTables
    from engine.model.transformer import DecoderLayer, Transformer

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


def slack() -> float:
    """:data:`SLACK` where the C decode step can run on this machine (its library and the
    paged attention kernel built and passed their checks), else 1: the factor a layer's
    kernel choice gives ours over torch's (:func:`engine.kernels.lowbit.chosen`)."""
    if lowbit.requested() == "torch":
        return 1.0
    return SLACK if layer_ops.library().available and paged_decode.kernel().available else 1.0


class Product(ctypes.Structure):
    """One linear as the C step calls it: its kernel (:data:`GEMV`, :data:`INT8`,
    :data:`INT4`), the GEMV's weight type, ``[n, k]``, the INT4 group, and pointers to the
    weights, the scales (or the INT4 scales and zeros) and the bias (NULL: none)."""

    _fields_ = [
        ("kind", ctypes.c_int32), ("wtype", ctypes.c_int32), ("n", ctypes.c_int64),
        ("k", ctypes.c_int64), ("group", ctypes.c_int64), ("weight", ctypes.c_void_p),
        ("scales", ctypes.c_void_p), ("bias", ctypes.c_void_p),
    ]  # fmt: skip


class _Layer(ctypes.Structure):
    _fields_ = [
        ("qkv", Product), ("o", Product), ("gate_up", Product), ("down", Product),
        ("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
    ]  # fmt: skip


class _Model(ctypes.Structure):
    _fields_ = [
        ("gemv", ctypes.c_void_p), ("int8", ctypes.c_void_p), ("int4", ctypes.c_void_p),
        ("attend", ctypes.c_void_p), ("hidden", ctypes.c_int64), ("heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64), ("head_dim", ctypes.c_int64),
        ("intermediate", ctypes.c_int64), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
        ("bf16", ctypes.c_int32), ("threads", ctypes.c_int32),
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
_SWITCH = native.Switch()
#: run decode steps through the model's modules inside this block (``bench --profile``
#: measures both)
eager = _SWITCH.turned_off


def _address(fn: Any) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value or 0


class DecodeStep:
    """The plan of a model's decode step in C (:func:`plan`): call it with a decode step's
    embedded tokens, positions and attention context for the hidden states after the last
    layer, or None where the step does not apply (the eager code runs it)."""

    def __init__(self, model: Transformer, dtype: torch.dtype, layers: list[tuple[Any, ...]],
                 head: Product | None, held: list[Tensor]) -> None:  # fmt: skip
        cfg = model.cfg
        self.model = model
        self.dtype = dtype
        self.held = held  # every tensor the plan points into
        self.layers = (_Layer * len(layers))(*(_Layer(*row) for row in layers))
        #: the LM head in the same call (None: its module runs it)
        self.head = head
        self.fn = layer_ops.library().lib.infersight_decode_step
        kernel = paged_decode.kernel()
        libs = (gemv.library(), lowbit.library())
        gemv_fn = _address(libs[0].lib.infersight_gemv) if libs[0].available else 0
        int8_fn = int4_fn = 0
        if libs[1].available:
            int8_fn = _address(libs[1].lib.infersight_int8_linear)
            int4_fn = _address(libs[1].lib.infersight_int4_linear)
        self.c_model = _Model(
            gemv_fn, int8_fn, int4_fn, _address(kernel.fn), cfg.hidden_size, cfg.num_heads,
            cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, cfg.rms_norm_eps,
            cfg.head_dim**-0.5, int(dtype == torch.bfloat16), 1,
        )  # fmt: skip
        #: each KV cache's pools as the C call takes them (an array of pointers, or None
        #: where the step cannot read them), by the cache: engines that share this model
        #: (the A/B lab's) each have their own, and a cache gone takes its entry with it
        self._pools: weakref.WeakKeyDictionary[object, Any] = weakref.WeakKeyDictionary()
        #: seconds in products (the LM head's included), attention and the rest, added up
        #: while :data:`native.RECORDING` or :attr:`clocks` (:meth:`clocked`)
        self.spent = (ctypes.c_double * 3)()
        self.clocks = False
        #: the calls that ran a step while the clocks ran
        self.steps = 0
        #: seconds of each layer's attention block and MLP, added up while layer timings are
        #: on (:meth:`time_layers`), as the eager step's hooks time them
        self.layer_seconds: Any = None

    def __call__(
        self, x: Tensor, positions: Tensor, tables: DecodeTables, logits_indices: Tensor | None
    ) -> Tensor | None:
        """fp32 logits ``[N, vocab]`` of the rows ``logits_indices`` (None: every row) after
        the decoder layers on ``x: [B, hidden]`` (the step's embedded tokens, changed in place),
        or None where this step does not apply (nothing ran)."""
        rows = x.shape[0]
        if _SWITCH.off or x.dtype != self.dtype or rows > gemv.MAX_ROWS or not x.is_contiguous():
            return None
        try:
            pools = self._pools[tables.owner]
        except KeyError:
            pools = self._pools[tables.owner] = self._pool_pointers(tables.pools)
        if pools is None:
            return None
        picked = logits_indices
        if picked is None:
            picked = torch.arange(rows)
        elif picked.dtype != torch.long or not picked.is_contiguous():
            picked = picked.long().contiguous()
        sampled = picked.numel()
        if sampled > rows:  # a row sampled twice: the call's scratch holds each row once
            return None
        head = self.head if sampled else None
        logits = torch.empty(sampled, head.n) if head is not None else None
        cos, sin = self.model.rope.angles(positions, x.dtype)
        self.c_model.threads = lowbit.threads()
        mask = tables.mask
        rc = native.call(
            "infersight::decode_step", self.fn, ctypes.byref(self.c_model), self.layers,
            len(self.layers), pools, x.data_ptr(), rows, cos.data_ptr(),
            sin.data_ptr(), tables.write_slots.data_ptr(), tables.slots.data_ptr(),
            tables.lens.data_ptr(), None if mask is None else mask.data_ptr(),
            tables.slots.shape[1], None if head is None else ctypes.byref(head),
            self.model.norm.weight.data_ptr(), picked.data_ptr(), sampled,
            None if logits is None else logits.data_ptr(),
            self.spent if native.RECORDING or self.clocks else None, self.layer_seconds,
        )  # fmt: skip
        self.steps += self.clocks
        if rc == -2:  # refused before anything ran: the eager code says what is wrong
            return None
        if rc:
            raise MemoryError("a kernel of the C decode step ran out of memory")
        return logits if logits is not None else self.model.head(x, logits_indices)

    @property
    def times_layers(self) -> bool:
        """Whether layer timings are on: the step times its layers as the hooks would."""
        return self.layer_seconds is not None

    def time_layers(self, on: bool) -> None:
        self.layer_seconds = (ctypes.c_double * (2 * len(self.layers)))() if on else None

    def take_layer_seconds(self) -> list[tuple[float, float]]:
        """Each layer's (attention block, MLP) seconds since the last call, zeroed; [] where
        layer timings are off or no step ran."""
        got = self.layer_seconds
        if got is None or not any(got):
            return []
        pairs = [(got[2 * i], got[2 * i + 1]) for i in range(len(self.layers))]
        got[:] = [0.0] * len(got)
        return pairs

    @contextlib.contextmanager
    def clocked(self) -> Iterator[list[float]]:
        """Inside, every step adds up its own time by kind; on the way out the list given
        holds the milliseconds per step in products and in attention (``bench --table``'s
        kernels-only figure)."""
        self.spent[:] = [0.0, 0.0, 0.0]
        self.clocks, self.steps = True, 0
        per_step: list[float] = []
        try:
            yield per_step
        finally:
            self.clocks = False
            if self.steps:
                per_step += [1e3 * self.spent[0] / self.steps, 1e3 * self.spent[1] / self.steps]

    def _pool_pointers(self, pools: list[Tensor]) -> Any:
        """``pools`` as an array of pointers; None where they are not what the step reads
        (one per layer, contiguous CPU tensors of the activations' dtype)."""
        if len(pools) != len(self.layers) or any(
            t.dtype != self.dtype or not t.is_contiguous() or t.device.type != "cpu" for t in pools
        ):
            return None
        return (ctypes.c_void_p * len(pools))(*(t.data_ptr() for t in pools))


def _declare(lib: Any) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.infersight_decode_step.restype = ctypes.c_int
    lib.infersight_decode_step.argtypes = [p, p, i64, p, p, i64, p, p, p, p, p, p, i64,
                                           p, p, p, i64, p, p, p]  # fmt: skip


def plan(model: Transformer, dtype: torch.dtype) -> tuple[DecodeStep | None, str]:
    """The model's decode step in one C call where every linear of every layer runs one of
    our C kernels on activations of ``dtype``, the attention the paged C kernel, and the
    norms and RoPE ours (``INFERSIGHT_LOWBIT`` not ``torch``); else None, and why (a line of
    the load report either way). The engine then has it checked in a child process
    (:mod:`engine.core.decode_check`) before it runs a step."""
    if lowbit.requested() == "torch":
        return None, f"decode steps eager ({lowbit.ENV}=torch)"
    return planned(model, dtype)


def planned(model: Transformer, dtype: torch.dtype) -> tuple[DecodeStep | None, str]:
    """:func:`plan` whatever ``INFERSIGHT_LOWBIT`` says (the check builds its own model)."""
    if dtype not in DTYPES:
        return None, f"decode steps eager (activations in {dtype})"
    found = layer_ops.library()
    if not found.available:
        return None, f"decode steps eager ({found.why})"
    if not paged_decode.kernel().available:
        return None, "decode steps eager (attention not on the paged C kernel)"
    cfg = model.cfg
    if cfg.qk_norm:
        return None, "decode steps eager (per-head q/k norms: not in the C step)"
    if cfg.head_dim > layer_ops.MAX_HEAD_DIM or cfg.head_dim % 2:
        return None, f"decode steps eager (head size {cfg.head_dim})"
    _declare(found.lib)
    hidden, q_size, inter = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size
    #: (n, k) of each product, as the C step sizes its buffers
    shapes = {
        "qkv_proj": ((cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, hidden),
        "o_proj": (hidden, q_size), "gate_up_proj": (2 * inter, hidden),
        "down_proj": (hidden, inter),
    }  # fmt: skip
    rows: list[tuple[Any, ...]] = []
    held: list[Tensor] = []
    for i, module in enumerate(model.layers):
        layer = cast("DecoderLayer", module)
        norms = (layer.input_norm.weight, layer.post_attn_norm.weight)
        if any(w.dtype != dtype or not w.is_contiguous() for w in norms):
            return None, f"decode steps eager (layer {i}'s norms are not {dtype})"
        products = []
        for name, linear in (("qkv_proj", layer.attn.qkv_proj), ("o_proj", layer.attn.o_proj),
                             ("gate_up_proj", layer.mlp.gate_up_proj),
                             ("down_proj", layer.mlp.down_proj)):  # fmt: skip
            describe = getattr(linear, "c_product", None)
            got = describe(dtype) if describe is not None else "runs torch's kernel"
            if isinstance(got, str):
                return None, f"decode steps eager (layer {i}'s {name} {got})"
            if (got.product.n, got.product.k) != shapes[name]:  # the C buffers' sizes
                return None, f"decode steps eager (layer {i}'s {name} is not {shapes[name]})"
            products.append(got.product)
            held += got.tensors
        held += norms
        rows.append((*products, norms[0].data_ptr(), norms[1].data_ptr()))
    # the final norm and the LM head in the same call, where the head is ours too
    norm = model.norm.weight
    describe = getattr(model.lm_head, "c_product", None)
    got = describe(dtype) if describe is not None else "runs torch's kernel"
    head = None
    if isinstance(got, str):
        why = f"the LM head {got}"
    elif got.product.k != hidden:
        why = f"the LM head takes {got.product.k} inputs"
    elif norm.dtype != dtype or not norm.is_contiguous():
        why = f"the final norm is not {dtype}"
    else:
        head = got.product
        held += [*got.tensors, norm]
    step = DecodeStep(model, dtype, rows, head, held)
    if head is None:
        return step, f"decode steps' layers in one C call ({why})"
    return step, "decode steps in one C call"


def builds() -> str:
    """The builds a C step calls into (its check, :mod:`engine.core.decode_check`, holds for
    these)."""
    paths = [layer_ops.library().path, gemv.library().path, lowbit.library().path]
    cc = native.compiler()
    if cc is not None:
        paths.append(native.library_path(paged_decode.SOURCE, cc, native.isa_flags()))
    return " | ".join(str(p) for p in paths)
