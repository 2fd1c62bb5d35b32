"""The A/B comparison where one side or both are models behind an OpenAI-compatible server
(:class:`~engine.evals.known.RemoteModel`): the same report as two local engines give
(:mod:`engine.evals.compare`), with each figure computed from what a server returns — at each
position its token's log-probability and its top-k — and the report saying which figures are
exact and which are bounded by k (``bounds``).

* Both sides generate from the same prompt ids (a server is sent the ids, not the text), and
  each scores the other's answer: a local engine teacher-forced as in the local lab, a server
  through completions with ``echo`` where it has it. A server without ``echo`` is compared up
  to the first divergence only, where both answers share every token so far and its own
  generation's rows are the scores of the other's.
* Exact from a server: each token's probability (servers return the chosen token's
  log-probability even outside the top-k), the top-1 agreement, the first divergence, a token's
  rank within the top-k. Bounded: the KL (over the tokens both sides give, the rest pooled: a
  lower bound, :func:`~engine.evals.known.pooled_kl`, with the probability left outside stated)
  and speculative sampling's acceptance (bounds either side).
* The tokenizers are checked first (the server's ``/tokenize`` against the local one; a server
  without it is taken to match, which the report says, and a token id it returns beyond the
  local vocabulary ends the comparison with that said); where they differ, the two answers are
  compared as text (the first character where they part), with that said.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.core.engine import LLMEngine
from engine.core.sampling import SamplingParams
from engine.errors import CancelledError, InvalidRequestError
from engine.evals.figures import TOP_N, divergence_by, first_difference
from engine.evals.known import (
    KnownRow,
    RemoteModel,
    RemoteRun,
    outside_mass,
    overlap_bounds,
    pooled_kl,
)
from engine.evals.scoring import score
from engine.evals.sides import SAMPLING_KEYS, prompt_ids_for, remote_prompt_ids
from engine.model.tokenizer import IncrementalDetokenizer, Tokenizer

Side = LLMEngine | RemoteModel
#: one side's view of one answer: a local engine's log-probabilities ``[n, vocab]`` (fp32, as
#: :func:`~engine.evals.scoring.score` gives them), a server's rows
View = Tensor | list[KnownRow]
EXACT = ["each token's probability (p_a, p_b)", "top-1 agreement", "first divergence",
         "rank within the top-k"]  # fmt: skip


def _local(side: Side) -> bool:
    return isinstance(side, LLMEngine)


def _known(view: View, i: int, other: View) -> dict[int, float]:
    """What ``view`` gives at position ``i``: a server's row; a local row restricted to the
    tokens the other side's row gives (both local: never, this module has a server)."""
    if isinstance(view, list):
        return view[i].known()
    assert isinstance(other, list)
    row = _dense(view, i)
    return {t: float(row[t]) for t in other[i].known()}


def _rank(view: View, i: int, token: int) -> int | None:
    if isinstance(view, list):
        return 1 if view[i].top[:1] and view[i].top[0][0] == token else view[i].rank_of(token)
    row = view[i]
    return int((row > row[token]).sum()) + 1


def _dense(view: Tensor, i: int) -> Tensor:
    """A local row's log-probabilities in float64, renormalised (an fp32 table sums to 1
    only up to rounding); one row at a time, so no float64 copy of the table is held."""
    return F.log_softmax(view[i].double(), -1)


def _logprob(view: View, i: int, token: int) -> float | None:
    if isinstance(view, list):
        known = view[i].known()
        return known.get(token)
    return float(_dense(view, i)[token])


def _argmax(view: View, i: int) -> int | None:
    if isinstance(view, list):
        return view[i].top[0][0] if view[i].top else None
    return int(view[i].argmax())


def _top(tokenizer: Tokenizer, view: View, i: int) -> list[list[Any]]:
    if isinstance(view, list):
        pairs = [(t, lp) for t, lp in view[i].top[:TOP_N]]
    else:
        values, ids = view[i].topk(min(TOP_N, view[i].shape[-1]))
        pairs = list(zip(ids.tolist(), values.tolist(), strict=True))
    return [[tokenizer.decode([t], skip_special_tokens=False), math.exp(lp)] for t, lp in pairs]


