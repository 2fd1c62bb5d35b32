"""What the commands share: the CUDA allocator's settings, the engine's configuration and
sampling from their options, loading the command's model, and progress lines on stderr.

Everything here imports torch (through the engine) only when called, so that the parser,
which imports the command modules, stays fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, MutableMapping
from typing import TYPE_CHECKING, Any

from engine.errors import InvalidRequestError
from engine.units import format_size

if TYPE_CHECKING:
    from engine.core.engine import LLMEngine
    from engine.core.sampling import SamplingParams


#: the CUDA allocator's settings the ``infersight`` command starts with: the K/V a step gathers
#: changes size every token, which splits the default allocator's fixed segments into pieces
#: too small to reuse; expandable segments grow in place instead
CUDA_ALLOC_CONF = "expandable_segments:True"


def configure_cuda_allocator(
    environ: MutableMapping[str, str] | None = None, platform: str | None = None
) -> str | None:
    """Give the CUDA allocator :data:`CUDA_ALLOC_CONF` unless the user set
    ``PYTORCH_CUDA_ALLOC_CONF`` themselves (theirs is kept as it is). Must run before torch
    initialises CUDA, which reads it once; it imports nothing. Linux only: PyTorch has
    expandable segments nowhere else, and would warn. Returns the setting in force."""
    environ = os.environ if environ is None else environ
    platform = sys.platform if platform is None else platform
    if "PYTORCH_CUDA_ALLOC_CONF" not in environ and platform.startswith("linux"):
        environ["PYTORCH_CUDA_ALLOC_CONF"] = CUDA_ALLOC_CONF
    return environ.get("PYTORCH_CUDA_ALLOC_CONF")


#: set as torch loads (its CPU allocator reads it once), it gives every host allocation of
#: 2 MiB and more transparent huge pages (madvise): a decode step streams each weight once,
#: and in 2 MiB pages the default model's 121 fp32 products read 4% faster on the 2-core
#: EPYC (36.9 against 35.6 GB/s, three runs each way), with fewer TLB misses; the KV pool too
THP_ENV = "THP_MEM_ALLOC_ENABLE"


def configure_cpu_allocator(
    environ: MutableMapping[str, str] | None = None, platform: str | None = None
) -> str | None:
    """Ask torch's CPU allocator for huge pages (:data:`THP_ENV`) unless the user set it
    themselves. Must run before torch is imported; it imports nothing. Linux only (where the
    kernel's transparent huge pages are "never", the allocator's advice is ignored). Returns
    the setting in force."""
    environ = os.environ if environ is None else environ
    platform = sys.platform if platform is None else platform
    if THP_ENV not in environ and platform.startswith("linux"):
        environ[THP_ENV] = "1"
    return environ.get(THP_ENV)


def engine_config(
    args: argparse.Namespace, max_batch_size: int = 16, max_tokens_per_step: int | None = None
) -> Any:
    from engine.core.config import EngineConfig
    from engine.core.scheduler import SchedulerLimits
    from engine.kv_cache.window import CacheWindow
    from engine.loader import expert_placement

    if max_tokens_per_step is None:
        max_tokens_per_step = args.max_tokens_per_step
    window = None
    if args.cache_window is not None:
        if args.cache_window < 1 or args.sink < 0:
            raise InvalidRequestError("--cache-window must be >= 1 and --sink >= 0")
        window = CacheWindow(sink=args.sink, window=args.cache_window)
    return EngineConfig(
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_memory=args.kv_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        limits=SchedulerLimits(
            max_batch_size=max_batch_size, max_tokens_per_step=max_tokens_per_step
        ),
        window=window,
        decode_graph=args.decode_graph,
        cuda_graphs=getattr(args, "cuda_graphs", None),
        prefix_caching=args.prefix_caching,
        cpu_experts=expert_placement.parse(getattr(args, "cpu_experts", None)),
        kv_dtype=getattr(args, "kv_dtype", "auto"),
    )


#: sampling flags → ``SamplingParams`` fields; a flag left out keeps the model's default
SAMPLING_FLAGS = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def sampling_params(
    args: argparse.Namespace, model_default: dict[str, Any] | None = None
) -> SamplingParams:
    """The model's default sampling (``engine.default_sampling``; ``None`` before a model is
    loaded: a check of the flags alone), overridden by every sampling flag given."""
    from app.loading import sampling_kwargs
    from engine.core.sampling import SamplingParams

    base = {"max_new_tokens": args.fallback_max_new_tokens, **(model_default or {})}
    overrides = {name: getattr(args, name) for name in SAMPLING_FLAGS}
    return SamplingParams(**sampling_kwargs(base, overrides), seed=args.seed, stop=tuple(args.stop))


#: a model load's own stages (engine.loader.load.load_model): seconds, shown on a terminal
LOAD_STAGES = ("read", "quantize", "settle")


def progress_printer(stream: Any = None) -> Callable[[str, int, int], None]:
    """Progress of a pull or import on ``stream`` (default: stderr as it is when called, not
    as it was at import): one updating line on a terminal, a line per quarter otherwise (logs
    stay short)."""
    stream = sys.stderr if stream is None else stream
    tty = bool(getattr(stream, "isatty", lambda: False)())
    step = 1 if tty else 25
    last: dict[str, int] = {}

    def report(stage: str, done: int, total: int) -> None:
        if stage == "load":  # one quick step (0/1, 1/1): nothing worth a line
            return
        if stage in LOAD_STAGES and not tty:  # a load's own: on a terminal's line only
            return
        pct = int(100 * done / max(total, 1)) // step * step
        if last.get(stage) == pct:
            return
        last[stage] = pct
        amount = f"{done}/{total}"
        if stage == "download" and total > 1:  # pip's bytes (a pip before 24.1 tells none)
            amount = f"{format_size(done)} of {format_size(total)}"
        line = f"{stage:>10}: {pct:3d}% ({amount})"
        if tty:
            stream.write("\r" + line + ("\n" if done >= total else ""))
        else:
            stream.write(line + "\n")
        stream.flush()

    return report


def load_engine(
    args: argparse.Namespace, precision: str | None = None, config: Any = None
) -> LLMEngine:
    """The command's model (``--model``: default, a folder or a .gguf file) through the one
    loader the app uses too (:func:`app.loading.load_engine`). ``config`` (an
    ``EngineConfig``) defaults to the command's KV and scheduling options."""
    from app.loading import LoadSpec
    from app.loading import load_engine as load
    from engine.core.config import EngineConfig

    set_threads(args.threads)
    if config is None:
        config = (
            engine_config(args) if hasattr(args, "block_size")
            else EngineConfig(kv_dtype=getattr(args, "kv_dtype", "auto"))
        )  # fmt: skip
    speculation = speculative_config(args)  # bad options fail before the load
    spec = LoadSpec(args.model, precision or args.precision, args.device,
                    tensor_parallel=getattr(args, "tensor_parallel", 1))  # fmt: skip
    engine = load(spec, progress_printer(), config=config)
    if speculation is not None:
        print(f"speculative decoding: building the drafter {speculation.label} …",
              file=sys.stderr, flush=True)  # fmt: skip
        engine.set_speculation(speculation)
    return engine


def speculative_config(args: argparse.Namespace) -> Any:
    """``--speculative`` / ``--draft-k`` / ``--fixed-k`` as a ``SpeculativeConfig`` (None: off),
    for the commands that run one drafter."""
    from engine.speculative.config import parse_speculative

    drafters = getattr(args, "speculative", None)
    if not drafters:
        return None
    if len(drafters) > 1 or len(args.draft_k) > 1:
        raise InvalidRequestError(
            "give one --speculative drafter and one --draft-k here (bench --workload "
            "speculative compares several)"
        )
    return parse_speculative(drafters[0], args.draft_k[0], adaptive=args.adaptive_k)


def set_threads(threads: int | None) -> None:
    """``--threads`` checked, then given to the engine (None: its default)."""
    from engine.hardware.threads import set_threads as set_engine_threads

    if threads is not None and threads < 1:
        raise InvalidRequestError(f"--threads must be at least 1, got {threads}")
    set_engine_threads(threads)
