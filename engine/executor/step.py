"""Which executor runs each step, in one place.

A step runs on the first executor of :data:`engine.executor.table.EXECUTORS` that was settled
at load and applies to it: the static decode runner (CUDA graphs on a GPU) for a decode step
that fits a bucket, else the compiled step for a decode step, else the C step for a decode
step whose attention reads a CPU pool, else the model's own forward, one operator at a time
(eager). Prefill steps run eagerly. Per-layer hooks (layer timings, a benchmark's eager row)
hold every step eager (:attr:`StepExecutor.eager_reasons`), except the C step, which times
its own layers. An executor that fails mid-run is dropped for good, the step run again
eagerly; the fallback is recorded with its reason.

:class:`StepExecutor` belongs to the model (:func:`of`), as the compiled graph and the C step
are plans of its weights: engines that share a model (the A/B lab's, a resized pool) share
them. What ran is counted by step kind and executor, so the paths report
(:meth:`engine.core.engine.LLMEngine.paths`) says what each step kind really ran.
"""

from __future__ import annotations

import logging
import weakref
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from engine.model.attention import AttentionContext
from engine.model.transformer import Transformer

if TYPE_CHECKING:
    from engine.core.runner import Batch
    from engine.executor.c_step import DecodeStep
    from engine.executor.cuda_graphs import StaticDecode
    from engine.executor.inductor import CompiledDecode
    from engine.kv_cache.paged import PagedKVCache

log = logging.getLogger(__name__)

#: the reason in :attr:`StepExecutor.eager_reasons` while per-layer timings are on (a C
#: decode step, which times its own layers, runs anyway)
LAYER_TIMINGS = "layer timings"
#: the step kinds counted apart
DECODE, PREFILL = "decode", "prefill"


class StepExecutor:
    """The executors a load settled for one model, and which ran (the module's docstring)."""

    def __init__(self, model: Transformer) -> None:
        # weakly: the model holds its executor, and a cycle would keep a dropped model's
        # weights until the cyclic collector runs
        self._model = weakref.ref(model)
        #: the decode step compiled by TorchInductor (:mod:`engine.executor.inductor`)
        self.compiled: CompiledDecode | None = None
        #: the decode step's layers in one C call (:mod:`engine.executor.c_step`)
        self.c_step: DecodeStep | None = None
        #: why the load settled the C step as it did (a line of the load report)
        self.c_step_why = "decode steps eager (no C step planned)"
        #: why every step must run eagerly for now (hooks of layer timings, say)
        self.eager_reasons: set[str] = set()
        #: (step kind, executor) → steps run
        self.ran: Counter[tuple[str, str]] = Counter()
        #: each executor dropped mid-run, and why
        self.fallbacks: list[str] = []

    @property
    def model(self) -> Transformer:
        model = self._model()
        if model is None:
            raise RuntimeError("the executor's model is gone")
        return model

    # -- a step ------------------------------------------------------------------------------
    def run(
        self,
        batch: Batch,
        kv: PagedKVCache,
        static: StaticDecode | None,
        inputs: Callable[[], tuple[Tensor, Tensor, AttentionContext, Tensor]],
    ) -> Tensor:
        """One step of the engine: on the static runner where it holds ``kv``'s addresses and
        the step fits a bucket, else :meth:`forward` on ``inputs()``."""
        if static is not None and static.kv is kv and not self.eager_reasons and static.fits(batch):
            self.ran[DECODE, "cuda-graphs"] += 1
            return static.run(batch)
        return self.forward(*inputs())

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        ctx: AttentionContext,
        logits_indices: Tensor | None = None,
    ) -> Tensor:
        """Logits of the rows ``logits_indices`` (default: every token), on the first of the
        compiled step, the C step and the model's forward that applies. A decode step is
        embedded once, whichever runs it (the embedding stays out of the graph and the C call:
        a few rows, read by index); one that an executor fails mid-way is embedded again, as
        the C step changes its rows in place."""
        model = self.model
        decode = bool(getattr(ctx, "decode_only", False))
        if not decode or model.announce is not None or not (self.compiled or self.c_step):
            self.ran[DECODE if decode else PREFILL, "eager"] += 1
            return model(input_ids, positions, ctx, logits_indices)
        with torch.inference_mode():
            x = model.embed_ids(input_ids)
            logits, clean = self._compiled(x, positions, ctx, logits_indices)
            if logits is None and clean:
                logits, clean = self._c_step(x, positions, ctx, logits_indices)
            if logits is not None:
                return logits
            self.ran[DECODE, "eager"] += 1
            if not clean:
                x = model.embed_ids(input_ids)
            return model.body(x, positions, ctx, logits_indices)

    def _compiled(
        self, x: Tensor, positions: Tensor, ctx: AttentionContext, rows: Tensor | None
    ) -> tuple[Tensor | None, bool]:
        """The compiled step's logits, or None; and whether ``x`` is as it was."""
        compiled = self.compiled
        if compiled is None or self.eager_reasons:
            return None, True
        try:
            logits = compiled(x, positions, ctx, rows)
        except Exception as exc:  # the graph broke: this step and every later one run
            # eagerly (a cache write the graph made is made again, the same)
            self.drop("compiled", exc)
            return None, False
        self.ran[DECODE, "compiled"] += 1
        return logits, True

    def _c_step(
        self, x: Tensor, positions: Tensor, ctx: AttentionContext, rows: Tensor | None
    ) -> tuple[Tensor | None, bool]:
        """The C step's logits, or None where it does not apply (nothing ran); and whether
        ``x`` is as it was."""
        step = self.c_step
        if step is None:
            return None, True
        # the C step times its layers itself where layer timings are on
        if self.eager_reasons and not (step.times_layers and self.eager_reasons == {LAYER_TIMINGS}):
            return None, True
        tables = ctx.decode_tables()
        if tables is None:
            return None, True
        try:
            logits = step(x, positions, tables, rows)
        except Exception as exc:  # as for the graph: eager from here on (the layers ran on
            # x in place; the cache writes are made again, the same)
            self.drop("c-step", exc)
            return None, False
        if logits is not None:
            self.ran[DECODE, "c-step"] += 1
        return logits, True

    def drop(self, executor: str, exc: BaseException) -> None:
        """``executor`` failed: every later step runs without it; the reason is kept."""
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        label = {"compiled": "compiled decode step", "c-step": "C decode step"}[executor]
        log.warning("the %s failed, running eagerly: %s", label, first)
        self.fallbacks.append(f"{executor} dropped: {type(exc).__name__}: {first}")
        if executor == "compiled":
            self.compiled = None
        elif executor == "c-step":
            self.c_step = None

    def steps(self) -> dict[str, dict[str, int]]:
        """Steps run so far, by step kind, then executor."""
        out: dict[str, dict[str, int]] = {}
        for (kind, executor), n in sorted(self.ran.items()):
            out.setdefault(kind, {})[executor] = n
        return out


def of(model: Transformer) -> StepExecutor:
    """``model``'s executor, made at its first use (the module's docstring)."""
    found = model.executor
    if not isinstance(found, StepExecutor):
        found = model.executor = StepExecutor(model)
    return found
