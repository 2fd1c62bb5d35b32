"""The two sides of an A/B comparison (:mod:`engine.evals.compare`): the prompt they share
(which needs one tokenizer for both), what each side runs with (:class:`Side`), and each side's
generation and what it ran as (:class:`SideRun`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from engine.core.engine import LLMEngine
from engine.core.sampling import SamplingParams
from engine.errors import InvalidRequestError
from engine.kv_cache.window import CacheWindow


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
    #: what the side's KV pool holds (:mod:`engine.formats.kv`)
    kv_dtype: str = ""

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
            kv_dtype=engine.kv.format.name,
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


@dataclass(frozen=True, slots=True)
class Side:
    """What one side runs with, besides its engine: sampling and cache window."""

    params: SamplingParams
    window: CacheWindow | None = None
