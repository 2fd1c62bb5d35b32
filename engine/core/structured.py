"""Structured outputs: a request's reply held to a grammar (a JSON schema, any JSON object, a
regular expression or a Lark grammar) by a token mask in our sampler.

The grammar engine is llguidance (a well-kept library: it compiles the grammar and tells, for
each step, which tokens may come next); the mask's use is ours. Per engine, one
:class:`Grammars` builds llguidance's view of the tokenizer once (a third of a second for a
49k vocabulary) and a matcher per request (:meth:`Grammars.matcher`, which refuses a bad grammar
with its error). Per step, :meth:`Grammars.masks` fills one bit row per constrained sequence (in
parallel, in llguidance's threads) and :func:`apply_masks` puts -inf on every token a row's bits
leave out, in the copy of the logits the sampler draws from (log-probabilities stay the model's
own). Each token a constrained sequence takes is then consumed by its matcher
(:meth:`Grammars.consume`); a grammar that has ended ends the reply.

Under speculative decoding the target's rows are masked in verification: row ``i`` by what the
grammar allows after the first ``i`` drafts (:meth:`Grammars.draft_masks`), so a draft the
grammar refuses is rejected and the token put in its place is one it allows. Prefix caching
and batching are untouched: the mask only filters sampling.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from engine.errors import InvalidRequestError
from engine.hardware.transfer import to_device

if TYPE_CHECKING:
    from engine.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

Kind = Literal["json_schema", "json_object", "regex", "lark"]


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a reply must match: ``text`` is the JSON schema (as JSON), the regular expression
    or the Lark grammar; ``json_object`` takes none (any JSON object)."""

    kind: Kind
    text: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("json_schema", "json_object", "regex", "lark"):
            raise InvalidRequestError(
                f"a constraint is json_schema, json_object, regex or lark, not {self.kind!r}"
            )
        if self.kind == "json_schema":
            try:
                json.loads(self.text)
            except ValueError as exc:
                raise InvalidRequestError(f"the JSON schema is not JSON: {exc}") from None

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> Constraint:
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    def grammar(self) -> str:
        """llguidance's grammar for this constraint."""
        from llguidance import LLMatcher

        if self.kind == "json_object":
            return str(LLMatcher.grammar_from_json_schema('{"type": "object"}'))
        if self.kind == "json_schema":
            return str(LLMatcher.grammar_from_json_schema(self.text))
        if self.kind == "regex":
            return str(LLMatcher.grammar_from_regex(self.text))
        return str(LLMatcher.grammar_from_lark(self.text))


class Grammars:
    """llguidance's view of one engine's tokenizer, the matchers of its constrained requests,
    and the mask's cost (``mask_s`` over ``mask_steps`` steps: the ms/step instrument)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: list[int]) -> None:
        from llguidance import LLExecutor, LLTokenizer

        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.tokenizer = LLTokenizer(tokenizer.backend_json(), n_vocab=vocab_size,
                                     eos_token=sorted(eos_ids))  # fmt: skip
        self.executor = LLExecutor()
        self.mask_s = 0.0
        self.mask_steps = 0

    def matcher(self, constraint: Constraint) -> Any:
        """A new matcher for ``constraint``; a grammar llguidance cannot use is refused with
        its reason."""
        from llguidance import LLMatcher

        try:
            grammar = constraint.grammar()
        except Exception as exc:  # llguidance says what is wrong with it
            raise InvalidRequestError(
                f"the {constraint.kind} constraint is invalid: {exc}"
            ) from None
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(
                f"the {constraint.kind} constraint is invalid: {matcher.get_error()}"
            )
        return matcher

    def masks(self, matchers: list[Any]) -> torch.Tensor:
        """``[len(matchers), words]`` int32 bit rows (on the CPU): bit ``t`` of a row set where
        token ``t`` may come next."""
        started = time.perf_counter()
        bits = torch.full((len(matchers), self.words), -1, dtype=torch.int32)
        pairs = [(m, i) for i, m in enumerate(matchers)]
        self.executor.unsafe_compute_mask_ptr(pairs, bits.data_ptr(), self.words * 4, len(pairs))
        self.mask_s += time.perf_counter() - started
        self.mask_steps += 1
        return bits

    def draft_masks(self, matcher: Any, drafts: list[int]) -> torch.Tensor:
        """``[len(drafts) + 1, words]`` bit rows for verifying ``drafts``: row ``i`` what may
        follow the first ``i`` drafts. The matcher walks the drafts and comes back (rollback);
        past a draft the grammar refuses, the rows allow everything: that draft is masked out
        of the target's row, so it is rejected there and the rows after it go unused."""
        started = time.perf_counter()
        bits = torch.full((len(drafts) + 1, self.words), -1, dtype=torch.int32)
        walked = 0
        for i in range(len(drafts) + 1):
            row = bits[i]
            matcher.unsafe_compute_mask_ptr(row.data_ptr(), self.words * 4)
            if i == len(drafts) or matcher.try_consume_tokens([drafts[i]]) != 1:
                break
            walked += 1
        if walked:
            matcher.rollback(walked)
        self.mask_s += time.perf_counter() - started
        self.mask_steps += 1
        return bits

    @staticmethod
    def consume(matcher: Any, token: int) -> bool:
        """``token`` taken by the matcher's sequence; whether its grammar has ended (or can
        go no further: a token it refused, logged)."""
        if not matcher.consume_token(token) or matcher.is_error():
            log.warning("the grammar refused token %d: %s", token, matcher.get_error())
            return True
        return bool(matcher.is_stopped())


def apply_masks(rows: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """``rows`` (``[R, V]`` logits) with -inf where a row's ``bits`` leave a token out; a
    copy."""
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, : rows.shape[-1]]
    allowed = to_device(allowed, rows.device)
    return rows.masked_fill(~allowed, float("-inf"))
