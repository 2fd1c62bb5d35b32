"""Speculative decoding: a cheap drafter proposes a few tokens, the model verifies them in one
forward pass, and the rule below keeps exactly the tokens the model itself would have produced.

**The rule** (Leviathan et al. 2023; Chen et al. 2023). The drafter proposes ``x₁ … x_k`` with
distributions ``q₁ … q_k`` (a lookup drafter's proposals are certain: ``q`` is one-hot). One
forward of the target over ``[last token, x₁ … x_k]`` gives its distributions ``p₁ … p_{k+1}``
(after the request's own penalty, temperature and filters, so "the target's distribution" is
exactly what plain sampling draws from). Draft ``x_j`` is accepted with probability
``min(1, p_j(x_j) / q_j(x_j))``; at the first rejection the token is drawn from
``normalise(max(0, p_j − q_j))`` and the step ends; if every draft is accepted a *bonus* token
is drawn from ``p_{k+1}``. Each output token is then distributed exactly as ``p``, so the
output distribution does not change. Greedy requests take the longest prefix of drafts that
equal the target's argmax, then the target's own next token: token for token what plain
greedy decoding gives. Either way a step yields between 1 and k+1 tokens.

**Where it runs.** The engine's step asks :class:`Speculator` for each decoding sequence's k
(:meth:`Speculator.plan`), the scheduler reserves KV slots for those k tokens beside the
sequence's one (it stays the only owner of batches and blocks), the drafter proposes, the
model verifies every sequence's drafts in the one forward pass of the step (a verifying
sequence is a chunk of 1 + k tokens in the flattened batch), and the engine rolls the KV cache
back to the accepted tokens, freeing the blocks that held only rejected ones.

**Drafters** (one interface, :class:`Drafter`):

* :class:`LookupDrafter`, prompt lookup: the longest recent n-gram that ends the sequence is
  looked up earlier in it, and the tokens that followed it there are proposed. No model, no
  cost; large gains where the answer copies its input (editing code, summarising), none on
  free prose, where it rarely finds a match and so rarely proposes anything.
* :class:`ModelDrafter`, a model with the same tokenizer and a KV pool of its own: the same
  weights at a lower precision (*self-speculation*: ``self:int4-g32+head`` drafting for
  fp32), or a separate smaller model.

**Adaptive k** (:class:`AdaptiveK`): per sequence, the acceptance rate α is estimated from its
recent steps, and k is the one that maximises the expected tokens per step
``(1 − α^(k+1)) / (1 − α)`` per unit of cost ``1 + c_verify(k) + k·c_draft``, both measured on
this machine when speculation starts (:func:`measure_costs`): ``c_verify(k)`` what verifying
k drafts adds to a decode step, ``c_draft`` a draft model's forward over the target's.
k = 0 switches speculation off for the sequence (it probes again after a while); a batch
large enough that verification no longer rides on memory bandwidth (more than
``max_verify_tokens`` tokens in all) lowers every k, and switches it off.

**Instruments** (:class:`SpecStats`) use vLLM's ``spec_decode_*`` names: drafts, draft tokens,
accepted tokens, accepted tokens per position, and the time spent drafting and verifying.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from engine.core.sampling import SamplingParams, apply_repetition_penalty, filter_logits
from engine.errors import InvalidRequestError
from engine.kv_cache.paged import CacheWindow, PagedKVCache, SeqChunk
from engine.quant.quantize import parse_precision_spec

if TYPE_CHECKING:
    from engine.core.engine import LLMEngine
    from engine.core.sequence import Sequence as Seq
    from engine.model.transformer import Transformer

log = logging.getLogger(__name__)

MAX_DRAFT_K = 16
#: the most tokens a draft model's cache catches up on in one step (a long prompt goes in
#: chunks of this size before the sequence drafts)
CATCH_UP = 256
#: what ``--speculative`` accepts, for messages
FORMS = "self:PRECISION (e.g. self:int4-g32+head), lookup, or model:DIR"


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Which drafter, and how far it may draft.

    ``method``: ``self`` (the target's own weights at ``precision``), ``lookup`` (prompt
    lookup) or ``model`` (the model folder ``model_dir``). ``k``: the most tokens drafted per
    step (llama.cpp's draft-max); ``adaptive`` lets each sequence use fewer, down to none.
    ``max_verify_tokens``: a step verifies at most this many tokens in all (each speculating
    sequence 1 + k), so k shrinks as the batch grows and speculation stops where it no longer
    pays. ``ngram_min``/``ngram_max``: the n-gram lengths prompt lookup matches.
    ``verify_cost``: what verifying drafts costs besides the decode step (the adaptive rule's
    ``c_verify``); None measures it on the target when speculation starts.
    ``draft_blocks``: a draft model's KV pool (default: :meth:`ModelDrafter.from_engine`'s)."""

    method: str
    precision: str | None = None
    model_dir: Path | None = None
    k: int = 8
    adaptive: bool = True
    max_verify_tokens: int = 32
    ngram_min: int = 2
    ngram_max: int = 4
    verify_cost: VerifyCost | None = None
    draft_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.method not in ("self", "lookup", "model"):
            raise InvalidRequestError(f"unknown drafter {self.method!r}; give {FORMS}")
        if not 1 <= self.k <= MAX_DRAFT_K:
            raise InvalidRequestError(f"the draft k must be in [1, {MAX_DRAFT_K}], got {self.k}")
        if self.method == "self":
            if not self.precision:
                raise InvalidRequestError("self-speculation needs a precision: self:int4-g32+head")
            parse_precision_spec(self.precision)  # says which precisions there are
        if self.method == "model" and self.model_dir is None:
            raise InvalidRequestError("a draft model needs its folder: model:DIR")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise InvalidRequestError("prompt lookup needs 1 <= ngram_min <= ngram_max")
        if self.max_verify_tokens < 2:
            raise InvalidRequestError("max_verify_tokens must be at least 2")

    @property
    def label(self) -> str:
        """The form ``--speculative`` takes: ``self:int4-g32+head``, ``lookup``,
        ``model:DIR``."""
        if self.method == "self":
            return f"self:{self.precision}"
        if self.method == "model":
            return f"model:{self.model_dir}"
        return "lookup"


