"""The ``infersight`` command.

Qt is imported only on the path that opens the window and torch only where a command needs
the engine, so ``infersight --help`` is instant. Every :class:`~engine.errors.InfersightError`
ends the command with one clear line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from engine.errors import InfersightError, InvalidRequestError

if TYPE_CHECKING:
    import socket

    from engine.core.engine import LLMEngine
    from engine.core.sampling import SamplingParams

log = logging.getLogger("infersight")

PRECISION_CHOICES = ("fp32", "bf16", "fp16")
MODEL_HELP = "'default', an HF model folder or a .gguf file (imported into the store once)"
DEVICE_HELP = "auto (CUDA when torch sees one, else cpu), cpu, cuda, cuda:1 …"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.verbose:
        for name in ("engine", "app", "infersight"):
            logging.getLogger(name).setLevel(logging.DEBUG)
    if not hasattr(args, "handler"):  # no command: the main job
        args = parser.parse_args([*(["-v"] if args.verbose else []), "app"])
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except InfersightError as exc:
        print(f"infersight: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninfersight: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug or an environment failure: say so in one line
        log.debug("unexpected error", exc_info=True)
        print(
            f"infersight: internal error: {type(exc).__name__}: {exc} "
            "(run with -v for the traceback, and please report it)",
            file=sys.stderr,
        )
        return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="infersight",
        description="Run local LLMs and see inside the inference engine. "
        "With no command: open the desktop app on the default model.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the engine does")
    sub = parser.add_subparsers(metavar="COMMAND")

    p = sub.add_parser("app", help="open the desktop app (the default with no command)")
    p.add_argument("--model", default=None, help="'default', an HF model folder or a .gguf file")
    p.add_argument("--precision", default=None, help="fp32, bf16, int8, int4-g32 … (see chat)")
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    p.add_argument("--data-dir", default=None, help="where chats and settings live")
    p.set_defaults(handler=cmd_app)

    p = sub.add_parser("chat", help="interactive terminal chat (streaming, multi-turn)")
    _model_args(p)
    _engine_args(p)
    _sampling_args(p, default_max_new=512)
    p.add_argument("--system", help="system prompt")
    p.set_defaults(handler=cmd_chat)

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server, with /metrics")
    _model_args(p)
    _engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    g.add_argument("--port", type=int, default=8000, help="0: any free port, named on stderr")
    g.add_argument(
        "--api-key", default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health "
        "(default: $INFERSIGHT_API_KEY; none: no key)",
    )  # fmt: skip
    g.add_argument("--served-model-name", default=None, help="the model id clients name")
    g.add_argument("--max-batch-size", type=int, default=16)
    g.add_argument("--max-waiting", type=int, default=64, help="requests queued before 503")
    g.add_argument("--max-waiting-tokens", type=int, default=65_536, help="their prompt tokens")
    g.add_argument("--queue-timeout", type=float, default=60.0, help="seconds a request may wait")
    g.add_argument("--max-n", type=int, default=8, help="largest n (choices per request)")
    g.add_argument("--max-tokens", type=int, default=4096, help="largest max_tokens")
    g.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body")
    g.add_argument(
        "--self-test-interval", type=float, default=300.0, metavar="S",
        help="seconds between self-tests (a fixed greedy prompt that must keep its first "
        "answer; 0: only at start)",
    )  # fmt: skip
    g.add_argument(
        "--oom-margin-mib", type=int, default=256,
        help="GPU memory held back and let go when a step runs out of memory",
    )  # fmt: skip
    p.set_defaults(handler=cmd_serve)

    p = sub.add_parser("generate", help="generate text from one prompt, streamed to stdout")
    _model_args(p)
    _engine_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="raw prompt text (no chat template)")
    src.add_argument("--chat", help="a user message, wrapped in the model's chat template")
    p.add_argument("--system", help="system prompt (with --chat)")
    _sampling_args(p, default_max_new=128)
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    p.set_defaults(handler=cmd_generate)

    p = sub.add_parser("tokenize", help="token ids of each stdin line, as JSON arrays")
    _model_args(p, precision=False)
    p.set_defaults(handler=cmd_tokenize)

    p = sub.add_parser("bench", help="measure speed and latency, optionally vs transformers")
    _model_args(p)
    _engine_args(p)
    p.add_argument(
        "--workload",
        choices=("single", "mixed", "chat", "speculative"),
        default="single",
        help="single: one request, prefill and decode speed (default); mixed: many requests "
        "of seeded random lengths through continuous batching; chat: a scripted conversation, "
        "each turn's TTFT with prefix caching off and on; speculative: plain decoding against "
        "each --speculative drafter at each --draft-k, on chat and input-grounded prompts",
    )
    p.add_argument("--prompt-len", type=int, default=32, help="single workload")
    p.add_argument("--new-tokens", type=int, default=128, help="single workload")
    p.add_argument("--repeats", type=int, default=3, help="single: alternating runs, medians")
    p.add_argument(
        "--batch", type=int, default=1, help="single workload: this many copies decode together"
    )
    p.add_argument("--requests", type=int, default=64, help="mixed workload")
    p.add_argument(
        "--max-batch-size", type=int, nargs="+", default=[1, 4, 16, 32], help="mixed workload"
    )
    p.add_argument("--seed", type=int, default=0, help="mixed and chat workloads")
    p.add_argument(
        "--shared-prefix", type=int, default=0, metavar="N",
        help="mixed workload: every prompt starts with the same N tokens (a system prompt)",
    )  # fmt: skip
    p.add_argument(
        "--prefix-cache", choices=("on", "off", "both"), default="on",
        help="mixed workload: run with prefix caching on, off, or both (off then on, at each "
        "batch size)",
    )  # fmt: skip
    p.add_argument("--turns", type=int, default=10, help="chat workload")
    p.add_argument("--message-tokens", type=int, default=150, help="chat: tokens per message")
    p.add_argument("--reply-tokens", type=int, default=64, help="chat: longest reply")
    p.add_argument("--system-tokens", type=int, default=100, help="chat: system prompt tokens")
    p.add_argument("--compare-hf", action="store_true", help="also run transformers' generate")
    p.add_argument(
        "--hf-batch-sizes", type=int, nargs="+", default=None,
        help="mixed workload: transformers' static batch sizes (default: --max-batch-size)",
    )  # fmt: skip
    p.add_argument(
        "--profile",
        action="store_true",
        help="where a decode step's time goes (matmul kernels, attention, other ops, "
        "Python/dispatch) by part of the model, over --new-tokens steps of batch 1",
    )
    p.add_argument(
        "--attention",
        choices=("auto", "compare"),
        default="auto",
        help="with --profile: compare profiles the decode step with the paged attention "
        "kernel and with gather + SDPA, taking turns on the same requests (--repeats times)",
    )
    p.add_argument(
        "--table",
        nargs="+",
        metavar="PRECISION",
        default=None,
        help="batch-1 decode of each precision (eager and compiled where the load compiles) "
        "as a fraction of the memory-bandwidth limit, back to back in each repeat",
    )
    p.add_argument(
        "--llama-cpp",
        metavar="PYTHON",
        default=None,
        help="with --table: also time llama.cpp on the default model's own GGUF, run by this "
        "Python of an environment with llama-cpp-python (make bench-peers builds one)",
    )
    p.add_argument(
        "--gguf-types",
        nargs="+",
        default=["Q4_1"],
        choices=("Q4_1", "Q8_0", "F32"),
        help="with --llama-cpp: the GGUF's Q4_1 as shipped, and llama.cpp's requantizations",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(handler=cmd_bench)

    p = sub.add_parser(
        "tune",
        help="the batching tuner: load (closed or open loop) under one setting of the "
        "scheduler limits or a sweep over a grid of them",
        description="Runs the load generator (engine/bench/loadgen.py) against the model under "
        "each combination of the limits and loads given, and prints vLLM-bench figures per "
        "setting, the Pareto front of throughput against p95 latency, the best setting for the "
        "SLO and where latency starts to grow faster than the load (the knee).",
    )
    _model_args(p)
    _engine_args(p, limits=False)
    g = p.add_argument_group("load")
    g.add_argument(
        "--mode", choices=("closed", "constant", "poisson"), default="closed",
        help="closed: --users concurrent users; constant or poisson: --rate requests/s",
    )  # fmt: skip
    g.add_argument("--users", type=int, nargs="+", default=[8], help="closed loop: users")
    g.add_argument("--rate", type=float, nargs="+", default=[1.0], help="open loop: requests/s")
    g.add_argument("--burstiness", type=float, default=1.0, help="poisson: gamma shape")
    g.add_argument("--requests", type=int, default=32, help="requests per setting")
    g.add_argument(
        "--duration", type=float, default=None, help="seconds per setting (instead of a count)"
    )
    g.add_argument("--output-median", type=int, default=96, help="output tokens, median")
    g.add_argument("--output-max", type=int, default=320, help="output tokens, at most")
    g.add_argument("--documents", type=float, default=0.25, help="share of document prompts")
    g.add_argument("--conversations", type=float, default=0.15, help="share of long conversations")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("limits (each a list: the sweep runs every combination)")
    g.add_argument("--max-batch-size", type=int, nargs="+", default=[16])
    g.add_argument("--max-tokens-per-step", type=int, nargs="+", default=[512])
    g.add_argument("--max-wait-ms", type=float, nargs="+", default=[0.0])
    g.add_argument(
        "--kv-blocks", type=int, nargs="+", default=None, help="usable KV blocks (default: all)"
    )
    g = p.add_argument_group("reading the sweep")
    g.add_argument(
        "--slo", default="ttft=2s,tpot=150ms", help="per-request SLO for goodput and the best "
        "setting, e.g. ttft=500ms,tpot=100ms",
    )  # fmt: skip
    g.add_argument(
        "--capacity", type=float, default=None, metavar="RATE",
        help="machines like this one needed for RATE requests/s on average, from the knee",
    )  # fmt: skip
    g.add_argument("--peak-factor", type=float, default=3.0)
    g.add_argument("--headroom", type=float, default=1.5)
    g.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(handler=cmd_tune)

    p = sub.add_parser("eval", help="quality: perplexity, or two precisions compared")
    esub = p.add_subparsers(metavar="ACTION", required=True)
    ep = esub.add_parser("ppl", help="perplexity on a held text (default: Twelfth Night)")
    _model_args(ep)
    ep.add_argument("--text", help="a UTF-8 text file to score instead of the default")
    ep.add_argument("--max-tokens", type=int, default=4096)
    ep.add_argument("--context", type=int, default=512)
    ep.add_argument("--stride", type=int, default=256)
    ep.add_argument("--json", action="store_true")
    ep.set_defaults(handler=cmd_eval_ppl)
    ep = esub.add_parser(
        "compare",
        help="A against B token by token: KL, top-1 agreement, first divergence, noise floor",
    )
    ep.add_argument("--model", default="default", help=MODEL_HELP + " (A's model)")
    ep.add_argument("--b-model", help="B's model, if not A's (it must share A's tokenizer)")
    ep.add_argument("--a", default="fp32", help="reference precision")
    ep.add_argument("--b", required=True, help="precision to judge, e.g. int4-g32")
    source = ep.add_mutually_exclusive_group()
    source.add_argument("--prompt", help="one prompt (default: eight built-in prompts)")
    source.add_argument("--prompts", help="a file with one prompt per line")
    ep.add_argument("--new-tokens", type=int, default=48)
    ep.add_argument("--temperature", type=float, default=0.0, help="both sides (0 = greedy)")
    ep.add_argument("--seed", type=int, default=0, help="both sides' sampling seed")
    ep.add_argument(
        "--no-noise", action="store_true", help="skip the noise floor (A computed token by token)"
    )
    ep.add_argument("--device", default="auto", help=DEVICE_HELP)
    ep.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    ep.add_argument(
        "--speculation", action="store_true",
        help="also measure speculative decoding with B drafting for A (k = 4 every step): "
        "the acceptance beside the one predicted from the two distributions",
    )  # fmt: skip
    ep.add_argument("--json", action="store_true")
    ep.set_defaults(handler=cmd_eval_compare)

    ep = esub.add_parser(
        "scan",
        help="which layers cost the quality: quantize one block at a time, plan a mixed: spec",
    )
    ep.add_argument("--model", default="default", help=MODEL_HELP)
    ep.add_argument("--low", required=True, help="each block's format: int8, int4-g32|g64|g128")
    ep.add_argument("--high", help="the format kept blocks get (default: int8 above INT4, "
                    "else none = bf16)")  # fmt: skip
    budget = ep.add_mutually_exclusive_group()
    budget.add_argument("--budget-mib", type=float, help="the weights' size limit in MiB")
    budget.add_argument(
        "--budget-like", metavar="SPEC", help="the size of this spec's weights, e.g. int4-g32"
    )
    ep.add_argument("--tokens", type=int, default=256, help="tokens of the held text to scan on")
    ep.add_argument(
        "--ppl",
        action="store_true",
        help="also measure the plan's perplexity (and --budget-like's) with eval ppl's protocol",
    )
    ep.add_argument("--ppl-tokens", type=int, default=1024, help="tokens of text for --ppl")
    ep.add_argument("--device", default="auto", help=DEVICE_HELP)
    ep.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    ep.add_argument("--json", action="store_true")
    ep.set_defaults(handler=cmd_eval_scan)

    p = sub.add_parser("models", help="the default model and the models in the cache")
    msub = p.add_subparsers(metavar="ACTION", required=True)
    mp = msub.add_parser("pull", help="fetch and convert the default model (once)")
    mp.set_defaults(handler=cmd_models_pull)
    mp = msub.add_parser("list", help="known models: size on disk, parameters, architecture")
    mp.set_defaults(handler=cmd_models_list)

    p = sub.add_parser(
        "plan",
        help="the memory plan of a model before loading it: weights, KV, peak, what fits",
    )
    p.add_argument(
        "--model",
        default="default",
        help="'default', an HF model folder, a .gguf file, or a config.json (shapes only)",
    )
    p.add_argument(
        "--precision",
        default=None,
        help="one precision for the whole plan, or several, comma-separated, for a table "
        f"(default: {','.join(PLAN_PRECISIONS)})",
    )
    p.add_argument("--device", default="auto", help=DEVICE_HELP + " (any, with --memory)")
    p.add_argument(
        "--memory",
        default=None,
        help="plan for this much device memory (12GiB, 24GB …) instead of what is free here",
    )
    p.add_argument(
        "--kv-memory",
        type=float,
        default=None,
        help="the KV pool a load would allocate: bytes (> 1) or a fraction of what is left",
    )
    p.add_argument("--json", action="store_true", help="print the plan(s) as JSON")
    p.set_defaults(handler=cmd_plan)

    p = sub.add_parser("import-gguf", help="convert a llama.cpp GGUF into an HF-style folder")
    p.add_argument("gguf", help="the .gguf file")
    p.add_argument("outdir", help="the model folder to create")
    p.add_argument("--dtype", choices=("fp16", "bf16", "fp32"), default="fp16")
    p.set_defaults(handler=cmd_import_gguf)
    return parser


THREADS_HELP = (
    "CPU threads (default: $INFERSIGHT_THREADS, else the fastest count for the model, timed "
    "once per machine)"
)


def _model_args(p: argparse.ArgumentParser, *, precision: bool = True) -> None:
    p.add_argument("--model", default="default", help=MODEL_HELP)
    if precision:
        p.add_argument(
            "--precision",
            default="fp32",
            help="fp32, bf16, fp16, int8, int4-g32|g64|g128 (+head), or mixed:attn=int8,"
            "mlp=int4-g32 with per-layer overrides such as mlp.0-2=int8 (see eval scan)",
        )
        p.add_argument("--device", default="auto", help=DEVICE_HELP)
        p.add_argument("--threads", type=int, default=None, help=THREADS_HELP)


def _engine_args(p: argparse.ArgumentParser, *, limits: bool = True) -> None:
    g = p.add_argument_group("KV cache and scheduling")
    g.add_argument(
        "--kv-memory",
        type=float,
        default=None,
        help="KV pool size: bytes (> 1) or a fraction of free memory (<= 1)",
    )
    g.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    if limits:
        g.add_argument("--max-tokens-per-step", type=int, default=512, help="prefill chunk budget")
    g.add_argument(
        "--cache-window",
        type=int,
        default=None,
        metavar="N",
        help="keep only the last N tokens (plus --sink first ones) in the KV cache",
    )
    g.add_argument("--sink", type=int, default=4, help="first tokens kept with --cache-window")
    g.add_argument(
        "--no-prefix-cache", dest="prefix_caching", action="store_false",
        help="compute every prompt in full (prefix caching shares the KV of prefixes already "
        "computed: earlier turns, a shared system prompt)",
    )  # fmt: skip
    g.add_argument(
        "--decode-graph",
        choices=("auto", "on", "off"),
        default=None,
        help="run decode steps as one TorchInductor graph: on, off, or auto (where measured "
        "faster on this kind of CPU/GPU); default: $INFERSIGHT_DECODE_GRAPH or auto",
    )
    g = p.add_argument_group("speculative decoding")
    g.add_argument(
        "--speculative", nargs="+", default=None, metavar="DRAFTER",
        help="draft tokens and verify them in one step: self:PRECISION (the model's own "
        "weights once more, e.g. self:int4-g32+head), lookup (n-grams of the prompt and reply "
        "so far, no model) or model:DIR (a smaller model with the same tokenizer); bench "
        "--workload speculative takes several",
    )  # fmt: skip
    g.add_argument(
        "--draft-k", nargs="+", type=int, default=[8], metavar="K",
        help="most draft tokens per step (default 8; bench --workload speculative takes several)",
    )  # fmt: skip
    g.add_argument(
        "--fixed-k", dest="adaptive_k", action="store_false",
        help="draft k tokens every step (default: each request adapts k to its acceptance)",
    )  # fmt: skip


def engine_config(
    args: argparse.Namespace, max_batch_size: int = 16, max_tokens_per_step: int | None = None
) -> Any:
    from engine.core.engine import EngineConfig
    from engine.core.scheduler import SchedulerLimits
    from engine.kv_cache.paged import CacheWindow

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
        limits=SchedulerLimits(
            max_batch_size=max_batch_size, max_tokens_per_step=max_tokens_per_step
        ),
        window=window,
        decode_graph=args.decode_graph,
        prefix_caching=args.prefix_caching,
    )


#: sampling flags → ``SamplingParams`` fields; a flag left out keeps the model's default
SAMPLING_FLAGS = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def _sampling_args(p: argparse.ArgumentParser, *, default_max_new: int) -> None:
    g = p.add_argument_group(
        "sampling",
        "Unset options take the model's own defaults (its generation_config.json; greedy "
        "when it has none); each option given overrides just that value.",
    )
    g.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help=f"default: the model's, else {default_max_new}",
    )
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=None, help="0 = off")
    g.add_argument("--top-p", type=float, default=None, help="1 = off")
    g.add_argument("--min-p", type=float, default=None, help="0 = off")
    g.add_argument("--repetition-penalty", type=float, default=None, help="1 = off")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], metavar="STR", help="stop string")
    p.set_defaults(fallback_max_new_tokens=default_max_new)


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


def progress_printer(stream: Any = sys.stderr) -> Callable[[str, int, int], None]:
    """Progress of a pull or import on stderr: one updating line on a terminal, a line per
    quarter otherwise (logs stay short)."""
    tty = bool(getattr(stream, "isatty", lambda: False)())
    step = 1 if tty else 25
    last: dict[str, int] = {}

    def report(stage: str, done: int, total: int) -> None:
        if stage == "load":  # one quick step (0/1, 1/1): nothing worth a line
            return
        pct = int(100 * done / max(total, 1)) // step * step
        if last.get(stage) == pct:
            return
        last[stage] = pct
        line = f"{stage:>10}: {pct:3d}% ({done}/{total})"
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
    from engine.core.engine import EngineConfig

    _set_threads(args.threads)
    if config is None:
        config = engine_config(args) if hasattr(args, "block_size") else EngineConfig()
    speculation = speculative_config(args)  # bad options fail before the load
    spec = LoadSpec(args.model, precision or args.precision, args.device)
    engine = load(spec, progress_printer(), config=config)
    if speculation is not None:
        print(f"speculative decoding: building the drafter {speculation.label} …",
              file=sys.stderr, flush=True)  # fmt: skip
        engine.set_speculation(speculation)
    return engine


def speculative_config(args: argparse.Namespace) -> Any:
    """``--speculative`` / ``--draft-k`` / ``--fixed-k`` as a ``SpeculativeConfig`` (None: off),
    for the commands that run one drafter."""
    from engine.speculative.speculator import parse_speculative

    drafters = getattr(args, "speculative", None)
    if not drafters:
        return None
    if len(drafters) > 1 or len(args.draft_k) > 1:
        raise InvalidRequestError(
            "give one --speculative drafter and one --draft-k here (bench --workload "
            "speculative compares several)"
        )
    return parse_speculative(drafters[0], args.draft_k[0], adaptive=args.adaptive_k)


def _set_threads(threads: int | None) -> None:
    from engine.hardware.threads import set_threads

    if threads is not None and threads < 1:
        raise InvalidRequestError(f"--threads must be at least 1, got {threads}")
    set_threads(threads)


def cmd_generate(args: argparse.Namespace) -> int:
    sampling_params(args)  # check the flags before loading anything
    if (args.prompt if args.prompt is not None else args.chat) == "":
        raise InvalidRequestError("the prompt is empty; give some text to continue")
    engine = load_engine(args)
    params = sampling_params(args, engine.default_sampling)
    if args.chat is not None:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.chat})
        prompt_ids = engine.chat_prompt_ids(messages)
    else:
        prompt_ids = engine.tokenizer.encode_prompt(args.prompt)
    generation = engine.generate(prompt_ids, params)
    for event in generation:
        if not args.json:
            sys.stdout.write(event.text)
            sys.stdout.flush()
    if args.json:
        print(json.dumps(generation.result.as_dict(), ensure_ascii=False))
    else:
        sys.stdout.write("\n")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    from app.server.routes import Server, ServerLimits

    for name in ("max_batch_size", "max_waiting", "max_waiting_tokens", "max_n",
                 "max_tokens", "max_body_bytes"):  # fmt: skip
        if getattr(args, name) < 1:
            raise InvalidRequestError(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 <= args.port <= 65535:
        raise InvalidRequestError("--port must be 1 to 65535 (or 0: any free port)")
    if not args.queue_timeout > 0:
        raise InvalidRequestError("--queue-timeout must be > 0 seconds")
    if args.self_test_interval < 0 or args.oom_margin_mib < 0:
        raise InvalidRequestError("--self-test-interval and --oom-margin-mib must be >= 0")
    # before minutes of loading, not after; any free port is taken now and held
    sock = _free_port(args.host) if args.port == 0 else None
    port = args.port if sock is None else int(sock.getsockname()[1])
    if sock is None:
        _check_port(args.host, port)
    limits = ServerLimits(
        max_waiting=args.max_waiting, max_waiting_tokens=args.max_waiting_tokens,
        queue_timeout_s=args.queue_timeout, max_n=args.max_n, max_tokens=args.max_tokens,
        max_body_bytes=args.max_body_bytes, self_test_s=args.self_test_interval,
        oom_margin_mib=args.oom_margin_mib,
    )  # fmt: skip
    import uvicorn

    engine = load_engine(args, config=engine_config(args, max_batch_size=args.max_batch_size))
    import logging

    from app.server.routes import JsonLines

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLines())
    server_log = logging.getLogger("infersight.server")
    server_log.addHandler(handler)
    server_log.setLevel(logging.INFO)
    server_log.propagate = False
    api_key = args.api_key or os.environ.get("INFERSIGHT_API_KEY") or None
    name = args.served_model_name or engine.name
    server = Server(engine, name=name, limits=limits, api_key=api_key)
    where = f"http://{args.host}:{port}"
    print(f"serving {name} ({engine.precision.text}, {engine.device}) on {where}/v1"
          + (" (API key required)" if api_key else ""), file=sys.stderr, flush=True)  # fmt: skip
    # On SIGTERM streams get 5 s to end before the lifespan cancels what still runs.
    if sock is None:
        uvicorn.run(
            server.app, host=args.host, port=port, log_level="warning",
            timeout_graceful_shutdown=5,
        )  # fmt: skip
        return 0
    uv = uvicorn.Server(uvicorn.Config(server.app, log_level="warning",
                                       timeout_graceful_shutdown=5))  # fmt: skip
    uv.run(sockets=[sock])
    return 0 if uv.started else 3  # uvicorn.run's status when it could not start


def _free_port(host: str) -> socket.socket:
    """A socket bound to any free port of ``host`` (``--port 0``), for uvicorn to serve on."""
    from app.server.routes import bind

    try:
        return bind(host, 0)
    except OSError as exc:
        raise InvalidRequestError(
            f"cannot listen on {host} ({exc.strerror or exc}): check --host"
        ) from None


def _check_port(host: str, port: int) -> None:
    import socket

    try:
        with socket.create_server((host, port)):
            pass
    except OSError as exc:
        raise InvalidRequestError(
            f"cannot listen on {host}:{port} ({exc.strerror or exc}); another program may be "
            "using it: choose another --port, or check --host"
        ) from None


def cmd_tokenize(args: argparse.Namespace) -> int:
    from app.loading import resolve_model_folder
    from engine.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(resolve_model_folder(args.model, progress_printer()))
    try:
        for line in _stdin_text():
            print(json.dumps(tokenizer.encode(line.rstrip("\n"))), flush=True)
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(f"stdin is not valid UTF-8 ({exc}); convert it first") from exc
    return 0


def _stdin_text() -> Any:
    """stdin decoded as strict UTF-8, whatever the locale says."""
    return open(sys.stdin.fileno(), encoding="utf-8", errors="strict", closefd=False)


def cmd_bench(args: argparse.Namespace) -> int:
    from app.loading import resolve_device, resolve_model_folder
    from engine.bench.speed import (
        BenchConfig,
        format_report,
        format_workload_report,
        run_bench,
        run_workload_bench,
    )
    from engine.core.engine import parse_precision

    for name in ("prompt_len", "new_tokens", "repeats", "requests", "batch", "turns",
                 "message_tokens", "reply_tokens"):  # fmt: skip
        if getattr(args, name) < 1:
            raise InvalidRequestError(f"--{name.replace('_', '-')} must be at least 1")
    if args.shared_prefix < 0 or args.system_tokens < 0:
        raise InvalidRequestError("--shared-prefix and --system-tokens must be at least 0")
    if any(b < 1 for b in args.max_batch_size):
        raise InvalidRequestError("--max-batch-size values must be at least 1")
    if any(b < 1 for b in args.hf_batch_sizes or ()):
        raise InvalidRequestError("--hf-batch-sizes values must be at least 1")
    device = resolve_device(args.device)
    parse_precision(args.precision, device)
    _set_threads(args.threads)
    config = engine_config(args, max_batch_size=max(args.max_batch_size))
    if args.table:
        _check_table_args(args)
    folder = resolve_model_folder(args.model, progress_printer())
    say = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
    if args.profile:
        return _bench_profile(args, folder, device, config)
    if args.table:
        return _bench_table(args, folder, config, say)
    if args.workload == "speculative":
        return _bench_speculative(args, folder, device, config, say)
    if args.workload == "chat":
        from engine.bench.chat import format_chat_report, run_chat_bench

        report = run_chat_bench(
            folder, turns=args.turns, message_tokens=args.message_tokens,
            reply_tokens=args.reply_tokens, system_tokens=args.system_tokens, seed=args.seed,
            precision=args.precision, device=device, engine_config=config, log=say,
        )  # fmt: skip
        print(json.dumps(report, indent=2) if args.json else format_chat_report(report))
        return 0
    if args.workload == "mixed":
        report = run_workload_bench(
            folder,
            requests=args.requests,
            batch_sizes=args.max_batch_size,
            precision=args.precision,
            device=device,
            compare_hf=args.compare_hf,
            hf_batch_sizes=args.hf_batch_sizes,
            seed=args.seed,
            engine_config=config,
            shared_prefix=args.shared_prefix,
            prefix_cache=args.prefix_cache,
            log=say,
        )
        print(json.dumps(report, indent=2) if args.json else format_workload_report(report))
        return 0
    report = run_bench(
        folder,
        BenchConfig(
            prompt_len=args.prompt_len,
            new_tokens=args.new_tokens,
            repeats=args.repeats,
            batch=args.batch,
        ),
        precision=args.precision,
        device=device,
        compare_hf=args.compare_hf,
        engine_config=config,
        log=say,
    )
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _bench_speculative(args: argparse.Namespace, folder: Any, device: str, config: Any,
                       say: Any) -> int:  # fmt: skip
    from engine.bench.speculative import format_spec_report, run_spec_bench
    from engine.speculative.speculator import parse_speculative

    drafters = args.speculative or ["lookup", "self:int4-g32+head"]
    for text in drafters:
        for k in args.draft_k:
            parse_speculative(text, k)  # bad options fail before the load
    from engine.loader.load import load_model

    engine = load_model(folder, precision=args.precision, device=device, config=config)
    report = run_spec_bench(
        engine, drafters, sorted(set(args.draft_k)), adaptive=args.adaptive_k,
        new_tokens=args.new_tokens, repeats=args.repeats, log=say,
    )  # fmt: skip
    print(json.dumps(report, indent=2) if args.json else format_spec_report(report))
    return 0


def _check_table_args(args: argparse.Namespace) -> None:
    """``bench --table``'s arguments, checked before anything loads."""
    from engine.core.engine import parse_precision

    for precision in args.table:
        parse_precision(precision, "cpu")
    if args.llama_cpp is None:
        return
    if args.model != "default":
        raise InvalidRequestError("--llama-cpp runs the default model's GGUF; use --model default")
    if shutil.which(args.llama_cpp) is None:
        raise InvalidRequestError(
            f"--llama-cpp {args.llama_cpp}: no such program; give the Python of an environment "
            "with llama-cpp-python (`make bench-peers` builds .peers/venv)"
        )


