"""Where a decode step's time goes: ``infersight bench --profile``.

A request is prefilled (``batch`` copies of it, each rotated so that none shares a cached
block), then ``steps`` decode steps run under ``torch.profiler`` (CPU activity). Each part of
the model is a scope (``record_function`` entered by forward hooks on its modules): the
attention block of each layer, with the attention proper (the cache write, the scores and their
softmax, the weighted sum: ``AttentionContext.attend``) as a scope inside it, the MLP block, the
norms, the embedding and the LM head. What runs outside the model (scheduling, the sampler,
detokenization, the engine's bookkeeping) is "engine". Every operator the profiler records falls
into the innermost scope around it and into one of these kinds of time:

* **matmul**: the self time of a matrix-product kernel (``aten::mm``, ``aten::addmm``,
  oneDNN's packed linear, the INT8/INT4 kernels, our C GEMV and low-bit kernels, …);
* **attention**: every operator inside the attention proper;
* **other ops**: the self time of every other operator (norms, RoPE, activations, copies,
  views, index building, sampling, …);
* **python/dispatch**: what is left of the step's wall time: Python in and around the model,
  and torch's dispatch between operators (an operator's self time is its own C++ work).

A decode step run in one C call (:mod:`engine.executor.c_step`) calls no module: its
layers and LM head are one event, the "C decode step" scope, split by the step's own clocks
into its products, its attention and the loops between them.

The profiler adds its own overhead to every operator, so the split is read as shares; the
report also gives the unprofiled time of a decode step, measured just before.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from engine.core.engine import LLMEngine
from engine.core.sampling import SamplingParams
from engine.kernels import native
from engine.model.attention import AttentionContext, DecodeTables

SCOPE = "infersight:"
SCOPES = ("attention block", "attention", "mlp", "norms", "embedding", "lm_head",
          "decode graph", "C decode step", "engine")  # fmt: skip
#: the C decode step's call (:mod:`engine.executor.c_step`): one event for every layer,
#: split into products, attention and the rest by the step's own clocks
C_STEP_EVENT = "infersight::decode_step"
#: the profiler events of the scopes (not ``infersight::…`` ops, which share the prefix)
SCOPE_EVENTS = {SCOPE + s: s for s in SCOPES}
#: the compiled decode step's attention op: the "attention" scope of a compiled step
ATTENTION_OPS = frozenset({"infersight::paged_decode_attention"})
#: the paged attention kernels (engine/kernels/paged_decode.py), attention wherever called
ATTENTION_KERNELS = frozenset(
    {"infersight::paged_attention_kernel", "infersight::paged_prefill_kernel"}
)
#: what torch.compile records around a compiled call: guards, the graph's wrapper
GRAPH_EVENTS = ("Torch-Compiled Region", "## Call CompiledFxGraph", "TorchDynamo Cache Lookup",
                "Pregraph bytecode")  # fmt: skip
KINDS = ("matmul", "attention", "other ops", "python/dispatch")
#: operators whose self time is a matrix-product kernel
#: (not ``aten::matmul`` or ``aten::linear``: composites whose self time is dispatch, around
#: one of these)
MATMUL_OPS = frozenset({
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
    "mkldnn::_linear_pointwise", "aten::_weight_int8pack_mm",
    "aten::_weight_int4pack_mm", "aten::_weight_int4pack_mm_for_cpu",
    # our C kernels, recorded by engine.kernels.native.call while profiling
    "infersight::gemv", "infersight::lowbit_int8", "infersight::lowbit_int4",
    "infersight::int4_dequantize",
})  # fmt: skip


@dataclass(slots=True)
class StepProfile:
    """Milliseconds per decode step, by scope and kind, and operator calls per step."""

    steps: int
    step_ms: float  # unprofiled, measured just before
    profiled_step_ms: float
    ms: dict[str, dict[str, float]] = field(default_factory=dict)  # scope → kind → ms/step
    calls: dict[str, dict[str, float]] = field(default_factory=dict)  # scope → kind → calls
    batch: int = 1
    #: ms per unprofiled step in products and attention by the C step's own clocks (None:
    #: the step ran eagerly)
    clocked_ms: float | None = None

    def kind_total(self, kind: str) -> float:
        return sum(row.get(kind, 0.0) for row in self.ms.values())

    @property
    def outside(self) -> float:
        """The share of the profiled step outside matrix products and attention."""
        inside = self.kind_total("matmul") + self.kind_total("attention")
        return 1.0 - inside / self.profiled_step_ms if self.profiled_step_ms else 0.0

    @property
    def outside_unprofiled(self) -> float | None:
        """The same share of the unprofiled step, by the C step's own clocks (the profiler
        adds its overhead to every operator, most of it outside the products)."""
        if self.clocked_ms is None or not self.step_ms:
            return None
        return 1.0 - self.clocked_ms / self.step_ms

    def as_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "step_ms": self.step_ms,
            "profiled_step_ms": self.profiled_step_ms,
            "ms_per_step": self.ms,
            "calls_per_step": self.calls,
            "batch": self.batch,
            "outside_matmul_and_attention": self.outside,
            "outside_matmul_and_attention_unprofiled": self.outside_unprofiled,
        }


class _ScopedContext(AttentionContext):
    """The step's attention context with its attention inside the "attention" scope; a fused
    RoPE + K/V write (:meth:`kv_target`) stays in the attention block's."""

    def __init__(self, inner: AttentionContext) -> None:
        self.inner = inner

    def attend(self, layer: int, q: torch.Tensor, kv: torch.Tensor) -> Any:
        with torch.profiler.record_function(SCOPE + "attention"):
            return self.inner.attend(layer, q, kv)

    @property
    def decode_only(self) -> bool:
        return bool(getattr(self.inner, "decode_only", False))

    def decode_tables(self) -> DecodeTables | None:  # the C decode step splits its own time
        return self.inner.decode_tables()

    def kv_target(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.inner.kv_target(layer)

    def attend_stored(self, layer: int, q: torch.Tensor) -> Any:
        with torch.profiler.record_function(SCOPE + "attention"):
            return self.inner.attend_stored(layer, q)


@contextmanager
def _scopes(engine: LLMEngine) -> Iterator[None]:
    """Forward hooks that open a scope around each part of the model, and the attention
    context wrapped; all removed on the way out."""
    model = engine.model
    handles = []

    def scoped(module: nn.Module, name: str) -> None:
        open_scopes: list[Any] = []

        def enter(_m: nn.Module, _args: Any) -> None:
            scope = torch.profiler.record_function(SCOPE + name)
            scope.__enter__()  # type: ignore[no-untyped-call]
            open_scopes.append(scope)

        def leave(_m: nn.Module, _args: Any, _out: Any) -> None:
            open_scopes.pop().__exit__(None, None, None)

        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave))

    scoped(model.embed, "embedding")
    for layer in model.layers:
        scoped(layer.get_submodule("attn"), "attention block")
        scoped(layer.get_submodule("mlp"), "mlp")
        scoped(layer.get_submodule("input_norm"), "norms")
        scoped(layer.get_submodule("post_attn_norm"), "norms")
    scoped(model.norm, "norms")
    scoped(model.lm_head, "lm_head")
    original = engine.kv.context
    engine.kv.context = lambda chunks: _ScopedContext(original(chunks))  # type: ignore[method-assign]
    try:
        yield
    finally:
        engine.kv.context = original  # type: ignore[method-assign]
        for handle in handles:
            handle.remove()