def parse_speculative(text: str, k: int = 8, **options: object) -> SpeculativeConfig:
    """``self:PRECISION``, ``lookup`` or ``model:DIR`` (``--speculative``), with ``k``
    (``--draft-k``) and any other :class:`SpeculativeConfig` field."""
    text = text.strip()
    method, _, arg = text.partition(":")
    if method == "self":
        return SpeculativeConfig("self", precision=arg or None, k=k, **options)  # type: ignore[arg-type]
    if method == "model":
        return SpeculativeConfig("model", model_dir=Path(arg) if arg else None, k=k, **options)  # type: ignore[arg-type]
    if method == "lookup" and not arg:
        return SpeculativeConfig("lookup", k=k, **options)  # type: ignore[arg-type]
    raise InvalidRequestError(f"unknown --speculative {text!r}; give {FORMS}")


# -- the acceptance rule --------------------------------------------------------------------


@dataclass(slots=True)
class Draft:
    """Tokens proposed for one sequence and, for a drafter that samples, the distribution each
    was drawn from (``[len(tokens), vocab]``); ``None``: the proposals are certain (one-hot)."""

    tokens: list[int] = field(default_factory=list)
    probs: Tensor | None = None


#: how each output token of a verified step came about (what the chat's overlay marks)
ACCEPTED, CORRECTED, BONUS = "accepted", "corrected", "bonus"


def processed_probs(row: Tensor, params: SamplingParams, seen: Tensor) -> Tensor:
    """The distribution plain sampling draws from for ``row`` (``[V]`` logits): repetition
    penalty over ``seen``, then temperature and filters; greedy: one-hot at the argmax."""
    row = apply_repetition_penalty(row, seen, params.repetition_penalty)
    if params.greedy:
        out = torch.zeros_like(row, dtype=torch.float32)
        out[row.argmax()] = 1.0
        return out
    return filter_logits(row.float(), params).softmax(-1)


def _seen(history: Tensor, drafted: list[int]) -> Tensor:
    if not drafted:
        return history
    extra = torch.tensor(drafted, dtype=history.dtype, device=history.device)
    return torch.cat([history, extra])


