"""Weight-only INT8 and INT4 linears, and the precision spec that chooses them.

* **INT8**: per output channel, symmetric: ``w ≈ q · s``, ``q ∈ [-127, 127]``, ``s = max|w| / 127``.
* **INT4**: group-wise (32, 64 or 128 input channels), asymmetric: ``w ≈ (q − 8) · s + z``,
  ``q ∈ [0, 15]``, one ``(s, z)`` per group.

Both run real low-bit kernels, never a dequantized copy of the whole matrix: on CPU
``torch._weight_int8pack_mm`` and ``torch._weight_int4pack_mm_for_cpu`` (bf16 activations, so
quantized models compute in bf16 there), on CUDA ``torch._weight_int4pack_mm`` (sm80+) and
``_weight_int8pack_mm``. Where the input width K does not fit a kernel (INT4 needs K to be a
multiple of the group and of 32), K is padded with zero columns and the load report says so.

A precision is a spec string: ``fp32``, ``bf16``, ``fp16``, ``int8``, ``int4-g64``,
``int8+head``, or ``mixed:attn=int8,mlp=int4-g32[,head=int8]``. A mixed spec may follow the
part defaults with per-layer overrides, ``attn.N=<q>`` or ``mlp.N-M=<q>`` (layers N to M,
inclusive), which beat the default for those blocks; ``none`` keeps a block in the compute
dtype: ``mixed:attn=int4-g128,mlp=int4-g128,attn.0-2=int8,mlp.7=none``. That is what the
sensitivity planner (:mod:`engine.evals.sensitivity`) writes, via :func:`format_mixed_spec`.
:func:`estimate_weight_bytes` predicts, from the config alone, the bytes a spec's weights
will take once loaded. Embeddings and norms stay in the compute dtype; the LM head is
quantized only when the spec names it. With tied embeddings the head *is* the embedding
matrix: quantizing it stores that matrix once, 4- or 8-bit, and the embedding lookup
dequantizes the few rows it needs (:class:`QuantizedEmbedding`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.errors import InvalidRequestError
from engine.hardware.cpu_paths import cpu_paths
from engine.model.config import ModelConfig

log = logging.getLogger(__name__)

FLOAT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
INT4_GROUPS = (32, 64, 128)


def dtype_name(dtype: torch.dtype | None) -> str:
    """``fp32`` / ``bf16`` / ``fp16`` for the float dtypes, torch's name otherwise."""
    names = {v: k for k, v in FLOAT_DTYPES.items()}
    return names.get(dtype, str(dtype)) if dtype is not None else "-"


PARTS = ("attn", "mlp", "head")
LAYER_PARTS = ("attn", "mlp")  # the parts every decoder layer has, so overrides can name them
SPEC_HELP = (
    "fp32, bf16, fp16, int8, int4-g32, int4-g64, int4-g128 (add +head to quantize the LM head "
    "too), or mixed:attn=<q>,mlp=<q>[,head=<q>] with <q> one of int8, int4-gN, none, "
    "optionally followed by per-layer overrides such as attn.3=<q> or mlp.0-5=<q>"
)


@dataclass(frozen=True, slots=True)
class QuantKind:
    bits: int  # 8 or 4
    group: int | None = None  # INT4 group size

    @property
    def name(self) -> str:
        return "int8" if self.bits == 8 else f"int4-g{self.group}"


@dataclass(frozen=True, slots=True)
class PrecisionSpec:
    text: str
    compute: torch.dtype
    parts: dict[str, QuantKind] = field(default_factory=dict)  # "attn" / "mlp" / "head"
    #: Per-layer overrides of a mixed spec, ``(part, layer) → kind``; ``None`` keeps that block
    #: in the compute dtype. An override beats its part's default.
    layers: dict[tuple[str, int], QuantKind | None] = field(default_factory=dict)

    @property
    def quantized(self) -> bool:
        return bool(self.parts) or any(k is not None for k in self.layers.values())

    @property
    def kinds(self) -> set[QuantKind]:
        """Every quantized format the spec uses anywhere (what the device must run)."""
        return set(self.parts.values()) | {k for k in self.layers.values() if k is not None}

    def block_kind(self, part: str, layer: int) -> QuantKind | None:
        """The format of one layer's ``attn`` or ``mlp`` block: its override, else the part's."""
        if (part, layer) in self.layers:
            return self.layers[(part, layer)]
        return self.parts.get(part)

    def kind_for(self, module_name: str) -> QuantKind | None:
        """The format of a linear by module name (``layers.3.mlp.down_proj``, ``lm_head``);
        ``None``: it stays in the compute dtype."""
        part = part_of(module_name)
        if part is None:
            return None
        layer = layer_of(module_name)
        return self.parts.get(part) if layer is None else self.block_kind(part, layer)

    def check_layers(self, num_layers: int) -> None:
        """Refuse overrides naming layers a model of ``num_layers`` layers lacks.

        The spec is parsed before the config is read, so this is a second step, run by the
        loader once it knows the model: a typo'd index must not quietly change nothing.
        """
        beyond = sorted((layer, part) for part, layer in self.layers if layer >= num_layers)
        if beyond:
            layer, part = beyond[0]
            raise InvalidRequestError(
                f"{self.text!r} overrides {part}.{layer}, but this model has {num_layers} "
                f"layers, numbered 0 to {num_layers - 1}; use layer indices below {num_layers}"
            )