def _scope_of(event: Any) -> str:
    if event.name in ATTENTION_OPS:
        return "attention"
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in SCOPE_EVENTS:
            return SCOPE_EVENTS[parent.name]
        if parent.name in ATTENTION_OPS:
            return "attention"
        if parent.name.startswith(GRAPH_EVENTS):
            return "decode graph"
        parent = parent.cpu_parent
    return "engine"


def profile_decode(
    engine: LLMEngine, prompt: list[int], steps: int = 32, batch: int = 1
) -> StepProfile:
    """Profile ``steps`` decode steps of ``batch`` copies of one request (see the module
    docstring); every copy is prefilled before the first step is timed."""
    return profile_decode_variants(engine, prompt, {"": nullcontext}, steps, batch)[""][0]


def profile_decode_variants(
    engine: LLMEngine,
    prompt: list[int],
    variants: dict[str, Callable[[], AbstractContextManager[Any]]],
    steps: int = 32,
    batch: int = 1,
    repeats: int = 1,
) -> dict[str, list[StepProfile]]:
    """:func:`profile_decode` of each variant (a context a step runs in, e.g. one attention
    path or the other), on the same prefilled requests, the variants taking turns
    ``repeats`` times: a side-by-side measurement in one run."""
    params = SamplingParams(max_new_tokens=2 * steps * repeats * len(variants) + 2,
                            ignore_eos=True)  # fmt: skip
    # Each copy's prompt is rotated by its index, so that no two share a cached block: every
    # sequence reads K/V of its own, as ``batch`` different requests would.
    engine.clear_prefix_cache()
    rids = [engine.add_request(prompt[i:] + prompt[:i], params) for i in range(batch)]
    out: dict[str, list[StepProfile]] = {name: [] for name in variants}
    try:
        seqs = [engine.sequence(rid) for rid in rids]
        while not all(seq.output_ids for seq in seqs):  # the prefills, in chunks
            engine.step()
        for _ in range(repeats):
            for name, variant in variants.items():
                with variant():
                    out[name].append(_profile_steps(engine, steps, batch))
    finally:
        for rid in rids:
            engine.cancel(rid)
        engine.step()
    return out


