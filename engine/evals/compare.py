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
:func:`measure_speculation` then *measures* it: A generates once more from the same prompt with
its own sampling (same seed, same token budget) while B's model drafts for it
(:class:`~engine.speculative.speculator.ModelDrafter`, a fixed k, every step drafting), on an
engine of its own over A's weights, so A's engine and its cache are left as they were. It
records the acceptance per drafted token (comparable with the prediction), vLLM's acceptance
rate (accepted / drafted tokens, which also counts the drafts left unchecked after a rejection),
the mean acceptance length, the acceptance at each draft position, and whether the output is
A's (for greedy A it must be, token for token). A pair that cannot draft for each other (a
different tokenizer, another device) is reported as not measured, with the reason.

The report is plain JSON data (:data:`FORMAT`): the app shows it, saves it and opens it, and
``infersight eval compare --json`` writes the same thing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.core.engine import LLMEngine
from engine.core.sampling import SamplingParams
from engine.errors import InvalidRequestError, OutOfMemoryError
from engine.kv_cache.paged import CacheWindow, SeqChunk
from engine.model.tokenizer import IncrementalDetokenizer, Tokenizer
from engine.speculative.speculator import (
    ModelDrafter,
    SpeculativeConfig,
    Speculator,
    VerifyCost,
)

if TYPE_CHECKING:
    pass

FORMAT = "infersight-ab/1"
TOP_N = 5  # top tokens kept per position, and vLLM's N for the divergence rule
SCORE_ID = "__ab-score__"  # the scratch sequence a scoring pass holds blocks under
SCORE_CHUNK = 512  # tokens per scoring forward: bounds the [tokens, vocab] logits on a device
KL_ROWS = 256  # rows per float64 KL computation: bounds its temporaries
SPEC_K = 4  # tokens B drafts per step when speculative decoding is measured


def prompt_ids_for(engine: LLMEngine, messages: list[dict[str, str]]) -> list[int]:
    """The prompt both sides get: the chat template when the model has one, else the text."""
    if engine.tokenizer.chat_template:
        return engine.chat_prompt_ids(messages)
    return engine.tokenizer.encode_prompt("\n".join(m["content"] for m in messages))


def shared_prompt_ids(a: LLMEngine, b: LLMEngine, messages: list[dict[str, str]]) -> list[int]:
    """The prompt's ids, the same for both sides, or a clear error when the two models do not
    share a tokenizer (see :func:`check_same_tokenizer`)."""
    ids = prompt_ids_for(a, messages)
    check_same_tokenizer(a.cfg.vocab_size, ids, b.cfg.vocab_size, prompt_ids_for(b, messages))
    return ids


def check_same_tokenizer(vocab_a: int, ids_a: list[int], vocab_b: int, ids_b: list[int]) -> None:
    """Token-by-token figures compare two distributions over one vocabulary: both models must
    have the same vocabulary size and tokenize the prompt the same way."""
    if vocab_a != vocab_b or ids_a != ids_b:
        raise InvalidRequestError(
            f"A and B do not share a tokenizer (vocabularies of {vocab_a} and {vocab_b} tokens, "
            "or the prompt tokenizes differently); compare two precisions of one model, or "
            "models of one family with the same vocabulary"
        )


