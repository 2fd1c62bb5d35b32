"""The memory plan: what loading a model folder will take, predicted before a single tensor is
read, and what will fit after it.

The plan (:func:`plan_memory`) adds up, from ``config.json`` alone:

* **weights** at the chosen precision, every packed copy, scale and zero point included
  (:func:`engine.quant.sizes.weight_bytes_by_kind`, the figures a load then reports);
* **KV bytes per token** (K and V, every layer, in the compute dtype) and the pool a load with
  this :class:`~engine.core.engine.EngineConfig` allocates, sized by the functions the engine
  itself sizes its pool with: on a GPU where the config gives no size,
  :func:`engine.core.pool_profile.size_pool` (``utilization × total − peak − runtime``, the
  peak here the weights, RoPE's tables and the workspace, where a load measures it in a
  warm-up forward);
  elsewhere :func:`kv_pool_blocks`;
* **workspace**: the activations of one step of ``max_tokens_per_step`` tokens, the logits of
  a full batch and their sampling (an estimate, stated as one), and the attention
  temporaries that grow with the context a step reads, at the pool's reach (the attention
  backend's ``workspace_bytes_per_token``, :mod:`engine.attention`, the load's own analytic
  term: 0 where our Triton kernels attend, as they read the pool in place);
* **rotary tables** on a GPU: RoPE's fp32 cos and sin of every position
  (:func:`rope_bytes`), on the device from the load's start to its end;
* **runtime**: on CUDA what the caching allocator does not hold: measured on this machine's
  GPU (the context, library workspaces, other processes, and the tensors this process keeps
  beside the model being planned), else the context and library workspaces
  (:data:`CUDA_RUNTIME_BYTES`, an estimate);
* **load peak**: the weights, plus what the bounded load
  (:func:`engine.loader.weights.load_transformer`) holds at most beside them: the largest tensor
  being assembled in fp32, its copy read from the checkpoint, INT4's packing temporaries (of
  torch's kernels or of ours, whichever the load runs), and a few chunks of quantization
  temporaries (:func:`load_overhead_bytes`).

Whether our Triton kernels run (the GEMMs, the attention) is decided for the plan where the
load decides it, :func:`engine.kernels.triton_support.planned`: on a CUDA GPU by default,
``INFERSIGHT_KERNELS`` respected, for a GPU that need not be here.

From the memory the device has (on a CPU its free memory now, on a GPU its memory, of which
the running engine takes ``gpu_memory_utilization``; or ``memory=`` for another machine), it
gives the longest context one sequence can
reach and the largest batch at a given context, and says why a load cannot fit with a
precision or context that would. On a CUDA GPU the precisions it
plans and suggests are those its compute capability runs natively (:mod:`engine.hardware.gpu`):
the GPU's own, or ``capability=`` for another machine's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.attention import planned as planned_attention
from engine.attention.triton import TritonBackend
from engine.core.config import (
    kv_format,
    kv_pool_blocks,
    layer_block_bytes,
    local_blocks,
    pool_bytes,
)
from engine.core.pool_profile import PoolSizing, size_pool
from engine.errors import InvalidRequestError, OutOfMemoryError
from engine.hardware import gpu
from engine.hardware import memory as device_memory
from engine.hardware.memory import free_memory
from engine.kernels import triton_support
from engine.kv_cache import dtypes as kv_dtypes
from engine.loader import expert_placement
from engine.loader.memory_terms import (
    load_overhead_bytes,
    rope_bytes,
    workspace_bytes,
)
from engine.model.config import ModelConfig
from engine.quant.sizes import Backends, weight_bytes_by_kind
from engine.quant.spec import PrecisionSpec, dtype_name, parse_precision_spec

if TYPE_CHECKING:
    from engine.core.config import EngineConfig

#: Device memory a CUDA process uses that torch's allocator does not count: the context,
#: cuBLAS/cuDNN handles and workspaces (typically 300–600 MiB; `make gpu-check` measures it).
CUDA_RUNTIME_BYTES = 512 * 2**20
#: The shortest context worth loading a model for.
MIN_CONTEXT = 256
#: Precisions a refused plan may suggest, best quality first (the compute dtype comes first).
SUGGESTIONS = ("int8", "int8+head", "int4-g32", "int4-g32+head", "int4-g128+head")
GiB = 2**30
MiB = 2**20


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """What loading ``model`` at ``precision`` on ``device`` takes, in bytes, and what fits."""

    model: str
    device: str
    precision: str
    weights: dict[str, int]  # by kind: embedding, attention, mlp, norm, lm_head
    kv_bytes_per_token: int  # a token of context (the full layers' where local ones have a pool)
    kv_pool_bytes: int  # the pool a load with this engine config allocates
    workspace_bytes: int
    runtime_bytes: int
    load_overhead_bytes: int  # held at most beside the weights while loading
    budget_bytes: int
    budget_source: str  # where the budget comes from: free memory now, or --memory
    max_position: int  # the model's own context limit
    suggestion: str = ""  # a precision or context that fits, when this does not
    notes: tuple[str, ...] = field(default_factory=tuple)
    #: the CUDA compute capability planned for; None: a CPU, or a GPU not known
    capability: tuple[int, int] | None = None
    #: the share of the budget the engine takes once running: a GPU's
    #: ``gpu_memory_utilization`` (the rest is margin), 1 on a CPU
    utilization: float = 1.0
    #: a GPU's default pool: the figures it is sized from, as a load sizes it (None: the
    #: config gives its size, or a CPU's share of its RAM)
    pool_sizing: PoolSizing | None = None
    #: RoPE's tables on a GPU (:func:`rope_bytes`), held from the load's start (0 on a CPU,
    #: whose plans leave them out)
    rope_bytes: int = 0
    #: whether the plan is for our Triton kernels' attention (no K/V gathered) and quantized
    #: GEMMs (INT4 packed a chunk of rows at a time), or the torch paths'
    #: (:func:`engine.kernels.triton_support.planned`)
    triton_attention: bool = False
    triton_gemms: bool = False
    #: the layers whose experts stay in host memory (``--cpu-experts``), and their bytes
    cpu_expert_layers: tuple[int, ...] = ()
    host_expert_bytes: int = 0
    #: of the pool, the bytes of the local layers' own (their windows: Gemma's sliding layers)
    kv_local_bytes: int = 0
    #: what the KV cache holds (:mod:`engine.kv_cache.dtypes`), and the longest context at
    #: each KV dtype the device takes, side by side (``(name, tokens)``)
    kv_dtype: str = ""
    kv_contexts: tuple[tuple[str, int], ...] = ()

    @property
    def weight_bytes(self) -> int:
        return sum(self.weights.values())

    @property
    def fixed_bytes(self) -> int:
        """Everything but the KV pool once loaded: weights, RoPE's tables, runtime, one
        step's workspace."""
        return self.weight_bytes + self.rope_bytes + self.runtime_bytes + self.workspace_bytes

    @property
    def steady_bytes(self) -> int:
        return self.fixed_bytes + self.kv_pool_bytes

    @property
    def load_bytes(self) -> int:
        """The most the load holds (the pool comes after it)."""
        return self.weight_bytes + self.rope_bytes + self.runtime_bytes + self.load_overhead_bytes

    @property
    def peak_bytes(self) -> int:
        """The most the device holds at once: during the load or once running."""
        return max(self.load_bytes, self.steady_bytes)

    @property
    def usable_bytes(self) -> int:
        """What the engine may take once running: ``utilization`` of the budget."""
        return int(self.budget_bytes * self.utilization)

    @property
    def kv_room_bytes(self) -> int:
        """What the usable budget leaves for KV once the weights, runtime and workspace are
        in."""
        return max(0, self.usable_bytes - self.fixed_bytes)

    @property
    def max_context(self) -> int:
        """The longest context one sequence can reach here (capped at the model's own)."""
        room = self.kv_room_bytes - self.kv_local_bytes
        return min(self.max_position, max(0, room) // self.kv_bytes_per_token)

    def max_batch(self, context: int) -> int:
        """Sequences of ``context`` tokens whose KV fits beside everything else."""
        room = self.kv_room_bytes - self.kv_local_bytes
        return max(0, room) // (max(1, context) * self.kv_bytes_per_token)

    @property
    def pool_tokens(self) -> int:
        return (self.kv_pool_bytes - self.kv_local_bytes) // self.kv_bytes_per_token

    @property
    def fits(self) -> bool:
        return (
            self._within()
            and self.max_context >= min(MIN_CONTEXT, self.max_position)
            and self.pool_tokens > 1  # a pool of at least one block beside its pad slot
        )

    def _within(self) -> bool:
        """The load within the budget, and the running engine within its usable share."""
        return self.load_bytes <= self.budget_bytes and self.steady_bytes <= self.usable_bytes

    def refusal(self) -> str | None:
        """Why a load would not fit, with the numbers and what would (None when it fits)."""
        if self.fits:
            return None
        share = f", {self.utilization:.0%} of it once running" if self.utilization < 1 else ""
        if self._within():  # the weights fit; the context does not
            why = (
                f"{self.model} at {self.precision} leaves room for {_tokens(self.max_context)} "
                f"of context on {self.device} ({_gib(self.kv_room_bytes)} for the KV cache "
                f"beside {_gib(self.weight_bytes)} of weights in {self.budget_source}, "
                f"{_gib(self.budget_bytes)}{share})"
            )
            return f"{why}; {self.suggestion}" if self.suggestion else why
        parts = [
            f"{self.model} at {self.precision} does not fit on {self.device}: it needs "
            f"{_gib(self.peak_bytes)} at its peak ({_gib(self.weight_bytes)} of weights, "
            f"{_gib(self.load_bytes)} while loading, {_gib(self.steady_bytes)} running"
            + (f" with a {_gib(self.kv_pool_bytes)} KV pool" if self.kv_pool_bytes else "")
            + f"), and {self.budget_source} is {_gib(self.budget_bytes)}{share}"
        ]
        if self.suggestion:
            parts.append(self.suggestion)
        return "; ".join(parts)

    def one_line(self) -> str:
        """The plan as one line (the model picker, the status bar)."""
        verdict = "fits" if self.fits else "does not fit"
        line = (
            f"{self.precision}: {_gib(self.weight_bytes)} weights, peak "
            f"{_gib(self.peak_bytes)} of {_gib(self.budget_bytes)}; {verdict}"
        )
        if self.max_context > 0:
            others = [f"{n} KV {_tokens(t)}" for n, t in self.kv_contexts if n != self.kv_dtype]
            line += f", context up to {_tokens(self.max_context)}"
            line += f" ({', '.join(others)})" if others else ""
        if self.cpu_expert_layers:
            line += (
                f"; experts of {len(self.cpu_expert_layers)} layers on the CPU "
                f"({_gib(self.host_expert_bytes)})"
            )
        return line

    def lines(self) -> list[str]:
        """The plan as a table (``infersight plan``, the app's plan box)."""
        rows = [f"Memory plan: {self.model} at {self.precision} on {self.where}"]
        for kind, nbytes in self.weights.items():
            if nbytes:
                rows.append(f"  weights  {kind:<10} {_mib(nbytes):>12}")
        rows += [
            f"  weights  total      {_mib(self.weight_bytes):>12}",
            *(
                [
                    f"  experts on the CPU  {_mib(self.host_expert_bytes):>12}  (the experts of "
                    f"{len(self.cpu_expert_layers)} layers, in host memory: --cpu-experts)"
                ]
                if self.cpu_expert_layers
                else []
            ),
            *([f"  rotary tables       {_mib(self.rope_bytes):>12}"] if self.rope_bytes else []),
            f"  KV cache per token  {self.kv_bytes_per_token / 1024:>9.1f} KiB "
            f"(pool {_mib(self.kv_pool_bytes)} = {_tokens(self.pool_tokens)})",
            *(
                [
                    f"  local layers' KV    {_mib(self.kv_local_bytes):>12}  (their windows "
                    "for the running set: a pool of their own, in the pool's figure)"
                ]
                if self.kv_local_bytes
                else []
            ),
            f"  workspace (est.)    {_mib(self.workspace_bytes):>12}",
            f"  runtime             {_mib(self.runtime_bytes):>12}",
            f"  load overhead       {_mib(self.load_overhead_bytes):>12}  (bound while loading)",
            f"  peak                {_mib(self.peak_bytes):>12}",
            f"  budget              {_mib(self.budget_bytes):>12}  ({self.budget_source})",
            f"  longest context     {_tokens(self.max_context):>12}"
            f"  (model's own: {_tokens(self.max_position)}; KV cache {self.kv_dtype})",
        ]
        if self.utilization < 1:  # a GPU: the running engine leaves a margin
            rows.insert(
                len(rows) - 1,
                f"  usable running      {_mib(self.usable_bytes):>12}  "
                f"({self.utilization:.0%} of it: --gpu-memory-utilization)",
            )
        if len(self.kv_contexts) > 1:
            shown = " · ".join(f"{name} {_tokens(n)}" for name, n in self.kv_contexts)
            rows.append(f"  context by KV dtype {shown}  (--kv-dtype)")
        batches = [c for c in (2048, 8192, 32768) if c <= self.max_position]
        if batches:
            shown = ", ".join(f"{self.max_batch(c)} × {_tokens(c)}" for c in batches)
            rows.append(f"  largest batch       {shown}")
        if self.pool_sizing is not None:
            rows.append(f"  KV pool sizing      {self.pool_sizing.summary()}")
        rows.append(f"  verdict             {'fits' if self.fits else 'does not fit'}")
        if not self.fits and self.suggestion:
            rows.append(f"  suggestion          {self.suggestion}")
        rows += [f"  note: {n}" for n in self.notes]
        return rows

    @property
    def where(self) -> str:
        """The device, with the compute capability planned for: ``cuda (compute capability
        7.5)``."""
        if self.capability is None:
            return self.device
        return f"{self.device} (compute capability {gpu.capability_text(self.capability)})"

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(
            weight_bytes=self.weight_bytes,
            steady_bytes=self.steady_bytes,
            peak_bytes=self.peak_bytes,
            usable_bytes=self.usable_bytes,
            kv_room_bytes=self.kv_room_bytes,
            max_context=self.max_context,
            max_batch={str(c): self.max_batch(c) for c in (2048, 8192, 32768)},
            fits=self.fits,
        )
        return out


def plan_memory(
    cfg: ModelConfig,
    precision: str,
    device: str = "cpu",
    *,
    memory: int | None = None,
    config: EngineConfig | None = None,
    name: str = "model",
    reclaimable: int = 0,
    packed: bool | None = None,
    capability: gpu.Capability | None = None,
) -> MemoryPlan:
    """The memory plan of ``cfg`` at ``precision`` on ``device``.

    ``memory``: the bytes to plan for (another machine's, say 12 GiB); by default what
    ``device`` has free now plus ``reclaimable`` (what unloading the current model would give
    back); a GPU measured here is planned with its whole memory, what is not torch's and the
    tensors that stay counted as runtime, and the running engine takes
    ``config.gpu_memory_utilization`` of it. ``config``: the engine config the load would use
    (its KV pool); by default the engine's own default pool. ``packed``: whether a CPU lays a
    tied float head out again (:func:`engine.quant.sizes.estimate_weight_bytes`); ``None``
    takes this machine's measured verdict (never timing now), and planning for another device
    assumes it does not.
    ``capability``: the CUDA compute capability to plan for (another machine's GPU, ``(7, 5)``
    for an RTX 20xx); by default the GPU's own where it is in this machine. The plan is refused
    for a precision that GPU cannot run natively, and never suggests one.
    """
    from engine.core.config import EngineConfig

    torch_device = torch.device(device)
    if capability is not None and torch_device.type != "cuda":
        raise InvalidRequestError(
            f"a compute capability describes a CUDA GPU, and this plan is for {device}; plan "
            "for a GPU with --device cuda, or leave --capability out"
        )
    given = capability
    # A plan for memory of another machine does not ask this one's device (which may be
    # absent: a plan for a 12 GiB GPU made on a laptop) which kernels it runs; a GPU that is
    # here is asked its capability, unless one is given.
    here = memory is None or (given is None and gpu.present(torch_device))
    probe = torch_device if here else torch.device("meta")
    if given is None and here:
        capability = gpu.capability(torch_device)
    spec = parse_precision_spec(precision, probe, capability=given)
    spec.check_layers(cfg.num_layers)
    config = config or EngineConfig()
    total, runtime = 0, 0
    if torch_device.type == "cuda":
        total, runtime, source = _gpu_memory(torch_device, memory, reclaimable)
        budget = total
    elif memory is not None:
        budget, source = int(memory), "the memory planned for"
    else:
        budget = int(free_memory(torch_device)) + reclaimable
        source = f"the memory free on {device}" + (
            " once the current model is unloaded" if reclaimable else ""
        )
    if torch_device.type != "cpu" or memory is not None:
        packed = False if packed is None else packed
    elif packed is None:  # what this machine measured, never a timing now
        from engine.kernels.packed_linear import packs

        packed = packs(spec.compute, cfg.vocab_size, cfg.hidden_size, measure=False)
    counted = 0 if config.cpu_experts == expert_placement.AUTO else int(config.cpu_experts)
    target = _Target(
        cfg, torch_device, config, budget, source, runtime, packed, name, capability, probe,
        given, total, counted,
    )  # fmt: skip
    plan = target.plan(spec)
    if config.cpu_experts == expert_placement.AUTO and torch_device.type != "cpu":
        plan = expert_placement.fewest(lambda n: replace(target, cpu_experts=n).plan(spec), cfg)
    if plan.fits:
        return plan
    return replace(plan, suggestion=target.suggestion(plan))


@dataclass(frozen=True, slots=True)
class _Target:
    """What a plan is made for, whatever the precision: the model, the device and its
    budget, the engine config."""

    cfg: ModelConfig
    device: torch.device
    config: EngineConfig
    budget: int
    source: str
    runtime: int
    packed: bool | None
    name: str
    capability: gpu.Capability | None  # the GPU's, or the one given; None: not known
    probe: torch.device  # the device specs are parsed for
    given: gpu.Capability | None  # the capability planned for instead of the probe's
    total: int  # a GPU's memory (0: a CPU)
    cpu_experts: int = 0  # layers whose experts stay on the CPU

    def parse(self, text: str) -> PrecisionSpec:
        return parse_precision_spec(text, self.probe, capability=self.given)

    def plan(self, spec: PrecisionSpec, *, alternatives: bool = True) -> MemoryPlan:
        """The plan at ``spec``; with ``alternatives``, the context each other KV dtype this
        device takes would give, side by side (each planned in full: the attention a load
        would run for it, and its workspace)."""
        cfg, config = self.cfg, self.config
        fmt = kv_format(config, spec.compute)
        if why := kv_dtypes.refusal(fmt, cfg.head_dim, self.device.type, self.capability):
            raise InvalidRequestError(why)
        gemms = triton_support.planned(self.device.type, self.capability)
        cuda = self.device.type == "cuda"
        backends = Backends(triton=gemms, cuda=cuda and not gemms)
        weights = weight_bytes_by_kind(cfg, spec, packed=self.packed, backends=backends)
        experts = expert_placement.place(cfg, spec, self.cpu_experts, backends, self.device)
        weights["mlp"] -= experts.device_bytes
        per_token, local_per_token = layer_block_bytes(cfg, 1, fmt)
        step = workspace_bytes(cfg, spec.compute, config)
        cuda = self.device.type == "cuda"
        rope = rope_bytes(cfg) if cuda else 0
        # our Triton kernels, where the load would run them: attention, quantized GEMMs
        attention = triton_support.planned(
            self.device.type, self.capability, head_dim=cfg.head_dim, dtype=spec.compute
        ) and not TritonBackend.pool_refusal(fmt)
        backend = planned_attention(self.device, attention, cfg, fmt)
        given = config.num_blocks is not None or config.kv_memory is not None
        sizing = None
        if cuda and not given:  # as a load sizes it, its peak estimated
            sizing = size_pool(
                cfg, config, spec.compute, total=self.total,
                peak=sum(weights.values()) + rope + step, non_torch=self.runtime,
                measured=False, attention=backend,
            )  # fmt: skip
            blocks = sizing.blocks
        else:
            room = max(0, self.budget - sum(weights.values()) - rope - self.runtime - step)
            blocks = kv_pool_blocks(cfg, config, spec.compute, self.device, float(room))
        blocks = max(0, blocks)
        # the workspace of the attention the load would run (ours and the CPU's paged
        # kernel read the pool in place; the torch path gathers)
        gather = backend.workspace_bytes_per_token(
            cfg, spec.compute, config.limits.max_batch_size, config.limits.max_tokens_per_step
        )
        reach = min(cfg.max_position_embeddings, blocks * config.block_size)
        window = cfg.sliding_window
        notes: tuple[str, ...] = ()
        if window:
            notes += (f"sliding window of {window} tokens: KV beyond it is released",)
        if experts.layers:
            notes += (
                f"the experts of {len(experts.layers)} layers take {experts.host_bytes / GiB:.2f} "
                "GiB of host memory, which the plan does not check against the machine's",
            )
        if self.device.type == "cuda" and self.capability is None:
            notes += (
                "compute capability unknown: planned for 8.0 or newer (bf16, INT4); for an "
                "older GPU pass --capability (7.5 for an RTX 20xx)",
            )
        contexts: tuple[tuple[str, int], ...] = ()
        if alternatives:
            contexts = tuple(
                (kv_format(c, spec.compute).name, replace(self, config=c).plan(spec,
                 alternatives=False).max_context)
                for c in (replace(config, kv_dtype=n) for n in ("auto", "int8", "fp8"))
                if not kv_dtypes.refusal(kv_format(c, spec.compute), cfg.head_dim,
                                         self.device.type, self.capability)
            )  # fmt: skip
        return MemoryPlan(
            model=self.name,
            device=str(self.device),
            precision=spec.text,
            kv_dtype=fmt.name,
            kv_contexts=contexts,
            weights=weights,
            kv_bytes_per_token=per_token,
            # + the zero pad slots
            kv_pool_bytes=pool_bytes(cfg, config, spec.compute, blocks)
            + per_token
            + local_per_token,
            # the local layers' blocks and their zero pad slot
            kv_local_bytes=local_per_token
            * (config.block_size * (local_blocks(cfg, config, blocks) or 0) + 1),
            workspace_bytes=step + gather * reach,
            runtime_bytes=self.runtime,
            load_overhead_bytes=load_overhead_bytes(cfg, spec, backends),
            budget_bytes=self.budget,
            budget_source=self.source,
            max_position=cfg.max_position_embeddings,
            notes=notes,
            capability=self.capability,
            utilization=config.gpu_memory_utilization if self.device.type == "cuda" else 1.0,
            pool_sizing=sizing,
            rope_bytes=rope,
            cpu_expert_layers=experts.layers,
            host_expert_bytes=experts.host_bytes,
            triton_attention=attention,
            triton_gemms=gemms,
        )

    def suggestion(self, plan: MemoryPlan) -> str:
        """The best-quality smaller precision that fits with the same engine config, else
        what else would help; only precisions the device runs natively."""
        for text in (dtype_name(self.parse(plan.precision).compute), *SUGGESTIONS):
            try:
                other = self.plan(self.parse(text))
            except InvalidRequestError:  # not available on this device
                continue
            if other.weight_bytes < plan.weight_bytes and other.fits:
                return (
                    f"try {other.precision}: it fits ({_gib(other.peak_bytes)} at its peak, "
                    f"context up to {_tokens(other.max_context)})"
                )
        if plan.load_bytes <= plan.budget_bytes and plan.kv_pool_bytes > plan.kv_room_bytes:
            return f"a KV pool under {_gib(plan.kv_room_bytes)} would fit"
        return f"no precision fits in {self.source}; free memory or use a smaller model"


def _gpu_memory(device: torch.device, memory: int | None, reclaimable: int) -> tuple[int, int, str]:
    """A GPU's total memory, its runtime (what a load's pool is sized beside, as
    :mod:`engine.core.pool_profile` measures it: not torch's, plus the tensors this process
    keeps beside the model planned, ``reclaimable`` being let go first), and what they are."""
    if memory is not None:
        return int(memory), CUDA_RUNTIME_BYTES, "the memory planned for"
    reader = device_memory.device_memory(device)
    assert reader is not None  # a CUDA device has one
    figures = reader.read()
    kept = max(0, figures.allocated - reclaimable)
    what = f"the memory of {device}" + (
        " once the current model is unloaded" if reclaimable else ""
    )
    return figures.total, figures.non_torch + kept, what


def plan_for_folder(
    folder: Path,
    precision: str,
    device: str = "cpu",
    **kwargs: Any,
) -> MemoryPlan:
    """:func:`plan_memory` for a model folder (its ``config.json`` only)."""
    cfg = ModelConfig.from_file(Path(folder) / "config.json")
    kwargs.setdefault("name", Path(folder).name)
    return plan_memory(cfg, precision, device, **kwargs)


def check_plan(plan: MemoryPlan) -> None:
    """Refuse a load that cannot fit, before it starts (it would run out halfway)."""
    why = plan.refusal()
    if why is not None:
        raise OutOfMemoryError(why)


# -- formatting ----------------------------------------------------------------------------------


def _gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f} GiB" if abs(nbytes) >= GiB / 2 else f"{nbytes / MiB:.0f} MiB"


def _mib(nbytes: float) -> str:
    return f"{nbytes / MiB:,.1f} MiB"


def _tokens(n: int) -> str:
    return f"{n / 1024:.0f}k tokens" if n >= 10240 else f"{n} tokens"


def parse_bytes(text: str) -> int:
    """``12GiB``, ``12 GB``, ``800MiB``, ``1.5T`` or a plain number of bytes (binary units:
    a GB here is a GiB, as memory is sold)."""
    import re

    match = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgt])(?:i?b)?|b)?", text.strip().lower())
    value = float(match.group(1)) * 1024 ** " kmgt".index(match.group(2) or " ") if match else 0.0
    if value < 1:
        raise InvalidRequestError(
            f"memory {text!r} is not a size; write it like 12GiB, 800MiB or 1.5T"
        )
    return int(value)
