"""The precision spec: which format each linear of a model is stored in.

A precision is a spec string: ``fp32``, ``bf16``, ``fp16``, ``int8``, ``int4-g64``,
``int8+head``, ``int4-g32+head8`` (the LM head in INT8 beside an INT4 body: what llama.cpp's
Q4_1 files keep, a Q8_0 head), ``w8a8`` (INT8 activations too, in prefill chunks and batches),
``w8a8-sq`` (the same, smoothed with the model's calibration of its own text: ``infersight
calibrate``; ``w8a8-sq@random`` takes the calibration named ``random`` instead; ``w8a8-static``
and ``w8a8-sq-static`` quantize activations with one scale per linear from the calibration), or
``mixed:attn=int8,mlp=int4-g32[,head=int8]``. A mixed spec may follow the part defaults with
per-layer overrides, ``attn.N=<q>`` or ``mlp.N-M=<q>`` (layers N to M, inclusive), which beat
the default for those blocks; ``none`` keeps a block in the compute dtype:
``mixed:attn=int4-g128,mlp=int4-g128,attn.0-2=int8,mlp.7=none``. That is what the sensitivity
planner (:mod:`engine.evals.sensitivity`) writes, via :func:`format_mixed_spec`. Embeddings and
norms stay in the compute dtype; the LM head is quantized only when the spec names it.
Quantized models compute in bf16 (torch's INT4 kernels take bf16 activations only), except on a
CUDA GPU older than compute capability 8.0, where bf16 is emulated: there they compute in fp16,
bf16 is refused, and INT4 runs only through our Triton kernels (the policy is
:mod:`engine.hardware.gpu`'s).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from engine.errors import InvalidRequestError
from engine.hardware import gpu
from engine.hardware.cpu_paths import cpu_paths
from engine.quant.int8 import triton_gemms

FLOAT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
INT4_GROUPS = (32, 64, 128)


def dtype_name(dtype: torch.dtype | None) -> str:
    """``fp32`` / ``bf16`` / ``fp16`` for the float dtypes, torch's name otherwise."""
    names = {v: k for k, v in FLOAT_DTYPES.items()}
    return names.get(dtype, str(dtype)) if dtype is not None else "-"


PARTS = ("attn", "mlp", "head")
LAYER_PARTS = ("attn", "mlp")  # the parts every decoder layer has, so overrides can name them
SPEC_HELP = (
    "fp32, bf16, fp16, int8, int4-g32, int4-g64, int4-g128, w8a8, w8a8-sq, w8a8-static, "
    "w8a8-sq-static (@name: another calibration than the model's own text; add +head to "
    "quantize the LM head too, +head8 to quantize it to int8), or "
    "mixed:attn=<q>,mlp=<q>[,head=<q>] with <q> one of "
    "int8, int4-gN, w8a8…, none, "
    "optionally followed by per-layer overrides such as attn.3=<q> or mlp.0-5=<q>"
)


@dataclass(frozen=True, slots=True)
class QuantKind:
    bits: int  # 8 or 4
    group: int | None = None  # INT4 group size
    #: W8A8 (:mod:`engine.quant.w8a8`): INT8 weights and, in products of more rows than a
    #: decode step's, INT8 activations per token
    activations: bool = False
    #: … with SmoothQuant's per-channel factors from the model's calibration folded in
    #: (:mod:`engine.quant.calibration`)
    smooth: bool = False
    #: … with one activation scale per linear from the calibration (``-static``), in place of
    #: one per token computed as it runs
    static: bool = False
    #: which of the model's calibrations smooths it or gives its static scales
    #: (``w8a8-sq@random``; ``self`` by default)
    calibration: str = "self"

    @property
    def calibrated(self) -> bool:
        """Whether loading it takes a calibration of the model (smoothing, static scales)."""
        return self.smooth or self.static

    @property
    def name(self) -> str:
        if self.activations:
            base = "w8a8" + ("-sq" if self.smooth else "") + ("-static" if self.static else "")
            named = self.calibrated and self.calibration != "self"
            return base + (f"@{self.calibration}" if named else "")
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

    @property
    def smoothed(self) -> bool:
        """Whether some block is smoothed with the model's calibration (``w8a8-sq``)."""
        return any(k.smooth for k in self.kinds)

    @property
    def calibration(self) -> str | None:
        """The calibration the calibrated blocks take (one per spec), or None."""
        names = sorted({k.calibration for k in self.kinds if k.calibrated})
        return names[0] if names else None

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
    base, at, name = text.partition("@")
    if base in W8A8_KINDS and (base != "w8a8" or not at):
        name = name or "self"
        if not _CALIBRATION_NAME.fullmatch(name):
            raise InvalidRequestError(
                f"{name!r} in {whole!r} is no calibration name; write {base} (the model's own "
                f"text), {base}@random or {base}@file-<name>, as `infersight calibrate` names "
                "them"
            )
        return QuantKind(
            8, activations=True, smooth="-sq" in base, static=base.endswith("-static"),
            calibration=name,
        )  # fmt: skip
    if text.startswith("int4-g") and text[6:].isdigit():
        group = int(text[6:])
        if group not in INT4_GROUPS:
            raise InvalidRequestError(
                f"INT4 group size {group} in {whole!r} does not exist; available: "
                f"{', '.join(f'int4-g{g}' for g in INT4_GROUPS)}"
            )
        return QuantKind(4, group)
    raise InvalidRequestError(f"unknown precision {whole!r}; choose one of: {SPEC_HELP}")