def _bench_table(args: argparse.Namespace, folder: Any, config: Any, say: Any) -> int:
    from engine.bench.speed import BenchConfig, format_table, run_table
    from engine.store.model_store import default_gguf_path, fetch_default_gguf

    gguf = None
    if args.llama_cpp:
        gguf = default_gguf_path() if default_gguf_path().is_file() else fetch_default_gguf()
    report = run_table(
        folder,
        args.table,
        BenchConfig(prompt_len=args.prompt_len, new_tokens=args.new_tokens, repeats=args.repeats),
        engine_config=config,
        llama_python=args.llama_cpp,
        gguf=gguf,
        gguf_types=tuple(args.gguf_types),
        log=say,
    )
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0


def _bench_profile(args: argparse.Namespace, folder: Any, device: str, config: Any) -> int:
    import torch

    from engine.bench.profile import format_profile, profile_decode
    from engine.bench.speed import bench_prompt
    from engine.loader.load import load_model

    engine = load_model(folder, precision=args.precision, device=device, config=config)
    prompt = bench_prompt(engine, args.prompt_len, args.seed)
    where = device
    if device == "cpu":
        where += f", {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads"
    title = f"{engine.name} · {args.precision} · {where}"
    if args.attention == "compare":
        return _profile_attention_paths(args, engine, prompt, title)
    result = profile_decode(engine, prompt, steps=args.new_tokens, batch=args.batch)
    if args.json:
        print(json.dumps({"model": engine.name, "precision": args.precision, "device": where,
                          **result.as_dict()}, indent=2))  # fmt: skip
    else:
        print(format_profile(result, title))
    return 0


