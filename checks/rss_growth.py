"""The engine's memory per request, in one process: what a soak's RSS slope points at, narrowed.

One precision of the default model is loaded with a KV pool small enough to be full of kept
prefixes after the warm-up (``--kv-mib``), so that what the pool holds no longer grows; then it
answers the soak's requests (:data:`checks.soak.MIX`: questions, documents, conversations;
40 % sampled), one after another, and reports the process's RSS every ``--every`` requests after
the warm-up. Flat is a fraction of a MiB per hundred requests.

``--exact-rows`` runs every prefill product at its own row count instead of
:func:`engine.quant.int8.bucket_rows`'s (how the INT4 server ran before the buckets), the
reproduction of what the hour's soak found (docs/reliability.md)::

    python -m checks.rss_growth --precision int4-g32 --speculative lookup
    python -m checks.rss_growth --precision int4-g32 --speculative lookup --exact-rows
"""

from __future__ import annotations

import argparse
import os
import random
import sys

import torch

from app.loading import resolve_model_folder
from checks.soak import MIX, proc_figures
from engine.bench.load_spec import draw_request, prompt_set
from engine.core.config import EngineConfig
from engine.core.sampling import SamplingParams
from engine.errors import InfersightError
from engine.loader.load import load_model
from engine.quant import int8
from engine.speculative.config import parse_speculative


def rss_mib() -> float:
    return proc_figures(os.getpid())["rss_mib"]


def main(argv: list[str] | None = None) -> int:
    about = (__doc__ or "").split("\n")[0]
    p = argparse.ArgumentParser(prog="python -m checks.rss_growth", description=about)
    p.add_argument("--model", default="default")
    p.add_argument("--precision", default="int4-g32")
    p.add_argument("--speculative", default=None, help="a drafter (lookup, …), as serve takes it")
    p.add_argument("--requests", type=int, default=300, help="requests measured after warm-up")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--kv-mib", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--exact-rows", action="store_true",
                   help="each prefill product at its own row count (no buckets)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("requests", "every", "kv_mib", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        p.error("--warmup must be at least 0")
    torch.set_num_threads(args.threads)
    if args.exact_rows:
        int8.bucket_rows = lambda m: m  # what ran before
    try:
        engine = load_model(resolve_model_folder(args.model, None), precision=args.precision,
                            config=EngineConfig(kv_memory=args.kv_mib << 20))  # fmt: skip
        if args.speculative:
            engine.set_speculation(parse_speculative(args.speculative))
    except InfersightError as exc:
        p.error(str(exc))
    rng, texts = random.Random(args.seed), prompt_set()

    def count(text: str) -> int:
        return len(engine.tokenizer.encode(text))

    def answer(n: int) -> None:
        for _ in range(n):
            _, messages, out = draw_request(rng, MIX, texts, count, 4000)
            sampled = rng.random() < 0.4
            params = SamplingParams(max_new_tokens=out, temperature=0.8 if sampled else 0.0,
                                    seed=rng.randint(0, 1000))  # fmt: skip
            for _event in engine.generate(engine.chat_prompt_ids(messages), params):
                pass

    answer(args.warmup)
    start = rss_mib()
    print(f"{args.precision}{' +' + args.speculative if args.speculative else ''}"
          f"{' (exact rows)' if args.exact_rows else ''}: {start:.1f} MiB after "
          f"{args.warmup} requests")  # fmt: skip
    done = 0
    while done < args.requests:
        n = min(args.every, args.requests - done)
        answer(n)
        done += n
        print(f"  +{done:4d} requests: {rss_mib() - start:+7.1f} MiB", flush=True)
    grown = rss_mib() - start
    print(f"grew {grown:+.1f} MiB over {done} requests ({100 * grown / done:+.2f} MiB a hundred)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
