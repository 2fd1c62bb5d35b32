"""The model call of a step: the scheduled chunks flattened into one batch (token ids,
positions, the KV slots each chunk writes, the rows whose logits are sampled), the forward
over it, and the compiled decode step's warm-up. Also a single sequence's forward through a
private contiguous cache, for scripts and evaluations."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.core.scheduler import ScheduledChunk
from engine.executor import inductor
from engine.executor import step as step_executor
from engine.formats.kv import KVFormat
from engine.hardware.transfer import upload
from engine.kv_cache.contiguous import ContiguousKVCache
from engine.kv_cache.paged import PagedKVCache, SeqChunk
from engine.kv_cache.window import CacheWindow
from engine.model.attention import AttentionContext
from engine.model.config import ModelConfig
from engine.model.transformer import Transformer

if TYPE_CHECKING:
    from engine.executor.cuda_graphs import StaticDecode
    from engine.speculative.rule import Draft

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Batch:
    """One forward's input: the chunks in the order their tokens are laid out (decode chunks
    first; a chunk verifying drafts carries them after its own token), and for each chunk that
    samples, its first row of logits."""

    order: list[ScheduledChunk]
    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    chunks: list[SeqChunk] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    samplers: list[tuple[ScheduledChunk, int]] = field(default_factory=list)
    #: prompt rows projected for their log-probabilities: (chunk, its first row of logits,
    #: how many), row ``j`` at position ``chunk.start + j`` scoring the prompt token after it
    prompt_rows: list[tuple[ScheduledChunk, int, int]] = field(default_factory=list)


class ModelRunner:
    """Runs the model over a step's batch. Holds the model, never the KV pool (the engine may
    swap its pool for a new one)."""

    def __init__(
        self, model: Transformer, cfg: ModelConfig, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.model = model
        #: how each step runs (:mod:`engine.executor.step`), shared by the engines on ``model``
        self.executor = step_executor.of(model)
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        #: decode steps over static buffers (CUDA graphs on a GPU), where the load settled
        #: them (:mod:`engine.executor.cuda_graphs`)
        self.static: StaticDecode | None = None

    def batch(
        self,
        scheduled: Sequence[ScheduledChunk],
        drafts: dict[str, Draft],
        window: CacheWindow | None,
    ) -> Batch:
        """The scheduled chunks flattened; a chunk verifying drafts goes after the decode
        chunks and samples a row per draft plus one."""
        order = sorted(scheduled, key=lambda c: c.length != 1 or c.seq.request_id in drafts)
        b = Batch(order)
        for c in order:
            rid = c.seq.request_id
            new = c.seq.tokens(c.start, c.start + c.length)
            if rid in drafts:
                new += drafts[rid].tokens
            b.ids += new
            start = c.start + (self.model.rope.long_offset if c.seq.rope_long else 0)
            b.positions += range(start, start + len(new))  # RoPE's: LongRoPE's long rows
            b.chunks.append(SeqChunk(rid, c.start, len(new), window))
            if c.seq.prompt_logprobs is not None:  # each prompt row but the last, until given
                scored = min(c.start + c.length, len(c.seq.prompt_ids) - 1) - c.start
                if scored > 0:
                    first = len(b.ids) - len(new)
                    b.prompt_rows.append((c, len(b.rows), scored))
                    b.rows += range(first, first + scored)
            if c.samples:
                b.samplers.append((c, len(b.rows)))
                drafted = len(drafts[rid].tokens) if rid in drafts else 0
                b.rows += range(len(b.ids) - 1 - drafted, len(b.ids))
        return b

    def forward(self, batch: Batch, kv: PagedKVCache) -> torch.Tensor:
        """Logits of the batch's sampled rows (each chunk's K/V written into ``kv`` on the
        way)."""

        def inputs() -> tuple[torch.Tensor, torch.Tensor, AttentionContext, torch.Tensor]:
            ids, positions, rows = self.inputs(batch.ids, batch.positions, batch.rows)
            return ids, positions, kv.context(batch.chunks), rows

        return self.executor.run(batch, kv, self.static, inputs)

    def inputs(
        self, ids: list[int], positions: list[int], rows: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token ids, positions and the sampled rows on the device, in one queued copy
        (:mod:`engine.hardware.transfer`): three views of one tensor, as the compiled decode
        step was warmed up with."""
        n = len(ids)
        packed = upload(ids + positions + rows, self.device)
        return packed[:n], packed[n : 2 * n], packed[2 * n :]

    # -- the compiled decode step -------------------------------------------------------------
    def settle_decode_graph(self, mode: str | None, kv: PagedKVCache) -> inductor.GraphChoice:
        """Compile the decode step where :func:`inductor.choose` says so, and compile it
        now: a few warm-up steps on scratch sequences, so that no reply waits for it."""
        choice = inductor.choose(
            mode, self.device, backend=kv.backend, tensor_parallel=self.model.announce is not None,
            experts=self.model.cfg.num_experts > 0,
        )  # fmt: skip
        if not choice.compiled:
            return choice
        model = self.model
        compiled = inductor.CompiledDecode(model.body)
        self.executor.compiled = compiled
        started = time.perf_counter()
        try:
            self._warm_decode(compiled, kv)
            compiled.warm = True
        except Exception as exc:  # an Inductor failure on this model: eager still works
            self.executor.compiled = None
            why = inductor.reason(exc)
            log.warning("compiling the decode step failed, running eagerly: %s", why)
            return inductor.GraphChoice(False, f"compiling failed ({why}); eager")
        took = time.perf_counter() - started
        return inductor.GraphChoice(True, f"{choice.why}, compiled in {took:.0f} s")

    def _warm_decode(self, compiled: inductor.CompiledDecode, kv: PagedKVCache) -> None:
        """Decode steps of batch 2 and 1 on scratch sequences: the two graphs that every later
        decode step uses (:func:`inductor.compile_forward`). Errors propagate (the
        executor would fall back to eager and hide them)."""
        mgr = kv.manager
        per_seq = mgr.blocks_for(4)
        if mgr.num_free < per_seq:
            raise RuntimeError("the KV pool has no room for the warm-up's scratch sequence")
        batch = 2 if mgr.num_free >= 2 * per_seq else 1
        ids = [f"\0warm{i}" for i in range(batch)]
        model = self.model
        try:
            for rid in ids:
                mgr.grow(rid, 2)
            model(
                torch.zeros(2 * batch, dtype=torch.long, device=self.device),
                torch.arange(2, device=self.device).repeat(batch),
                kv.context([SeqChunk(rid, 0, 2) for rid in ids]),
            )
            for b in range(batch, 0, -1):
                for pos in (2, 3):
                    for rid in ids[:b]:
                        mgr.grow(rid, pos + 1)
                    tokens, positions, rows = self.inputs([0] * b, [pos] * b, list(range(b)))
                    with torch.inference_mode():
                        compiled(
                            model.embed_ids(tokens),
                            positions,
                            kv.context([SeqChunk(rid, pos, 1) for rid in ids[:b]]),
                            rows,
                        )
        finally:
            for rid in ids:
                mgr.free(rid)

    # -- single sequences, for scripts and evaluations --------------------------------------
    def forward_logits(
        self, token_ids: Sequence[int], cache: ContiguousKVCache, start: int
    ) -> torch.Tensor:
        """Logits for every position of ``token_ids`` continuing a sequence at ``start``,
        through a private contiguous cache (not the engine's pool). LongRoPE's factors are
        this call's, by how far it reaches (as a transformers forward picks them)."""
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=self.device)
        first = start + self.model.rope.offset(start + len(ids))
        positions = torch.arange(first, first + len(ids), device=self.device)
        ctx = cache.context([0], [start], [len(ids)])
        return self.model(ids, positions, ctx)

    def new_cache(self, capacity: int, kv_format: KVFormat | None = None) -> ContiguousKVCache:
        """A one-sequence contiguous cache of ``capacity`` tokens whose K/V read back as a
        pool of ``kv_format`` holds them (None: the compute dtype's)."""
        return ContiguousKVCache(
            self.cfg, slots=1, capacity=capacity, dtype=self.dtype, device=self.device,
            kv_format=kv_format,
        )  # fmt: skip