def _profile_attention_paths(args: argparse.Namespace, engine: Any, prompt: Any, title: str) -> int:
    """``bench --profile --attention compare``: the decode step with the paged kernel and
    with the portable gather + SDPA, taking turns on the same requests."""
    import statistics
    from contextlib import nullcontext

    from engine.bench.profile import format_profile, profile_decode_variants
    from engine.kernels import paged_decode

    if not paged_decode.kernel().available:
        raise InvalidRequestError(
            f"the paged decode kernel is not available here: {paged_decode.status()}"
        )
    runs = profile_decode_variants(
        engine, prompt, {"paged": nullcontext, "gather": paged_decode.portable},
        steps=args.new_tokens, batch=args.batch, repeats=args.repeats,
    )  # fmt: skip
    # the fastest repeat of each: the one least disturbed by the machine's other work; the
    # ratio is the median of each repeat's own (the two paths ran back to back in it)
    best = {name: min(ps, key=lambda p: p.step_ms) for name, ps in runs.items()}
    attention = {name: p.kind_total("attention") for name, p in best.items()}
    ratios = [
        paged.kind_total("attention") / gather.kind_total("attention")
        for paged, gather in zip(runs["paged"], runs["gather"], strict=True)
    ]
    report = {
        "title": title, "batch": args.batch, "context": args.prompt_len,
        "paths": {name: p.as_dict() for name, p in best.items()},
        "attention_ms": attention,
        "attention_ms_each_repeat": {
            name: [p.kind_total("attention") for p in ps] for name, ps in runs.items()
        },
        "step_ms": {name: p.step_ms for name, p in best.items()},
        "attention_ratio": statistics.median(ratios),
        "attention_ratio_each_repeat": ratios,
    }  # fmt: skip
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for name, p in best.items():
        path = "paged kernel" if name == "paged" else "gather + SDPA"
        print(format_profile(p, f"{title} · attention: {path}"), end="\n\n")
    print(
        f"attention incl. its K/V reads: {attention['paged']:.1f} ms per step with the paged "
        f"kernel, {attention['gather']:.1f} ms with gather + SDPA "
        f"(fastest of {args.repeats} each); paged / gather in each repeat: "
        + ", ".join(f"{r:.2f}" for r in ratios)
        + f" (median {report['attention_ratio']:.2f}); decode step "
        f"{best['paged'].step_ms:.1f} against {best['gather'].step_ms:.1f} ms (batch "
        f"{args.batch}, {args.prompt_len}-token contexts)"
    )
    return 0


