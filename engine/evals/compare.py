"""A/B comparison of two engines on one prompt, token by token: the data behind the app's A/B
lab and ``infersight eval compare``.

Both engines generate from the same prompt (each with its own sampling and cache window, the
same seed). Then each model *scores* both outputs, teacher-forced: model M's log-probabilities
at every position of sequence S, with S's tokens as the context. Everything per token follows
from those four ``[n, vocab]`` tables:

* ``kl``: KL(A‖B) = Σ p_A (log p_A − log p_B), in nats, at each position of a column's own
  sequence: how far B's next-token distribution is from A's on that context;
* ``p_a``, ``p_b``: each model's probability of the token that column holds;
* ``top_a``, ``top_b``: each model's five likeliest next tokens there;
* ``noise_kl``: KL(A‖A′), where A′ is A itself computed another way: the prompt in one pass,
  then one token per forward (decode's batch of one) instead of the whole sequence in one
  prefill. That is the run-to-run noise of A's own numbers; a B whose KL is no larger than it
  is indistinguishable from A here.

Distributions are the models' own (temperature 1, untruncated), whatever sampling generated
the text: sampling changes which tokens are drawn, not what a model believes.

The summary is taken on A's output (A is the reference, as the base model is in llama.cpp's
``--kl-divergence``): mean and 99th-percentile KL, RMS Δp (the root mean square of
p_B − p_A for A's token), top-1 agreement (both models' likeliest token is the same), and
whether the two answers differ at all ("flips"). The first divergence follows vLLM's
``check_logprobs_close``: the first index where the two generated tokens differ, and whether
each side's token is among the other side's top-N there (both contexts are the common prefix).

Speculative decoding with B drafting for A would accept, per drafted token, B's likeliest
token where it is A's likeliest (greedy: the top-1 agreement), or with probability
Σ min(p_A, p_B) = 1 − TV(p_A, p_B) under rejection sampling, with each side's distribution at
its sampling temperature (1 for a greedy side); both are measured on A's output.
:func:`~engine.evals.acceptance.measure_speculation` then *measures* it: A generates once more
from the same prompt with its own sampling (same seed, same token budget) while B's model
drafts for it (:class:`~engine.speculative.drafters.ModelDrafter`, a fixed k, every step
drafting), on an engine of its own over A's weights, so A's engine and its cache are left as
they were. It records the acceptance per drafted token (comparable with the prediction), vLLM's
acceptance rate (accepted / drafted tokens, which also counts the drafts left unchecked after a
rejection), the mean acceptance length, the acceptance at each draft position, and whether the
output is A's (for greedy A it must be, token for token). A pair that cannot draft for each
other (a different tokenizer, another device) is reported as not measured, with the reason.

The report is plain JSON data (:data:`~engine.evals.compare_file.FORMAT`): the app shows it,
saves it and opens it, and ``infersight eval compare --json`` writes the same thing.

Where each part lives: the two sides, their shared prompt and their generations
(:mod:`engine.evals.sides`); the teacher-forced scoring (:mod:`engine.evals.scoring`); the
per-token figures and the summary (:mod:`engine.evals.figures`); the measured speculative
decoding (:mod:`engine.evals.acceptance`); the file format (:mod:`engine.evals.compare_file`).
This module puts them together: :func:`compare_prompt`, :func:`build_report`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from engine.core.engine import LLMEngine
from engine.evals.acceptance import measure_speculation, with_speculation
from engine.evals.figures import column_figures, divergence, summarize
from engine.evals.scoring import Scores, score_side
from engine.evals.sides import Side, SideRun, generate, shared_prompt_ids
from engine.model.tokenizer import IncrementalDetokenizer, Tokenizer


def token_pieces(tokenizer: Tokenizer, ids: Sequence[int]) -> list[str]:
    """The text each token adds, as the streaming detokenizer releases it (a character split
    over several tokens lands on the one that completes it); ``"".join`` is the full text."""
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add(t) for t in ids]
    if pieces:
        pieces[-1] += detok.flush()
    return pieces


def build_report(
    prompt: str,
    prompt_ids: list[int],
    run_a: SideRun,
    run_b: SideRun,
    scores: Scores,
    tokenizer: Tokenizer,
    memory: dict[str, str] | None = None,
    speculation: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The comparison as plain JSON data (see the module docstring for each figure).
    ``speculation``: what :func:`~engine.evals.acceptance.measure_speculation` returned
    (``None``: not measured)."""
    summary = summarize(run_a, run_b, scores)
    with_speculation(summary, speculation)
    sides: dict[str, Any] = {}
    for key, run in (("a", run_a), ("b", run_b)):
        pieces = token_pieces(tokenizer, run.token_ids)
        side = asdict(run)
        side["window"] = None if run.window is None else list(run.window)
        side["pieces"] = pieces
        side["text"] = "".join(pieces)
        sides[key] = side
    return {
        "prompt": prompt,
        "prompt_tokens": len(prompt_ids),
        "a": sides["a"],
        "b": sides["b"],
        "columns": {
            "a": column_figures(
                tokenizer, run_a.token_ids, scores.a_on_a, scores.b_on_a, scores.noise_on_a
            ),
            "b": column_figures(
                tokenizer, run_b.token_ids, scores.a_on_b, scores.b_on_b, scores.noise_on_b
            ),
        },
        "divergence": divergence(run_a.token_ids, run_b.token_ids, scores, tokenizer),
        "summary": summary,
        "memory": memory or {"mode": "side by side", "message": ""},
    }


def compare_prompt(
    a: LLMEngine,
    b: LLMEngine,
    prompt: str,
    side_a: Side,
    side_b: Side,
    *,
    noise: bool = True,
    speculate: bool = True,
) -> dict[str, Any]:
    """The whole A/B of one prompt on two loaded engines, one after the other; ``speculate``
    also measures speculative decoding with B drafting for A
    (:func:`~engine.evals.acceptance.measure_speculation`)."""
    prompt_ids = shared_prompt_ids(a, b, [{"role": "user", "content": prompt}])
    run_a = generate(a, prompt_ids, side_a.params, side_a.window)
    run_b = generate(b, prompt_ids, side_b.params, side_b.window)
    runs = (run_a, run_b)
    a_on_a, a_on_b, noise_a, noise_b = score_side(a, prompt_ids, runs, side_a.window, noise=noise)
    b_on_a, b_on_b, _, _ = score_side(b, prompt_ids, runs, side_b.window)
    scores = Scores(a_on_a, a_on_b, b_on_a, b_on_b, noise_a, noise_b)
    speculation = None
    if speculate:
        speculation = measure_speculation(
            a, b, prompt_ids, side_a.params, side_a.window, expected=run_a.token_ids
        )
    return build_report(
        prompt, prompt_ids, run_a, run_b, scores, a.tokenizer, speculation=speculation
    )
