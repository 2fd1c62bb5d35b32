"""Tensor parallelism's ranks at run time: rank 0 drives, the others follow.

Rank 0 lives in the engine's process and runs everything a single device runs: the scheduler,
the block tables, sampling. Before each forward of its model it tells the other ranks what to
compute (:class:`Driver`, through :attr:`engine.model.transformer.Transformer.announce`): the
token ids, the positions, and the attention context's recipe, which each rank turns into a
context over its own KV pool, laid out as rank 0's (the same blocks and slots, its own KV
heads). Each other rank (:func:`follow`, one process each) then runs the same forward on its
shard; the layers' all-reduces (:func:`all_reduce`) join the ranks twice a layer, and only
rank 0 computes logits.

Two process groups of the model's own join its ranks (:class:`Groups`, made by
:func:`engine.loader.parallel.groups`; not ``torch.distributed``'s default group, so that one
process may hold several split models): the control group, always gloo, carries the
announcements (pickled, :func:`broadcast_object`) and the barriers; the tensors' group carries
the all-reduces and the logits' all-gather, gloo on CPUs and NCCL across GPUs. A rank reads
an announcement before it runs the forward it describes, so the two groups' traffic stays in
order. Every collective has the groups' timeout; a rank that fails says why on a queue before
it exits, and rank 0 turns the failed collective into an error naming the rank
(:meth:`Driver.failure`).
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from engine.attention.context import PoolContext
from engine.attention.paged import PagedBackend
from engine.attention.triton import TritonBackend
from engine.errors import InfersightError
from engine.formats import kv as kv_format
from engine.kv_cache.contiguous import ContiguousKVCache, _ContiguousContext
from engine.kv_cache.layered import LayeredBlockManager
from engine.kv_cache.paged import PagedKVCache, SeqChunk
from engine.model.attention import AttentionContext
from engine.model.config import ModelConfig
from engine.model.transformer import Transformer
from engine.parallel.shard import vocab_per_rank

log = logging.getLogger(__name__)


class RankFailed(InfersightError):
    """A rank of a tensor-parallel model died, raised or timed out."""


@dataclass(frozen=True, slots=True)
class Groups:
    """One split model's process groups (``torch.distributed`` backends of its own)."""

    control: Any  # gloo: the announcements and the barriers
    tensors: Any  # gloo on CPUs, NCCL on GPUs: the all-reduces and the all-gather
    store: Any  # the rendezvous both were made through (kept alive with them)


def broadcast_object(group: Any, obj: object = None) -> object:
    """Rank 0's ``obj``, pickled, on every rank of ``group`` (its size, then its bytes)."""
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    if group.rank() == 0:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.long)
    else:
        size = torch.zeros(1, dtype=torch.long)
    group.broadcast([size], opts).wait()
    if group.rank() != 0:
        data = torch.empty(int(size.item()), dtype=torch.uint8)
    group.broadcast([data], opts).wait()
    return obj if group.rank() == 0 else pickle.loads(data.numpy().tobytes())


def gather_vocab(t: Tensor, vocab_size: int, group: Any) -> Tensor:
    """Every rank's logits columns ``[rows, per rank]`` (the last rank's padded), side by
    side: the whole vocabulary's ``[rows, V]`` on each rank (``group``: the tensors' group;
    the rows per rank: :func:`engine.parallel.shard.vocab_per_rank`)."""
    world = group.size()
    per = vocab_per_rank(vocab_size, world)
    if t.shape[1] < per:
        t = torch.nn.functional.pad(t, (0, per - t.shape[1]))
    parts = [torch.empty_like(t) for _ in range(world)]
    group.allgather([parts], [t.contiguous()]).wait()
    return torch.cat(parts, dim=1)[:, :vocab_size]


def all_reduce(t: Tensor, group: Any) -> Tensor:
    """The sum of ``t`` across the ranks of ``group`` (the tensors' group), in place (a
    row-parallel product's fresh output); a half-precision ``t`` is summed in fp32 and
    rounded once, as one device's product rounds its sum once. (On a GPU ``wait`` orders the
    stream after the sum; it does not block this thread.)"""
    if t.dtype == torch.float32:
        group.allreduce([t]).wait()
        return t
    wide = t.float()
    group.allreduce([wide]).wait()
    return t.copy_(wide)


@dataclass(frozen=True, slots=True)
class Paged:
    """A paged context's recipe: the pool (rank 0's id for it, and how to build it), the
    step's chunks and the block tables of their sequences."""

    pool: int
    num_blocks: int
    block_size: int
    #: whether the pool's steps attend through our Triton kernels (on a GPU)
    triton: bool
    chunks: tuple[SeqChunk, ...]
    tables: dict[str, list[int]]
    #: the local layers' pool and tables, where they are kept apart (None: not)
    local_blocks: int | None = None
    local_tables: dict[str, list[int]] | None = None
    #: what the pool holds (:func:`engine.formats.kv.named`): each rank its own heads' rows
    kv_format: str = ""


