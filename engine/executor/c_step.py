"""The C decode step as an executor: a CPU decode step's decoder layers (and the LM head,
where it is ours) in one C call, ``infersight_decode_step`` in ``csrc/layer_ops.c``.

Where every product of every layer runs one of our C kernels, :func:`plan` describes the
layers once, at load (each linear's kernel and operands, the :class:`~engine.kernels.
decode_step.Product` its ``c_product`` gives), and each decode step then runs them all in one
call, on the very kernels the eager step would call. Whether the step may run at all (the
attention backend, tensor parallelism) is the compatibility table's
(:mod:`engine.executor.table`); which step runs each time is :mod:`engine.executor.step`'s.
The C ABI, the products' descriptors and the kernels' builds are
:mod:`engine.kernels.decode_step`'s."""

from __future__ import annotations

import contextlib
import ctypes
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from engine.kernels import gemv, layer_ops, lowbit, native, paged_decode
from engine.kernels.decode_step import (
    DTYPES,
    SWITCH,
    Layer,
    Model,
    Product,
    address,
)

if TYPE_CHECKING:
    from engine.model.attention import DecodeTables
    from engine.model.transformer import DecoderLayer, Transformer


class DecodeStep:
    """The plan of a model's decode step in C (:func:`plan`): call it with a decode step's
    embedded tokens, positions and attention context for the hidden states after the last
    layer, or None where the step does not apply (the eager code runs it)."""

    def __init__(self, model: Transformer, dtype: torch.dtype, layers: list[tuple[Any, ...]],
                 head: Product | None, held: list[Tensor]) -> None:  # fmt: skip
        cfg = model.cfg
        # weakly: the model holds its executor, which holds this step
        self._model = weakref.ref(model)
        self.dtype = dtype
        self.held = held  # every tensor the plan points into
        self.layers = (Layer * len(layers))(*(Layer(*row) for row in layers))
        #: the LM head in the same call (None: its module runs it)
        self.head = head
        self.fn = layer_ops.library().lib.infersight_decode_step
        kernel = paged_decode.kernel()
        libs = (gemv.library(), lowbit.library())
        gemv_fn = address(libs[0].lib.infersight_gemv) if libs[0].available else 0
        int8_fn = int4_fn = 0
        if libs[1].available:
            int8_fn = address(libs[1].lib.infersight_int8_linear)
            int4_fn = address(libs[1].lib.infersight_int4_linear)
        self.c_model = Model(
            gemv_fn, int8_fn, int4_fn, address(kernel.fn), cfg.hidden_size, cfg.num_heads,
            cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, cfg.rms_norm_eps,
            cfg.head_dim**-0.5, int(dtype == torch.bfloat16), 1, 0,
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
        if SWITCH.off or x.dtype != self.dtype or rows > gemv.MAX_ROWS or not x.is_contiguous():
            return None
        try:
            pools, kv_fmt = self._pools[tables.owner]
        except KeyError:
            pools, kv_fmt = self._pools[tables.owner] = self._pool_pointers(tables.pools)
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
        model = self._model()
        if model is None:
            return None
        cos, sin = model.rope.angles(positions, x.dtype)
        self.c_model.threads = lowbit.threads()
        self.c_model.kv_fmt = kv_fmt  # this cache's (engines sharing the model may differ)
        mask = tables.mask
        rc = native.call(
            "infersight::decode_step", self.fn, ctypes.byref(self.c_model), self.layers,
            len(self.layers), pools, x.data_ptr(), rows, cos.data_ptr(),
            sin.data_ptr(), tables.write_slots.data_ptr(), tables.slots.data_ptr(),
            tables.lens.data_ptr(), None if mask is None else mask.data_ptr(),
            tables.slots.shape[1], None if head is None else ctypes.byref(head),
            model.norm.weight.data_ptr(), picked.data_ptr(), sampled,
            None if logits is None else logits.data_ptr(),
            self.spent if native.RECORDING or self.clocks else None, self.layer_seconds,
        )  # fmt: skip
        self.steps += self.clocks
        if rc == -2:  # refused before anything ran: the eager code says what is wrong
            return None
        if rc:
            raise MemoryError("a kernel of the C decode step ran out of memory")
        return logits if logits is not None else model.head(x, logits_indices)

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

    def _pool_pointers(self, pools: list[Tensor]) -> tuple[Any, int]:
        """``pools`` as an array of pointers and their format's code for the C kernels
        (``csrc/kv_rows.h``); None where they are not what the step reads (one per layer,
        contiguous CPU tensors of the activations' dtype, or int8 rows)."""
        if len(pools) != len(self.layers) or any(
            t.dtype not in (self.dtype, torch.int8) or t.dtype != pools[0].dtype
            or not t.is_contiguous() or t.device.type != "cpu"
            for t in pools
        ):  # fmt: skip
            return None, 0
        pointers = (ctypes.c_void_p * len(pools))(*(t.data_ptr() for t in pools))
        return pointers, paged_decode.pool_format(pools[0])


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
    (:mod:`engine.executor.c_step_check`) before it runs a step."""
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
    if cfg.layer_extras:
        return None, f"decode steps eager ({cfg.layer_extras}: not in the C step)"
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
