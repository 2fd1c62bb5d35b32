"""What quantizing the activations costs, against what quantizing the weights costs.

Our low-bit CPU kernels (:mod:`engine.kernels.lowbit`) quantize each block of 32 activations to
int8; torch's kernels keep them in float. For each precision, the default model is loaded with
torch's kernels and with ours (``INFERSIGHT_LOWBIT``), and the three next-token distributions
(fp32, and the precision on each kernel) are scored teacher-forced over the same text
(:func:`engine.evals.scoring.score`):

* ``weights``: KL(fp32 ‖ precision, torch's kernels), the weight quantization's own cost;
* ``activations``: KL(torch's kernels ‖ ours), what quantizing the activations adds;

and their ratio, which must stay below 0.1 for ``INFERSIGHT_LOWBIT=auto`` to hand a format to
our kernels (:data:`engine.kernels.lowbit.ADMITTED`). Also the share of positions whose top
token both kernels agree on.

Run: ``python -m tests.lowbit_kl [--tokens 1024] [--precision int8+head int4-g32+head]``.
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
    args = parser.parse_args(argv)

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
            scores[mode] = score(load_model(folder, precision=precision), prompt, text)
        weights, activations = kl(base, scores["torch"]), kl(scores["torch"], scores["ours"])
        agree = float((scores["torch"].argmax(-1) == scores["ours"].argmax(-1)).float().mean())
        ratio = activations / weights
        rows.append({"precision": precision, "tokens": len(text), "weights_kl": weights,
                     "activations_kl": activations, "ratio": ratio,
                     "top1_agreement": agree})  # fmt: skip
        print(f"{precision}: weights KL {weights:.5f}, activations KL {activations:.5f} "
              f"({ratio:.2f}× the weights'), top-1 agreement {agree:.4f}")  # fmt: skip
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
