"""``infersight chat``: a streaming, multi-turn chat in the terminal.

Commands: ``/reset`` forgets the conversation, ``/quit`` (or Ctrl-D) leaves, ``/help``.
Ctrl-C while a reply streams stops that reply and keeps what was said so far.
"""

from __future__ import annotations

import sys
from typing import TextIO

from engine.core.engine import LLMEngine
from engine.core.sampling import SamplingParams
from engine.errors import InfersightError

HELP = "commands: /reset (new conversation), /quit (or Ctrl-D), /help; Ctrl-C stops a reply"


class ChatSession:
    """Conversation state and one turn of generation; the terminal loop drives it."""

    def __init__(
        self, engine: LLMEngine, params: SamplingParams, system: str | None = None
    ) -> None:
        self.engine = engine
        self.params = params
        self.system = system
        self.history: list[dict[str, str]] = []

    def reset(self) -> None:
        self.history.clear()

    def messages(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.history

    def prompt_ids(self, out: TextIO) -> list[int]:
        """The templated conversation; oldest turns are dropped if it outgrows the context."""
        budget = self.engine.context_length - min(self.params.max_new_tokens, 256)
        ids = self.engine.chat_prompt_ids(self.messages())
        while len(ids) > budget and len(self.history) > 1:
            del self.history[:2]  # the oldest user/assistant exchange
            out.write("[context full: forgot the oldest exchange]\n")
            ids = self.engine.chat_prompt_ids(self.messages())
        return ids

    def reply(self, user_text: str, out: TextIO) -> str:
        """Stream the assistant's answer to ``out``; Ctrl-C keeps the partial answer."""
        self.history.append({"role": "user", "content": user_text})
        text = ""
        try:
            generation = self.engine.generate(self.prompt_ids(out), self.params)
            for event in generation:
                text += event.text
                out.write(event.text)
                out.flush()
        except KeyboardInterrupt:
            out.write(" [stopped]")
        except InfersightError:
            self.history.pop()  # the turn never happened; the rest of the chat stays
            raise
        except Exception as exc:  # the engine failed mid-reply: keep the chat and what came
            out.write(f" [error: {type(exc).__name__}: {exc}]")
        out.write("\n")
        self.history.append({"role": "assistant", "content": text})
        return text


def describe_sampling(params: SamplingParams) -> str:
    """``greedy``, or what is on: ``temperature 0.2, top-k 50, top-p 0.9``."""
    p = params
    parts = ["greedy"] if p.greedy else [f"temperature {p.temperature:g}"]
    if not p.greedy:
        parts += [f"top-k {p.top_k}"] * (p.top_k > 0) + [f"top-p {p.top_p:g}"] * (p.top_p < 1)
        parts += [f"min-p {p.min_p:g}"] * (p.min_p > 0)
    parts += [f"repetition penalty {p.repetition_penalty:g}"] * (p.repetition_penalty != 1)
    return ", ".join(parts)


def run_chat(engine: LLMEngine, params: SamplingParams, *, system: str | None = None) -> int:
    """The terminal loop over a loaded engine (``infersight chat`` loads it and builds
    ``params``: the model's default sampling with the command's flags on top)."""
    session = ChatSession(engine, params, system=system)
    print(
        f"{engine.name} ({engine.cfg.model_type}, {engine.precision.text}, {engine.device}; "
        f"{describe_sampling(session.params)}). {HELP}"
    )
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print()
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/quit", "/exit"):
            return 0
        if text == "/reset":
            session.reset()
            print("[new conversation]")
            continue
        if text == "/help":
            print(HELP)
            continue
        sys.stdout.write("bot> ")
        try:
            session.reply(text, sys.stdout)
        except InfersightError as exc:
            print(f"\n[error: {exc}]")