@dataclass(frozen=True, slots=True)
class Contiguous:
    """A contiguous context's recipe (a single sequence's scoring: ``forward_logits``)."""

    cache: int
    slots_total: int
    capacity: int
    slots: list[int]
    starts: list[int]
    lengths: list[int]
    #: the quantized format whose round trip K/V take (:class:`ContiguousKVCache`); "": none
    kv_format: str = ""


@dataclass(frozen=True, slots=True)
class Forward:
    ids: Tensor
    positions: Tensor
    #: the rows whose logits rank 0 asks for (None: every row): a vocabulary-parallel head
    #: computes its columns of them on every rank
    rows: Tensor | None
    context: Paged | Contiguous
    #: the ids of rank 0's caches still alive: the others drop the rest
    live: frozenset[int]


STOP = "stop"


class Driver:
    """Rank 0's side: announces each forward to the other ranks; knows their processes, to
    say which one failed and why."""

    def __init__(self, processes: list[Any], errors: Any, timeout_s: float) -> None:
        self.processes = processes  # rank r's process at index r - 1
        self.errors = errors
        self.timeout_s = timeout_s
        #: the model's groups, once rank 0 has joined them
        self.groups: Groups | None = None
        #: what the ranks hold, for the load report
        self.summary = ""
        self._caches: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        self.closed = False

    def _recipe(self, ctx: AttentionContext) -> Paged | Contiguous:
        if isinstance(ctx, PoolContext):
            cache = ctx.cache
            mgr = cache.manager
            self._caches[id(cache)] = cache
            chunks = tuple(ctx.chunks)
            tables = {c.seq_id: list(mgr.tables[c.seq_id]) for c in chunks}
            recipe = Paged(id(cache), mgr.num_blocks, cache.block_size, cache.triton, chunks,
                           tables, kv_format=cache.format.name)  # fmt: skip
            if isinstance(mgr, LayeredBlockManager):
                local = {c.seq_id: list(mgr.local.tables[c.seq_id]) for c in chunks}
                recipe = replace(recipe, local_blocks=mgr.local.num_blocks, local_tables=local)
            return recipe
        if isinstance(ctx, _ContiguousContext):
            c = ctx.cache
            self._caches[id(c)] = c
            quantized = "" if c.quantized is None else c.quantized.name
            return Contiguous(id(c), c.k[0].shape[0], c.capacity, list(ctx.slots),
                              list(ctx.starts), list(ctx.lengths), quantized)  # fmt: skip
        raise InfersightError(f"tensor parallelism does not run a {type(ctx).__name__}")

    def announce(
        self, ids: Tensor, positions: Tensor, ctx: AttentionContext, rows: Tensor | None
    ) -> None:
        if self.closed:
            raise RankFailed("this tensor-parallel model was shut down; load it again")
        # a rank already gone is named now: a send to it need not fail (the bytes fit in
        # the socket's buffer) and the control group waits as long as rank 0 idles
        dead = self.dead()
        if dead:
            raise self.failure(RuntimeError(dead))
        message = Forward(
            ids.cpu(), positions.cpu(), None if rows is None else rows.cpu(), self._recipe(ctx),
            frozenset(self._caches),
        )  # fmt: skip
        self.send(message)

    def send(self, message: object) -> None:
        try:
            assert self.groups is not None
            broadcast_object(self.groups.control, message)
        except Exception as exc:
            raise self.failure(exc) from exc

    def reduce(self, t: Tensor) -> Tensor:
        try:
            assert self.groups is not None
            return all_reduce(t, self.groups.tensors)
        except Exception as exc:
            raise self.failure(exc) from exc

    def gatherer(self, vocab_size: int) -> Callable[[Tensor], Tensor]:
        def gather(t: Tensor) -> Tensor:
            try:
                assert self.groups is not None
                return gather_vocab(t, vocab_size, self.groups.tensors)
            except Exception as exc:
                raise self.failure(exc) from exc

        return gather

    def memory(self, device: torch.device) -> tuple[int | None, ...]:
        """Each rank's memory in bytes, rank 0 first: on a GPU what NVML says GPU ``r`` has
        in use, on a CPU the resident set of rank ``r``'s process; None where it cannot be
        read (no NVML, a rank gone)."""
        if device.type == "cuda":
            from engine.hardware import nvml

            world = len(self.processes) + 1
            gpus = [nvml.device_memory(torch.device("cuda", r)) for r in range(world)]
            return tuple(None if g is None else g.used_bytes for g in gpus)
        import psutil

        def rss(pid: int | None) -> int | None:
            try:
                return int(psutil.Process(pid).memory_info().rss)
            except (psutil.Error, ValueError):
                return None

        return (rss(os.getpid()), *(rss(p.pid) for p in self.processes))

    def dead(self) -> str | None:
        """The first rank whose process has ended ("rank r ended"), or None."""
        for rank, process in enumerate(self.processes, start=1):
            if not process.is_alive():
                return f"rank {rank} ended"
        return None

    def gone(self) -> str | None:
        """Why the ranks cannot go on, checked while they start: a rank that said why it
        failed, or one whose process ended; None while all are running."""
        if not self.errors.empty():
            return "a rank failed"
        return self.dead()

    def failure(self, exc: BaseException) -> RankFailed:
        """What failed, by rank: a rank's own report where it made one, else the rank whose
        process is gone, else the collective's error (a timeout)."""
        self.closed = True
        try:
            return self._named(exc)
        finally:  # the group is broken: the ranks still running cannot go on
            for process in self.processes:
                if process.is_alive():
                    process.kill()

    def _named(self, exc: BaseException) -> RankFailed:
        reports: list[tuple[int, str]] = []
        while True:
            try:
                reports.append(self.errors.get(timeout=0.5 if not reports else 0.05))
            except (queue.Empty, OSError, ValueError):
                break
        if reports:
            rank, why = reports[0]
            return RankFailed(f"tensor-parallel rank {rank} failed: {why}")
        for rank, process in enumerate(self.processes, start=1):
            process.join(timeout=0.5)
            if not process.is_alive():
                return RankFailed(
                    f"tensor-parallel rank {rank} died (exit code {process.exitcode}); "
                    "reload the model (without --tensor-parallel to run on one device)"
                )
        return RankFailed(f"a collective of the tensor-parallel ranks failed: {exc}")

    def close(self) -> None:
        """Stop the other ranks and wait for them; kill any that does not stop."""
        if not self.closed:
            self.closed = True
            try:
                # with a rank gone the group is broken: the others are killed below
                if self.groups is not None and self.dead() is None:
                    broadcast_object(self.groups.control, STOP)
            except Exception as exc:  # a rank already gone: the processes are ended below
                log.warning("stopping the tensor-parallel ranks: %s", exc)
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        self.groups = None  # their connections close with them