def accept(
    logits: Tensor,
    draft: Draft,
    params: SamplingParams,
    history: Tensor,
    generator: torch.Generator | None,
    rule: str = "exact",
) -> tuple[list[int], int]:
    """The tokens a verified step yields for one sequence and how many of them are accepted
    drafts (they come first; one target token follows). ``logits: [len(draft) + 1, V]`` are
    the target's rows at the last token and at each draft; ``history`` the sequence's tokens
    so far (for the repetition penalty, extended by the drafts before each row). ``rule``:
    ``exact``, or ``resample-from-p``, deliberately wrong (on a rejection it draws from p
    instead of the residual), for the test that must catch it."""
    drafted, d = draft.tokens, len(draft.tokens)
    if params.greedy:
        if params.repetition_penalty == 1.0:
            best = logits.argmax(-1).tolist()
        else:
            best = [
                int(apply_repetition_penalty(logits[j], _seen(history, drafted[:j]),
                                             params.repetition_penalty).argmax())
                for j in range(d + 1)
            ]  # fmt: skip
        n = 0
        while n < d and drafted[n] == best[n]:
            n += 1
        return [*drafted[:n], best[n]], n
    for j in range(d + 1):
        p = processed_probs(logits[j], params, _seen(history, drafted[:j]))
        if j == d:  # every draft accepted: the bonus token
            return [*drafted, _draw(p, generator)], d
        x = drafted[j]
        q = None if draft.probs is None else draft.probs[j].to(p.device, torch.float32)
        qx = 1.0 if q is None else float(q[x])
        u = float(torch.rand((), generator=generator, device=p.device))
        if u * qx < float(p[x]):  # accepted with probability min(1, p(x) / q(x))
            continue
        if rule == "resample-from-p":
            residual = p
        elif q is None:
            residual = p.clone()
            residual[x] = 0.0  # max(0, p − one-hot(x))
        else:
            residual = (p - q).clamp_min_(0.0)
        if not float(residual.sum()) > 0:  # p ≤ q everywhere: p = q, no rejection possible
            residual = p
        return [*drafted[:j], _draw(residual, generator)], j
    raise AssertionError("unreachable")


def _draw(weights: Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(weights, 1, generator=generator))


# -- drafters -------------------------------------------------------------------------------


class Drafter(ABC):
    """Proposes draft tokens for sequences. A drafter keeps whatever per-sequence state it
    needs (an n-gram index, a KV cache) under the request id, until :meth:`forget`."""

    #: ``self:…``, ``lookup`` or ``model:…``
    name: str = ""
    #: memory the drafter holds (weights and KV pool of a draft model)
    weights_bytes: int = 0
    kv_bytes: int = 0
    #: the target's vocabulary rows a drafter's probabilities cover
    vocab_size: int = 0

    @abstractmethod
    def propose(
        self, seqs: Sequence[Seq], ks: Sequence[int], window: CacheWindow | None
    ) -> list[Draft]:
        """Up to ``ks[i]`` draft tokens for ``seqs[i]``, which continue its current tokens."""

    def rollback(self, seq_id: str, valid: int) -> None:
        """Only the first ``valid`` tokens of ``seq_id`` are what was drafted from."""
        return

    def forget(self, seq_id: str) -> None:
        """``seq_id`` finished, was cancelled or preempted: drop its state."""
        return

    def close(self) -> None:
        """Let go of everything (the engine switches speculation off or to another drafter)."""
        return


class LookupDrafter(Drafter):
    """Prompt lookup decoding (Saxena 2023; vLLM's and transformers' n-gram proposer): the
    last n tokens (n from ``ngram_max`` down to ``ngram_min``) are looked up at their most
    recent earlier occurrence in the sequence, prompt and output alike, and the tokens that
    followed it there are proposed. Each sequence's n-grams are indexed incrementally (a
    dictionary per length), so a step costs O(new tokens), not O(length)."""

    def __init__(self, ngram_min: int = 2, ngram_max: int = 4) -> None:
        self.name = "lookup"
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self._index: dict[str, _NgramIndex] = {}

    def propose(
        self, seqs: Sequence[Seq], ks: Sequence[int], window: CacheWindow | None
    ) -> list[Draft]:
        out = []
        for seq, k in zip(seqs, ks, strict=True):
            if k <= 0:
                out.append(Draft())
                continue
            tokens = seq.prompt_ids + seq.output_ids
            index = self._index.setdefault(
                seq.request_id, _NgramIndex(self.ngram_min, self.ngram_max)
            )
            out.append(Draft(index.lookup(tokens, k)))
        return out

    def forget(self, seq_id: str) -> None:
        self._index.pop(seq_id, None)

    def close(self) -> None:
        self._index.clear()


