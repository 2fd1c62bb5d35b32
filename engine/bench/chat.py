"""``infersight bench --workload chat``: a scripted conversation, turn by turn, through two
engines on the same weights, prefix caching off and on, taking turns so that a noisy machine
hurts both alike.

Each turn sends the whole conversation so far (system prompt, every earlier message and
reply, the new message) through the model's chat template, as a chat app does. Without prefix
caching the time to the first token grows with the conversation; with it, each turn computes
little more than its new message. Messages are random ordinary words of a fixed token length
(seeded); replies are the model's own (greedy, up to ``reply_tokens``), the same on both engines
when caching changes nothing, which the report says.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from engine.bench.report import text_table
from engine.core.engine import LLMEngine
from engine.core.sampling import SamplingParams
from engine.errors import InvalidRequestError
from engine.loader.load import load_model


@dataclass(frozen=True, slots=True)
class TurnResult:
    turn: int
    prompt_tokens: int  # the whole conversation sent this turn
    ttft_off_s: float
    ttft_on_s: float
    cached_tokens: int  # of the prompt, found in the prefix cache (caching on)
    computed_tokens: int  # of the prompt, computed (caching on)
    same_reply: bool  # the two engines replied alike


def message_words(engine: LLMEngine) -> list[int]:
    """Token ids that decode to a space and a plain lowercase word: a message made of them
    encodes back to the same ids, so its token length is what was asked for."""
    tok = engine.tokenizer
    words = []
    for i in range(engine.cfg.vocab_size):
        text = tok.decode([i])
        if len(text) > 3 and text[0] == " " and text[1:].isalpha() and text[1:].islower():
            words.append(i)
    return words


def _reply(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> tuple[list[int], Any]:
    gen = engine.generate(prompt, params)
    for _ in gen:
        pass
    metrics = engine.request_metrics(gen.request_id)
    assert metrics is not None
    return gen.result.token_ids, metrics


def run_chat_bench(
    folder: Path,
    *,
    turns: int = 10,
    message_tokens: int = 150,
    reply_tokens: int = 64,
    system_tokens: int = 100,
    seed: int = 0,
    precision: str = "fp32",
    device: str = "cpu",
    engine_config: Any = None,
    log: Callable[[str], None] = lambda _: None,
    tensor_parallel: int = 1,
) -> dict[str, Any]:
    on = load_model(
        folder, precision=precision, device=device, config=engine_config,
        tensor_parallel=tensor_parallel,
    )  # fmt: skip
    on.set_prefix_caching(True)
    pool = on.kv.manager.num_blocks
    off = on.sibling(replace(on.config, prefix_caching=False, num_blocks=pool, kv_memory=None))
    rng = random.Random(seed)
    words = message_words(on)
    if not words:
        raise InvalidRequestError(
            "this model's tokenizer has no plain-word tokens to write chat messages with; "
            "use --workload mixed, or a model with a word-piece vocabulary"
        )

    def text(n: int) -> str:
        return "".join(on.tokenizer.decode([rng.choice(words)]) for _ in range(n))

    messages = [{"role": "system", "content": text(system_tokens).strip()}] if system_tokens else []
    params = SamplingParams(max_new_tokens=reply_tokens, temperature=0.0)
    for engine in (off, on):  # warm both up, so that turn 1 times no first-call costs
        _reply(engine, on.tokenizer.encode(text(16)), SamplingParams(max_new_tokens=4))
    on.clear_prefix_cache()
    results: list[TurnResult] = []
    for turn in range(1, turns + 1):
        messages.append({"role": "user", "content": text(message_tokens).strip()})
        prompt = on.chat_prompt_ids(messages)
        if len(prompt) + reply_tokens > on.context_length:
            log(f"turn {turn}: the conversation ({len(prompt)} tokens) fills the context; stop")
            break
        log(f"turn {turn}: {len(prompt)} prompt tokens")
        want, m_off = _reply(off, prompt, params)
        got, m_on = _reply(on, prompt, params)
        results.append(
            TurnResult(
                turn=turn,
                prompt_tokens=len(prompt),
                ttft_off_s=m_off.time_to_first_token_seconds,
                ttft_on_s=m_on.time_to_first_token_seconds,
                cached_tokens=m_on.cached_prompt_tokens,
                computed_tokens=m_on.computed_prompt_tokens,
                same_reply=got == want,
            )
        )
        messages.append({"role": "assistant", "content": on.tokenizer.decode(got)})
    report: dict[str, Any] = {
        "model": str(folder),
        "precision": precision,
        "device": device,
        "message_tokens": message_tokens,
        "reply_tokens": reply_tokens,
        "system_tokens": system_tokens,
        "seed": seed,
        "block_size": on.kv.block_size,
        "turns": [asdict(r) for r in results],
        "replies_identical": all(r.same_reply for r in results),
    }
    if len(results) > 1:
        first, last = results[0], results[-1]
        report["last_vs_first_ttft"] = {
            "off": last.ttft_off_s / first.ttft_off_s,
            "on": last.ttft_on_s / first.ttft_on_s,
        }
    return report


def format_chat_report(report: dict[str, Any]) -> str:
    lines = [
        f"model {report['model']}  precision {report['precision']}  device {report['device']}  "
        f"messages of {report['message_tokens']} tokens, replies up to {report['reply_tokens']}, "
        f"system prompt {report['system_tokens']} (seed {report['seed']}), "
        f"KV blocks of {report['block_size']}"
    ]
    cols = ["turn", "prompt tok", "TTFT off s", "TTFT on s", "cached", "computed", "same reply"]
    rows = [
        [
            str(r["turn"]), str(r["prompt_tokens"]), f"{r['ttft_off_s']:.3f}",
            f"{r['ttft_on_s']:.3f}", str(r["cached_tokens"]), str(r["computed_tokens"]),
            "yes" if r["same_reply"] else "NO",
        ]
        for r in report["turns"]
    ]  # fmt: skip
    lines += text_table(cols, rows)
    if "last_vs_first_ttft" in report:
        ratio = report["last_vs_first_ttft"]
        n = len(report["turns"])
        lines.append(
            f"TTFT of turn {n} / turn 1: prefix caching off {ratio['off']:.2f}x, "
            f"on {ratio['on']:.2f}x"
        )
    lines.append(
        "replies identical with and without caching: "
        + ("yes" if report["replies_identical"] else "NO")
    )
    return "\n".join(lines)