def parse_quant_kind(text: str) -> QuantKind | None:
    """One format by name: ``int8``, ``int4-g32|64|128``, or ``none`` (``None``)."""
    return _quant_kind(text.strip(), text)


def _quant_kind(text: str, whole: str) -> QuantKind | None:
    if text == "none":
        return None
    if text == "int8":
        return QuantKind(8)
    if text.startswith("int4-g") and text[6:].isdigit():
        group = int(text[6:])
        if group not in INT4_GROUPS:
            raise InvalidRequestError(
                f"INT4 group size {group} in {whole!r} does not exist; available: "
                f"{', '.join(f'int4-g{g}' for g in INT4_GROUPS)}"
            )
        return QuantKind(4, group)
    raise InvalidRequestError(f"unknown precision {whole!r}; choose one of: {SPEC_HELP}")


_LAYER_RANGE = re.compile(r"(\d+)(?:-(\d+))?", re.ASCII)
#: Overrides are expanded layer by layer; an index past this is a typo, not a model (the
#: largest open models have about a hundred layers), and must not expand into a hang.
MAX_LAYER_INDEX = 4095


def _override_layers(part: str, layers: str, item: str, whole: str) -> range:
    """The layers ``N`` or ``N-M`` of an override key ``part.N[-M]``."""
    if part not in LAYER_PARTS:
        why = "the LM head has no layers" if part == "head" else f"{part!r} is no part"
        raise InvalidRequestError(
            f"cannot read {item!r} in {whole!r}: {why}; per-layer overrides are written "
            "attn.N=<q> or mlp.N=<q>, or for layers N to M attn.N-M=<q>"
        )
    match = _LAYER_RANGE.fullmatch(layers)
    if match is None:
        raise InvalidRequestError(
            f"{layers!r} in {item!r} ({whole!r}) is not a layer index; write {part}.N or "
            f"{part}.N-M with N and M layer numbers counted from 0, e.g. {part}.0-3"
        )
    first = int(match.group(1))
    last = int(match.group(2)) if match.group(2) is not None else first
    if last < first:
        raise InvalidRequestError(
            f"the layer range {layers} in {item!r} ({whole!r}) runs backwards; write "
            f"{part}.{last}-{first}"
        )
    if last > MAX_LAYER_INDEX:
        raise InvalidRequestError(
            f"layer {last} in {item!r} ({whole!r}) is past any model's last layer; layers are "
            "counted from 0 up to the model's layer count less one"
        )
    return range(first, last + 1)


def _parse_mixed(text: str) -> tuple[dict[str, QuantKind], dict[tuple[str, int], QuantKind | None]]:
    parts: dict[str, QuantKind] = {}
    layers: dict[tuple[str, int], QuantKind | None] = {}
    for item in filter(None, text[6:].split(",")):
        key, sep, value = item.partition("=")
        part, dot, which = key.partition(".")
        if not sep or (part not in PARTS and not dot):
            raise InvalidRequestError(
                f"cannot read {item!r} in {text!r}; write part=kind with part one of "
                f"{', '.join(PARTS)}, or a per-layer override such as mlp.3=kind"
            )
        if not dot:
            kind = _quant_kind(value, text)
            if kind is not None:
                parts[key] = kind
            continue
        span = _override_layers(part, which, item, text)
        kind = _quant_kind(value, text)
        for layer in span:
            if (part, layer) in layers:
                raise InvalidRequestError(
                    f"{part}.{layer} is given more than one format in {text!r}; give each "
                    "layer's block at most one override"
                )
            layers[(part, layer)] = kind
    if not parts and not any(k is not None for k in layers.values()):
        raise InvalidRequestError(f"{text!r} quantizes nothing; choose one of: {SPEC_HELP}")
    return parts, layers