def follow(
    model: Transformer, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, control: Any
) -> None:
    """The other ranks' loop: each forward rank 0 announces on ``control``, on this rank's
    shard (on ``device``), until it says stop. Caches are built the first time a recipe names them,
    laid out as rank 0's."""
    pools: dict[int, PagedKVCache] = {}
    contiguous: dict[int, ContiguousKVCache] = {}
    no_rows = torch.empty(0, dtype=torch.long)
    while True:
        message = broadcast_object(control)
        if message == STOP:
            return
        assert isinstance(message, Forward)
        for held in (pools, contiguous):
            for key in [k for k in held if k not in message.live]:
                del held[key]
        recipe = message.context
        ctx: AttentionContext
        if isinstance(recipe, Paged):
            pool = pools.get(recipe.pool)
            if pool is None:
                pool = pools[recipe.pool] = PagedKVCache(
                    cfg, num_blocks=recipe.num_blocks, block_size=recipe.block_size,
                    dtype=dtype, device=device, prefix_caching=False,
                    attention=TritonBackend() if recipe.triton else PagedBackend(device),
                    local_blocks=recipe.local_blocks,
                    kv_format=kv_format.named(recipe.kv_format) if recipe.kv_format else None,
                )  # fmt: skip
            pool.manager.tables = recipe.tables
            if isinstance(pool.manager, LayeredBlockManager):
                assert recipe.local_tables is not None
                pool.manager.local.tables = recipe.local_tables
            ctx = pool.context(list(recipe.chunks))
        else:
            cache = contiguous.get(recipe.cache)
            if cache is None:
                cache = contiguous[recipe.cache] = ContiguousKVCache(
                    cfg, slots=recipe.slots_total, capacity=recipe.capacity, dtype=dtype,
                    device=device,
                    kv_format=kv_format.named(recipe.kv_format) if recipe.kv_format else None,
                )  # fmt: skip
            ctx = cache.context(recipe.slots, recipe.starts, recipe.lengths)
        # the logits' rows where the head is split (its all-gather needs every rank), else none
        rows = message.rows if model.gather is not None else no_rows
        ids, positions = message.ids.to(device), message.positions.to(device)
        model(ids, positions, ctx, None if rows is None else rows.to(device))
