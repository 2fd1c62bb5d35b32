"""The two sides of an A/B comparison (:mod:`engine.evals.compare`): the prompt they share
(which needs one tokenizer for both), what each side runs with (:class:`Side`), and each side's
generation and what it ran as (:class:`SideRun`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, cast

from engine.core.engine import LLMEngine
from engine.core.sampling import SamplingParams
from engine.errors import InvalidRequestError
from engine.evals.known import RemoteModel
from engine.kv_cache.window import CacheWindow
from engine.model.tokenizer import Tokenizer


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


#: text tokenized on both sides of a comparison with a server, besides the prompt: digits,
#: accents, CJK and an emoji, which two tokenizers split differently where they differ
TOKENIZER_PROBE = " 12345 naïve café — 東京 🙂 def f(x):\n\treturn x"


def remote_prompt_ids(
    sides: dict[str, LLMEngine | RemoteModel], messages: list[dict[str, str]]
) -> tuple[list[int] | None, Tokenizer | None, str]:
    """For a comparison with a server: the prompt's ids (the local side's chat template),
    the tokenizer that reads both answers, and what the check found. The ids are None where
    a server tokenizes the prompt's text and the probe otherwise than the local side (the
    answers are then compared as text). A server without a tokenizer route is taken to match,
    and said so."""
    local = [s for s in sides.values() if isinstance(s, LLMEngine)]
    if not local:
        servers: list[RemoteModel] = [s for s in sides.values() if not isinstance(s, LLMEngine)]
        return servers_prompt_ids(servers[0], servers[1], messages)
    engine = local[0]
    text = "\n".join(m["content"] for m in messages) + TOKENIZER_PROBE
    mine = engine.tokenizer.encode(text)
    said = []
    for name, side in sides.items():
        if isinstance(side, LLMEngine):
            continue
        theirs = side.prompt_ids(text)
        if theirs is None:
            said.append(f"{name.upper()}'s server has no /tokenize: its tokenizer is taken to "
                        "be the local one's")  # fmt: skip
        elif theirs != mine:
            return (
                None,
                None,
                (
                    f"{name.upper()}'s server tokenizes the prompt otherwise than the local model "
                    f"({len(theirs)} tokens against {len(mine)})"
                ),
            )
        else:
            said.append(f"{name.upper()}'s server tokenizes the prompt as the local model does")
    return prompt_ids_for(engine, messages), engine.tokenizer, "; ".join(said)


def servers_prompt_ids(
    a: RemoteModel, b: RemoteModel, messages: list[dict[str, str]]
) -> tuple[list[int] | None, Tokenizer | None, str]:
    """Two servers and no local model: token by token where both tokenize the prompt and the
    probe alike (``/tokenize``), A's server gives the templated prompt's ids and reads ids
    back to text (``/detokenize``); else None (compared as text) and why."""
    text = "\n".join(m["content"] for m in messages) + TOKENIZER_PROBE
    ids_a, ids_b = a.prompt_ids(text), b.prompt_ids(text)
    if ids_a is None or ids_b is None:
        which = "A" if ids_a is None else "B"
        return None, None, (f"no local model, and {which}'s server has no /tokenize to check "
                            "the two tokenizers by")  # fmt: skip
    if ids_a != ids_b:
        return None, None, (f"the two servers tokenize the prompt otherwise ({len(ids_a)} "
                            f"tokens against {len(ids_b)})")  # fmt: skip
    prompt = a.chat_prompt_ids(messages)
    decoder = a.decoder() if prompt is not None else None
    if prompt is None or decoder is None:
        return None, None, ("no local model, and A's server cannot template the chat or read "
                            "ids back (/tokenize with messages, /detokenize)")  # fmt: skip
    said = (
        "no local model: both servers tokenize the prompt alike; the prompt is A's "
        "server's chat template, tokens read back by its /detokenize (special tokens shown)"
    )
    # read as a Tokenizer: decode and vocab_size are all that the comparison asks of one
    return prompt, cast("Tokenizer", decoder), said


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
