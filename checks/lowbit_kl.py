"""What quantizing the activations costs, against what quantizing the weights costs.

Our low-bit CPU kernels (:mod:`engine.kernels.lowbit`) quantize the activations, per block of
32 to int8 for INT4 weights and per block of 128 to int16 for INT8 weights; torch's kernels
keep them in float. For each precision, the default model is loaded with torch's kernels and
with ours (``INFERSIGHT_LOWBIT``), and the three next-token distributions (fp32, and the
precision on each kernel) are scored teacher-forced over the same text, one token per step
as decode computes them (:func:`engine.evals.scoring.score` with ``decode_steps``: an INT8
layer takes ours for decode's few rows only, torch's for a prefill's):

* ``weights``: KL(fp32 ‖ precision, torch's kernels), the weight quantization's own cost;
* ``activations``: KL(torch's kernels ‖ ours), what quantizing the activations adds;

and their ratio, which must stay below 0.1 for ``INFERSIGHT_LOWBIT=auto`` to hand a format to
our kernels (:data:`engine.kernels.lowbit.ADMITTED`). Also the share of positions whose top
token both kernels agree on.

``--compute fp32`` runs the quantized models in fp32 instead of bf16 (on a CPU they compute in
bf16; this option exists for this measurement only). In bf16 any two kernels that add in
another order end up about KL 0.0015 apart over the default model's 30 layers, our float GEMV
and torch's INT8 kernel too, and that noise hides an approximation smaller than bf16's own
rounding (INT8's int16 activations); in fp32 it is 1e-8. INT8 only: torch's INT4 kernel takes
bf16 activations alone.

Run: ``python -m checks.lowbit_kl [--tokens 1024] [--precision int8+head int4-g32+head]
[--compute fp32]``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch


def kl(p: torch.Tensor, q: torch.Tensor) -> float:
    """Mean over positions of KL(p ‖ q), both log-probabilities."""
    return float((p.exp() * (p - q)).sum(dim=-1).mean())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--precision", nargs="+", default=["int8+head", "int4-g32+head"])
    parser.add_argument("--compute", choices=["bf16", "fp32"], default="bf16")
    args = parser.parse_args(argv)
    if args.compute == "fp32":
        from engine.hardware import gpu

        if any(not p.startswith("int8") for p in args.precision):
            parser.error("--compute fp32 takes INT8 precisions only")
        # the precision spec asks this for its compute dtype: fp32 here, whatever the machine
        setattr(gpu, "compute_dtype_for", lambda _capability: torch.float32)  # noqa: B010

    from engine.evals.perplexity import default_text
    from engine.evals.scoring import score
    from engine.kernels import lowbit
    from engine.loader.load import load_model
    from engine.store.model_store import pull_default

    folder = pull_default()
    reference = load_model(folder, precision="fp32")
    ids = reference.tokenizer.encode_prompt(default_text().read_text(encoding="utf-8"))
    prompt, text = ids[:1], ids[1 : args.tokens + 1]
    base = score(reference, prompt, text)
    rows = []
    for precision in args.precision:
        scores = {}
        for mode in ("torch", "ours"):
            os.environ[lowbit.ENV] = mode
            engine = load_model(folder, precision=precision)
            scores[mode] = score(engine, prompt, text, decode_steps=True)
        weights, activations = kl(base, scores["torch"]), kl(scores["torch"], scores["ours"])
        agree = float((scores["torch"].argmax(-1) == scores["ours"].argmax(-1)).float().mean())
        ratio = activations / weights
        rows.append({"precision": precision, "compute": args.compute, "tokens": len(text),
                     "weights_kl": weights,
                     "activations_kl": activations, "ratio": ratio,
                     "top1_agreement": agree})  # fmt: skip
        print(f"{precision} ({args.compute}): weights KL {weights:.3g}, activations KL "
              f"{activations:.3g} ({ratio:.2g}× the weights'), "
              f"top-1 agreement {agree:.4f}")  # fmt: skip
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