def score(
    engine: LLMEngine,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    *,
    window: CacheWindow | None = None,
    decode_steps: bool = False,
    check: Callable[[], None] | None = None,
) -> Tensor:
    """Log-probabilities ``[len(output_ids), vocab]`` (fp32, on the CPU) of ``engine``'s next
    token at each output position, teacher-forced on ``prompt_ids + output_ids``.

    It runs through the engine's own paged cache and attention, as generation does, with the
    same cache window, in forwards of up to :data:`SCORE_CHUNK` tokens. ``decode_steps``
    computes the outputs one token per forward after a prefill of the prompt (as generation
    computed them): the two agree up to rounding, which is what the noise floor measures.
    The engine must be idle and its pool must hold the whole sequence. ``check`` runs before
    each forward; it may raise to cancel.
    """
    prompt, output = list(prompt_ids), list(output_ids)
    if not prompt:
        raise InvalidRequestError("scoring needs a prompt of at least one token")
    vocab = engine.cfg.vocab_size
    if not output:
        return torch.empty(0, vocab)
    seq = prompt + output
    inputs = seq[:-1]  # the last token is a target only
    first_row = len(prompt) - 1  # the position that predicts the first output token
    if decode_steps:
        spans = [(0, len(prompt))] + [(p, p + 1) for p in range(len(prompt), len(inputs))]
    else:
        spans = [(p, min(p + SCORE_CHUNK, len(inputs))) for p in range(0, len(inputs), SCORE_CHUNK)]
    manager = engine.kv.manager
    if not manager.can_grow(SCORE_ID, len(inputs)):
        raise InvalidRequestError(
            f"scoring {len(inputs)} tokens needs {manager.blocks_for(len(inputs))} KV blocks "
            f"but {manager.num_free} are free; give the KV cache more memory"
        )
    manager.grow(SCORE_ID, len(inputs))
    out: list[Tensor] = []
    device = engine.device
    try:
        for start, end in spans:
            rows = [r - start for r in range(max(start, first_row), end)]
            if check:
                check()
            ctx = engine.kv.context([SeqChunk(SCORE_ID, start, end - start, window)])
            logits = engine.model(
                torch.tensor(inputs[start:end], device=device),
                torch.arange(start, end, device=device),
                ctx,
                torch.tensor(rows, dtype=torch.long, device=device),
            )  # every span runs: the prompt's too fill the cache the outputs attend to
            if rows:
                out.append(F.log_softmax(logits.float(), dim=-1).cpu())
    finally:
        manager.free(SCORE_ID)
    return torch.cat(out)


def token_pieces(tokenizer: Tokenizer, ids: Sequence[int]) -> list[str]:
    """The text each token adds, as the streaming detokenizer releases it (a character split
    over several tokens lands on the one that completes it); ``"".join`` is the full text."""
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add(t) for t in ids]
    if pieces:
        pieces[-1] += detok.flush()
    return pieces


@dataclass(frozen=True, slots=True)
class SideRun:
    """One side's generation and what it ran as (the report's ``a`` / ``b``)."""

    model: str
    precision: str
    device: str
    sampling: dict[str, Any]
    window: tuple[int, int] | None
    token_ids: list[int]
    finish_reason: str | None
    ttft_s: float | None
    tokens_per_s: float | None
    weights_bytes: int
    kv_bytes: int

    @classmethod
    def of(
        cls,
        engine: LLMEngine,
        params: SamplingParams,
        window: CacheWindow | None,
        token_ids: list[int],
        finish_reason: str | None,
        ttft_s: float | None,
        tokens_per_s: float | None,
    ) -> SideRun:
        sampling = {k: v for k, v in asdict(params).items() if k in SAMPLING_KEYS}
        return cls(
            model=engine.name,
            precision=engine.precision.text,
            device=str(engine.device),
            sampling=sampling,
            window=None if window is None else (window.sink, window.window),
            token_ids=list(token_ids),
            finish_reason=finish_reason,
            ttft_s=ttft_s,
            tokens_per_s=tokens_per_s,
            weights_bytes=engine.weights_bytes,
            kv_bytes=engine.kv.nbytes,
        )


SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                 "seed")  # fmt: skip


def generate(
    engine: LLMEngine, prompt_ids: list[int], params: SamplingParams, window: CacheWindow | None
) -> SideRun:
    """One side's answer, alone on its engine (a script's or the command line's A/B)."""
    engine.set_window(window)
    gen = engine.generate(prompt_ids, params)
    for _ in gen:
        pass
    r = gen.result
    tps = 1.0 / r.tpot_s if r.tpot_s else None
    return SideRun.of(engine, params, window, r.token_ids, r.finish_reason, r.ttft_s, tps)


@dataclass(slots=True)
class Scores:
    """The four teacher-forced tables (``[model][sequence]``) and the noise floor's two
    (A′ on each sequence; absent when not measured)."""

    a_on_a: Tensor
    a_on_b: Tensor
    b_on_a: Tensor
    b_on_b: Tensor
    noise_on_a: Tensor | None = None
    noise_on_b: Tensor | None = None