def parse_precision_spec(text: str, device: torch.device | str = "cpu") -> PrecisionSpec:
    text = text.strip()
    dev = torch.device(device)
    if text in FLOAT_DTYPES:
        return PrecisionSpec(text, FLOAT_DTYPES[text])
    parts: dict[str, QuantKind] = {}
    layers: dict[tuple[str, int], QuantKind | None] = {}
    base, plus_head = (text[: -len("+head")], True) if text.endswith("+head") else (text, False)
    if plus_head and not base.startswith("mixed:"):
        kind = _quant_kind(base, text)
        assert kind is not None
        parts = {"attn": kind, "mlp": kind, "head": kind}
    elif text.startswith("mixed:"):
        parts, layers = _parse_mixed(text)
    else:
        kind = _quant_kind(text, text)
        assert kind is not None
        parts = {"attn": kind, "mlp": kind}
    spec = PrecisionSpec(text, torch.bfloat16, parts, layers)
    int4 = any(k.bits == 4 for k in spec.kinds)  # overrides included
    if dev.type == "cpu" and int4:
        probe = cpu_paths().int4_kernel
        if not probe.ok:
            raise InvalidRequestError(
                f"{text} cannot run on this CPU: torch's INT4 kernel is unavailable "
                f"({probe.why}); use int8 or a float precision"
            )
    if dev.type == "cuda" and int4:
        major, minor = torch.cuda.get_device_capability(dev)
        if major < 8:
            raise InvalidRequestError(
                f"INT4 needs a CUDA GPU of compute capability 8.0 or newer (Ampere+); this one is "
                f"{major}.{minor}. Use int8, bf16 or fp16 here"
            )
    # The low-bit kernels take bf16 activations (on CUDA fp16 would do for INT8 only).
    return spec


def format_mixed_spec(
    attn: QuantKind | None,
    mlp: QuantKind | None,
    head: QuantKind | None = None,
    overrides: Mapping[tuple[str, int], QuantKind | None] | None = None,
) -> str:
    """The canonical ``mixed:`` text for part defaults and per-layer overrides.

    Defaults come first (``head`` only when quantized), then the overrides, attention before
    MLP, by layer, with runs of consecutive layers in the same format written as one range
    (``mlp.0-5=int8``). Overrides equal to their part's default are dropped: they say nothing.
    :func:`parse_precision_spec` reads the text back to the same defaults and overrides.
    """
    defaults = {"attn": attn, "mlp": mlp}
    items = [f"attn={_kind_text(attn)}", f"mlp={_kind_text(mlp)}"]
    if head is not None:
        items.append(f"head={head.name}")
    chosen = overrides or {}
    for part in LAYER_PARTS:
        own = sorted(
            ((layer, kind) for (p, layer), kind in chosen.items() if p == part),
            key=lambda item: item[0],
        )
        runs: list[tuple[int, int, QuantKind | None]] = []
        for layer, kind in own:
            if layer < 0:
                raise ValueError(f"layer index {layer} of {part} is negative")
            if kind == defaults[part]:
                continue
            if runs and runs[-1][1] == layer - 1 and runs[-1][2] == kind:
                runs[-1] = (runs[-1][0], layer, kind)
            else:
                runs.append((layer, layer, kind))
        for first, last, kind in runs:
            span = str(first) if first == last else f"{first}-{last}"
            items.append(f"{part}.{span}={_kind_text(kind)}")
    return "mixed:" + ",".join(items)


def _kind_text(kind: QuantKind | None) -> str:
    return "none" if kind is None else kind.name


# -- INT8 -------------------------------------------------------------------------------------