#: the W8A8 formats: dynamic per-token activation scales, smoothed, static (calibrated) scales
W8A8_KINDS = ("w8a8", "w8a8-sq", "w8a8-static", "w8a8-sq-static")
#: a calibration's name (a file name in the model's ``calibration/`` folder)
_CALIBRATION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}", re.ASCII)
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


def parse_precision_spec(
    text: str, device: torch.device | str = "cpu", *, capability: gpu.Capability | None = None
) -> PrecisionSpec:
    """The spec ``text`` as it runs on ``device``, refused where that device cannot run it.

    On a CUDA device its compute capability decides (:mod:`engine.hardware.gpu`): below 8.0
    quantized specs compute in fp16, and bf16 and INT4 are refused with what to use instead.
    ``capability`` plans for a GPU that is not this machine's (``infersight plan --capability
    7.5``): the policy then applies as on that GPU, and ``device`` is not asked (``meta``).
    On a CPU the probes decide whether INT4 runs.
    """
    text = text.strip()
    dev = torch.device(device)
    if text in FLOAT_DTYPES:
        if text == "bf16":
            cap = _capability(dev, capability)
            if not gpu.runs_bf16(cap):
                assert cap is not None
                which, where = _which(capability)
                raise InvalidRequestError(
                    f"bf16 needs compute capability 8.0 or newer ({which} is "
                    f"{gpu.capability_text(cap)}); use fp16, or int8 (which computes in fp16 "
                    f"{where}) where fp16 does not fit: below 8.0 bf16 has no tensor cores and "
                    "attention falls back to fp32 scores"
                )
        return PrecisionSpec(text, FLOAT_DTYPES[text])
    parts: dict[str, QuantKind] = {}
    layers: dict[tuple[str, int], QuantKind | None] = {}
    head_suffix = next((s for s in ("+head8", "+head") if text.endswith(s)), "")
    base = text[: len(text) - len(head_suffix)]
    if head_suffix and not base.startswith("mixed:"):
        kind = _quant_kind(base, text)
        assert kind is not None
        head = _quant_kind("int8", text) if head_suffix == "+head8" else kind
        assert head is not None
        parts = {"attn": kind, "mlp": kind, "head": head}
    elif text.startswith("mixed:"):
        parts, layers = _parse_mixed(text)
    else:
        kind = _quant_kind(text, text)
        assert kind is not None
        parts = {"attn": kind, "mlp": kind}
    int4 = any(k.bits == 4 for k in parts.values()) or any(
        k is not None and k.bits == 4 for k in layers.values()
    )  # overrides included
    if dev.type == "cpu" and capability is None and int4:
        probe = cpu_paths().int4_kernel
        if not probe.ok:
            raise InvalidRequestError(
                f"{text} cannot run on this CPU: torch's INT4 kernel is unavailable "
                f"({probe.why}); use int8 or a float precision"
            )
    cap = _capability(dev, capability)
    if int4 and not gpu.runs_int4(cap):  # unless our Triton kernels run it (7.5, in fp16)
        ours, kernels = triton_gemms(torch.device("cuda"))
        if not gpu.runs_int4(cap, triton=ours):
            assert cap is not None
            which, where = _which(capability)
            why_not = "" if ours else f", but the engine here runs {kernels}"
            raise InvalidRequestError(
                f"INT4 needs a CUDA GPU of compute capability 8.0 or newer (Ampere+: torch's "
                f"INT4 kernel takes bf16 activations only), or 7.5 with Infersight's Triton "
                f"kernels{why_not}; {which} is {gpu.capability_text(cap)}, so {text} cannot "
                f"run {where}. Use int8 (it computes in fp16 {where}) or fp16"
            )
    calibrations = sorted({k.calibration for k in [*parts.values(), *layers.values()]
                           if k is not None and k.calibrated})  # fmt: skip
    if len(calibrations) > 1:
        raise InvalidRequestError(
            f"{text!r} smooths with {len(calibrations)} calibrations "
            f"({', '.join(calibrations)}); one load takes one: name the same one throughout"
        )
    # INT8's kernels take bf16 or fp16 activations; torch's INT4 kernels bf16 only (and they
    # run only where bf16 does), ours either.
    return PrecisionSpec(text, gpu.compute_dtype_for(cap), parts, layers)


def _capability(dev: torch.device, given: gpu.Capability | None) -> gpu.Capability | None:
    """The capability planned for, else ``dev``'s own (asked only when the spec needs it)."""
    return given if given is not None else gpu.capability(dev)


def _which(given: gpu.Capability | None) -> tuple[str, str]:
    """How a refusal names the GPU: this machine's, or the one a plan is made for."""
    return ("this GPU", "here") if given is None else ("the GPU planned for", "there")


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


def layer_of(module_name: str) -> int | None:
    """The decoder layer a module belongs to (``layers.3.attn.o_proj`` → 3), if any."""
    head, _, rest = module_name.partition(".")
    index = rest.partition(".")[0]
    return int(index) if head == "layers" and index.isdigit() else None


def part_of(module_name: str) -> str | None:
    """Which spec part a linear belongs to: ``attn``, ``mlp`` or ``head``."""
    if module_name == "lm_head":
        return "head"
    if module_name.endswith((".router", ".shared_gate")):  # routing stays in float
        return None
    if ".attn." in module_name:
        return "attn"
    if ".mlp." in module_name:
        return "mlp"
    return None