def column_figures(
    tokenizer: Tokenizer, ids: list[int], view_a: View, view_b: View
) -> dict[str, Any]:
    """The per-token figures of one answer, over the positions both views cover."""
    n = min(len(ids), len(view_a), len(view_b))
    out: dict[str, Any] = {k: [] for k in ("kl", "p_a", "p_b", "rank_a", "rank_b", "outside_a",
                                           "top_a", "top_b")}  # fmt: skip
    for i in range(n):
        ka, kb = _known(view_a, i, view_b), _known(view_b, i, view_a)
        out["kl"].append(pooled_kl(ka, kb))
        out["outside_a"].append(outside_mass(ka, kb))
        for name, view in (("a", view_a), ("b", view_b)):
            lp = _logprob(view, i, ids[i])
            out[f"p_{name}"].append(None if lp is None else math.exp(lp))
            out[f"rank_{name}"].append(_rank(view, i, ids[i]))
            out[f"top_{name}"].append(_top(tokenizer, view, i))
    out["noise_kl"] = None
    return out


def summarize(column: dict[str, Any], views: tuple[View, View], greedy: bool) -> dict[str, Any]:
    """The figures on A's answer (as :func:`engine.evals.figures.summarize` names them)."""
    kl = column["kl"]
    n = len(kl)
    pairs = [(a, b) for a, b in zip(column["p_a"], column["p_b"], strict=True)
             if a is not None and b is not None]  # fmt: skip
    top1 = [_argmax(views[0], i) == _argmax(views[1], i) for i in range(n)]
    low = high = None
    if greedy and n:  # Σ min(p_A, p_B) at temperature 1, bounded by what both give
        bounds = [overlap_bounds(_known(views[0], i, views[1]), _known(views[1], i, views[0]))
                  for i in range(n)]  # fmt: skip
        low = sum(b[0] for b in bounds) / n
        high = sum(b[1] for b in bounds) / n
    ordered = sorted(kl)
    return {
        "tokens": n,
        "kl_mean": sum(kl) / n if n else None,
        "kl_p99": float(torch.quantile(torch.tensor(ordered, dtype=torch.float64), 0.99))
        if n
        else None,
        "kl_max": ordered[-1] if n else None,
        "outside_a_mean": sum(column["outside_a"]) / n if n else None,
        "rms_dp": math.sqrt(sum((b - a) ** 2 for a, b in pairs) / len(pairs)) if pairs else None,
        "top1_agreement": sum(top1) / n if n else None,
        "flips": None,  # set by the caller, which has both answers
        "noise_kl_mean": None,
        "noise_kl_p99": None,
        "speculative": {
            "greedy_acceptance": sum(top1) / n if n else None,
            "sampling_acceptance": low,
            "sampling_acceptance_high": high,
            "mode": "greedy" if greedy else "sampling",
        },
    }


def divergence(
    tokenizer: Tokenizer, ids_a: list[int], ids_b: list[int], own_a: View, own_b: View
) -> dict[str, Any]:
    """vLLM's rule (:func:`engine.evals.figures.divergence`), from each side's own rows."""
    own = {"a": own_a, "b": own_b}

    def in_top(side: str, index: int, token: int) -> bool | None:
        if index >= len(own[side]):
            return None
        rank = _rank(own[side], index, token)
        return rank is not None and rank <= TOP_N

    return divergence_by(ids_a, ids_b, tokenizer, in_top)


def bounds_text(sides: dict[str, Side], k: int, cut_short: dict[str, str]) -> str:
    """What the report can and cannot say, in a sentence or three."""
    remote = [n.upper() for n, s in sides.items() if not _local(s)]
    who = " and ".join(remote)
    text = (
        f"{who} {'are servers' if len(remote) > 1 else 'is a server'}, which return{'' if len(remote) > 1 else 's'} "  # noqa: E501
        f"each token's probability and its top {k}: exact are {', '.join(EXACT)}; the KL is a "
        f"lower bound (over the tokens both sides give, the rest pooled into one; "
        f"'outside' says how much of A's probability the pool holds) and speculative "
        f"sampling's acceptance is given as bounds."
    )
    for name, why in cut_short.items():
        text += f" {name.upper()} {why}."
    return text


def run_side(
    side: Side, prompt_ids: list[int], params: SamplingParams,
    on_text: Callable[[str], None], check: Callable[[], None],
) -> tuple[list[int], RemoteRun | None, dict[str, Any]]:  # fmt: skip
    """One side's answer: its ids, a server's run (None for a local engine), its figures."""
    if not _local(side):
        remote: RemoteModel = side  # type: ignore[assignment]

        def text(piece: str) -> None:
            check()
            on_text(piece)

        run = remote.generate(prompt_ids, params.max_new_tokens, params.temperature,
                              params.seed, text)  # fmt: skip
        return run.token_ids, run, {"finish_reason": run.finish_reason, "ttft_s": run.ttft_s,
                                    "tokens_per_s": run.tokens_per_s}  # fmt: skip
    engine: LLMEngine = side  # type: ignore[assignment]
    engine.set_window(None)
    detok = IncrementalDetokenizer(engine.tokenizer)
    gen = engine.generate(prompt_ids, params)
    for event in gen:
        check()
        if event.token_id is not None:
            piece = detok.add(event.token_id)
            if piece:
                on_text(piece)
    r = gen.result
    tps = 1.0 / r.tpot_s if r.tpot_s else None
    return list(r.token_ids), None, {"finish_reason": r.finish_reason, "ttft_s": r.ttft_s,
                                     "tokens_per_s": tps}  # fmt: skip


