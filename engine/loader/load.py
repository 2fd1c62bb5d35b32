"""Loading a model folder into an :class:`~engine.core.engine.LLMEngine`: the weights at a
precision, the tokenizer, the CPU's thread count and weight layout, the decode graph, and the
model's own sampling defaults (:mod:`engine.loader.generation_config`). What a load will take,
and whether it fits, is planned before it starts (:mod:`engine.loader.memory_plan`).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine.core.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.errors import InvalidRequestError, ModelLoadError
from engine.hardware import threads as cpu_threads
from engine.hardware.cpu_paths import cpu_paths
from engine.hardware.measured import machine_name
from engine.hardware.threads import settle_step_threads, settle_threads
from engine.kernels import decode_step, paged_decode
from engine.kernels.packed_linear import pack_linears
from engine.kv_cache.paged import SeqChunk
from engine.loader import expert_placement
from engine.loader.drafter import speculation
from engine.loader.generation_config import generation_config_eos, generation_config_sampling
from engine.loader.memory_plan import plan_memory
from engine.loader.weights import load_transformer, smoothing_plan
from engine.model.config import ModelConfig
from engine.model.inventory import linear_modules, parameter_count
from engine.model.moe import MoE
from engine.model.tokenizer import Tokenizer
from engine.model.transformer import Transformer
from engine.quant import calibration as calibration_files
from engine.quant.inventory import quantized_parameter_count
from engine.quant.spec import PrecisionSpec, parse_precision_spec

log = logging.getLogger(__name__)

MiB = 2**20


def load_model(
    folder: Path | str,
    *,
    precision: str = "fp32",
    device: str = "cpu",
    pack: bool | None = None,
    config: EngineConfig | None = None,
    alpha: float | dict[str, float] | None = None,
    tensor_parallel: int = 1,
    progress: Callable[[str, int, int], None] | None = None,
) -> LLMEngine:
    """Load a HF-style model folder into an engine (published as ``engine.load``). CPU linears
    are laid out for oneDNN where that measured faster on this machine
    (:func:`engine.kernels.packed_linear.packs`); ``pack=True`` packs every linear this CPU can
    pack, ``False`` none (plain ``nn.Linear``). ``alpha``: SmoothQuant's α for a ``w8a8-sq``
    spec in place of the one its calibration chose (the calibration's own sweep).
    ``tensor_parallel``: the model split over that many processes
    (:mod:`engine.loader.parallel`), this one rank 0. ``progress``: told each stage as it
    goes, ``(stage, done, total)``: ``read`` (or ``quantize``) tensor by tensor, then
    ``settle`` (threads, the linears' layout, the KV pool, the decode graph)."""
    folder = Path(folder)
    torch_device = torch.device(device)
    spec = parse_precision_spec(precision, torch_device)
    dtype = spec.compute
    if not folder.is_dir():
        raise ModelLoadError(
            f"model folder {folder} does not exist; pass a Hugging Face model folder "
            "(config.json, *.safetensors, tokenizer.json) or --model default"
        )
    if torch_device.type == "cpu" and dtype == torch.float16:
        log.warning("fp16 on CPU runs through slow fallback kernels; bf16 or fp32 is faster")
    if tensor_parallel < 1:
        raise InvalidRequestError(
            f"--tensor-parallel {tensor_parallel}: give the number of processes, 1 or more"
        )
    if tensor_parallel > 1:
        from engine.loader.parallel import load_parallel

        return load_parallel(
            folder, world=tensor_parallel, precision=precision, device=device, config=config,
            alpha=alpha, settle=engine_for, load=load_model,
        )  # fmt: skip
    cfg = ModelConfig.from_file(folder / "config.json")
    spec.check_layers(cfg.num_layers)
    tokenizer = Tokenizer.from_folder(folder)
    cal = (
        None if spec.calibration is None else calibration_files.load(folder, spec.calibration, cfg)
    )
    plan = smoothing_plan(cfg, spec, cal, alpha)
    engine_config = config or EngineConfig()
    host = expert_placement.resolve(
        cfg, torch_device, engine_config,
        lambda: plan_memory(cfg, precision, str(torch_device), config=engine_config),
    )  # fmt: skip
    model = load_transformer(
        folder, cfg, dtype, torch_device, quant=spec.kind_for if spec.quantized else None,
        smoothing=plan, progress=progress, host_experts=host,
    )  # fmt: skip
    if cal is not None:
        calibration_files.set_static_scales(model, cal, plan, spec.kind_for)
    eos = set(cfg.eos_token_ids) | set(generation_config_eos(folder))
    if progress:
        progress("settle", 0, 1)
    engine = engine_for(
        model, tokenizer, cfg, spec, torch_device,
        name=folder.name, eos_token_ids=sorted(eos), config=config, pack=pack,
    )  # fmt: skip
    if progress:
        progress("settle", 1, 1)
    engine.default_sampling = generation_config_sampling(folder)
    engine.folder = folder
    engine.speculation = functools.partial(speculation, load=load_model)
    num_parameters = engine.num_parameters
    sizing = engine.pool_sizing  # why a GPU's pool has its size: the warm-up's figures
    log.info(
        "loaded %s: %s, %d layers, %.1fM parameters, %s, %.0f MiB of weights, "
        "KV pool %d blocks × %d tokens (%.0f MiB%s)",
        folder.name, cfg.model_type, cfg.num_layers, num_parameters / 1e6, precision,
        engine.weights_bytes / MiB, engine.kv.manager.num_blocks, engine.kv.block_size,
        engine.kv.nbytes / MiB, "" if sizing is None else f"; sized {sizing.summary()}",
    )  # fmt: skip
    if torch_device.type == "cpu":
        log.info("  %s; %s", cpu_paths().summary(), engine.threads_report)
        log.info("  decode attention: %s", paged_decode.status())
    log.info("  %s", engine.graph.summary())
    log.info("  kernels: %s", engine.kernels)
    log.info("  %s", engine.graphs.summary())
    _log_weights(engine, num_parameters)
    return engine


def engine_for(
    model: Transformer,
    tokenizer: Tokenizer,
    cfg: ModelConfig,
    spec: PrecisionSpec,
    device: torch.device,
    *,
    name: str,
    eos_token_ids: list[int],
    config: EngineConfig | None = None,
    pack: bool | None = None,
) -> LLMEngine:
    """An engine around a loaded ``model``, settled as every load settles it: on a CPU the
    thread count, then the linears' layout (timed at that count; ``pack`` as in
    :func:`load_model`), and where decode steps run in one C call the thread count again,
    timed on that step; the KV pool (profiled on a GPU); the decode graph."""
    num_parameters = parameter_count(model) + quantized_parameter_count(model)  # before packing
    threads = ""
    if device.type == "cpu":
        # Threads first: the layout timings below then run at the count decode will use.
        threads = settle_threads(linear_modules(model), spec.compute)
        if pack is not False:
            pack_linears(model, timed=pack is None)
    engine = LLMEngine(
        model, tokenizer, cfg, eos_token_ids=eos_token_ids, dtype=spec.compute, device=device,
        name=name, num_parameters=num_parameters, config=config, precision=spec,
    )  # fmt: skip
    engine.threads_report = threads
    if device.type == "cpu" and engine.runner.executor.c_step is not None:
        # decode steps run in one C call: time that step itself at each count
        step_threads = settle_step_threads(_step_key(engine), lambda t: _time_step(engine, t))
        engine.threads_report = step_threads or threads
    engine.graph = engine.runner.settle_decode_graph(engine.config.decode_graph, engine.kv)
    engine.settle_cuda_graphs()
    engine.runner.executor.ran.clear()  # the load's timed steps are not the engine's
    for module in model.modules():  # the warm-ups' routings are not the user's
        if isinstance(module, MoE):
            module.load = None
    return engine


def _step_key(engine: LLMEngine) -> str:
    """What the C decode step's thread timing holds for: this machine, the model's shapes,
    each linear's kernel and the builds of our kernels."""
    cfg = engine.cfg
    kernels = sorted({str(getattr(m, "kernel", type(m).__name__))
                      for m in linear_modules(engine.model)})  # fmt: skip
    return (
        f"{machine_name()} | torch {torch.__version__} | {cpu_threads.DEFAULT_THREADS} cores | "
        f"C step | {engine.precision.text} {cfg.num_layers}x{cfg.hidden_size}/"
        f"{cfg.intermediate_size}/{cfg.vocab_size} | {kernels} | {decode_step.builds()}"
    )


#: the context the thread timing decodes at, and its decode steps per count
TIMED_CONTEXT, TIMED_STEPS = 64, 8


def _time_step(engine: LLMEngine, threads: int) -> float:
    """ms of one batch-1 decode step (the best of :data:`TIMED_STEPS`) at ``threads``, on a
    scratch sequence of :data:`TIMED_CONTEXT` tokens prefilled first; inf where the pool has
    no room for it."""
    mgr, model = engine.kv.manager, engine.model
    rid, n = "\0threads", TIMED_CONTEXT
    if not mgr.can_grow(rid, n + TIMED_STEPS):
        return float("inf")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    best = float("inf")
    try:
        mgr.grow(rid, n + TIMED_STEPS)
        model(torch.zeros(n, dtype=torch.long), torch.arange(n),
              engine.kv.context([SeqChunk(rid, 0, n)]))  # fmt: skip
        for i in range(TIMED_STEPS):
            ids, positions, rows = engine.runner.inputs([0], [n + i], [0])
            started = time.perf_counter()
            engine.runner.executor.forward(
                ids, positions, engine.kv.context([SeqChunk(rid, n + i, 1)]), rows
            )
            best = min(best, time.perf_counter() - started)
    finally:
        mgr.free(rid)
        torch.set_num_threads(before)
    return best * 1e3


def _log_weights(engine: LLMEngine, num_parameters: int) -> None:
    for group in engine.weight_groups:
        log.info(
            "  %-9s %-34s %7.1fM params %8.1f MiB", group.kind, group.form,
            group.parameters / 1e6, group.nbytes / MiB,
        )  # fmt: skip
    fp16 = 2 * num_parameters
    log.info(
        "  weights %.1f MiB = %.2f× their fp16 size (%.1f MiB)",
        engine.weights_bytes / MiB, engine.weights_bytes / fp16, fp16 / MiB,
    )  # fmt: skip
