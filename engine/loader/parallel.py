"""A model split over N processes (tensor parallelism), loaded: rank 0 here, in the engine's
process, the other ranks started from a fork server (:func:`_context`), each loading its own
shard of the same checkpoint (:mod:`engine.parallel.shard`) and then following rank 0's
forwards (:func:`engine.parallel.executor.follow`).

On a CPU every rank runs on the CPU (sharing out its threads); on CUDA rank ``r`` runs on
GPU ``r``. The ranks meet in two process groups of the model's own (:func:`groups`): gloo for
rank 0's announcements and the barriers, and the tensors' group for the all-reduces (gloo on
CPUs, NCCL across GPUs). They are ``torch.distributed`` backends made from a rendezvous store
that rank 0 opens, not its default group, so a process may hold several split models at once
(the A/B lab's two sides, ``eval compare``'s A and B). Every collective on the tensors
times out after :data:`TIMEOUT_S`; loading waits longer, at a barrier that names a rank that
never arrives. A rank waits for rank 0's next announcement as long as rank 0 is idle
(:data:`IDLE`): a rank that dies closes its connections, so the others' waits fail at once.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import signal
import sys
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch._C._distributed_c10d import PrefixStore, TCPStore

from engine.core.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.errors import InvalidRequestError
from engine.model.config import ModelConfig
from engine.model.transformer import Transformer
from engine.parallel import executor
from engine.parallel.shard import Shard, plan
from engine.quant.spec import PrecisionSpec

log = logging.getLogger(__name__)

#: seconds a collective on the tensors waits for the other ranks before it fails
TIMEOUT_S = 30.0
#: seconds the ranks wait for each other to load
LOAD_TIMEOUT_S = 600.0
#: how long a rank waits for rank 0's next announcement: as long as the model sits idle
#: (a chat's user reading, a server without requests), so in effect for ever
IDLE = timedelta(days=30)
#: how often a rank waiting for the others to start asks whether they are up, or gone
MEET_POLL_S = 0.05


#: the tensors' group's backend, by device type
BACKENDS = {"cpu": "gloo", "cuda": "nccl"}


def rank_device(device: str | torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: the CPU for every rank on a CPU, GPU ``rank`` on CUDA."""
    kind = torch.device(device).type
    return torch.device("cpu") if kind == "cpu" else torch.device(kind, rank)


def rendezvous(world: int, port: int = 0, timeout_s: float = TIMEOUT_S) -> Any:
    """The store the ranks meet through: rank 0's (``port`` 0: a free one, then read from
    its ``port``) or, given the port, another rank's connection to it."""
    timeout = timedelta(seconds=timeout_s)
    if port == 0:
        return TCPStore("127.0.0.1", 0, world, True, timeout=timeout, wait_for_workers=False)
    return TCPStore("127.0.0.1", port, world, False, timeout=timeout)


def meet(store: Any, rank: int, world: int, gone: Callable[[], str | None]) -> None:
    """Say this rank is up and wait for every other rank to say so, up to
    :data:`LOAD_TIMEOUT_S`, asking ``gone`` each second whether to give up (why, or None):
    the groups are made once every rank is there, since making them waits as long as they
    wait (:data:`IDLE` for the control group)."""
    store.set(f"up/{rank}", "1")
    keys = [f"up/{r}" for r in range(world)]
    deadline = time.monotonic() + LOAD_TIMEOUT_S
    # ``check`` asks without waiting: a ``wait`` that times out has c10d print two warnings
    # a second on the terminal while the other ranks start
    while not store.check(keys):
        why = gone()
        if why:
            raise RuntimeError(why)
        if time.monotonic() > deadline:
            raise RuntimeError(f"not every rank started within {LOAD_TIMEOUT_S:.0f} s")
        time.sleep(MEET_POLL_S)


def groups(
    rank: int, world: int, store: Any, device: torch.device, timeout_s: float = TIMEOUT_S
) -> executor.Groups:
    """This rank's two groups of the model: the control group, gloo (the announcements,
    waited for up to :data:`IDLE`, and ``monitored_barrier``), and the group the tensors'
    collectives run in, :data:`BACKENDS` of ``device``'s type, timing out after
    ``timeout_s``. On CPUs both are gloo, and a CPU run goes through every line a GPU run
    does but the backend's."""
    timeout = timedelta(seconds=timeout_s)
    control = dist.ProcessGroupGloo(PrefixStore("control/", store), rank, world, IDLE)
    tensors_store = PrefixStore("tensors/", store)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # a collective that times out aborts NCCL's communicators and fails, where PyTorch's
        # default (3) would also tear this process down: rank 0 is the app's
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = timeout
        tensors: Any = dist.ProcessGroupNCCL(tensors_store, rank, world, options)
    else:
        tensors = dist.ProcessGroupGloo(tensors_store, rank, world, timeout)
    return executor.Groups(control, tensors, store)


