"""A model split over N processes (tensor parallelism), loaded: rank 0 here, in the engine's
process, the other ranks spawned, each loading its own shard of the same checkpoint
(:mod:`engine.parallel.shard`) and then following rank 0's forwards
(:func:`engine.parallel.executor.follow`).

The ranks meet in a ``torch.distributed`` process group: gloo on a CPU (NCCL on CUDA is not
built yet). Every collective times out after :data:`TIMEOUT_S`; loading waits longer, at a
barrier that names a rank that never arrives.
"""

from __future__ import annotations

import atexit
import functools
import logging
import signal
import socket
import weakref
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.core.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.errors import InvalidRequestError
from engine.model.config import ModelConfig
from engine.model.transformer import Transformer
from engine.parallel import executor
from engine.parallel.shard import Shard, plan
from engine.quant.spec import PrecisionSpec

log = logging.getLogger(__name__)

#: seconds a collective waits for the other ranks before it fails
TIMEOUT_S = 30.0
#: seconds the ranks wait for each other to load
LOAD_TIMEOUT_S = 600.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _init(rank: int, world: int, port: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=TIMEOUT_S),
    )  # fmt: skip


def shard_for(cfg: ModelConfig, spec: PrecisionSpec, rank: int, world: int) -> Shard:
    """Rank ``rank``'s shard, its MLP channels in whole INT4 groups where the spec has some."""
    groups = [k.group for k in spec.kinds if k.group]
    # the embedding and a float head split by vocabulary rows; a quantized head stays whole
    vocab = spec.kind_for("lm_head") is None
    return plan(cfg, rank, world, align=max(groups, default=1), vocab=vocab)


def _load_shard(folder: Path, precision: str, rank: int, world: int,
                alpha: Any) -> tuple[Transformer, Shard, PrecisionSpec]:  # fmt: skip
    from engine.loader.weights import load_transformer, smoothing_plan
    from engine.quant import calibration as calibration_files
    from engine.quant.spec import parse_precision_spec

    device = torch.device("cpu")
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
               errors: Any, alpha: Any) -> None:  # fmt: skip
    """A spawned rank: join the group, load its shard, follow rank 0 until it says stop.
    Whatever fails goes to ``errors`` with the rank before the process exits."""
    from engine.kernels import layer_ops
    from engine.model.transformer import TORCH_OPS

    # Ctrl+C reaches every process of the terminal's group: rank 0 shuts the ranks down
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        torch.set_num_threads(threads)
        _init(rank, world, port)
        model, shard, spec = _load_shard(Path(folder), precision, rank, world, alpha)
        ops, _ = layer_ops.cpu_ops()
        model.set_ops(ops or TORCH_OPS)
        gather = functools.partial(executor.gather_vocab, vocab_size=shard.full.vocab_size)
        model.set_parallel(executor.all_reduce, gather if shard.vocab is not None else None)
        dist.monitored_barrier(timeout=timedelta(seconds=LOAD_TIMEOUT_S))
        executor.follow(model, shard.local, spec.compute)
    except BaseException as exc:
        errors.put((rank, f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


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

    if torch.device(device).type != "cpu":
        raise InvalidRequestError(
            "--tensor-parallel runs on CPUs for now (gloo); NCCL across CUDA GPUs is not "
            "built yet: load on one GPU, or with --device cpu"
        )
    if dist.is_initialized():
        raise InvalidRequestError(
            "a tensor-parallel model is already loaded in this process; close it first"
        )
    # a split the model cannot take is refused here, before any process starts
    from engine.quant.spec import parse_precision_spec

    spec = parse_precision_spec(precision, torch.device("cpu"))
    shard_for(ModelConfig.from_file(folder / "config.json"), spec, 0, world)
    threads = max(1, torch.get_num_threads() // world)
    context = mp.get_context("spawn")
    errors = context.Queue()
    port = _free_port()
    processes = [
        context.Process(
            target=_rank_main,
            name=f"infersight-rank-{rank}",
            daemon=True,
            args=(rank, world, port, str(folder), precision, threads, errors, alpha),
        )
        for rank in range(1, world)
    ]
    for process in processes:
        process.start()
    driver = executor.Driver(processes, errors, TIMEOUT_S)
    try:
        _init(0, world, port)
        torch.set_num_threads(threads)
        model, shard, spec = _load_shard(folder, precision, 0, world, alpha)
        gatherer = driver.gatherer(shard.full.vocab_size) if shard.vocab is not None else None
        model.set_parallel(driver.reduce, gatherer)
        try:
            dist.monitored_barrier(timeout=timedelta(seconds=LOAD_TIMEOUT_S))
        except Exception as exc:
            raise driver.failure(exc) from exc
        model.announce = driver.announce
        tokenizer = Tokenizer.from_folder(folder)
        cfg = shard.local
        eos = set(cfg.eos_token_ids) | set(generation_config_eos(folder))
        engine = settle(
            model, tokenizer, cfg, spec, torch.device("cpu"), name=folder.name,
            eos_token_ids=sorted(eos), config=config, pack=False,
        )  # fmt: skip
    except BaseException:
        driver.close()
        raise
    engine.default_sampling = generation_config_sampling(folder)
    engine.folder = folder
    engine.speculation = functools.partial(speculation, load=load)  # drafters: one process
    engine.parallel = driver
    engine.kernels += f"; tensor parallel: {world} ranks (gloo), this rank holds {_holds(shard)}"
    weakref.finalize(engine, driver.close)
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
