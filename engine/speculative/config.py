"""Which drafter, and how far it may draft: the ``--speculative`` setting and its parser."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from engine.errors import InvalidRequestError
from engine.quant.spec import parse_precision_spec

MAX_DRAFT_K = 16
#: what ``--speculative`` accepts, for messages
FORMS = "self:PRECISION (e.g. self:int4-g32+head), lookup, or model:DIR"


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


def same_drafter(a: SpeculativeConfig, b: SpeculativeConfig) -> bool:
    """Whether ``b`` can reuse ``a``'s drafter (only k and the adaptive settings differ)."""
    keep = {"k": a.k, "adaptive": a.adaptive, "max_verify_tokens": a.max_verify_tokens,
            "verify_cost": a.verify_cost}  # fmt: skip
    return replace(b, **keep) == a  # type: ignore[arg-type]