class _NgramIndex:
    """For each n-gram length, the end position of each n-gram's latest occurrence among the
    n-grams that end before the sequence's last token (so a match always has a follower)."""

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.sizes = range(ngram_max, ngram_min - 1, -1)
        self.maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.indexed = 0  # n-grams ending before this position are in the maps

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        length = len(tokens)
        for end in range(self.indexed, length - 1):
            for n in self.sizes:
                if end + 1 >= n:
                    self.maps[n][tuple(tokens[end + 1 - n : end + 1])] = end
        self.indexed = max(self.indexed, length - 1)
        for n in self.sizes:
            if length < n:
                continue
            found = self.maps[n].get(tuple(tokens[length - n :]))
            if found is not None:
                return tokens[found + 1 : found + 1 + k]
        return []


class ModelDrafter(Drafter):
    """A draft model with the target's tokenizer, run autoregressively for k tokens per step
    over a KV pool of its own (the same paged cache and block manager as the target's, keyed
    by the same request ids). Per sequence it remembers how many tokens its cache holds; each
    step first catches up on the tokens added since (the prompt, on its first step; the
    accepted drafts and the target's token after that), then drafts. A rollback only lowers
    that count: rejected positions are overwritten by the next step, and their blocks freed.
    A catch-up longer than :data:`CATCH_UP` tokens (a long prompt) goes in chunks of that
    size, one a step, before the sequence drafts; a sequence that would pass the draft
    model's context is not drafted for.

    Greedy requests draft the draft model's argmax; sampled ones draw from its distribution
    under the request's own sampling (the rule needs that ``q``), with the request's
    generator."""

    def __init__(
        self,
        name: str,
        model: Transformer,
        *,
        vocab_size: int,
        dtype: torch.dtype,
        device: torch.device,
        num_blocks: int,
        block_size: int,
        weights_bytes: int = 0,
        keep: object = None,
    ) -> None:
        self.name = name
        self.model = model
        self.device = device
        self.vocab_size = vocab_size
        self.kv = PagedKVCache(
            model.cfg, num_blocks=num_blocks, block_size=block_size, dtype=dtype,
            device=device, prefix_caching=False,
        )  # fmt: skip
        self.weights_bytes = weights_bytes
        self.kv_bytes = self.kv.nbytes
        self.context_length = model.cfg.max_position_embeddings
        self._done: OrderedDict[str, int] = OrderedDict()  # tokens in the draft cache, LRU
        self._window: CacheWindow | None = None
        self._keep = keep  # the engine the model came from, when loaded for this drafter

    @classmethod
    def from_engine(
        cls, name: str, draft: LLMEngine, target: LLMEngine, num_blocks: int | None = None
    ) -> ModelDrafter:
        """Draft with ``draft``'s model (its weights shared, not copied) for ``target``, over
        a pool of ``num_blocks`` blocks in the draft model's dtype. By default a quarter of the
        target's blocks, at least one full context and at most the target's size: a self-draft
        would otherwise double the KV memory, and only the few sequences that speculate at
        once (``max_verify_tokens`` bounds them) hold draft blocks; the least recently drafted
        give theirs up when it is full."""
        _check_pair(draft, target)
        mgr = target.kv.manager
        if num_blocks is None:
            context = mgr.blocks_for(target.context_length + MAX_DRAFT_K + 1)
            num_blocks = min(mgr.num_blocks, max(context, mgr.num_blocks // 4))
        return cls(
            name, draft.model, vocab_size=target.cfg.vocab_size, dtype=draft.dtype,
            device=draft.device, num_blocks=num_blocks, block_size=target.kv.block_size,
            weights_bytes=draft.weights_bytes, keep=draft,
        )  # fmt: skip

    def propose(
        self, seqs: Sequence[Seq], ks: Sequence[int], window: CacheWindow | None
    ) -> list[Draft]:
        self._window = window
        drafts = [Draft() for _ in seqs]
        active: list[tuple[int, int, int]] = []  # (index in seqs, k, first position to feed)
        behind: list[tuple[Seq, int]] = []  # (sequence, first position) of long catch-ups
        wanted = {s.request_id for s, k in zip(seqs, ks, strict=True) if k > 0}
        for i, (seq, k) in enumerate(zip(seqs, ks, strict=True)):
            rid, n = seq.request_id, seq.num_tokens
            if k <= 0 or n + k - 1 > self.context_length:
                continue
            done = min(self._done.get(rid, 0), n - 1)
            end = n + k - 1 if n - done <= CATCH_UP else done + CATCH_UP
            if self._make_room(rid, end, wanted):
                self._done[rid] = done
                self._done.move_to_end(rid)
                if n - done <= CATCH_UP:
                    active.append((i, k, done))
                else:
                    behind.append((seq, done))
        self._catch_up(behind, window)
        if not active:
            return drafts
        # Round 0 feeds each sequence's tokens not yet in the draft cache (one, in the steady
        # state); round r feeds the draft of round r - 1. Single-token chunks go first.
        active.sort(key=lambda a: seqs[a[0]].num_tokens - a[2] != 1)
        fed = {i: seqs[i].tokens(start, seqs[i].num_tokens) for i, _, start in active}
        starts = {i: start for i, _, start in active}
        probs: dict[int, list[Tensor]] = {i: [] for i, _, _ in active}
        for r in range(max(k for _, k, _ in active)):
            batch = [(i, k) for i, k, _ in active if k > r]
            ids: list[int] = []
            positions: list[int] = []
            chunks: list[SeqChunk] = []
            rows: list[int] = []
            for i, _ in batch:
                seq = seqs[i]
                start = starts[i] if r == 0 else seq.num_tokens + r - 1
                tokens = fed[i] if r == 0 else drafts[i].tokens[-1:]
                ids += tokens
                positions += range(start, start + len(tokens))
                chunks.append(SeqChunk(seq.request_id, start, len(tokens), window))
                rows.append(len(ids) - 1)
            logits = self.model(
                torch.tensor(ids, device=self.device),
                torch.tensor(positions, device=self.device),
                self.kv.context(chunks),
                torch.tensor(rows, dtype=torch.long, device=self.device),
            )[:, : self.vocab_size]
            self._pick(logits, [(seqs[i], drafts[i], probs[i]) for i, _ in batch])
        for i, k, _ in active:
            self._done[seqs[i].request_id] = seqs[i].num_tokens + k - 1
            if probs[i]:
                drafts[i].probs = torch.stack(probs[i])
        return drafts

    def _catch_up(self, behind: list[tuple[Seq, int]], window: CacheWindow | None) -> None:
        """Feed the next :data:`CATCH_UP` tokens of each sequence far behind (no draft)."""
        if not behind:
            return
        ids: list[int] = []
        positions: list[int] = []
        chunks: list[SeqChunk] = []
        for seq, start in behind:
            ids += seq.tokens(start, start + CATCH_UP)
            positions += range(start, start + CATCH_UP)
            chunks.append(SeqChunk(seq.request_id, start, CATCH_UP, window))
        self.model(
            torch.tensor(ids, device=self.device),
            torch.tensor(positions, device=self.device),
            self.kv.context(chunks),
            torch.tensor([len(ids) - 1], dtype=torch.long, device=self.device),
        )
        for seq, start in behind:
            self._done[seq.request_id] = start + CATCH_UP
            if window is not None:
                self.kv.manager.release_outside_window(seq.request_id, window)

    def _pick(self, logits: Tensor, rows: list[tuple[Seq, Draft, list[Tensor]]]) -> None:
        """Each row's next draft token: the argmax for greedy requests (batched where no
        penalty applies), else a draw from the draft's distribution (kept for the rule)."""
        plain = all(s.params.greedy and s.params.repetition_penalty == 1.0 for s, _, _ in rows)
        if plain:
            for (_, draft, _), token in zip(rows, logits.argmax(-1).tolist(), strict=True):
                draft.tokens.append(int(token))
            return
        for j, (seq, draft, probs) in enumerate(rows):
            assert seq.history is not None
            seen = _seen(seq.history[: seq.num_tokens], draft.tokens)
            q = processed_probs(logits[j], seq.params, seen)
            token = int(q.argmax()) if seq.params.greedy else _draw(q, seq.generator)
            draft.tokens.append(token)
            if not seq.params.greedy:
                probs.append(q)

    def _make_room(self, rid: str, length: int, keep: set[str]) -> bool:
        """Slots for ``length`` tokens of ``rid``, evicting the least recently drafted
        sequences outside ``keep`` if the pool is full; False if it cannot."""
        mgr = self.kv.manager
        while not mgr.can_grow(rid, length):
            victim = next((r for r in self._done if r not in keep), None)
            if victim is None:
                return False
            self.forget(victim)
        mgr.grow(rid, length)
        return True

    def rollback(self, seq_id: str, valid: int) -> None:
        if seq_id in self._done:
            self._done[seq_id] = min(self._done[seq_id], valid)
            self.kv.manager.truncate(seq_id, self._done[seq_id])
            if self._window is not None:  # after the rollback: what the next draft reads
                self.kv.manager.release_outside_window(seq_id, self._window)

    def forget(self, seq_id: str) -> None:
        self._done.pop(seq_id, None)
        self.kv.manager.free(seq_id)

    def close(self) -> None:
        for rid in list(self._done):
            self.forget(rid)
        self._keep = None


def _check_pair(draft: LLMEngine, target: LLMEngine) -> None:
    """A draft model must speak the target's tokens: the same vocabulary, token for token."""
    a, b = draft.tokenizer, target.tokenizer
    probe = "Speculative decoding: draft, verify, accept — ünïcödé 123."
    if (
        draft.cfg.vocab_size < target.cfg.vocab_size
        or a.vocab_size != b.vocab_size
        or a.encode(probe) != b.encode(probe)
    ):
        raise InvalidRequestError(
            f"the draft model {draft.name} does not share {target.name}'s tokenizer "
            f"(vocabularies of {a.vocab_size} and {b.vocab_size} tokens); a draft model must "
            "use the same tokenizer"
        )
    if draft.device != target.device:
        raise InvalidRequestError(
            f"the draft model is on {draft.device} and the target on {target.device}; load "
            "both on one device"
        )


def build_drafter(config: SpeculativeConfig, target: LLMEngine) -> Drafter:
    """The drafter ``config`` names, for ``target``: a self-draft loads the target's folder
    once more at the draft precision; a draft model loads its folder at the target's
    precision. Raises :class:`InvalidRequestError` / ``ModelLoadError`` with what to do."""
    from engine.core.engine import EngineConfig
    from engine.loader.load import load_model

    if config.method == "lookup":
        return LookupDrafter(config.ngram_min, config.ngram_max)
    if config.method == "self":
        if target.folder is None:
            raise InvalidRequestError(
                "self-speculation loads the target's folder again, and this engine was not "
                "loaded from one; use lookup or model:DIR"
            )
        folder, precision = target.folder, config.precision or ""
    else:
        assert config.model_dir is not None
        folder, precision = Path(config.model_dir).expanduser(), target.precision.text
        if not (folder / "config.json").is_file():
            raise InvalidRequestError(
                f"the draft model folder {folder} has no config.json; give model:DIR with a "
                "Hugging Face folder of a smaller model that uses this model's tokenizer"
            )
    # The draft engine only lends its model: a one-block pool, no prefix caching.
    draft = load_model(
        folder, precision=precision, device=str(target.device),
        config=EngineConfig(num_blocks=1, prefix_caching=False,
                            decode_graph=target.config.decode_graph),
    )  # fmt: skip
    return ModelDrafter.from_engine(config.label, draft, target, config.draft_blocks)


# -- adaptive k and the instruments ---------------------------------------------------------


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a step yields on average when each draft is accepted with probability α:
    ``(1 − α^(k+1)) / (1 − α)`` (Leviathan et al., eq. 1)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass(frozen=True, slots=True)
class VerifyCost:
    """What verifying k drafts adds to a decode step, as a fraction of it:
    ``fixed + k·per_token`` for k ≥ 1. ``fixed`` is the step up from the one-token decode path
    to the multi-token one (a GEMM instead of a GEMV, causal attention instead of the decode
    kernel), ``per_token`` what each further token adds. :func:`measure_costs` times
    them on the target at start-up."""

    fixed: float = 0.15
    per_token: float = 0.05

    def at(self, k: int) -> float:
        return 0.0 if k <= 0 else self.fixed + k * self.per_token


def best_k(alpha: float, k_max: int, verify: VerifyCost, draft_per_token: float = 0.0) -> int:
    """The k in ``[0, k_max]`` with the most expected tokens per unit of step cost
    ``1 + verify.at(k) + k·draft_per_token``; 0 where no draft pays."""
    scores = [
        expected_tokens(alpha, k) / (1.0 + verify.at(k) + k * draft_per_token)
        for k in range(k_max + 1)
    ]
    return max(range(k_max + 1), key=lambda k: (scores[k], -k))


def _time_forward(
    model: Transformer, kv: PagedKVCache, lengths: Sequence[int], repeats: int = 5,
) -> dict[int, float] | None:  # fmt: skip
    """Median seconds of ``model``'s forward over ``length`` new tokens after 64 others on a
    scratch sequence of ``kv``'s pool, for each length; None where the pool has no room."""
    mgr, rid, context = kv.manager, "\0spec-probe", 64
    longest = context + max(lengths)
    if mgr.num_free < mgr.blocks_for(longest):
        return None
    device = kv.device
    times = {}
    try:
        mgr.grow(rid, longest)
        ids = torch.zeros(longest, dtype=torch.long, device=device)
        model(ids[:context], torch.arange(context, device=device),
              kv.context([SeqChunk(rid, 0, context)]))  # fmt: skip
        for length in lengths:
            runs = []
            for _ in range(repeats):
                started = time.perf_counter()
                model(
                    ids[:length], torch.arange(context, context + length, device=device),
                    kv.context([SeqChunk(rid, context, length)]),
                    torch.arange(length, device=device),
                ).sum().item()  # fmt: skip
                runs.append(time.perf_counter() - started)
            times[length] = sorted(runs)[len(runs) // 2]
    finally:
        mgr.free(rid)
    return times


def measure_costs(
    engine: LLMEngine, drafter: Drafter, k: int, verify: VerifyCost | None = None
) -> tuple[VerifyCost, float]:
    """What speculation costs here, as fractions of the target's one-token decode step: the
    target's forward at 1, 2 and 1 + k new tokens fitted to :class:`VerifyCost` (unless
    ``verify`` is given), and a draft model's one-token forward (``c_draft``; 0 for a drafter
    without a model). The defaults where a pool has no room for the scratch sequence."""
    model_drafter = isinstance(drafter, ModelDrafter)
    if verify is not None and not model_drafter:
        return verify, 0.0
    times = _time_forward(engine.model, engine.kv, (1,) if verify else (1, 2, 1 + k))
    if times is None:
        return verify or VerifyCost(), 0.5 if model_drafter else 0.0
    one = times[1]
    if verify is None:
        per_token = max(0.0, (times[1 + k] - times[2]) / one / max(1, k - 1))
        verify = VerifyCost(max(0.0, times[2] / one - 1.0 - per_token), per_token)
    draft = 0.0
    if isinstance(drafter, ModelDrafter):
        drafted = _time_forward(drafter.model, drafter.kv, (1,))
        draft = 0.5 if drafted is None else drafted[1] / one
    return verify, draft


@dataclass(slots=True)
class AdaptiveK:
    """One sequence's acceptance, decayed so that recent steps count most. Each verified
    step is a run of accepted drafts ended by a rejection (or by the end of the draft): the
    maximum-likelihood α of a geometric run is accepted / (accepted + rejections)."""

    accepted: float = 2.0  # prior: α = 2/3
    trials: float = 3.0
    #: steps without speculation since k fell to 0; it starts due, so that a sequence whose
    #: prior says "do not draft" drafts one token at once and learns its own α
    off_steps: int = 16
    DECAY = 0.8
    PROBE_EVERY = 16  # a sequence with k = 0 drafts one token again after this many steps

    @property
    def alpha(self) -> float:
        return self.accepted / self.trials

    def update(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        self.accepted = self.DECAY * self.accepted + accepted
        self.trials = self.DECAY * self.trials + accepted + (1 if accepted < proposed else 0)


@dataclass(slots=True)
class SpecStats:
    """Counters in vLLM's vocabulary (``spec_decode_num_drafts`` …) and timings."""

    num_drafts: int = 0  # (sequence, step) pairs with at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    #: drafts cut short by a rejection (the rest end with every draft accepted): with the
    #: accepted tokens they give the acceptance of one drafted token, accepted / (accepted +
    #: rejections), which a prediction from the two distributions estimates
    num_rejections: int = 0
    #: at each draft position: drafts that reached it, and drafts accepted there
    draft_tokens_per_pos: list[int] = field(default_factory=list)
    accepted_tokens_per_pos: list[int] = field(default_factory=list)
    steps: int = 0  # steps in which some sequence verified drafts
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    last_draft_s: float = 0.0
    last_verify_s: float = 0.0

    def record(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        self.num_rejections += int(accepted < proposed)
        grow = proposed - len(self.draft_tokens_per_pos)
        if grow > 0:
            self.draft_tokens_per_pos += [0] * grow
            self.accepted_tokens_per_pos += [0] * grow
        for pos in range(proposed):
            self.draft_tokens_per_pos[pos] += 1
            if pos < accepted:
                self.accepted_tokens_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens per verified step, the target's own token included (vLLM's definition)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def acceptance_per_pos(self) -> tuple[float, ...]:
        return tuple(
            a / d if d else 0.0
            for a, d in zip(self.accepted_tokens_per_pos, self.draft_tokens_per_pos, strict=True)
        )


class Speculator:
    """The engine's speculation state: the drafter, each sequence's adaptive k, the stats."""

    def __init__(
        self,
        config: SpeculativeConfig,
        drafter: Drafter,
        verify: VerifyCost | None = None,
        draft_cost: float | None = None,
    ) -> None:
        self.config = config
        self.drafter = drafter
        self.verify_cost = config.verify_cost or verify or VerifyCost()
        #: c_draft: a draft token's cost over the target's decode step, measured at start
        if draft_cost is None:
            draft_cost = 0.5 if isinstance(drafter, ModelDrafter) else 0.0
        self.draft_cost = draft_cost
        self.stats = SpecStats()
        self.rule = "exact"
        self._k: dict[str, AdaptiveK] = {}

    @property
    def label(self) -> str:
        return self.config.label

    def plan(self, running: Sequence[Seq]) -> None:
        """Set each running sequence's ``spec_k`` for the next step: decoding sequences only,
        within their remaining tokens, adaptive per sequence, and within the step's
        verification budget."""
        conf = self.config
        decoding = [s for s in running if s.num_tokens - s.num_computed == 1]
        for seq in running:
            seq.spec_k = 0
        if not decoding:
            return
        # every decoding sequence verifies 1 + k tokens: k shrinks as the batch grows
        k_cap = min(conf.k, conf.max_verify_tokens // len(decoding) - 1)
        if k_cap <= 0:
            return
        for seq in decoding:
            left = seq.max_new_tokens - len(seq.output_ids) - 1  # the target's token is one
            k = min(k_cap, left)
            if k <= 0:
                continue
            if conf.adaptive:
                state = self._k.setdefault(seq.request_id, AdaptiveK())
                chosen = best_k(state.alpha, k, self.verify_cost, self.draft_cost)
                if chosen == 0:
                    state.off_steps += 1
                    if state.off_steps < AdaptiveK.PROBE_EVERY:
                        continue
                    chosen, state.off_steps = 1, 0
                k = chosen
            seq.spec_k = k

    def draft(
        self, seqs: Sequence[Seq], ks: Sequence[int], window: CacheWindow | None
    ) -> list[Draft]:
        started = time.perf_counter()
        drafts = self.drafter.propose(seqs, ks, window)
        took = time.perf_counter() - started
        self.stats.draft_time_s += took
        self.stats.last_draft_s = took
        return drafts

    def verified(self, seq: Seq, proposed: int, accepted: int) -> None:
        self.stats.record(proposed, accepted)
        if proposed and self.config.adaptive:
            self._k.setdefault(seq.request_id, AdaptiveK()).update(proposed, accepted)

    def step_done(self, verify_s: float) -> None:
        """The step's forward and verification took ``verify_s``."""
        self.stats.steps += 1
        self.stats.verify_time_s += verify_s
        self.stats.last_verify_s = verify_s

    def forget(self, seq_id: str) -> None:
        self._k.pop(seq_id, None)
        self.drafter.forget(seq_id)

    def close(self) -> None:
        self.drafter.close()
        self._k.clear()

    def with_config(self, config: SpeculativeConfig) -> Speculator:
        """The same drafter under new k / adaptivity settings (what a k slider changes)."""
        new = Speculator(config, self.drafter, self.verify_cost, self.draft_cost)
        new.stats, new._k, new.rule = self.stats, self._k, self.rule
        return new


def same_drafter(a: SpeculativeConfig, b: SpeculativeConfig) -> bool:
    """Whether ``b`` can reuse ``a``'s drafter (only k and the adaptive settings differ)."""
    keep = {"k": a.k, "adaptive": a.adaptive, "max_verify_tokens": a.max_verify_tokens,
            "verify_cost": a.verify_cost}  # fmt: skip
    return replace(b, **keep) == a  # type: ignore[arg-type]
