"""The ``infersight`` command: its parser and the dispatch to the commands, which live by
group in :mod:`app.cli.run`, :mod:`app.cli.serve`, :mod:`app.cli.bench`, :mod:`app.cli.eval`
and :mod:`app.cli.models`.

Qt is imported only on the path that opens the window and torch only where a command needs
the engine, so ``infersight --help`` is instant. Every :class:`~engine.errors.InfersightError`
ends the command with one clear line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from app.cli.bench import cmd_bench, cmd_tune
from app.cli.common import configure_cpu_allocator, configure_cuda_allocator
from app.cli.eval import cmd_calibrate, cmd_eval_compare, cmd_eval_ppl, cmd_eval_scan
from app.cli.kernels import add_kernels_parser
from app.cli.models import PLAN_PRECISIONS, add_models_parser, cmd_import_gguf, cmd_plan
from app.cli.options import (
    CPU_EXPERTS_HELP,
    DEVICE_HELP,
    MODEL_HELP,
    THREADS_HELP,
    UTILIZATION_HELP,
    engine_args,
    kv_dtype_arg,
    model_args,
    sampling_args,
    serve_args,
    tensor_parallel_arg,
    verbose_arg,
)
from app.cli.run import cmd_chat, cmd_generate, cmd_tokenize
from app.cli.serve import cmd_serve
from engine.errors import InfersightError, InvalidRequestError

log = logging.getLogger("infersight")


def main(argv: Sequence[str] | None = None) -> int:
    configure_cuda_allocator()  # before anything initialises CUDA
    configure_cpu_allocator()  # before anything imports torch
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
    verbose_arg(parser)
    sub = parser.add_subparsers(metavar="COMMAND")

    p = sub.add_parser("app", help="open the desktop app (the default with no command)")
    p.add_argument("--model", default=None, help="'default', an HF model folder or a .gguf file")
    p.add_argument("--precision", default=None, help="fp32, bf16, int8, int4-g32 … (see chat)")
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    p.add_argument(
        "--tensor-parallel", type=int, default=1, metavar="N",
        help="load the first model split over N processes (see docs/tensor-parallel.md)",
    )  # fmt: skip
    p.add_argument("--data-dir", default=None, help="where chats and settings live")
    p.add_argument(
        "--serve", type=int, default=None, metavar="PORT",
        help="serve the first model on 127.0.0.1:PORT once it is loaded (Serve on localhost "
        "ticked; the key: $INFERSIGHT_API_KEY, else one generated and shown)",
    )  # fmt: skip
    p.set_defaults(handler=cmd_app)

    p = sub.add_parser("chat", help="interactive terminal chat (streaming, multi-turn)")
    model_args(p)
    engine_args(p)
    sampling_args(p, default_max_new=512)
    p.add_argument("--system", help="system prompt")
    p.set_defaults(handler=cmd_chat)

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server, with /metrics")
    model_args(p)
    engine_args(p)
    serve_args(p)
    p.set_defaults(handler=cmd_serve)

    p = sub.add_parser("generate", help="generate text from one prompt, streamed to stdout")
    model_args(p)
    engine_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="raw prompt text (no chat template)")
    src.add_argument("--chat", help="a user message, wrapped in the model's chat template")
    p.add_argument("--system", help="system prompt (with --chat)")
    sampling_args(p, default_max_new=128)
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    p.add_argument("--json-schema", metavar="FILE",
                   help="hold the reply to this JSON schema (structured output)")  # fmt: skip
    p.set_defaults(handler=cmd_generate)

    p = sub.add_parser("tokenize", help="token ids of each stdin line, as JSON arrays")
    model_args(p, precision=False)
    p.set_defaults(handler=cmd_tokenize)

    p = sub.add_parser("bench", help="measure speed and latency, optionally vs transformers")
    model_args(p)
    engine_args(p)
    p.add_argument(
        "--workload",
        choices=("single", "mixed", "chat", "speculative", "structured"),
        default="single",
        help="single: one request, prefill and decode speed (default); mixed: many requests "
        "of seeded random lengths through continuous batching; chat: a scripted conversation, "
        "each turn's TTFT with prefix caching off and on; speculative: plain decoding against "
        "each --speculative drafter at each --draft-k, on chat and input-grounded prompts; "
        "structured: a --batch held to a JSON schema against the same batch free, the grammar "
        "mask's ms/step",
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
        "--kv-dtypes", nargs="+", metavar="DTYPE", default=None,
        help="single workload: the same weights behind a KV cache of each dtype, in turn "
        "within each repeat (e.g. auto int8 at --prompt-len 4096: what int8 KV buys decode)",
    )  # fmt: skip
    p.add_argument(
        "--prefill-table",
        nargs="+",
        metavar="PRECISION",
        default=None,
        help="prefill of one --prompt-len prompt in each precision (the first is the "
        "reference), every row in turn within each of --repeats; e.g. fp32 bf16 int8 w8a8 "
        "w8a8-sq",
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
        help="with --table: also time llama.cpp on the model's own GGUF (the default model's, "
        "or the one beside a synthetic model's weights), run by this Python of an environment "
        "with llama-cpp-python (make bench-peers builds one)",
    )
    p.add_argument(
        "--gguf-types",
        nargs="+",
        default=["Q4_1"],
        choices=("Q4_0", "Q4_1", "Q8_0", "F16", "F32"),
        help="with --llama-cpp: the model's GGUF in its own type (the default model's Q4_1, a "
        "synthetic model's F16), and llama.cpp's requantizations of it to the others",
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
    model_args(p)
    engine_args(p, limits=False)
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
    g.add_argument(
        "--endpoint", metavar="URL", default=None,
        help="load an OpenAI-compatible server at URL instead of a local model (vLLM, "
        "llama.cpp's server, Ollama, infersight serve …): its key from the keyring or "
        "$INFERSIGHT_ENDPOINT_KEY; the limits do not apply",
    )  # fmt: skip
    g.add_argument(
        "--endpoint-model", metavar="ID", default="",
        help="the model to ask the endpoint for (default: the first it lists)",
    )  # fmt: skip
    g.add_argument(
        "--endpoint-eos", action="store_true",
        help="let the endpoint's replies end at their end token: send no ignore_eos (for a "
        "server that refuses fields it does not know; the drawn lengths are then upper bounds)",
    )  # fmt: skip
    g.add_argument(
        "--traffic", metavar="NAME=SHARE,…", default="",
        help="with --endpoint: how requests are sent and the faults among them, e.g. "
        "completions=0.5,unstreamed=0.3,sampled=0.4,disconnect=0.05,cancel=0.05 (faults: "
        "disconnect, cancel, slow_reader, oversize_body, over_context, malformed); the report "
        "then counts how each request ended",
    )  # fmt: skip
    g.add_argument(
        "--guidellm", metavar="PATH", type=Path, default=None,
        help="also write the endpoint's runs as GuideLLM's benchmarks.json at PATH (one "
        "benchmark per load; guidellm export and its outputs read it)",
    )  # fmt: skip
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
    model_args(ep)
    ep.add_argument("--text", help="a UTF-8 text file to score instead of the default")
    ep.add_argument("--max-tokens", type=int, default=4096)
    ep.add_argument("--context", type=int, default=512)
    ep.add_argument("--stride", type=int, default=256)
    kv_dtype_arg(ep)
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
    for side in ("a", "b"):
        ep.add_argument(
            f"--{side}-kv-dtype", default="auto", metavar="DTYPE",
            help=f"{side.upper()}'s KV cache: auto, fp16, bf16, int8 or fp8 (--b int8 --b-kv-dtype "
            "... judges weights and cache together; the same precision on both sides, "
            "the cache alone, on one copy of the weights)",
        )  # fmt: skip
    for side in ("a", "b"):
        ep.add_argument(
            f"--{side}-lowbit", choices=("auto", "ours", "torch"), default=None,
            help=f"{side.upper()}'s INT4/INT8 CPU kernels: ours (activations quantized to int8 "
            "per block), torch's (float activations), or auto (default: INFERSIGHT_LOWBIT); "
            "the same precision on both sides with ours and torch measures what quantizing "
            "the activations costs",
        )  # fmt: skip
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
    tensor_parallel_arg(ep, "split A and B each over N processes")
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
    ep.add_argument(
        "--low", required=True, help="each block's format: int8, int4-g32|g64|g128, w8a8"
    )
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
    ep.add_argument(
        "--experts",
        action="store_true",
        help="a mixture of experts: also rank each expert alone (one pass from its layer per "
        "expert) with its share of the routed tokens",
    )
    ep.add_argument("--device", default="auto", help=DEVICE_HELP)
    ep.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    tensor_parallel_arg(
        ep, "not taken: the scan swaps one block at a time in a model held whole; the "
        "mixed: spec it plans loads split",
    )  # fmt: skip
    ep.add_argument("--json", action="store_true")
    ep.set_defaults(handler=cmd_eval_scan)

    p = sub.add_parser(
        "calibrate",
        help="activation statistics for w8a8-sq, from text the model writes itself "
        "(saved beside the model, reused by later loads)",
    )
    p.add_argument("--model", default="default", help=MODEL_HELP)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--from-file", metavar="TEXT", help="calibrate on this UTF-8 text instead")
    source.add_argument(
        "--random", action="store_true",
        help="calibrate on random tokens (the counter-example: w8a8-sq@random)",
    )  # fmt: skip
    p.add_argument("--prompts", type=int, default=20, help="prompts the model answers")
    p.add_argument("--samples", type=int, default=10, help="answers sampled per prompt")
    p.add_argument("--min-tokens", type=int, default=32, help="shortest sequence")
    p.add_argument("--max-tokens", type=int, default=2048, help="longest sequence")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", default="fp32", help="the float model that writes and reads")
    p.add_argument(
        "--sweep", action="store_true",
        help="only choose α again, on the calibration's saved statistics and held text",
    )  # fmt: skip
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    tensor_parallel_arg(
        p, "not taken: the statistics read every channel of a product in one process; the "
        "calibration a single process writes serves split loads too",
    )  # fmt: skip
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_calibrate)

    add_models_parser(sub, DEVICE_HELP)
    add_kernels_parser(sub)

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
        "--tensor-parallel", type=int, default=1, metavar="N",
        help="plan one rank of the model split over N devices (its largest shard: --memory is "
        "then each device's)",
    )  # fmt: skip
    p.add_argument(
        "--capability",
        default=None,
        help="plan for a CUDA GPU of this compute capability (7.5 for an RTX 20xx, 8.6 for an "
        "RTX 30xx …) instead of this machine's: below 8.0 bf16 and INT4 are not planned",
    )
    p.add_argument(
        "--kv-memory",
        type=float,
        default=None,
        help="the KV pool a load would allocate: bytes (> 1) or a fraction of what is left",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help=UTILIZATION_HELP)
    p.add_argument("--cpu-experts", default="0", metavar="N|auto", help=CPU_EXPERTS_HELP)
    kv_dtype_arg(p)
    p.add_argument("--json", action="store_true", help="print the plan(s) as JSON")
    p.set_defaults(handler=cmd_plan)

    p = sub.add_parser("import-gguf", help="convert a llama.cpp GGUF into an HF-style folder")
    p.add_argument("gguf", help="the .gguf file")
    p.add_argument("outdir", help="the model folder to create")
    p.add_argument("--dtype", choices=("fp16", "bf16", "fp32"), default="fp16")
    p.set_defaults(handler=cmd_import_gguf)
    return parser


def cmd_app(args: argparse.Namespace) -> int:
    from app.gui.launch import run_gui

    if args.serve is not None and not 1024 <= args.serve <= 65535:  # the panel's own range
        raise InvalidRequestError(f"--serve takes a port from 1024 to 65535, not {args.serve}")

    return run_gui(args)


if __name__ == "__main__":
    raise SystemExit(main())