def score_side(
    engine: LLMEngine,
    prompt_ids: list[int],
    runs: tuple[SideRun, SideRun],
    window: CacheWindow | None,
    *,
    noise: bool = False,
    check: Callable[[], None] | None = None,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """One model's scores of A's and B's outputs, and (``noise``) its A′ scores of both.
    ``check`` runs between passes: it may raise to cancel."""
    out: list[Tensor | None] = []
    for run in runs:
        out.append(score(engine, prompt_ids, run.token_ids, window=window, check=check))
    for run in runs:
        if noise:
            out.append(
                score(engine, prompt_ids, run.token_ids, window=window, decode_steps=True,
                      check=check)
            )  # fmt: skip
        else:
            out.append(None)
    a, b, na, nb = out
    assert a is not None and b is not None
    return a, b, na, nb


def _kl(logp: Tensor, logq: Tensor) -> Tensor:
    """KL(p‖q) per row, in float64 over renormalised rows: the fp32 tables sum to 1 only up
    to rounding, which would leave a KL of ~1e-7 (even negative) where p and q are equal.
    :data:`KL_ROWS` rows at a time, so the float64 copies stay small."""
    out = []
    for i in range(0, len(logp), KL_ROWS):
        p = F.log_softmax(logp[i : i + KL_ROWS].double(), -1)
        q = F.log_softmax(logq[i : i + KL_ROWS].double(), -1)
        out.append((p.exp() * (p - q)).sum(-1).clamp(min=0.0))
    return torch.cat(out) if out else torch.empty(0, dtype=torch.float64)


def _tempered(logp: Tensor, temperature: float) -> Tensor:
    """Probabilities at ``temperature`` (1 where the side is greedy)."""
    t = temperature if temperature and temperature > 0 else 1.0
    return F.softmax(logp / t, dim=-1)


def _quantile(x: Tensor, q: float) -> float | None:
    return float(torch.quantile(x.double(), q)) if len(x) else None


def _top(tokenizer: Tokenizer, logp: Tensor) -> list[list[list[Any]]]:
    values, ids = logp.topk(min(TOP_N, logp.shape[-1]), dim=-1)
    probs = values.exp().tolist()
    return [
        [
            [tokenizer.decode([i], skip_special_tokens=False), p]
            for i, p in zip(row, prow, strict=True)
        ]
        for row, prow in zip(ids.tolist(), probs, strict=True)
    ]


def _column(
    tokenizer: Tokenizer, ids: list[int], logp_a: Tensor, logp_b: Tensor, noise: Tensor | None
) -> dict[str, Any]:
    target = torch.tensor(ids, dtype=torch.long)[:, None]
    return {
        "kl": _kl(logp_a, logp_b).tolist(),
        "p_a": logp_a.gather(1, target).exp()[:, 0].tolist() if ids else [],
        "p_b": logp_b.gather(1, target).exp()[:, 0].tolist() if ids else [],
        "noise_kl": None if noise is None else _kl(logp_a, noise).tolist(),
        "top_a": _top(tokenizer, logp_a),
        "top_b": _top(tokenizer, logp_b),
    }


def first_difference(ids_a: Sequence[int], ids_b: Sequence[int]) -> int | None:
    """The first index where two token sequences differ (the shorter one's length where one
    stopped and the other went on), or ``None`` when they are equal."""
    index = next((i for i, (x, y) in enumerate(zip(ids_a, ids_b, strict=False)) if x != y), None)
    if index is None and len(ids_a) != len(ids_b):
        index = min(len(ids_a), len(ids_b))
    return index


def divergence(
    ids_a: list[int], ids_b: list[int], scores: Scores, tokenizer: Tokenizer
) -> dict[str, Any]:
    """vLLM's rule: the first index where the generated tokens differ, and whether each side's
    token is among the other's top-N there. Up to that index the two contexts are the same, so
    A's scores on A's output and B's on B's output describe the same context."""
    index = first_difference(ids_a, ids_b)
    out: dict[str, Any] = {"index": index, "top_n": TOP_N, "a_token": None, "b_token": None,
                           "a_in_b_top": None, "b_in_a_top": None}  # fmt: skip
    if index is None:
        return out
    if index < len(ids_a):
        out["a_token"] = tokenizer.decode([ids_a[index]], skip_special_tokens=False)
    if index < len(ids_b):
        out["b_token"] = tokenizer.decode([ids_b[index]], skip_special_tokens=False)
    if index < len(ids_a) and index < len(ids_b):
        top_b = scores.b_on_b[index].topk(TOP_N).indices.tolist()
        top_a = scores.a_on_a[index].topk(TOP_N).indices.tolist()
        out["a_in_b_top"] = ids_a[index] in top_b
        out["b_in_a_top"] = ids_b[index] in top_a
    return out


def summarize(run_a: SideRun, run_b: SideRun, scores: Scores) -> dict[str, Any]:
    """The figures on A's output (see the module docstring)."""
    ids = torch.tensor(run_a.token_ids, dtype=torch.long)
    la, lb = scores.a_on_a, scores.b_on_a
    kl = _kl(la, lb)
    n = len(ids)
    rms_dp: float | None = None  # None when there are no tokens: JSON has no NaN
    top1 = greedy = sampled = rms_dp
    if n:
        pa = la.gather(1, ids[:, None]).exp()[:, 0]
        pb = lb.gather(1, ids[:, None]).exp()[:, 0]
        rms_dp = float(((pb - pa) ** 2).mean().sqrt())
        top1 = float((la.argmax(-1) == lb.argmax(-1)).double().mean())
        # greedy drafting: B's top token is accepted where it is A's top token
        greedy = top1
        # sampling (rejection sampling at each side's temperature; 1 for a greedy side):
        # a drafted token is accepted with probability Σ min(p_A, p_B) = 1 − TV(p_A, p_B)
        pa_t = _tempered(la, run_a.sampling.get("temperature", 0.0))
        pb_t = _tempered(lb, run_b.sampling.get("temperature", 0.0))
        sampled = float(torch.minimum(pa_t, pb_t).sum(-1).double().mean())
    noise = None if scores.noise_on_a is None else _kl(la, scores.noise_on_a)
    return {
        "tokens": n,
        "kl_mean": float(kl.double().mean()) if n else None,
        "kl_p99": _quantile(kl, 0.99),
        "kl_max": float(kl.max()) if n else None,
        "rms_dp": rms_dp,
        "top1_agreement": top1,
        "flips": run_a.token_ids != run_b.token_ids,
        "noise_kl_mean": None if noise is None or not n else float(noise.double().mean()),
        "noise_kl_p99": None if noise is None else _quantile(noise, 0.99),
        "speculative": {
            "greedy_acceptance": greedy,
            "sampling_acceptance": sampled,
            "mode": "greedy" if run_a.sampling.get("temperature", 0.0) == 0 else "sampling",
        },
    }


_OUT_OF_MEMORY = (MemoryError, torch.OutOfMemoryError, OutOfMemoryError)


def measure_speculation(
    target: LLMEngine,
    draft: LLMEngine,
    prompt_ids: list[int],
    params: SamplingParams,
    window: CacheWindow | None = None,
    *,
    expected: Sequence[int] | None = None,
    k: int = SPEC_K,
    check: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Speculative decoding with ``draft``'s model drafting for ``target``, measured:
    ``target`` generates from ``prompt_ids`` with ``params`` under ``window`` while the
    drafter proposes ``k`` tokens at every step (no adaptive k). ``expected`` is the target's
    plain output, which the speculative one is checked against.

    It runs on a sibling of ``target`` (the same weights, a KV pool just large enough, no
    prefix caching): neither engine's state changes, and the drafter and both pools are let go
    before it returns. Returns ``{"measured": {...}}`` (the keys are in
    :data:`MEASURED_KEYS`), or ``{"not_measured": reason}`` where ``draft`` cannot draft for
    ``target`` (another tokenizer or device) or memory is short. ``check`` runs after every
    token (so at least once a step); it may raise to cancel."""
    needed = len(prompt_ids) + params.max_new_tokens + k + 1
    blocks = target.kv.manager.blocks_for(needed) + 1
    config = SpeculativeConfig(
        "model", model_dir=draft.folder or Path(draft.name), k=k, adaptive=False,
        verify_cost=VerifyCost(),  # nothing to time: k is fixed
    )  # fmt: skip
    try:
        engine = target.sibling(replace(target.config, num_blocks=blocks, prefix_caching=False))
        engine.set_window(window)
        drafter = ModelDrafter.from_engine(config.label, draft, engine)
    except InvalidRequestError as exc:
        return {"not_measured": str(exc)}
    except _OUT_OF_MEMORY as exc:
        return {"not_measured": f"out of memory ({exc})"}
    spec = engine.speculator = Speculator(config, drafter)
    gen = engine.generate(prompt_ids, params)
    try:
        for _ in gen:
            if check:
                check()
    except _OUT_OF_MEMORY as exc:
        return {"not_measured": f"out of memory ({exc})"}
    finally:
        engine.cancel(gen.request_id)  # a cancelled run's request ends (no-op when done)
        engine.set_speculation(None)  # closes the drafter: its KV blocks go back
    st, result = spec.stats, gen.result
    ids = result.token_ids
    trials = st.num_accepted_tokens + st.num_rejections
    measured = {
        "k": k,
        "mode": "greedy" if params.greedy else "sampling",
        "tokens": len(ids),
        "drafts": st.num_drafts,
        "draft_tokens": st.num_draft_tokens,
        "accepted_tokens": st.num_accepted_tokens,
        "token_acceptance": st.num_accepted_tokens / trials if trials else None,
        "acceptance_rate": st.acceptance_rate,
        "mean_acceptance_length": st.mean_acceptance_length,
        "acceptance_per_pos": list(st.acceptance_per_pos()),
        "draft_tokens_per_pos": list(st.draft_tokens_per_pos),
        "matches_a": None if expected is None else ids == list(expected),
        "first_difference": None if expected is None else first_difference(ids, expected),
        "tokens_per_s": 1.0 / result.tpot_s if result.tpot_s else None,
    }
    return {"measured": measured}


#: what ``summary["speculative"]["measured"]`` holds: the k drafted per step, the mode (greedy
#: or sampling, A's), the tokens generated, the verified steps with drafts (``drafts``), the
#: drafted and accepted tokens; ``token_acceptance``: accepted / (accepted + rejections), the
#: acceptance of one drafted token, which the prediction estimates; ``acceptance_rate``:
#: accepted / drafted tokens (vLLM's, lower for the drafts a rejection leaves unchecked);
#: ``mean_acceptance_length``: tokens per verified step, the target's own included;
#: ``acceptance_per_pos``: the acceptance rate at each draft position, and
#: ``draft_tokens_per_pos`` the drafts that reached it; ``matches_a``: whether the output is
#: A's plain output (``first_difference``: where it is not); ``tokens_per_s``; and
#: ``predicted_mean_acceptance_length``, what the predicted acceptance gives for these drafts.
MEASURED_KEYS = ("k", "mode", "tokens", "drafts", "draft_tokens", "accepted_tokens",
                 "token_acceptance", "acceptance_rate", "mean_acceptance_length",
                 "acceptance_per_pos", "draft_tokens_per_pos", "matches_a", "first_difference",
                 "tokens_per_s", "predicted_mean_acceptance_length")  # fmt: skip


def with_speculation(summary: dict[str, Any], speculation: dict[str, Any] | None) -> None:
    """Put :func:`measure_speculation`'s result beside the prediction in ``summary``, with
    the mean acceptance length the predicted acceptance α gives for the drafts made: a draft
    that reached position j is accepted with probability α^j (Leviathan et al.; for k drafts
    at every step, ``(1 − α^(k+1)) / (1 − α)``; fewer are drafted near the end).
    ``None``: not attempted, and no key is added."""
    if not speculation:
        return
    spec = summary.setdefault("speculative", {})
    if "measured" in speculation:
        measured = dict(speculation["measured"])
        key = "greedy_acceptance" if measured["mode"] == "greedy" else "sampling_acceptance"
        alpha, drafts = spec.get(key), measured["drafts"]
        reached = measured["draft_tokens_per_pos"]
        measured["predicted_mean_acceptance_length"] = (
            None
            if alpha is None or not drafts
            else 1.0 + sum(n * alpha ** (j + 1) for j, n in enumerate(reached)) / drafts
        )
        spec["measured"] = measured
    else:
        spec["not_measured"] = str(speculation.get("not_measured", "unknown reason"))


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
    ``speculation``: what :func:`measure_speculation` returned (``None``: not measured)."""
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
            "a": _column(
                tokenizer, run_a.token_ids, scores.a_on_a, scores.b_on_a, scores.noise_on_a
            ),
            "b": _column(
                tokenizer, run_b.token_ids, scores.a_on_b, scores.b_on_b, scores.noise_on_b
            ),
        },
        "divergence": divergence(run_a.token_ids, run_b.token_ids, scores, tokenizer),
        "summary": summary,
        "memory": memory or {"mode": "side by side", "message": ""},
    }


