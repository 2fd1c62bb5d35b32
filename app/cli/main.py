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

from app.cli.bench import cmd_bench, cmd_tune
from app.cli.common import configure_cuda_allocator
from app.cli.eval import cmd_calibrate, cmd_eval_compare, cmd_eval_ppl, cmd_eval_scan
from app.cli.models import PLAN_PRECISIONS, add_models_parser, cmd_import_gguf, cmd_plan
from app.cli.run import cmd_chat, cmd_generate, cmd_tokenize
from app.cli.serve import cmd_serve
from engine.errors import InfersightError

log = logging.getLogger("infersight")

MODEL_HELP = "'default', an HF model folder or a .gguf file (imported into the store once)"
DEVICE_HELP = "auto (CUDA when torch sees one, else cpu), cpu, cuda, cuda:1 …"


def main(argv: Sequence[str] | None = None) -> int:
    configure_cuda_allocator()  # before anything initialises CUDA
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
    p.add_argument(
        "--tensor-parallel", type=int, default=1, metavar="N",
        help="load the first model split over N processes (see docs/tensor-parallel.md)",
    )  # fmt: skip
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
    g = p.add_argument_group(
        "replicas on Ray Serve (pip install 'infersight[ray]'; see docs/replicas.md)"
    )
    g.add_argument(
        "--ray", action="store_true",
        help="serve the same app as a Ray Serve deployment: an engine per replica, each with "
        "the limits above, Ray's proxy in front on --host/--port",
    )  # fmt: skip
    scale = g.add_mutually_exclusive_group()
    scale.add_argument("--replicas", type=int, default=None, metavar="N",
                       help="engine replicas (default 1)")  # fmt: skip
    scale.add_argument(
        "--autoscale", default=None, metavar="MIN..MAX",
        help="replicas between MIN and MAX, by Ray's autoscaler on ongoing requests",
    )  # fmt: skip
    g.add_argument(
        "--address", default=None,
        help="an existing Ray cluster ('auto' or HOST:PORT; default: start a local one)",
    )  # fmt: skip
    g.add_argument(
        "--config", default=None, metavar="FILE",
        help="a Ray Serve config (YAML or JSON: `infersight tune --capacity ... --json` "
        "writes one); its deployments' replicas and limits, its args the model and options",
    )  # fmt: skip
    g.add_argument("--cpus-per-replica", type=float, default=1.0,
                   help="Ray CPUs each engine replica reserves")  # fmt: skip
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
    p.add_argument("--json-schema", metavar="FILE",
                   help="hold the reply to this JSON schema (structured output)")  # fmt: skip
    p.set_defaults(handler=cmd_generate)

    p = sub.add_parser("tokenize", help="token ids of each stdin line, as JSON arrays")
    _model_args(p, precision=False)
    p.set_defaults(handler=cmd_tokenize)

    p = sub.add_parser("bench", help="measure speed and latency, optionally vs transformers")
    _model_args(p)
    _engine_args(p)
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
    _tensor_parallel_arg(ep, "split A and B each over N processes")
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
    ep.add_argument("--device", default="auto", help=DEVICE_HELP)
    ep.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    _tensor_parallel_arg(
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
    _tensor_parallel_arg(
        p, "not taken: the statistics read every channel of a product in one process; the "
        "calibration a single process writes serves split loads too",
    )  # fmt: skip
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_calibrate)

    add_models_parser(sub, DEVICE_HELP)

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
    p.add_argument("--json", action="store_true", help="print the plan(s) as JSON")
    p.set_defaults(handler=cmd_plan)

    p = sub.add_parser("import-gguf", help="convert a llama.cpp GGUF into an HF-style folder")
    p.add_argument("gguf", help="the .gguf file")
    p.add_argument("outdir", help="the model folder to create")
    p.add_argument("--dtype", choices=("fp16", "bf16", "fp32"), default="fp16")
    p.set_defaults(handler=cmd_import_gguf)
    return parser


UTILIZATION_HELP = (
    "on a GPU, without --kv-memory or --num-blocks: the share of its memory the engine takes "
    "in all (weights, a step's peak measured in a warm-up, the KV pool), in (0, 1] "
    "(default 0.9)"
)
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
            help="fp32, bf16, fp16, int8, int4-g32|g64|g128 (+head), w8a8 (INT8 activations "
            "too), w8a8-sq[@calibration] (smoothed: see calibrate), or mixed:attn=int8,"
            "mlp=int4-g32 with per-layer overrides such as mlp.0-2=int8 (see eval scan)",
        )
        p.add_argument("--device", default="auto", help=DEVICE_HELP)
        p.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
        _tensor_parallel_arg(
            p, "split the model over N processes (Megatron-style tensor parallelism; on CPUs "
            "over gloo, the threads shared out among them; a GPU each over NCCL)",
        )  # fmt: skip


def _tensor_parallel_arg(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument(
        "--tensor-parallel", type=int, default=1, metavar="N",
        help=f"{help} (docs/tensor-parallel.md)",
    )  # fmt: skip


def _engine_args(p: argparse.ArgumentParser, *, limits: bool = True) -> None:
    g = p.add_argument_group("KV cache and scheduling")
    g.add_argument(
        "--kv-memory",
        type=float,
        default=None,
        help="KV pool size: bytes (> 1) or a fraction of free memory (<= 1)",
    )
    g.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9, help=UTILIZATION_HELP)
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
    g.add_argument(
        "--cuda-graphs",
        choices=("auto", "on", "off"),
        default=None,
        help="replay decode steps as CUDA graphs, one per batch-size bucket (needs our Triton "
        "kernels): on, off, or auto (on a GPU with them); default: $INFERSIGHT_CUDA_GRAPHS or "
        "auto",
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


def cmd_app(args: argparse.Namespace) -> int:
    from app.gui.launch import run_gui

    return run_gui(args)


if __name__ == "__main__":
    raise SystemExit(main())