def _read_text_file(path: str) -> str:
    from pathlib import Path

    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InvalidRequestError(f"{path} does not exist; give a UTF-8 text file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"cannot read {path} as UTF-8 text: {exc}") from exc


def tune_settings(args: argparse.Namespace) -> tuple[list[Any], Any]:
    """``tune``'s grid and SLO from its arguments, every value checked before a load."""
    from engine.bench.loadgen import SLO, LoadSpec, PromptMix
    from engine.bench.tuning import grid

    mix = PromptMix(
        documents=args.documents, conversations=args.conversations,
        output_median=args.output_median, output_max=args.output_max,
        output_min=min(16, args.output_median),
    )  # fmt: skip
    base = LoadSpec(
        mode=args.mode, burstiness=args.burstiness, seed=args.seed, mix=mix,
        requests=None if args.duration is not None else args.requests,
        duration_s=args.duration,
    )  # fmt: skip
    loads = args.users if args.mode == "closed" else args.rate
    for value in loads:  # checks each one, as users or as a rate
        if args.mode == "closed":
            LoadSpec(mode="closed", users=int(value))
        else:
            LoadSpec(mode=args.mode, rate=float(value))
    for name in ("max_batch_size", "max_tokens_per_step", "kv_blocks"):
        if any(v < 1 for v in getattr(args, name) or ()):
            raise InvalidRequestError(f"--{name.replace('_', '-')} values must be at least 1")
    if any(not w >= 0 for w in args.max_wait_ms):
        raise InvalidRequestError("--max-wait-ms values must be >= 0")
    settings = grid(
        base, max_batch_size=args.max_batch_size, max_tokens_per_step=args.max_tokens_per_step,
        max_wait_ms=args.max_wait_ms, kv_blocks=args.kv_blocks or (), loads=loads,
    )  # fmt: skip
    slo = SLO.parse(args.slo) if args.slo else None
    return settings, slo


def cmd_tune(args: argparse.Namespace) -> int:
    import torch

    from app.loading import resolve_device, resolve_model_folder
    from engine.bench.loadgen import drive
    from engine.bench.tuning import Sweep, format_points, sweep_report
    from engine.core.engine import parse_precision

    settings, slo = tune_settings(args)
    device = resolve_device(args.device)
    parse_precision(args.precision, device)
    _set_threads(args.threads)
    config = engine_config(
        args, max_batch_size=max(args.max_batch_size),
        max_tokens_per_step=max(args.max_tokens_per_step),
    )  # fmt: skip
    folder = resolve_model_folder(args.model, progress_printer())
    from engine.loader.load import load_model

    engine = load_model(folder, precision=args.precision, device=device, config=config)
    sweep = Sweep(engine, settings, slo=slo)
    shown = [0]

    def progress() -> None:
        if len(sweep.points) > shown[0]:
            shown[0] = len(sweep.points)
            p = sweep.points[-1]
            r = p.result
            line = f"{r.output_throughput:.1f} out tok/s, p95 TTFT {r.ttft_ms['p95']:.0f} ms"
            print(f"[{shown[0]}/{len(settings)}] {p.label}: {line}", file=sys.stderr)

    try:
        drive(engine, sweep, on_step=progress)
    except KeyboardInterrupt:
        sweep.stop()
        print("stopped: the settings measured so far follow", file=sys.stderr)
    progress()
    report = sweep_report(
        sweep.points, slo, target_rate=args.capacity, peak_factor=args.peak_factor,
        headroom=args.headroom,
    )  # fmt: skip
    where = str(device)
    if engine.device.type == "cpu":
        where += f", {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads"
    report = {"model": engine.name, "precision": args.precision, "device": where,
              "kv_blocks": engine.kv.manager.num_blocks, **report}  # fmt: skip
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{engine.name} · {args.precision} · {where} · KV pool {engine.kv.manager.num_blocks} "
          f"blocks × {engine.kv.block_size}")  # fmt: skip
    print(format_points(sweep.points, slo))
    print("Pareto front (output tok/s vs p95 TTFT): " + ", ".join(report["pareto_ttft"]))
    if slo is not None:
        print(f"best for {slo.describe()} at p95: {report['best_for_slo'] or 'none meets it'}")
    for name, k in report["knees"].items():
        print(f"knee of {name}: {k['label']} ({k['request_throughput']:.2f} req/s)")
        if "capacity" in k:
            print("  " + k["capacity"]["text"])
    if args.capacity is not None and not report["knees"]:
        print("no knee: sweep at least three loads of one setting, up to where latency grows")
    return 0


