"""Which layers cost the quality: the layer sensitivity scan and the mixed-spec planner.

Quantizing every block the same way spends bytes evenly, but quality is not lost evenly: a
few blocks (often the first layers' MLPs) account for much of the damage. The scan measures
it block by block. It quantizes one block (the attention or the MLP of one layer) to the
``low`` format, leaves everything else in fp32, and measures the mean KL divergence
``KL(reference ‖ that model)`` of the next-token distributions over a fixed text, in nats per
position. The planner then keeps the blocks that cost the most KL per byte saved at the
``high`` format, as many as a byte budget holds, and writes the ``mixed:`` spec for it.

Cost: the model is loaded once, in fp32 (the reference); each block's run starts from the
residual stream entering its layer, cached from the reference pass, since the layers below
it are unchanged. A scan of L layers therefore costs about L full forwards, not 2L.

The quantized kernels take bf16 activations: the block under test gets its input cast to
bf16 and its output cast back to fp32, exactly as the layer would run in a quantized model
with the rest kept at full precision. Measuring one block against an fp32 reference isolates
that block's own error; the loaded quantized model also rounds everything else to bf16,
which is the same for every block and so does not change their order.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.errors import InvalidRequestError
from engine.hardware import gpu
from engine.kernels.packed_linear import packs
from engine.kv_cache.contiguous import ContiguousKVCache
from engine.loader.weights import load_transformer
from engine.model.attention import AttentionContext
from engine.model.config import ModelConfig
from engine.model.moe import MoE, expert_load
from engine.model.transformer import Transformer
from engine.quant.linear import quantized_linear
from engine.quant.sizes import block_bytes, estimate_weight_bytes
from engine.quant.spec import (
    LAYER_PARTS,
    PrecisionSpec,
    QuantKind,
    format_mixed_spec,
    parse_precision_spec,
    parse_quant_kind,
)

log = logging.getLogger(__name__)

#: The linears of each block, by attribute of ``layer.attn`` / ``layer.mlp``.
BLOCK_LINEARS = {"attn": ("qkv_proj", "o_proj"), "mlp": ("gate_up_proj", "down_proj")}


@dataclass(frozen=True, slots=True)
class BlockSensitivity:
    """What quantizing one block to ``low`` costs, and what keeping it at ``high`` weighs."""

    layer: int
    part: str  # "attn" or "mlp"
    kl: float  # mean KL(reference ‖ this block at low), nats per position
    bytes_low: int
    bytes_high: int


@dataclass(frozen=True, slots=True)
class ExpertSensitivity:
    """What quantizing one expert of a layer of experts to ``low`` alone costs (``kl``, as a
    block's), and the share of that layer's routed tokens of the text it took."""

    layer: int
    expert: int
    kl: float
    share: float


@dataclass(frozen=True, slots=True)
class Scan:
    """A finished scan: one :class:`BlockSensitivity` per block, plus what stays fixed."""

    model: str
    low: str  # a format name: int8, int4-g32, …
    high: str  # a format name, or "none" (the compute dtype, bf16)
    text_tokens: int
    blocks: list[BlockSensitivity]
    all_low_kl: float  # every block at low at once (the starting point of a plan)
    fixed_bytes: int  # the embedding, the norms and the (bf16) LM head: no block's choice
    #: a mixture of experts scanned expert by expert (:func:`scan_model`'s ``experts``), the
    #: costliest first; () otherwise
    experts: tuple[ExpertSensitivity, ...] = ()

    @property
    def min_bytes(self) -> int:
        """The weights with every block at ``low``."""
        return self.fixed_bytes + sum(b.bytes_low for b in self.blocks)

    @property
    def max_bytes(self) -> int:
        """The weights with every block at ``high``."""
        return self.fixed_bytes + sum(b.bytes_high for b in self.blocks)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data (``infersight`` writes it; :meth:`from_dict` reads it back)."""
        return {
            "model": self.model,
            "low": self.low,
            "high": self.high,
            "text_tokens": self.text_tokens,
            "all_low_kl": self.all_low_kl,
            "fixed_bytes": self.fixed_bytes,
            "min_bytes": self.min_bytes,
            "max_bytes": self.max_bytes,
            "blocks": [
                {
                    "layer": b.layer,
                    "part": b.part,
                    "kl": b.kl,
                    "bytes_low": b.bytes_low,
                    "bytes_high": b.bytes_high,
                }
                for b in self.blocks
            ],
            "experts": [
                {"layer": e.layer, "expert": e.expert, "kl": e.kl, "share": e.share}
                for e in self.experts
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Scan:
        """The scan :meth:`to_dict` wrote (``min_bytes`` and ``max_bytes`` are derived, so
        they are recomputed, not read)."""
        try:
            blocks = [
                BlockSensitivity(
                    int(b["layer"]),
                    str(b["part"]),
                    float(b["kl"]),
                    int(b["bytes_low"]),
                    int(b["bytes_high"]),
                )
                for b in data["blocks"]
            ]
            return cls(
                str(data["model"]),
                str(data["low"]),
                str(data["high"]),
                int(data["text_tokens"]),
                blocks,
                float(data["all_low_kl"]),
                int(data["fixed_bytes"]),
                tuple(
                    ExpertSensitivity(
                        int(e["layer"]), int(e["expert"]), float(e["kl"]), float(e["share"])
                    )
                    for e in data.get("experts", ())
                ),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequestError(
                f"this is not a sensitivity scan ({type(exc).__name__}: {exc}); pass the JSON "
                "that a scan wrote"
            ) from exc


@dataclass(frozen=True, slots=True)
class Plan:
    """A ``mixed:`` spec that fits a byte budget, and what the scan predicts it costs."""

    spec: str
    bytes: int  # weights of the spec once loaded (estimate_weight_bytes), ≤ budget_bytes
    budget_bytes: int
    upgraded: list[tuple[int, str]]  # (layer, part) kept at high, most KL per byte first
    predicted_kl: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec,
            "bytes": self.bytes,
            "budget_bytes": self.budget_bytes,
            "upgraded": [{"layer": layer, "part": part} for layer, part in self.upgraded],
            "predicted_kl": self.predicted_kl,
        }


def scan_sensitivity(
    folder: Path | str,
    low: str,
    *,
    high: str | None = None,
    text_ids: Sequence[int],
    device: str = "cpu",
    progress: Callable[[int, int], None] | None = None,
    experts: bool = False,
) -> Scan:
    """Load the model at ``folder`` once in fp32 and :func:`scan_model` it.

    ``low`` is a format name (``int8``, ``int4-g32``, …); ``high`` defaults to ``int8`` for
    an INT4 ``low`` and to ``none`` (bf16) otherwise. Both are checked against the device
    before anything is loaded. ``progress(done, total)`` is called after each block (and the
    final all-low pass); it may raise :class:`~engine.errors.CancelledError` to stop.
    """
    folder = Path(folder)
    torch_device = torch.device(device)
    low_kind, high_kind = scan_formats(low, high)
    for kind in (low_kind, high_kind):
        if kind is not None:  # refuses INT4 where the device cannot run it
            parse_precision_spec(format_mixed_spec(kind, kind), torch_device)
    cfg = ModelConfig.from_file(folder / "config.json")
    model = load_transformer(folder, cfg, torch.float32, torch_device)
    return scan_model(
        model, low_kind, high_kind, text_ids, name=folder.name, progress=progress,
        experts=experts,
    )  # fmt: skip


def scan_formats(low: str, high: str | None) -> tuple[QuantKind, QuantKind | None]:
    """``low`` and ``high`` by name, with ``high``'s default."""
    low_kind = parse_quant_kind(low)
    if low_kind is None:
        raise InvalidRequestError(
            "the scan's low format must be quantized: int8, int4-g32, int4-g64, int4-g128 or w8a8"
        )
    for kind in (low_kind, None if high is None else parse_quant_kind(high)):
        if kind is not None and kind.smooth:
            raise InvalidRequestError(
                f"the scan quantizes one block at a time, and {kind.name}'s smoothing is "
                "folded across a layer's norms and linears at load; scan with w8a8, then "
                "compare w8a8-sq as a whole (eval compare --b w8a8-sq)"
            )
    if high is None:
        return low_kind, QuantKind(8) if low_kind.bits == 4 else None
    return low_kind, parse_quant_kind(high)


def scan_model(
    model: Transformer,
    low: QuantKind,
    high: QuantKind | None,
    text_ids: Sequence[int],
    *,
    name: str = "model",
    progress: Callable[[int, int], None] | None = None,
    experts: bool = False,
) -> Scan:
    """Scan an fp32 model built by :func:`~engine.loader.weights.load_transformer` without packing
    (its linears are plain ``nn.Linear``). Every block is restored before ``progress`` is
    called and on any error, so the model leaves as it came, cancelled or not. ``experts``:
    a mixture of experts is also scanned expert by expert (:func:`_scan_experts`: one pass
    from its layer per expert)."""
    cfg = model.cfg
    device = model.norm.weight.device
    # what a quantized model computes in on this device (bf16; fp16 below sm80)
    compute = gpu.compute_dtype_for(gpu.capability(device))
    _check_text(cfg, text_ids)
    sizes = {
        (layer, part): (
            block_bytes(cfg, part, low, compute, layer=layer),
            block_bytes(cfg, part, high, compute, layer=layer),
        )
        for layer in range(cfg.num_layers)
        for part in LAYER_PARTS
    }
    if any(big <= small for small, big in sizes.values()):
        raise InvalidRequestError(
            f"high ({_name(high)}) does not store a block in more bytes than low ({low.name}), "
            "so keeping blocks at high buys nothing; choose a larger high (int8 or none)"
        )
    started = time.perf_counter()
    before = expert_load(model)["expert_tokens"]
    runner = _Runner(model, text_ids)
    routed = [
        [now - was for now, was in zip(a, b, strict=True)]
        for a, b in zip(expert_load(model)["expert_tokens"], before, strict=True)
    ]
    blocks = [(layer, part) for layer in range(cfg.num_layers) for part in LAYER_PARTS]
    total = len(blocks) + 1
    quantized: dict[tuple[int, str], dict[str, nn.Module]] = {}
    results: list[BlockSensitivity] = []
    for done, (layer, part) in enumerate(blocks, start=1):
        quantized[(layer, part)] = _quantize_block(model, layer, part, low, compute)
        with _swapped(model, {(layer, part): quantized[(layer, part)]}):
            kl = runner.kl_from(layer)
        results.append(BlockSensitivity(layer, part, kl, *sizes[(layer, part)]))
        if progress is not None:
            progress(done, total)
    with _swapped(model, quantized):
        all_low_kl = runner.kl_from(0)
    if progress is not None:
        progress(total, total)
    packed = device.type == "cpu" and packs(compute, cfg.vocab_size, cfg.hidden_size)
    all_low = PrecisionSpec(format_mixed_spec(low, low), compute, {"attn": low, "mlp": low})
    fixed = estimate_weight_bytes(cfg, all_low, packed=packed) - sum(r.bytes_low for r in results)
    log.info(
        "sensitivity scan of %s at %s: %d blocks over %d tokens in %.1f s",
        name, low.name, len(results), len(text_ids), time.perf_counter() - started,
    )  # fmt: skip
    ranked = _scan_experts(model, runner, low, compute, routed) if experts else ()
    return Scan(name, low.name, _name(high), len(text_ids), results, all_low_kl, fixed, ranked)


def _scan_experts(
    model: Transformer, runner: _Runner, low: QuantKind, compute: torch.dtype,
    routed: list[list[int]],
) -> tuple[ExpertSensitivity, ...]:  # fmt: skip
    """Each expert of each layer of experts quantized to ``low`` alone, the rest in fp32: its
    KL from its layer on, and its share of the layer's tokens in the reference pass
    (``routed``, per layer of experts); the costliest first."""
    found: list[ExpertSensitivity] = []
    layers = [i for i, m in enumerate(model.layers) if isinstance(m.mlp, MoE)]
    for layer, counts in zip(layers, routed, strict=True):
        moe = model.layers[layer].mlp
        assert isinstance(moe, MoE)
        total = max(1, sum(counts))
        for expert in range(moe.num_experts):
            swap = {}
            for attr in BLOCK_LINEARS["mlp"]:
                linear = getattr(moe.experts[expert], attr)
                with torch.inference_mode():
                    swap[f"experts.{expert}.{attr}"] = CastActivations(
                        quantized_linear(linear.weight.float(), linear.bias, low, compute),
                        compute,
                    )  # fmt: skip
            with _swapped(model, {(layer, "mlp"): swap}):
                kl = runner.kl_from(layer)
            found.append(ExpertSensitivity(layer, expert, kl, counts[expert] / total))
    return tuple(sorted(found, key=lambda e: -e.kl))


def plan_mixed(scan: Scan, budget_bytes: int) -> Plan:
    """The ``mixed:`` spec that keeps the most sensitive blocks at ``high`` within a budget.

    Greedy: start from every block at ``low``, then take blocks in order of KL per extra
    byte, keeping each one that still fits (one that does not is skipped, and a cheaper one
    after it may fit). ``predicted_kl`` is a first-order estimate: the all-low KL less the KL
    each kept block caused on its own, as if the blocks' errors added up and ``high`` were
    lossless; it is floored at 0. Measure the planned spec (``eval compare``) to know.
    """
    if budget_bytes < scan.min_bytes:
        raise InvalidRequestError(
            f"a budget of {budget_bytes} bytes ({budget_bytes / 2**20:.2f} MiB) is below the "
            f"smallest this model can be with {scan.low} blocks: {scan.min_bytes} bytes "
            f"({scan.min_bytes / 2**20:.2f} MiB); give at least that"
        )
    low, high = parse_quant_kind(scan.low), parse_quant_kind(scan.high)
    order = sorted(
        scan.blocks,
        key=lambda b: (-b.kl / max(b.bytes_high - b.bytes_low, 1), b.layer, b.part),
    )
    total, kept = scan.min_bytes, []
    for block in order:
        extra = block.bytes_high - block.bytes_low
        if total + extra <= budget_bytes:
            kept.append(block)
            total += extra
    spec = format_mixed_spec(low, low, None, {(b.part, b.layer): high for b in kept})
    predicted = max(0.0, scan.all_low_kl - sum(b.kl for b in kept))
    return Plan(spec, total, budget_bytes, [(b.layer, b.part) for b in kept], predicted)


# -- the scan's machinery ---------------------------------------------------------------------


class CastActivations(nn.Module):
    """A quantized linear inside an fp32 model: the low-bit kernels take activations in the
    quantized model's compute dtype, so the input is cast to it and the output back to
    fp32."""

    def __init__(self, inner: nn.Module, compute: torch.dtype) -> None:
        super().__init__()
        self.inner = inner
        self.compute = compute

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(x.to(self.compute)).float()


def _quantize_block(
    model: Transformer, layer: int, part: str, kind: QuantKind, compute: torch.dtype
) -> dict[str, nn.Module]:
    block = getattr(model.layers[layer], part)
    modules: dict[str, nn.Module] = {}
    # a layer of experts: every expert's products (and a shared expert's), by their path
    # within the block; the router stays in float, as a load keeps it
    paths = BLOCK_LINEARS[part] if part == "attn" or not isinstance(block, MoE) else [
        name for name, m in block.named_modules()
        if type(m) is nn.Linear and name.rpartition(".")[2] in BLOCK_LINEARS["mlp"]
    ]  # fmt: skip
    for attr in paths:
        linear = block.get_submodule(attr)
        if type(linear) is not nn.Linear:
            raise InvalidRequestError(
                f"layers.{layer}.{part}.{attr} is a {type(linear).__name__}, not nn.Linear; "
                "scan a model loaded in fp32 without packing or quantization"
            )
        with torch.inference_mode():
            modules[attr] = CastActivations(
                quantized_linear(linear.weight.float(), linear.bias, kind, compute), compute
            )
    return modules


@contextmanager
def _swapped(
    model: Transformer, swaps: Mapping[tuple[int, str], Mapping[str, nn.Module]]
) -> Iterator[None]:
    """Put ``swaps`` (block → attribute → module) into ``model``; restore the originals on
    the way out, whatever happened inside."""
    originals: list[tuple[nn.Module, str, nn.Module]] = []
    try:
        for (layer, part), modules in swaps.items():
            block = getattr(model.layers[layer], part)
            for path, module in modules.items():  # an attribute, or a path into the block
                within, _, attr = path.rpartition(".")
                parent = block.get_submodule(within) if within else block
                originals.append((parent, attr, getattr(parent, attr)))
                setattr(parent, attr, module)
        yield
    finally:
        for block, attr, module in reversed(originals):
            setattr(block, attr, module)


class _Runner:
    """Forwards over one fixed text: the reference once (keeping each layer's input), then
    the model as it now is, from any layer up."""

    def __init__(self, model: Transformer, text_ids: Sequence[int]) -> None:
        self.model = model
        device = model.norm.weight.device
        tokens = len(text_ids)
        # One cache serves every pass: a pass writes each layer's K/V for every position
        # before it reads them, so nothing of an earlier pass is ever seen.
        self.cache = ContiguousKVCache(
            model.cfg, slots=1, capacity=tokens, dtype=torch.float32, device=device
        )
        # one forward over the text: LongRoPE's factors by its length, as transformers picks
        first = model.rope.offset(tokens)
        self.positions = torch.arange(first, first + tokens, device=device)
        self.tokens = tokens
        with torch.inference_mode():
            x = model.embed_ids(torch.tensor(list(text_ids), dtype=torch.long, device=device))
            self.inputs: list[Tensor] = []  # the residual stream entering each layer
            ctx = self._context()
            self.angles = model.angles(self.positions, x.dtype)
            for layer, angles in zip(model.layers, self.angles, strict=True):
                self.inputs.append(x)
                x = layer(x, *angles, ctx)
            self.ref_logp = self._logp(x)
            self.ref_p = self.ref_logp.exp()

    def kl_from(self, first: int) -> float:
        """Mean KL(reference ‖ model) over the positions, running layers ``first`` and up
        from the reference's input to layer ``first``."""
        model = self.model
        with torch.inference_mode():
            x, ctx = self.inputs[first], self._context()
            for layer, angles in zip(model.layers[first:], self.angles[first:], strict=True):
                x = layer(x, *angles, ctx)
            kl = (self.ref_p * (self.ref_logp - self._logp(x))).sum(-1).mean()
        # Rounding can leave a KL of (near) nothing a hair below zero.
        return max(float(kl), 0.0)

    def _context(self) -> AttentionContext:
        return self.cache.context([0], [0], [self.tokens])

    def _logp(self, x: Tensor) -> Tensor:
        return F.log_softmax(self.model.head(x), dim=-1)


def _check_text(cfg: ModelConfig, text_ids: Sequence[int]) -> None:
    if not text_ids:
        raise InvalidRequestError("the scan text is empty; give it at least one token")
    if len(text_ids) > cfg.max_position_embeddings:
        raise InvalidRequestError(
            f"the scan text has {len(text_ids)} tokens but the model's context is "
            f"{cfg.max_position_embeddings}; cut the text to fit"
        )
    if any(not 0 <= t < cfg.vocab_size for t in text_ids):
        raise InvalidRequestError(f"scan token ids must be in [0, {cfg.vocab_size})")


def _name(kind: QuantKind | None) -> str:
    return "none" if kind is None else kind.name
