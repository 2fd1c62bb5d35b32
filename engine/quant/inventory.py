"""The loaded weights by kind and the form each is held in: the load report, the parameters
the quantized layers hold, and the bytes a decode step reads (the speed limit of batch-1
decode). Counted from the model's modules, whatever loaded them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import Tensor, nn

from engine.kernels import gemv
from engine.kernels.packed_linear import GemvLinear, PackedLinear
from engine.quant.embedding import QuantizedEmbedding
from engine.quant.int4 import Int4Linear
from engine.quant.int8 import Int8Linear
from engine.quant.spec import dtype_name
from engine.quant.w8a8 import W8A8Linear


def decode_read_bytes(model: nn.Module) -> int:
    """Bytes of weights a decode step reads at least once: every linear (the LM head included,
    also where it shares the embedding's tensor) and every norm, but of the embedding only its
    few rows; of a mixture of experts' routed experts, the share a token chooses (``k`` of
    ``E``: its *active* parameters). Memory bandwidth ÷ this is the speed limit of batch-1
    decode."""
    from engine.model.moe import MoE

    total = _read_bytes(model.modules())
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        experts = _read_bytes(moe.experts.modules())
        total -= experts - experts * moe.top_k // moe.num_experts
    return total


def _read_bytes(modules: Iterable[nn.Module]) -> int:
    seen: set[int] = set()
    total = 0
    for module in modules:
        if isinstance(module, (nn.Embedding, QuantizedEmbedding)):
            continue
        nbytes = getattr(module, "nbytes", None)
        tensors: list[object]
        if isinstance(nbytes, int):  # PackedLinear, Int8Linear, Int4Linear
            total += nbytes
            tensors = [getattr(module, "bias", None)]
        else:
            tensors = list(module.parameters(recurse=False))
        for t in tensors:
            if isinstance(t, Tensor) and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


def quantized_parameter_count(model: nn.Module) -> int:
    """Logical parameters held by quantized linears (their buffers are not Parameters)."""
    return sum(
        m.in_features * m.out_features + (m.out_features if m.bias is not None else 0)
        for m in model.modules()
        if isinstance(m, (Int8Linear, Int4Linear))
    )


@dataclass(frozen=True, slots=True)
class WeightGroup:
    """One line of the load report: weights of one kind held in one format."""

    kind: str  # embedding, attention, mlp, lm_head, norm
    form: str  # e.g. "bf16", "fp32 (oneDNN-packed)", "int4-g128 (int4 kernel), K padded +64"
    parameters: int
    nbytes: int


def weight_report(model: nn.Module) -> list[WeightGroup]:
    """Bytes of the weights by kind and format (what a precision really costs)."""
    groups: dict[tuple[str, str], list[int]] = {}
    seen: set[int] = set()

    def add(kind: str, form: str, params: int, nbytes: int) -> None:
        entry = groups.setdefault((kind, form), [0, 0])
        entry[0] += params
        entry[1] += nbytes

    for name, module in model.named_modules():
        kind = _kind_of(name)
        if isinstance(module, QuantizedEmbedding):
            add("embedding", "shares the quantized lm_head", 0, 0)
            continue
        if isinstance(module, (Int8Linear, Int4Linear)):
            form = (
                "w8a8" if isinstance(module, W8A8Linear)
                else "int8" if isinstance(module, Int8Linear) else f"int4-g{module.group}"
            )  # fmt: skip
            form += f" ({module.kernel})"
            if module.padded_k:
                form += f", K padded +{module.padded_k}"
            add(kind, form, module.in_features * module.out_features, module.nbytes)
        elif isinstance(module, PackedLinear):
            form = f"{dtype_name(module.dtype)} (oneDNN-packed)"
            add(kind, form, module.in_features * module.out_features, module.nbytes)
        for param in module.parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            form = dtype_name(param.dtype)
            if isinstance(module, GemvLinear) and param is module.weight:
                form += f" (nn.Linear, our GEMV ≤ {gemv.MAX_ROWS} rows)"
            elif isinstance(module, nn.Linear) and param is module.weight:
                form += " (nn.Linear)"
            add(kind, form, param.numel(), param.numel() * param.element_size())
        bias = getattr(module, "bias", None)
        if isinstance(bias, Tensor) and id(bias) not in seen:
            seen.add(id(bias))
            add(kind, dtype_name(bias.dtype), bias.numel(), bias.numel() * bias.element_size())
    return [WeightGroup(k, f, p, b) for (k, f), (p, b) in sorted(groups.items())]


def _kind_of(name: str) -> str:
    if name.startswith("embed"):
        return "embedding"
    if name.startswith("lm_head"):
        return "lm_head"
    # the block's own name, or a name within it (not Gemma's attn_out_norm, mlp_out_norm)
    if ".attn." in name or name.endswith(".attn"):
        return "attention"
    if ".mlp." in name or name.endswith(".mlp"):
        return "mlp"
    return "norm"


def linear_kernel(module: nn.Module) -> str:
    """The kernel a linear layer runs on (the paths report's per-layer entries)."""
    if isinstance(module, (Int8Linear, Int4Linear)):
        return str(module.kernel)
    if isinstance(module, GemvLinear):
        return f"our GEMV (≤ {gemv.MAX_ROWS} rows), F.linear above"
    if isinstance(module, PackedLinear):
        return "oneDNN packed"
    return "F.linear (torch)"
