"""What an engine ran, and why: the paths report (:meth:`engine.core.engine.LLMEngine.paths`).

Per step kind (prefill, decode): the attention backend and its kernel, the executors the load
settled (in their one precedence order, :mod:`engine.executor.table`, each with the reason it
was or was not settled), and how many steps each executor really ran; per layer: the kernel
of each product (a mixture of experts: the kernel its routed experts run in, or why they run one
module at a time). Every fallback is listed with its reason: an executor dropped mid-run, a
kernel that failed its load-time check. Tests and ``make gpu-check`` assert on it, so a
silent fallback fails them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from engine.executor import table
from engine.kernels import paged_decode
from engine.model import lanes
from engine.model.moe import MoE
from engine.model.transformer import DecoderLayer
from engine.quant.inventory import linear_kernel

if TYPE_CHECKING:
    from engine.core.engine import LLMEngine

#: the attention's kernel by backend and step kind (the CPU's prefill: as measured)
ATTENTION_KERNELS = {
    ("triton", "decode"): "triton paged decode",
    ("triton", "prefill"): "triton paged prefill",
    ("c", "decode"): "C paged decode",
    ("torch", "decode"): "gather + SDPA",
    ("torch", "prefill"): "SDPA",
}
PRODUCTS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def attention_kernel(engine: LLMEngine, kind: str) -> str:
    """The kernel ``engine``'s steps of ``kind`` attend with: by its pool's backend; a CPU
    prefill on the paged C kernel or SDPA, as measured (:func:`paged_decode.prefill_faster`);
    soft-capped scores (Gemma 2) on the C kernels, which cap, else the textbook computation."""
    backend, cfg = engine.kv.backend, engine.cfg
    capped = cfg.attn_softcap is not None
    if (backend, kind) == ("c", "prefill"):
        faster = capped or paged_decode.prefill_faster(
            engine.dtype, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        )
        return "C paged prefill" if faster else "SDPA"
    if capped and backend == "torch":
        return "gather + textbook attention (soft cap)"
    return ATTENTION_KERNELS[backend, kind]


def settled(engine: LLMEngine) -> list[dict[str, Any]]:
    """Each executor in precedence order: whether the load settled it, and why (refused by
    the table, or the load's own line)."""
    executor = engine.runner.executor
    backend = engine.kv.backend
    parallel = engine.model.announce is not None
    lines = {
        "cuda-graphs": (engine.runner.static is not None, engine.graphs.why),
        "compiled": (executor.compiled is not None, engine.graph.why),
        "c-step": (executor.c_step is not None, executor.c_step_why),
        "eager": (True, "the model's forward, one operator at a time"),
    }
    rows = []
    for name in table.EXECUTORS:
        on, why = lines[name]
        refused = table.refusal(
            name, backend, tensor_parallel=parallel, experts=engine.model.cfg.num_experts > 0
        )
        rows.append({"executor": name, "settled": on and not refused, "why": refused or why})
    return rows


def paths(engine: LLMEngine) -> dict[str, Any]:
    """The report (the module's docstring), as plain data."""
    executor = engine.runner.executor
    model = engine.model
    layers = []
    for i, module in enumerate(model.layers):
        layer = cast(DecoderLayer, module)
        # a mixture of experts: its first expert's products (every expert's run alike)
        linears = (layer.attn.qkv_proj, layer.attn.o_proj, *layer.mlp.linears()[:2])
        entry: dict[str, Any] = {"layer": i}
        entry.update((name, linear_kernel(m)) for name, m in zip(PRODUCTS, linears, strict=True))
        entry["fused_layer"] = layer.fused is not None
        if isinstance(layer.mlp, MoE):  # the routed experts' own kernel, or why none
            kernel = layer.mlp.kernel
            entry["experts"] = kernel.name if kernel is not None else layer.mlp.kernel_refusal
            if layer.mlp.crossing is not None:
                entry["experts"] += " (in host memory)"
        layers.append(entry)
    return {
        "attention": {
            "backend": engine.kv.backend,
            "decode": attention_kernel(engine, "decode"),
            "prefill": attention_kernel(engine, "prefill"),
        },
        "norms_and_rope": model.ops.name,
        "executors": settled(engine),
        "steps": executor.steps(),
        "layers": layers,
        "lm_head": linear_kernel(model.lm_head),
        "fallbacks": [*engine.kernel_failures, *executor.fallbacks],
        **({"two_lane_decode_steps": model.laned_steps} if lanes.applies(model) else {}),
    }