def _profile_steps(engine: LLMEngine, steps: int, batch: int) -> StepProfile:
    from torch.profiler import ProfilerActivity, profile

    clocks = getattr(engine.runner.executor.c_step, "clocked", None)
    with clocks() if clocks is not None else nullcontext([]) as clocked:
        started = time.perf_counter()
        for _ in range(steps):  # unprofiled, for the real step time
            engine.step()
        step_ms = (time.perf_counter() - started) / steps * 1e3
    # A compiled step has no modules to hook: its parts are the graph's kernels, the
    # opaque matmuls and the attention op (kernels are recorded, see decode_graph).
    scopes = nullcontext() if engine.graph.compiled else _scopes(engine)
    c_step = engine.runner.executor.c_step
    spent = getattr(c_step, "spent", None)
    if spent is not None:
        spent[:] = [0.0, 0.0, 0.0]
    native.RECORDING = True  # our C kernels' calls as events (a ctypes call is none)
    try:
        with scopes, profile(activities=[ProfilerActivity.CPU]) as prof:
            started = time.perf_counter()
            for _ in range(steps):
                engine.step()
            wall_ms = (time.perf_counter() - started) * 1e3
    finally:
        native.RECORDING = False

    ms = {s: dict.fromkeys(KINDS, 0.0) for s in SCOPES}
    calls = {s: dict.fromkeys(KINDS[:3], 0.0) for s in SCOPES}
    accounted = inside = c_step_ms = 0.0
    c_calls = 0
    for event in prof.events():
        self_ms = event.self_cpu_time_total / 1e3
        if event.name == C_STEP_EVENT:
            c_step_ms += self_ms
            c_calls += 1
            accounted += self_ms
            continue
        if event.name in SCOPE_EVENTS or event.name.startswith(GRAPH_EVENTS):
            # a scope's own time is time in it outside its ops: Python and dispatch
            scope = SCOPE_EVENTS.get(event.name, "decode graph")
            ms[scope]["python/dispatch"] += self_ms / steps
            inside += self_ms
            continue
        scope = _scope_of(event)
        if scope == "attention" or event.name in ATTENTION_KERNELS:
            kind = "attention"
        elif event.name in MATMUL_OPS:
            kind = "matmul"
        else:
            kind = "other ops"
        ms[scope][kind] += self_ms / steps
        calls[scope][kind] += 1 / steps
        accounted += self_ms
    if c_calls and spent is not None:
        # the C step's clocks split its calls: products, attention, the loops between them,
        # and what is left of the calls' time (entering the call, its scratch space)
        products, attention, other = (1e3 * v / steps for v in spent)
        row = ms["C decode step"]
        row["matmul"] += products
        row["attention"] += attention
        row["other ops"] += other
        row["python/dispatch"] += max(0.0, c_step_ms / steps - products - attention - other)
        layers = engine.cfg.num_layers
        calls["C decode step"]["matmul"] += 4 * layers * c_calls / steps
        calls["C decode step"]["attention"] += layers * c_calls / steps
    # the rest of the wall time ran outside every scope and op: the engine's Python
    outside = max(0.0, wall_ms - accounted - inside)
    ms["engine"]["python/dispatch"] += outside / steps
    return StepProfile(steps, step_ms, wall_ms / steps, ms, calls, batch,
                       sum(clocked) if clocked else None)  # fmt: skip


def format_profile(p: StepProfile, title: str) -> str:
    """The split as a table: scopes down, kinds across, ms per decode step."""
    width = max(len(s) for s in SCOPES) + 2
    lines = [
        title,
        f"decode step: {p.step_ms:.2f} ms unprofiled, {p.profiled_step_ms:.2f} ms under the "
        f"profiler ({p.steps} steps, batch {p.batch}); ms per step:",
        f"{'':<{width}}" + "".join(f"{k:>16}" for k in KINDS) + f"{'total':>10}",
    ]
    for scope in SCOPES:
        row = p.ms[scope]
        if not any(row.values()):
            continue
        lines.append(
            f"{scope:<{width}}" + "".join(f"{row[k]:16.2f}" for k in KINDS)
            + f"{sum(row.values()):10.2f}"
        )  # fmt: skip
    total = p.profiled_step_ms
    lines.append(
        f"{'all':<{width}}"
        + "".join(f"{p.kind_total(k):9.2f} ({p.kind_total(k) / total:4.0%})" for k in KINDS)
        + f"{sum(p.kind_total(k) for k in KINDS):10.2f}"
    )
    line = f"outside matrix products and attention: {p.outside:.0%} of the profiled step"
    if p.outside_unprofiled is not None:
        line += f", {p.outside_unprofiled:.0%} of the unprofiled one by the C step's own clocks"
    lines.append(line)
    return "\n".join(lines)
