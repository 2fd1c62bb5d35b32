"""Drafters: prompt lookup, and a draft model (the target's own weights at a lower precision,
or a smaller model with its tokenizer) over a KV pool of its own."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from engine.attention.paged import PagedBackend
from engine.core.sampling import race
from engine.errors import InvalidRequestError
from engine.executor import step as step_executor
from engine.formats.kv import SCALE_BYTES, KVFormat
from engine.hardware.transfer import fetch, upload
from engine.kv_cache.paged import PagedKVCache, SeqChunk
from engine.kv_cache.window import CacheWindow
from engine.speculative.config import MAX_DRAFT_K
from engine.speculative.rule import Draft, distributions, seen_with

if TYPE_CHECKING:
    from engine.core.engine import LLMEngine
    from engine.core.sequence import Sequence as Seq
    from engine.model.transformer import Transformer

#: the most tokens a draft model's cache catches up on in one step (a long prompt goes in
#: chunks of this size before the sequence drafts)
CATCH_UP = 256


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
        kv_format: KVFormat | None = None,
    ) -> None:
        self.name = name
        self.model = model
        self.device = device
        self.vocab_size = vocab_size
        self.kv = PagedKVCache(
            model.cfg, num_blocks=num_blocks, block_size=block_size, dtype=dtype,
            device=device, prefix_caching=False, attention=PagedBackend(device, kv=kv_format),
            kv_format=kv_format,
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
        give theirs up when it is full. The pool holds the target's quantized rows where the
        target's does and the draft model's heads take them (a float pool otherwise)."""
        _check_pair(draft, target)
        fmt = target.kv.format
        kv = fmt if fmt.quantized and draft.cfg.head_dim % SCALE_BYTES == 0 else None
        mgr = target.kv.manager
        if num_blocks is None:
            context = mgr.blocks_for(target.context_length + MAX_DRAFT_K + 1)
            num_blocks = min(mgr.num_blocks, max(context, mgr.num_blocks // 4))
        return cls(
            name, draft.model, vocab_size=target.cfg.vocab_size, dtype=draft.dtype,
            device=draft.device, num_blocks=num_blocks, block_size=target.kv.block_size,
            weights_bytes=draft.weights_bytes, keep=draft, kv_format=kv,
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
                first = start + self._rope_offset(seq)
                positions += range(first, first + len(tokens))
                chunks.append(SeqChunk(seq.request_id, start, len(tokens), window))
                rows.append(len(ids) - 1)
            logits = step_executor.of(self.model).forward(
                upload(ids, self.device),
                upload(positions, self.device),
                self.kv.context(chunks),
                upload(rows, self.device),
            )[:, : self.vocab_size]
            self._pick(logits, [(seqs[i], drafts[i], probs[i]) for i, _ in batch])
        for i, k, _ in active:
            self._done[seqs[i].request_id] = seqs[i].num_tokens + k - 1
            if probs[i]:
                drafts[i].probs = torch.stack(probs[i])
        return drafts

    def _rope_offset(self, seq: Seq) -> int:
        """What to add to ``seq``'s positions in the draft model's RoPE tables: LongRoPE's long
        rows where the target runs ``seq`` on them and the draft model has them too."""
        return self.model.rope.long_offset if getattr(seq, "rope_long", False) else 0

    def _catch_up(self, behind: list[tuple[Seq, int]], window: CacheWindow | None) -> None:
        """Feed the next :data:`CATCH_UP` tokens of each sequence far behind (no draft)."""
        if not behind:
            return
        ids: list[int] = []
        positions: list[int] = []
        chunks: list[SeqChunk] = []
        for seq, start in behind:
            ids += seq.tokens(start, start + CATCH_UP)
            first = start + self._rope_offset(seq)
            positions += range(first, first + CATCH_UP)
            chunks.append(SeqChunk(seq.request_id, start, CATCH_UP, window))
        step_executor.of(self.model).forward(  # no row of logits: only the draft cache
            upload(ids, self.device),
            upload(positions, self.device),
            self.kv.context(chunks),
            upload([], self.device),
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
        seqs = [seq for seq, _, _ in rows]
        seen = []
        for seq, draft, _ in rows:
            assert seq.history is not None
            drafted = upload(draft.tokens, logits.device)
            seen.append(seen_with(seq.history[: seq.num_tokens], drafted))
        q = distributions(logits, [s.params for s in seqs], seen)
        tokens = fetch(race(q, [s.generator for s in seqs]))[0]  # greedy rows are one-hot
        for (seq, draft, probs), token, row in zip(rows, tokens, q, strict=True):
            draft.tokens.append(int(token))
            if not seq.params.greedy:
                probs.append(row)

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