def side_info(side: Side, params: SamplingParams, ids: list[int], figures: dict[str, Any],
              tokenizer: Tokenizer) -> dict[str, Any]:  # fmt: skip
    """The report's ``a`` / ``b`` (as :class:`~engine.evals.sides.SideRun` gives them)."""
    from engine.evals.compare import token_pieces

    local = _local(side)
    engine = side if local else None
    pieces = token_pieces(tokenizer, ids)
    return {
        "model": engine.name if isinstance(engine, LLMEngine) else side.name,
        "precision": engine.precision.text if isinstance(engine, LLMEngine) else "server",
        "device": str(engine.device) if isinstance(engine, LLMEngine) else "remote",
        "sampling": {k: v for k, v in vars_of(params).items() if k in SAMPLING_KEYS},
        "window": None,
        "token_ids": ids,
        "weights_bytes": engine.weights_bytes if isinstance(engine, LLMEngine) else None,
        "kv_bytes": engine.kv.nbytes if isinstance(engine, LLMEngine) else None,
        "kv_dtype": engine.kv.format.name if isinstance(engine, LLMEngine) else "",
        "remote": not local,
        "pieces": pieces,
        "text": "".join(pieces),
        **figures,
    }


def vars_of(params: SamplingParams) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(params)


def compare_with_remote(
    sides: dict[str, Side], messages: list[dict[str, str]], prompt: str,
    params: dict[str, SamplingParams], *, on_text: Callable[[str, str], None] | None = None,
    check: Callable[[], None] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The A/B of ``sides`` (``"a"``, ``"b"``; at least one a server) on ``messages``: both
    generate (servers in threads of their own, so that their times are theirs), both score,
    and the report says which figures are exact (see the module docstring)."""
    check = check or (lambda: None)
    emit = on_text or (lambda side, text: None)
    prompt_ids, tokenizer, verdict = remote_prompt_ids(sides, messages)
    if prompt_ids is None:
        return text_report(sides, messages, prompt, params, verdict, emit, check)
    assert tokenizer is not None
    cancelled = threading.Event()

    def checked() -> None:
        if cancelled.is_set():
            raise CancelledError("cancelled")
        check()

    results: dict[str, tuple[list[int], RemoteRun | None, dict[str, Any]]] = {}
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="ab-remote") as pool:
        futures = {
            name: pool.submit(
                run_side, side, prompt_ids, params[name], partial(emit, name), checked
            )
            for name, side in sides.items()
            if not _local(side)
        }
        try:
            for name, side in sides.items():
                if _local(side):
                    results[name] = run_side(side, prompt_ids, params[name],
                                             partial(emit, name), checked)  # fmt: skip
            for name, future in futures.items():
                while True:  # a cancel is heard while a server is still streaming
                    try:
                        results[name] = future.result(timeout=0.1)
                        break
                    except TimeoutError:
                        check()
        except BaseException:
            cancelled.set()
            raise
    ids = {name: results[name][0] for name in sides}
    beyond = [t for name in sides for t in ids[name] if not 0 <= t < tokenizer.vocab_size]
    if beyond:
        raise InvalidRequestError(
            f"the server returned token ids beyond the local vocabulary ({beyond[0]} of "
            f"{tokenizer.vocab_size}): the two tokenizers differ; pick a local model of the "
            "server's family"
        )
    index = first_difference(ids["a"], ids["b"])
    views: dict[tuple[str, str], View] = {}  # (scorer, answer) → view
    cut_short: dict[str, str] = {}
    for name, side in sides.items():
        other = "b" if name == "a" else "a"
        if isinstance(side, LLMEngine):
            for answer in ("a", "b"):
                check()
                views[name, answer] = score(side, prompt_ids, ids[answer], check=check)
            continue
        run = results[name][1]
        assert run is not None
        views[name, name] = run.rows
        scored = side.score(prompt_ids, ids[other])
        if scored is None:
            shared = len(ids[other]) if index is None else index
            scored = run.rows[:shared]
            cut_short[name] = (
                f"cannot score a given text (its completions have no echo): its figures on "
                f"{other.upper()}'s answer stop at the first divergence (token {shared})"
            )
        views[name, other] = scored
    columns = {
        answer: column_figures(tokenizer, ids[answer], views["a", answer], views["b", answer])
        for answer in ("a", "b")
    }
    greedy = all(p.temperature == 0 for p in params.values())
    summary = summarize(columns["a"], (views["a", "a"], views["b", "a"]), greedy)
    summary["flips"] = ids["a"] != ids["b"]
    summary["speculative"]["not_measured"] = "a server cannot draft or verify here"
    k = max((s.k for s in sides.values() if not _local(s)), default=0)  # type: ignore[union-attr]
    notes = [n for name in sides if results[name][1] for n in results[name][1].notes]  # type: ignore[union-attr]
    report = {
        "prompt": prompt,
        "prompt_tokens": len(prompt_ids),
        "a": side_info(sides["a"], params["a"], ids["a"], results["a"][2], tokenizer),
        "b": side_info(sides["b"], params["b"], ids["b"], results["b"][2], tokenizer),
        "columns": columns,
        "divergence": divergence(tokenizer, ids["a"], ids["b"], views["a", "a"], views["b", "b"]),
        "summary": summary,
        "memory": {"mode": "side by side", "message": ""},
        "bounds": {
            "k": k,
            "exact": EXACT,
            "text": bounds_text(sides, k, cut_short),
            "tokenizer": verdict,
            "notes": notes,
        },
    }
    return report


def text_report(
    sides: dict[str, Side], messages: list[dict[str, str]], prompt: str,
    params: dict[str, SamplingParams], verdict: str, emit: Callable[[str, str], None],
    check: Callable[[], None],
) -> dict[str, Any]:  # fmt: skip
    """Two sides of different tokenizers: each answers the chat its own way (a local engine
    through its template, a server through its chat route), compared as text."""
    texts: dict[str, str] = {}
    figures: dict[str, dict[str, Any]] = {}
    for name, side in sides.items():
        if _local(side):
            engine: LLMEngine = side  # type: ignore[assignment]
            ids, _, fig = run_side(engine, prompt_ids_for(engine, messages), params[name],
                                   partial(emit, name), check)  # fmt: skip
            texts[name] = engine.tokenizer.decode(ids)
        else:
            remote: RemoteModel = side  # type: ignore[assignment]
            p = params[name]
            run = remote.chat(messages, p.max_new_tokens, p.temperature, p.seed,
                              partial(emit, name))  # fmt: skip
            texts[name] = run.text
            fig = {"finish_reason": run.finish_reason, "ttft_s": run.ttft_s,
                   "tokens_per_s": run.tokens_per_s}  # fmt: skip
        figures[name] = fig
    a, b = texts["a"], texts["b"]
    at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if at is None and len(a) != len(b):
        at = min(len(a), len(b))
    side_of = {
        name: {"model": getattr(s, "name", ""), "precision": "", "remote": not _local(s),
               "pieces": [texts[name]], "text": texts[name], "token_ids": [], **figures[name]}
        for name, s in sides.items()
    }  # fmt: skip
    if _local(sides["a"]):
        side_of["a"]["precision"] = sides["a"].precision.text  # type: ignore[union-attr]
    if _local(sides["b"]):
        side_of["b"]["precision"] = sides["b"].precision.text  # type: ignore[union-attr]
    return {
        "prompt": prompt, "prompt_tokens": None, **side_of,
        "columns": {}, "divergence": {"index": None, "char_index": at},
        "summary": {"tokens": None, "flips": a != b, "text_only": True},
        "memory": {"mode": "side by side", "message": ""},
        "bounds": {"k": 0, "exact": [], "tokenizer": verdict, "notes": [],
                   "text": f"{verdict}: the answers are compared as text only"
                   + ("" if at is None else f"; they part at character {at}")},
    }  # fmt: skip


def ids_by_text(tokenizer: Tokenizer) -> Callable[[str], int | None]:
    """A token's id from its text, for a server that names tokens by text only: the one id of
    the local vocabulary that decodes to it (None: no token, or several, decode to it)."""
    seen: dict[str, int | None] = {}
    for tid in range(tokenizer.vocab_size):
        text = tokenizer.decode([tid], skip_special_tokens=False)
        seen[text] = None if text in seen else tid
    return lambda text: seen.get(text)