def refusal(device: str | torch.device, world: int) -> str:
    """Why ``world`` ranks cannot run on ``device`` here, or "" when they can."""
    kind = torch.device(device).type
    if kind not in BACKENDS:
        return f"--tensor-parallel runs on CPUs (gloo) and CUDA GPUs (NCCL), not on {kind}"
    if kind == "cuda":
        count = torch.cuda.device_count()
        if count < world:
            return (
                f"--tensor-parallel {world} on CUDA needs a GPU per rank, and {count} "
                f"{'is' if count == 1 else 'are'} visible: use --tensor-parallel {max(count, 1)}"
                " or fewer, or --device cpu"
            )
        if not dist.is_nccl_available():
            return "this PyTorch build has no NCCL: --tensor-parallel needs it on CUDA"
    return ""


def shard_for(cfg: ModelConfig, spec: PrecisionSpec, rank: int, world: int) -> Shard:
    """Rank ``rank``'s shard, its MLP channels in whole INT4 groups where the spec has some;
    the embedding and the LM head (float or quantized) split by vocabulary rows."""
    groups = [k.group for k in spec.kinds if k.group]
    return plan(cfg, rank, world, align=max(groups, default=1), vocab=True)


def _load_shard(folder: Path, precision: str, rank: int, world: int, alpha: Any,
                device: torch.device) -> tuple[Transformer, Shard, PrecisionSpec]:  # fmt: skip
    from engine.loader.weights import load_transformer, smoothing_plan
    from engine.quant import calibration as calibration_files
    from engine.quant.spec import parse_precision_spec

    spec = parse_precision_spec(precision, device)
    cfg = ModelConfig.from_file(folder / "config.json")
    spec.check_layers(cfg.num_layers)
    shard = shard_for(cfg, spec, rank, world)
    cal = (
        None if spec.calibration is None else calibration_files.load(folder, spec.calibration, cfg)
    )
    smoothing = smoothing_plan(cfg, spec, cal, alpha)
    model = load_transformer(
        folder, cfg, spec.compute, device, quant=spec.kind_for if spec.quantized else None,
        smoothing=smoothing, shard=shard,
    )  # fmt: skip
    if cal is not None:
        calibration_files.set_static_scales(model, cal, smoothing, spec.kind_for)
    return model, shard, spec