@dataclass(frozen=True, slots=True)
class Side:
    """What one side runs with, besides its engine: sampling and cache window."""

    params: SamplingParams
    window: CacheWindow | None = None


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
    also measures speculative decoding with B drafting for A (:func:`measure_speculation`)."""
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


def document(comparisons: list[dict[str, Any]]) -> dict[str, Any]:
    """What a file holds: the format tag and one or more comparisons."""
    return {"format": FORMAT, "comparisons": comparisons}


def read_document(data: Any) -> list[dict[str, Any]]:
    """The comparisons of a saved file's parsed JSON; a clear error for anything else,
    checked deep enough that showing a comparison cannot fail on its shape."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise InvalidRequestError(
            f"this is not an A/B comparison file (expected format {FORMAT!r}); save one from the "
            "A/B lab or write one with `infersight eval compare --json`"
        )
    comparisons = data.get("comparisons")
    if not isinstance(comparisons, list) or not comparisons:
        raise InvalidRequestError("the comparison file holds no comparison")
    for i, c in enumerate(comparisons):
        problem = _shape_problem(c)
        if problem:
            raise InvalidRequestError(
                f"comparison {i + 1} of the file is damaged or from another program: {problem}"
            )
    return comparisons


def _shape_problem(c: Any) -> str | None:
    """What is wrong with one comparison's shape, or ``None``."""
    if not isinstance(c, dict):
        return "it is not an object"
    for key in ("a", "b", "columns", "divergence", "summary"):
        if not isinstance(c.get(key), dict):
            return f"{key!r} is missing or not an object"
    for side in ("a", "b"):
        info, column = c[side], c["columns"].get(side)
        pieces, ids = info.get("pieces"), info.get("token_ids")
        if not isinstance(pieces, list) or not all(isinstance(p, str) for p in pieces):
            return f"{side}.pieces must be a list of strings"
        if not isinstance(ids, list) or len(ids) != len(pieces):
            return f"{side}.token_ids must be a list as long as {side}.pieces"
        if not isinstance(column, dict):
            return f"columns.{side} is missing"
        for key in ("kl", "p_a", "p_b", "top_a", "top_b"):
            values = column.get(key)
            if not isinstance(values, list) or len(values) != len(pieces):
                return f"columns.{side}.{key} must be a list with one entry per token"
        noise = column.get("noise_kl")
        if noise is not None and (not isinstance(noise, list) or len(noise) != len(pieces)):
            return f"columns.{side}.noise_kl must be null or a list with one entry per token"
        numbers = column["kl"] + column["p_a"] + column["p_b"] + (noise or [])
        if not all(isinstance(v, (int, float)) for v in numbers):
            return f"columns.{side} holds figures that are not numbers"
    return _speculation_problem(c["summary"].get("speculative"))


def _speculation_problem(spec: Any) -> str | None:
    """What is wrong with ``summary.speculative`` (absent, or without ``measured``: fine)."""
    if spec is None:
        return None
    if not isinstance(spec, dict):
        return "summary.speculative is not an object"
    measured = spec.get("measured")
    if measured is None:
        return None
    if not isinstance(measured, dict):
        return "summary.speculative.measured is not an object"
    for key in ("token_acceptance", "acceptance_rate", "mean_acceptance_length"):
        value = measured.get(key)
        if value is not None and not isinstance(value, (int, float)):
            return f"summary.speculative.measured.{key} is not a number"
    return None