def quantize_int8(w: Tensor, scale_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """Per-row symmetric INT8: ``(q int8 [N, K], scale [N])`` with ``w ≈ q · scale``.

    The scale is rounded to ``scale_dtype`` *before* ``q`` is computed against it, so that
    dequantization in that dtype is exactly ``q · scale``. Rows are quantized a chunk at a
    time (:func:`row_chunks`): beside ``w``, only the int8 result and one chunk's fp32
    temporaries exist."""
    n = w.shape[0]
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scale = torch.empty(n, dtype=scale_dtype, device=w.device)
    for rows in row_chunks(n, w.shape[1]):
        chunk = w[rows].float()
        s = (chunk.abs().amax(dim=1) / 127).clamp(min=1e-12).to(scale_dtype)
        q[rows] = torch.round(chunk / s.float()[:, None]).clamp_(-127, 127)
        scale[rows] = s
    return q, scale


#: fp32 bytes of weight rows quantized at once: bounds a quantization's temporaries
QUANT_CHUNK_BYTES = 32 * 2**20


def row_chunks(n: int, k: int, multiple: int = 1) -> list[slice]:
    """Slices of ``n`` rows of width ``k``, each about :data:`QUANT_CHUNK_BYTES` in fp32 and
    a multiple of ``multiple`` rows long (the last one may be shorter)."""
    rows = max(multiple, QUANT_CHUNK_BYTES // (4 * k) // multiple * multiple)
    return [slice(start, min(start + rows, n)) for start in range(0, n, rows)]


def dequantize_int8(q: Tensor, scale: Tensor) -> Tensor:
    return q.float() * scale.float()[:, None]


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
        x = torch.ones(1, 32, dtype=torch.bfloat16, device=device)
        w = torch.full((8, 32), 2, dtype=torch.int8, device=device)
        scales = torch.full((8,), 0.5, dtype=torch.bfloat16, device=device)
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
        q, scale = quantize_int8(weight, dtype)
        self.register_buffer("weight", q)
        self.register_buffer("scales", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))
        self.padded_k = 0
        # Probed once per device on a tiny tensor (on a CPU by engine.hardware), never decided
        # by a failing call: only a missing kernel may switch a layer to the converting path.
        cpu = weight.device.type == "cpu"
        self.use_kernel = cpu_paths().int8_kernel.ok if cpu else int8_kernel_runs(weight.device)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.use_kernel:  # an error here (CUDA out of memory, say) propagates as it is
            y = torch._weight_int8pack_mm(x2, self.weight, self.scales)
        else:  # weights stay int8 in memory; one matrix converted per call
            y = F.linear(x2, self.weight.to(x2.dtype)) * self.scales
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scales))

    @property
    def kernel(self) -> str:
        """The path this layer runs, for the load report."""
        return "int8 kernel" if self.use_kernel else "int8 converted per call"

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


# -- INT4 -------------------------------------------------------------------------------------


def quantize_int4(w: Tensor, group: int) -> tuple[Tensor, Tensor, Tensor]:
    """Group-wise asymmetric INT4 of ``w [N, K]`` (K divisible by ``group``):
    ``(q int32 [N, K] in 0..15, scale bf16 [N, K/group], zero bf16 [N, K/group])``,
    ``w ≈ (q − 8) · scale + zero`` (the convention of torch's int4 kernels)."""
    n, k = w.shape
    groups = w.float().reshape(n, k // group, group)
    lo, hi = groups.amin(dim=2), groups.amax(dim=2)
    # A hair of slack before bf16 rounding keeps the grid covering [lo, hi] afterwards.
    scale = ((hi - lo) / 15 * (1 + 2**-7)).clamp(min=1e-8).to(torch.bfloat16)
    zero = (lo + 8 * scale.float()).to(torch.bfloat16)
    q = torch.round((groups - zero.float()[..., None]) / scale.float()[..., None] + 8)
    return q.clamp(0, 15).to(torch.int32).reshape(n, k), scale, zero


def dequantize_int4(q: Tensor, scale: Tensor, zero: Tensor, group: int) -> Tensor:
    n, k = q.shape
    g = q.float().reshape(n, k // group, group) - 8
    return (g * scale.float()[..., None] + zero.float()[..., None]).reshape(n, k)


def _inner_k_tiles(k: int) -> int:
    for tiles in (8, 4, 2):
        if k % (tiles * 16) == 0:
            return tiles
    raise ValueError(f"K={k} is not a multiple of 32")


def padded_width(k: int, group: int) -> int:
    """Smallest K' ≥ K that the INT4 kernels accept for ``group`` (a multiple of it and 32)."""
    step = max(group, 32)
    return -(-k // step) * step


class Int4Linear(nn.Module):
    quantized = True
    weight: Tensor
    scales_and_zeros: Tensor
    bias: Tensor | None

    def __init__(self, weight: Tensor, bias: Tensor | None, group: int) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.group = group
        k = padded_width(self.in_features, group)
        self.padded_k = k - self.in_features
        # The CPU packing also wants N divisible by 16: extra zero rows, sliced off the output.
        self.padded_n = -(-self.out_features // 16) * 16 - self.out_features
        self.on_cuda = weight.device.type == "cuda"
        tiles = self.inner_k_tiles = _inner_k_tiles(k)
        packed, scale, zero = self._quantize_and_pack(weight, k, tiles)
        # [K/group, N, 2]: (scale, zero) per group and output channel, as the kernels want.
        sz = torch.stack([scale, zero], dim=2).transpose(0, 1).contiguous()
        self.register_buffer("weight", packed)
        self.register_buffer("scales_and_zeros", sz)
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.bfloat16))

    def _quantize_and_pack(self, weight: Tensor, k: int, tiles: int) -> tuple[Tensor, ...]:
        """Quantize ``weight`` (padded to ``[N + padded_n, k]`` with zeros) a chunk of rows at a
        time and pack it for the kernel: beside ``weight``, only the packed result and one
        chunk's temporaries exist. The CPU packing lays rows out in independent blocks
        (``cpu_paths().int4_block_rows``), so chunks of whole blocks are packed one by one;
        for CUDA the 4-bit values are kept a byte each (a quarter of fp32) and packed once."""
        n = self.out_features + self.padded_n
        block = None if self.on_cuda else cpu_paths().int4_block_rows
        chunks = row_chunks(n, k, block or 1) if self.on_cuda or block else [slice(0, n)]
        values = None
        if self.on_cuda:
            values = torch.empty((n, k), dtype=torch.uint8, device=weight.device)
        packed_rows: list[Tensor] = []
        scales: list[Tensor] = []
        zeros: list[Tensor] = []
        for rows in chunks:
            chunk = weight[rows].float()
            pad_rows = rows.stop - rows.start - chunk.shape[0]
            if self.padded_k or pad_rows:
                chunk = F.pad(chunk, (0, self.padded_k, 0, pad_rows))
            q, scale, zero = quantize_int4(chunk, self.group)
            if values is not None:
                values[rows] = q
            else:
                packed_rows.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, tiles))
            scales.append(scale)
            zeros.append(zero)
        packed = pack_int4_cuda(values, tiles) if values is not None else torch.cat(packed_rows)
        return packed, torch.cat(scales), torch.cat(zeros)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        if self.padded_k:
            x2 = F.pad(x2, (0, self.padded_k))
        if self.on_cuda:
            y = torch.ops.aten._weight_int4pack_mm(
                x2, self.weight, self.group, self.scales_and_zeros
            )
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2, self.weight, self.group, self.scales_and_zeros
            )
        if self.padded_n:
            y = y[:, : self.out_features]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scales_and_zeros))

    kernel = "int4 kernel"  # the only INT4 path: without it INT4 is refused at parse time

    def extra_repr(self) -> str:
        pad = f", K padded +{self.padded_k}" if self.padded_k else ""
        size = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{size}, int4 g{self.group}{pad}"