def _rank_main(rank: int, world: int, port: int, folder: str, precision: str, threads: int,
               errors: Any, alpha: Any, device_type: str, timeout_s: float,
               environ: dict[str, str]) -> None:  # fmt: skip
    """A started rank: join the group, load its shard, follow rank 0 until it says stop.
    Whatever fails goes to ``errors`` with the rank before the process exits. ``environ``:
    rank 0's environment as the rank started (a fork server's is its own start's)."""
    from engine.kernels import layer_ops
    from engine.model.transformer import TORCH_OPS

    # Ctrl+C reaches every process of the terminal's group: rank 0 shuts the ranks down
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.clear()
    os.environ.update(environ)
    try:
        torch.set_num_threads(threads)
        device = rank_device(device_type, rank)
        store = rendezvous(world, port, timeout_s)
        parent = os.getppid()
        meet(store, rank, world, lambda: "rank 0 is gone" if os.getppid() != parent else None)
        ours = groups(rank, world, store, device, timeout_s)
        group = ours.tensors
        model, shard, spec = _load_shard(Path(folder), precision, rank, world, alpha, device)
        if device.type == "cpu":
            ops, _ = layer_ops.cpu_ops()
            model.set_ops(ops or TORCH_OPS)
        gather = functools.partial(
            executor.gather_vocab, vocab_size=shard.full.vocab_size, group=group
        )
        model.set_parallel(
            functools.partial(executor.all_reduce, group=group),
            gather if shard.vocab is not None else None,
        )
        ours.control.monitored_barrier(timedelta(seconds=LOAD_TIMEOUT_S))
        executor.follow(model, shard.local, spec.compute, device, ours.control)
    except BaseException as exc:
        errors.put((rank, f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None
    # stopped as asked: nothing is left to do, and the interpreter's teardown of torch and
    # the process groups costs most of a second per rank (each close of a split model)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _context() -> Any:
    """How the ranks start: from a fork server that has imported torch and this module once
    per process (``forkserver``: a rank then starts in a fraction of a second, where a fresh
    interpreter spends seconds importing torch), on Linux; spawned elsewhere. A
    fork server is a clean process of its own, never a fork of this one's threads, CUDA
    context or Qt; it exits when this process does, and a rank watches it as its parent
    (:func:`meet`)."""
    # macOS: a fork of a process that loaded its system frameworks is not safe there
    if not sys.platform.startswith("linux") or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    return context


def load_parallel(
    folder: Path, *, world: int, precision: str, device: str, config: EngineConfig | None,
    alpha: Any, settle: Callable[..., LLMEngine], load: Callable[..., LLMEngine],
) -> LLMEngine:  # fmt: skip
    """The engine of a model split ``world`` ways: its rank 0, the others started here.
    ``settle`` makes the engine around rank 0's shard (:func:`engine.loader.load.engine_for`),
    ``load`` loads a draft model (:func:`engine.loader.load.load_model`)."""
    from engine.loader.drafter import speculation
    from engine.loader.generation_config import generation_config_eos, generation_config_sampling
    from engine.model.tokenizer import Tokenizer

    problem = refusal(device, world)
    if problem:
        raise InvalidRequestError(problem)
    # a split the model cannot take is refused here, before any process starts
    from engine.quant.spec import parse_precision_spec

    spec = parse_precision_spec(precision, torch.device(device))
    shard_for(ModelConfig.from_file(folder / "config.json"), spec, 0, world)
    threads = max(1, torch.get_num_threads() // world)
    kind = torch.device(device).type
    context = _context()
    errors = context.Queue()
    timeout_s = TIMEOUT_S
    store = rendezvous(world, 0, timeout_s)
    port = store.port
    processes = [
        context.Process(
            target=_rank_main,
            name=f"infersight-rank-{rank}",
            daemon=True,
            args=(
                rank,
                world,
                port,
                str(folder),
                precision,
                threads,
                errors,
                alpha,
                kind,
                timeout_s,
                dict(os.environ),
            ),
        )
        for rank in range(1, world)
    ]
    for process in processes:
        process.start()
    driver = executor.Driver(processes, errors, timeout_s)
    here = rank_device(device, 0)
    try:
        try:
            meet(store, 0, world, driver.gone)
        except RuntimeError as exc:
            raise driver.failure(exc) from exc
        driver.groups = groups(0, world, store, here, timeout_s)
        torch.set_num_threads(threads)
        model, shard, spec = _load_shard(folder, precision, 0, world, alpha, here)
        gatherer = driver.gatherer(shard.full.vocab_size) if shard.vocab is not None else None
        model.set_parallel(driver.reduce, gatherer)
        try:
            driver.groups.control.monitored_barrier(timedelta(seconds=LOAD_TIMEOUT_S))
        except Exception as exc:
            raise driver.failure(exc) from exc
        model.announce = driver.announce
        tokenizer = Tokenizer.from_folder(folder)
        cfg = shard.local
        eos = set(cfg.eos_token_ids) | set(generation_config_eos(folder))
        engine = settle(
            model, tokenizer, cfg, spec, here, name=folder.name,
            eos_token_ids=sorted(eos), config=config, pack=False,
        )  # fmt: skip
    except BaseException:
        driver.close()
        raise
    engine.default_sampling = generation_config_sampling(folder)
    engine.folder = folder
    engine.speculation = functools.partial(speculation, load=load)  # drafters: one process
    engine.parallel = driver
    backend = BACKENDS[here.type]
    driver.summary = f"tensor parallel: {world} ranks ({backend}), this rank holds {_holds(shard)}"
    engine.kernels += f"; {driver.summary}"
    # the ranks live as long as the model they hold shards of (its engines share it)
    weakref.finalize(model, driver.close)
    atexit.register(driver.close)
    return engine


def _holds(shard: Shard) -> str:
    vocab = (
        "the embedding and LM head whole"
        if shard.vocab is None
        else f"vocabulary rows {shard.vocab[0]}–{shard.vocab[1] - 1}"
    )
    return (
        f"query heads {shard.heads[0]}–{shard.heads[-1]}, KV heads "
        f"{shard.kv_heads[0]}–{shard.kv_heads[-1]}, MLP channels {shard.inter[0]}–"
        f"{shard.inter[1] - 1}, {vocab}"
    )
