"""The command line's argument groups, shared by the commands (:mod:`app.cli.main` builds the
parser from them) and by what reads a command's options without its parser: the replicas of
``serve --ray`` take ``infersight serve``'s defaults from :func:`serve_defaults`."""

from __future__ import annotations

import argparse
from typing import Any

MODEL_HELP = "'default', an HF model folder or a .gguf file (imported into the store once)"
DEVICE_HELP = "auto (CUDA when torch sees one, else cpu), cpu, cuda, cuda:1 …"


CPU_EXPERTS_HELP = (
    "a mixture of experts: keep the experts of the first N layers of experts in host memory, "
    "run on the CPU, and the rest on the device; auto: the fewest layers that let the plan "
    "fit (default 0)"
)
UTILIZATION_HELP = (
    "on a GPU, without --kv-memory or --num-blocks: the share of its memory the engine takes "
    "in all (weights, a step's peak measured in a warm-up, the KV pool), in (0, 1] "
    "(default 0.9)"
)
KV_DTYPE_HELP = (
    "what the KV cache holds: auto (the model's compute dtype), fp16 or bf16 (that float, "
    "named), int8 (each token's K and V rows with a scale of their own: about half a 16-bit "
    "cache's bytes, twice the context), fp8 (e4m3, GPUs with native FP8: sm_89+); default auto"
)
THREADS_HELP = (
    "CPU threads (default: $INFERSIGHT_THREADS, else the fastest count for the model, timed "
    "once per machine)"
)


def verbose_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("-v", "--verbose", action="store_true", help="log what the engine does")


def model_args(p: argparse.ArgumentParser, *, precision: bool = True) -> None:
    p.add_argument("--model", default="default", help=MODEL_HELP)
    if precision:
        p.add_argument(
            "--precision",
            default="fp32",
            help="fp32, bf16, fp16, int8, int4-g32|g64|g128 (+head, or +head8: an INT8 head), "
            "w8a8 (INT8 activations "
            "too), w8a8-sq[@calibration] (smoothed: see calibrate), or mixed:attn=int8,"
            "mlp=int4-g32 with per-layer overrides such as mlp.0-2=int8 (see eval scan)",
        )
        p.add_argument("--device", default="auto", help=DEVICE_HELP)
        p.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
        tensor_parallel_arg(
            p, "split the model over N processes (Megatron-style tensor parallelism; on CPUs "
            "over gloo, the threads shared out among them; a GPU each over NCCL)",
        )  # fmt: skip


def tensor_parallel_arg(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument(
        "--tensor-parallel", type=int, default=1, metavar="N",
        help=f"{help} (docs/tensor-parallel.md)",
    )  # fmt: skip


def kv_dtype_arg(p: Any) -> None:
    """``--kv-dtype`` (:mod:`engine.kv_cache.dtypes` checks the name)."""
    p.add_argument("--kv-dtype", default="auto", metavar="DTYPE", help=KV_DTYPE_HELP)


def engine_args(p: argparse.ArgumentParser, *, limits: bool = True) -> None:
    g = p.add_argument_group("KV cache and scheduling")
    kv_dtype_arg(g)
    g.add_argument(
        "--kv-memory",
        type=float,
        default=None,
        help="KV pool size: bytes (> 1) or a fraction of free memory (<= 1)",
    )
    g.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9, help=UTILIZATION_HELP)
    g.add_argument("--cpu-experts", default="0", metavar="N|auto", help=CPU_EXPERTS_HELP)
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


def sampling_args(p: argparse.ArgumentParser, *, default_max_new: int) -> None:
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


def serve_args(p: argparse.ArgumentParser) -> None:
    """``infersight serve``'s own options (after the model's and the engine's): the
    server's limits, and its replicas on Ray Serve."""
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


def serve_defaults() -> dict[str, Any]:
    """``infersight serve``'s options with their defaults, by name (the command line's own,
    the model's, the engine's and the server's)."""
    p = argparse.ArgumentParser(add_help=False)
    verbose_arg(p)
    model_args(p)
    engine_args(p)
    serve_args(p)
    return vars(p.parse_args([]))