def cmd_eval_ppl(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from engine.evals.perplexity import default_text, perplexity

    for name in ("max_tokens", "context", "stride"):
        if getattr(args, name) < 1:
            raise InvalidRequestError(f"--{name.replace('_', '-')} must be at least 1")
    text_path = args.text or str(default_text())
    text = _read_text_file(text_path)
    engine = load_engine(args)
    result = perplexity(
        engine,
        text,
        text_name=text_path,
        max_tokens=args.max_tokens,
        context=args.context,
        stride=args.stride,
    )
    if args.json:
        print(json.dumps(asdict(result), indent=2))
    else:
        print(
            f"{engine.name} {result.precision}: perplexity {result.perplexity:.3f} over "
            f"{result.scored} tokens of {result.text} (context {result.context}, "
            f"stride {result.stride})"
        )
    return 0


def cmd_eval_compare(args: argparse.Namespace) -> int:
    from app.loading import resolve_device
    from engine.core.engine import parse_precision
    from engine.core.sampling import SamplingParams
    from engine.evals.compare import Side, compare_prompt, document
    from engine.evals.perplexity import DEFAULT_PROMPTS

    device = resolve_device(args.device)
    parse_precision(args.a, device)
    parse_precision(args.b, device)
    if args.new_tokens < 1:
        raise InvalidRequestError("--new-tokens must be at least 1")
    prompts = DEFAULT_PROMPTS
    if args.prompt is not None:
        prompts = [args.prompt] if args.prompt.strip() else []
    elif args.prompts:
        prompts = [line.strip() for line in _read_text_file(args.prompts).splitlines()]
        prompts = [p for p in prompts if p]
    if not prompts:
        raise InvalidRequestError(f"{args.prompts or '--prompt'} holds no prompt (one per line)")
    side = Side(
        SamplingParams(max_new_tokens=args.new_tokens, temperature=args.temperature,
                       seed=args.seed)
    )  # fmt: skip
    # a KV pool for the longest prompt's answer, not a share of memory: A leaves room for B
    from engine.core.engine import EngineConfig

    tokens = max(len(p.encode()) for p in prompts) + 256 + args.new_tokens
    pool = EngineConfig(num_blocks=-(-tokens // 16) + 2)
    a = load_engine(args, args.a, pool)
    b = load_engine(argparse.Namespace(**{**vars(args), "model": args.b_model or args.model}),
                    args.b, pool)  # fmt: skip
    reports = []
    for i, prompt in enumerate(prompts):
        reports.append(compare_prompt(
            a, b, prompt, side, side, noise=not args.no_noise, speculate=args.speculation
        ))  # fmt: skip
        print(f"compared {i + 1}/{len(prompts)}", file=sys.stderr)
    if args.json:
        print(json.dumps(document(reports), indent=1, ensure_ascii=False))
        return 0
    print(f"A = {reports[0]['a']['precision']}, B = {reports[0]['b']['precision']}, "
          f"{args.new_tokens} tokens a prompt; figures on A's output, KL in nats")  # fmt: skip
    print(f"{'KL mean':>9} {'KL p99':>9} {'noise':>9} {'top-1':>6} {'1st diff':>8}  prompt")
    for r in reports:
        s, d = r["summary"], r["divergence"]
        diff = "-" if d["index"] is None else str(d["index"])
        noise = "-" if s["noise_kl_mean"] is None else f"{s['noise_kl_mean']:9.2e}"
        print(f"{s['kl_mean']:9.4f} {s['kl_p99']:9.4f} {noise:>9} {s['top1_agreement']:6.1%} "
              f"{diff:>8}  {r['prompt']}")  # fmt: skip
    n = len(reports)
    mean_kl = sum(r["summary"]["kl_mean"] for r in reports) / n
    top1 = sum(r["summary"]["top1_agreement"] for r in reports) / n
    flips = sum(r["summary"]["flips"] for r in reports)
    print(f"mean KL {mean_kl:.4f} nats, top-1 agreement {top1:.1%}, answers differ in {flips}/{n}")
    for r in reports:
        print(f"\n## {r['prompt']}\nA: {r['a']['text']!r}\nB: {r['b']['text']!r}")
        spec = r["summary"].get("speculative", {})
        if "measured" in spec:
            m = spec["measured"]
            key = "greedy_acceptance" if m["mode"] == "greedy" else "sampling_acceptance"
            print(f"B drafting for A (k = {m['k']}): {m['token_acceptance'] or 0:.1%} of drafted "
                  f"tokens accepted (predicted {spec.get(key) or 0:.1%}), "
                  f"{m['mean_acceptance_length'] or 1:.2f} tokens a step")  # fmt: skip
        elif "not_measured" in spec:
            print(f"B drafting for A: not measured ({spec['not_measured']})")
    return 0


def cmd_eval_scan(args: argparse.Namespace) -> int:
    from app.loading import resolve_device, resolve_model_folder
    from engine.core.engine import parse_precision
    from engine.evals.perplexity import default_text, perplexity
    from engine.evals.sensitivity import plan_mixed, scan_sensitivity
    from engine.model.config import ModelConfig
    from engine.model.tokenizer import Tokenizer
    from engine.quant.quantize import estimate_weight_bytes

    if args.tokens < 2 or args.ppl_tokens < 2:
        raise InvalidRequestError("--tokens and --ppl-tokens must be at least 2")
    if args.ppl and not args.budget_like:
        raise InvalidRequestError("--ppl compares the plan with --budget-like's spec; give both")
    device = resolve_device(args.device)
    _set_threads(args.threads)
    folder = resolve_model_folder(args.model, progress_printer())
    cfg = ModelConfig.from_file(folder / "config.json")
    budget = None
    if args.budget_mib is not None:
        budget = int(args.budget_mib * 2**20)
    elif args.budget_like:
        packed = None if device == "cpu" else False  # as the scan counts a tied head's copy
        budget = estimate_weight_bytes(
            cfg, parse_precision(args.budget_like, device), packed=packed
        )
    text = default_text().read_text(encoding="utf-8")
    ids = Tokenizer.from_folder(folder).encode(text)[: args.tokens]
    scan = scan_sensitivity(
        folder, args.low, high=args.high, text_ids=ids, device=device,
        progress=lambda i, n: print(f"scanned {i}/{n}", file=sys.stderr),
    )  # fmt: skip
    out: dict[str, Any] = {"scan": scan.to_dict()}
    plan = plan_mixed(scan, budget) if budget is not None else None
    if plan is not None:
        out["plan"] = plan.to_dict()
    if args.ppl and plan is not None:
        held = default_text()
        ppl = {}
        for spec in (plan.spec, args.budget_like):
            engine = load_engine(argparse.Namespace(**{**vars(args), "model": str(folder)}), spec)
            result = perplexity(engine, held.read_text(encoding="utf-8"), text_name=held.name,
                                max_tokens=args.ppl_tokens)  # fmt: skip
            ppl[spec] = {"perplexity": result.perplexity, "weights_bytes": engine.weights_bytes}
            del engine
        out["perplexity"] = ppl
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    mib = 2**-20
    print(f"{scan.model}: KL(fp32 ‖ one block at {scan.low}) on {scan.text_tokens} tokens, nats")
    print(f"{'layer':>5} {'attn':>10} {'mlp':>10}")
    by_layer: dict[int, dict[str, float]] = {}
    for b in scan.blocks:
        by_layer.setdefault(b.layer, {})[b.part] = b.kl
    for layer, kls in sorted(by_layer.items()):
        print(f"{layer:5d} {kls.get('attn', 0.0):10.2e} {kls.get('mlp', 0.0):10.2e}")
    print(f"every block at {scan.low}: KL {scan.all_low_kl:.4f}; sizes "
          f"{scan.min_bytes * mib:.1f}–{scan.max_bytes * mib:.1f} MiB")  # fmt: skip
    if plan is not None:
        print(f"plan for {plan.budget_bytes * mib:.1f} MiB: {plan.spec}")
        print(f"  {plan.bytes * mib:.1f} MiB, {len(plan.upgraded)} blocks at {scan.high}, "
              f"predicted KL {plan.predicted_kl:.4f} (first-order)")  # fmt: skip
    if "perplexity" in out and plan is not None:
        mixed, uniform = (out["perplexity"][s]["perplexity"] for s in (plan.spec, args.budget_like))
        verdict = "beats" if mixed < uniform else "does NOT beat"
        print(f"perplexity over {args.ppl_tokens} tokens of {default_text().name}: plan "
              f"{mixed:.3f}, {args.budget_like} {uniform:.3f}: the plan {verdict} "
              f"{args.budget_like}, the spec of its size")  # fmt: skip
    return 0


def cmd_models_pull(args: argparse.Namespace) -> int:
    from engine.store.model_store import pull_default

    path = pull_default(progress=progress_printer())
    print(path)
    return 0


def cmd_models_list(args: argparse.Namespace) -> int:
    from engine.store.model_store import known_models

    rows = [("name", "arch", "params", "on disk", "path")]
    for m in known_models():
        if m.present:
            rows.append(
                (
                    m.name,
                    m.architecture,
                    f"{m.parameters / 1e6:.1f}M",
                    f"{m.disk_bytes / 2**20:.0f} MiB",
                    str(m.path),
                )
            )
        else:
            rows.append((m.name, "-", "-", "not pulled", "run `infersight models pull`"))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())
    return 0


PLAN_PRECISIONS = ("fp16", "int8", "int8+head", "int4-g32", "int4-g32+head", "int4-g128+head")


def cmd_plan(args: argparse.Namespace) -> int:
    from pathlib import Path

    from app.loading import resolve_device, resolve_model_folder
    from engine.core.engine import EngineConfig
    from engine.loader.load import parse_bytes, plan_memory
    from engine.model.config import ModelConfig

    memory = parse_bytes(args.memory) if args.memory else None
    device = args.device if memory is not None and args.device != "auto" else None
    device = device or resolve_device(args.device)
    path = Path(args.model).expanduser()
    if path.suffix.lower() == ".json" and path.is_file():
        cfg, name = ModelConfig.from_file(path), path.stem
    elif path.suffix.lower() == ".gguf":  # its header: nothing is imported to plan it
        from engine.store.gguf_import import gguf_model_config

        cfg, name = gguf_model_config(path), path.stem
    else:
        folder = resolve_model_folder(args.model, progress_printer())
        cfg, name = ModelConfig.from_file(folder / "config.json"), folder.name
    config = EngineConfig(kv_memory=args.kv_memory)
    texts = [t.strip() for t in (args.precision or ",".join(PLAN_PRECISIONS)).split(",")]
    plans = [
        plan_memory(cfg, text, device, memory=memory, config=config, name=name)
        for text in texts
        if text
    ]
    if args.json:
        print(json.dumps([p.as_json() for p in plans], indent=2))
    elif len(plans) == 1:
        print("\n".join(plans[0].lines()))
    else:
        print(
            f"Memory plan: {name} on {plans[0].device}, {plans[0].budget_source} "
            f"{plans[0].budget_bytes / 2**30:.2f} GiB"
        )
        for plan in plans:
            print(f"  {plan.one_line()}")
    return 0 if any(p.fits for p in plans) else 3


def cmd_import_gguf(args: argparse.Namespace) -> int:
    from pathlib import Path

    from engine.store.gguf_import import import_gguf

    summary = import_gguf(
        Path(args.gguf), Path(args.outdir), dtype=args.dtype, progress=progress_printer()
    )
    types = ", ".join(f"{k}×{v}" for k, v in sorted(summary.tensor_types.items()))
    print(f"imported {summary.name} ({summary.architecture}; {types}) into {args.outdir}")
    return 0


def cmd_app(args: argparse.Namespace) -> int:
    from app.gui.launch import run_gui

    return run_gui(args)


def cmd_chat(args: argparse.Namespace) -> int:
    from app.cli.chat import run_chat

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sampling_params(args)  # check the flags before loading anything
    engine = load_engine(args)
    return run_chat(engine, sampling_params(args, engine.default_sampling), system=args.system)


if __name__ == "__main__":
    raise SystemExit(main())