def cpu_int4_block_rows() -> int | None:
    """Rows per block of ``_convert_weight_to_int4pack_for_cpu``'s layout, found by probing.

    The CPU packing interleaves blocks of rows: byte ``[b, k, j]`` of ``packed.view(N / B, K,
    B / 2)`` holds row ``b·B + j`` in its low nibble and row ``b·B + B/2 + j`` in its high one.
    B depends on the build (64 with AVX-512). ``None`` if no B matches: then a tied embedding
    keeps its own 4-bit copy.
    """
    gen = torch.Generator().manual_seed(0)
    for block in (64, 32, 16):
        q = torch.randint(0, 16, (2 * block, 64), generator=gen, dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
        rows = torch.arange(2 * block)
        if packed.shape == (2 * block, 32) and torch.equal(
            _read_int4_rows(packed, rows, block, 64), q
        ):
            return block
    return None


def _read_int4_rows(packed: Tensor, rows: Tensor, block: int, k: int) -> Tensor:
    half = block // 2
    view = packed.view(-1, k, half)
    within = rows % block
    data = view[rows // block, :, within % half].to(torch.int32)  # [T, K]
    return torch.where((within < half)[:, None], data & 15, data >> 4)


# -- reading rows back from the CUDA INT4 layout ----------------------------------------------


def pack_int4_cuda(q: Tensor, tiles: int) -> Tensor:
    """``_convert_weight_to_int4pack`` of ``q`` (int32 [N, K], 0..15): it takes two values a
    byte, the even column in the high nibble."""
    return torch.ops.aten._convert_weight_to_int4pack(
        (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), tiles
    )


@dataclass(frozen=True, slots=True)
class Int4TileLayout:
    """Where torch's CUDA INT4 packing keeps each value, so embedding rows can be read from it.

    The packed int32 tensor is a run of tiles of ``tile_rows × tile_cols`` values, ordered by
    row tile, then column tile (a tile is what one warp loads: 8 × 16·inner-k-tiles values with
    NVIDIA's m16n8k16 layout, 16 rows on ROCm). Inside a tile, value ``(r, c)`` is the 4 bits
    at ``shift[r, c]`` of int32 word ``word[r, c]``. Found by :func:`cuda_int4_layout`.
    """

    tile_rows: int
    tile_cols: int
    word: Tensor  # int64 [tile_rows, tile_cols]
    shift: Tensor  # int32 [tile_rows, tile_cols]

    def read_rows(self, packed: Tensor, rows: Tensor, k: int) -> Tensor:
        """Rows ``rows`` (int [T]) of the [N, k] matrix packed in ``packed``: int32 [T, k]."""
        col_tiles = k // self.tile_cols
        words = packed.reshape(-1, col_tiles, self.tile_rows * self.tile_cols // 8)
        within = rows % self.tile_rows
        index = self.word[within][:, None, :].expand(-1, col_tiles, -1)
        data = words[rows // self.tile_rows].gather(2, index) >> self.shift[within][:, None, :]
        return (data & 15).reshape(len(rows), k)


def _nibbles(packed: Tensor) -> Tensor:
    """Every 4-bit value of an int32 tensor, word by word, lowest bits first."""
    words = packed.reshape(-1, 1).to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 4, device=packed.device)
    return ((words >> shifts) & 15).reshape(-1)


def _layout_from(location: Tensor, tile_rows: int, tile_cols: int) -> Int4TileLayout | None:
    """The tile layout that explains ``location`` (value (r, c) → its nibble), if tiles of
    ``tile_rows × tile_cols`` in row-tile-major order do."""
    rows, cols = location.shape
    size = tile_rows * tile_cols
    tile = location[:tile_rows, :tile_cols]
    if rows % tile_rows or cols % tile_cols or int(tile.max()) >= size:
        return None
    r = torch.arange(rows, device=location.device)[:, None]
    c = torch.arange(cols, device=location.device)[None, :]
    start = ((r // tile_rows) * (cols // tile_cols) + c // tile_cols) * size
    if not torch.equal(start + tile[r % tile_rows, c % tile_cols], location):
        return None
    return Int4TileLayout(tile_rows, tile_cols, tile // 8, ((tile % 8) * 4).to(torch.int32))


def probe_int4_layout(
    device: torch.device, tiles: int, pack: Callable[[Tensor, int], Tensor] = pack_int4_cuda
) -> Int4TileLayout | None:
    """Find the packing's layout by packing a probe matrix whose values spell, hex digit by hex
    digit, their own position; then check it by reading a random matrix back exactly.

    Nothing about the kernel's layout is assumed beyond "a permutation of 4-bit values in
    tiles", so a torch that changes it gets ``None`` (and a clear refusal), never wrong rows.
    """
    rows, cols = 64, 2 * 16 * tiles  # several row tiles of any plausible height, 2 column tiles
    count = rows * cols  # ≤ 16 384: four hex digits
    position = torch.arange(count, device=device, dtype=torch.int32).view(rows, cols)
    source = torch.zeros(count, dtype=torch.int64, device=device)
    for digit in range(4):
        nibbles = _nibbles(pack((position >> (4 * digit)) & 15, tiles))
        if nibbles.numel() != count:
            return None
        source += nibbles << (4 * digit)  # source[n]: the position nibble n came from
    everything = torch.arange(count, device=device)
    if not torch.equal(source.sort().values, everything):
        return None
    location = torch.empty_like(source)
    location[source] = everything
    gen = torch.Generator().manual_seed(0)
    check = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.int32).to(device)
    packed, ids = pack(check, tiles), torch.arange(rows, device=device)
    for tile_rows in (8, 16, 32):
        layout = _layout_from(location.view(rows, cols), tile_rows, 16 * tiles)
        if layout is not None and torch.equal(layout.read_rows(packed, ids, cols), check):
            return layout
    return None


_CUDA_INT4_LAYOUTS: dict[tuple[str, int], Int4TileLayout | None] = {}


def cuda_int4_layout(device: torch.device, tiles: int) -> Int4TileLayout | None:
    """:func:`probe_int4_layout` once per device and inner-k-tile count."""
    key = (str(device), tiles)
    if key not in _CUDA_INT4_LAYOUTS:
        _CUDA_INT4_LAYOUTS[key] = probe_int4_layout(device, tiles, pack_int4_cuda)
        if _CUDA_INT4_LAYOUTS[key] is None:
            log.warning("cannot read rows from the CUDA INT4 layout on %s", device)
    return _CUDA_INT4_LAYOUTS[key]


class QuantizedEmbedding(nn.Module):
    """Token embedding read from a tied, quantized LM head: one matrix serves both.

    Rows are dequantized on lookup (a few per step), so the tied matrix exists only once, in
    its quantized form.
    """

    inverse_scale: Tensor

    def __init__(
        self, head: Int8Linear | Int4Linear, dtype: torch.dtype, inverse_scale: Tensor
    ) -> None:
        super().__init__()
        self.__dict__["head"] = head  # a reference, not a submodule: counted once, as the head
        self.dtype = dtype
        # The head holds W·diag(s) (see head_channel_scale); embedding rows are W[id].
        self.register_buffer("inverse_scale", inverse_scale.float())
        self.embedding_dim = head.in_features
        self.own_rows: Tensor | None = None
        self.cuda_layout: Int4TileLayout | None = None
        if isinstance(head, Int4Linear) and head.on_cuda:
            self.cuda_layout = cuda_int4_layout(head.weight.device, head.inner_k_tiles)
            if self.cuda_layout is None:
                raise InvalidRequestError(
                    "this torch build packs CUDA INT4 weights in a layout Infersight cannot "
                    "read rows from, so a tied INT4 head cannot serve the embedding; use "
                    "int8+head, or INT4 without +head"
                )
        if isinstance(head, Int4Linear) and not head.on_cuda:
            block = cpu_paths().int4_block_rows
            rows = head.out_features + head.padded_n
            if block is None or rows % block:
                raise InvalidRequestError(
                    "this torch build packs INT4 weights in a layout Infersight cannot read "
                    "rows from, so a tied INT4 head cannot serve the embedding; use int8+head, "
                    "or INT4 without +head"
                )
            self.block = block

    def forward(self, ids: Tensor) -> Tensor:
        head = self.__dict__["head"]
        flat = ids.reshape(-1)
        if isinstance(head, Int8Linear):
            rows = head.weight[flat].float() * head.scales[flat].float()[:, None]
        else:
            k = head.in_features + head.padded_k
            q = self._int4_rows(head, flat, k).float() - 8
            sz = head.scales_and_zeros[:, flat].float()  # [K/group, T, 2]
            groups = q.view(len(flat), k // head.group, head.group)
            rows = groups * sz[..., 0].T[..., None] + sz[..., 1].T[..., None]
            rows = rows.reshape(len(flat), k)[:, : head.in_features]
        rows = rows * self.inverse_scale
        return rows.to(self.dtype).reshape(*ids.shape, self.embedding_dim)

    def _int4_rows(self, head: Int4Linear, ids: Tensor, k: int) -> Tensor:
        """Rows ``ids`` of the head's 4-bit values (0..15), read from its packed weight."""
        if self.cuda_layout is not None:
            return self.cuda_layout.read_rows(head.weight, ids, k)
        return _read_int4_rows(head.weight, ids, self.block, k)


def head_channel_scale(norm_weight: Tensor, alpha: float = 0.5) -> Tensor:
    """Per-input-channel scale ``s`` for quantizing the LM head (activation-aware, as AWQ).

    The head's input is the final RMSNorm's output, whose channel ``k`` has a magnitude set by
    the norm weight ``g_k``. Quantizing ``W·diag(s)`` and feeding it ``x / s`` (the ``1/s``
    folded into ``g``) is exact before rounding, and with ``s = |g|^alpha`` (mean 1) the
    rounding error moves away from the channels that carry large activations. ``alpha = 0.5``
    is AWQ's usual middle; it is not tuned to our evaluation text. On SmolLM2 with INT4-g32 it
    cut the tied head's perplexity cost from +9.1% to +6.8% (`eval ppl`).
    """
    magnitude = norm_weight.detach().float().abs().clamp(min=1e-3)
    scale = magnitude**alpha
    return scale / scale.mean()


def quantized_linear(weight: Tensor, bias: Tensor | None, kind: QuantKind) -> nn.Module:
    """Build the quantized module for one full-precision weight (any float dtype)."""
    if kind.bits == 8:
        return Int8Linear(weight, bias, torch.bfloat16)
    assert kind.group is not None
    return Int4Linear(weight, bias, kind.group)


# -- weight bytes, predicted from the config -------------------------------------------------


def linear_bytes(
    out_features: int, in_features: int, kind: QuantKind | None, dtype: torch.dtype
) -> int:
    """Bytes of one linear's weight (bias aside) as the loader stores it.

    ``None``: the float matrix in ``dtype``. INT8: the int8 matrix and one bf16 scale a row
    (:class:`Int8Linear`). INT4: two values a byte of the matrix padded to the kernel's shape
    (K to :func:`padded_width`, N to a multiple of 16), and a bf16 (scale, zero) pair per
    group and padded row (:class:`Int4Linear`); the CUDA and CPU packings are the same size.
    """
    if kind is None:
        return out_features * in_features * _itemsize(dtype)
    if kind.bits == 8:
        return out_features * in_features + out_features * 2
    assert kind.group is not None
    k = padded_width(in_features, kind.group)
    n = -(-out_features // 16) * 16
    return n * k // 2 + (k // kind.group) * n * 2 * 2


def block_bytes(cfg: ModelConfig, part: str, kind: QuantKind | None, compute: torch.dtype) -> int:
    """Bytes of one layer's ``attn`` block (qkv_proj + o_proj, with the q/k/v biases of a
    Qwen2-style model) or ``mlp`` block (gate_up_proj + down_proj) stored in ``kind``
    (``None``: the ``compute`` dtype). A quantized linear keeps its bias in bf16."""
    hidden = cfg.hidden_size
    if part == "attn":
        qkv = cfg.q_size + 2 * cfg.kv_size
        total = linear_bytes(qkv, hidden, kind, compute) + linear_bytes(
            hidden, cfg.q_size, kind, compute
        )
        if cfg.attention_bias:
            total += qkv * (_itemsize(compute) if kind is None else 2)
        return total
    if part == "mlp":
        inner = cfg.intermediate_size
        return linear_bytes(2 * inner, hidden, kind, compute) + linear_bytes(
            hidden, inner, kind, compute
        )
    raise ValueError(f"part {part!r} is not a layer block; use one of {', '.join(LAYER_PARTS)}")


def estimate_weight_bytes(
    cfg: ModelConfig, spec: PrecisionSpec, *, packed: bool | None = None
) -> int:
    """Bytes the weights of ``cfg`` will take loaded at ``spec``: exactly the
    ``weights_bytes`` of :func:`engine.load <engine.loader.load.load_model>`, without reading
    a single tensor (what a planner needs to fit a budget before loading).

    It counts what :func:`engine.loader.weights.weight_bytes` counts: the embedding, the norms,
    every block at its format (:func:`block_bytes`), and the LM head. A tied head is stored
    once, as the embedding or, quantized, as the head that the embedding reads its rows from
    (:class:`QuantizedEmbedding`). One case depends on the machine: on a CPU whose oneDNN
    path runs the compute dtype and measured faster for the head's shape, the loader lays a
    tied float head out as a second, packed matrix beside the embedding. ``packed`` says whether
    it does: ``None`` asks :func:`engine.kernels.packed_linear.packs`, as a default CPU load
    does; pass ``True`` for ``pack=True`` and ``False`` for ``pack=False`` or a GPU.
    """
    return sum(weight_bytes_by_kind(cfg, spec, packed=packed).values())


def weight_bytes_by_kind(
    cfg: ModelConfig, spec: PrecisionSpec, *, packed: bool | None = None
) -> dict[str, int]:
    """:func:`estimate_weight_bytes` by the kinds of the load report
    (:func:`engine.loader.weights.weight_report`): ``embedding``, ``attention`` (Qwen3's q/k norms
    included), ``mlp``, ``norm`` and ``lm_head``."""
    compute, size = spec.compute, _itemsize(spec.compute)
    hidden, vocab = cfg.hidden_size, cfg.vocab_size
    kinds = {"embedding": 0, "attention": 0, "mlp": 0, "norm": hidden * size, "lm_head": 0}
    for layer in range(cfg.num_layers):
        kinds["norm"] += 2 * hidden * size  # input and post-attention norms
        kinds["attention"] += 2 * cfg.head_dim * size if cfg.qk_norm else 0  # Qwen3
        kinds["attention"] += block_bytes(cfg, "attn", spec.block_kind("attn", layer), compute)
        kinds["mlp"] += block_bytes(cfg, "mlp", spec.block_kind("mlp", layer), compute)
    head = spec.parts.get("head")
    embedding = vocab * hidden * size
    if head is not None:  # a tied embedding reads its rows from the quantized head
        kinds["lm_head"] = linear_bytes(vocab, hidden, head, compute)
        kinds["embedding"] = 0 if cfg.tie_word_embeddings else embedding
        return kinds
    if packed is None:
        from engine.kernels.packed_linear import packs

        packed = packs(compute, vocab, hidden)
    kinds["embedding"] = embedding
    kinds["lm_head"] = embedding if packed or not cfg.tie_word_embeddings else 0
    return kinds


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def layer_of(module_name: str) -> int | None:
    """The decoder layer a module belongs to (``layers.3.attn.o_proj`` → 3), if any."""
    head, _, rest = module_name.partition(".")
    index = rest.partition(".")[0]
    return int(index) if head == "layers" and index.isdigit() else None


def part_of(module_name: str) -> str | None:
    """Which spec part a linear belongs to: ``attn``, ``mlp`` or ``head``."""
    if module_name == "lm_head":
        return "head"
    if ".attn." in module_name:
        return "attn"
    if ".mlp." in module_name:
        return "mlp"
    return None
