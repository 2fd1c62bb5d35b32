"""What an A/B comparison knows of a side it cannot look inside: a model behind an
OpenAI-compatible server, which returns, at each position, the token there, that token's
log-probability and the top-k alternatives — not the whole distribution.

:class:`KnownRow` is one such position; :class:`RemoteModel` is what the comparison asks of a
server (the app's :mod:`app.endpoints.remote` speaks it over HTTP); :func:`pooled_kl` is the
KL divergence over what both sides know, with everything else pooled into one outcome. By the
log-sum inequality (KL never grows when outcomes are merged), the pooled KL is a lower bound on
the full one, equal to it where the pooled rest holds no probability on either side.

No torch here: the app's endpoint client builds these rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

#: the least mass a pooled rest is taken to have on the reference's other side (a server's
#: top-k that sum to 1 within rounding leaves a rest of ~0, whose log is -inf)
REST_FLOOR = 1e-12


@dataclass(frozen=True, slots=True)
class KnownRow:
    """One position as a server scored it: the token there (its id), that token's
    log-probability, and the top-k alternatives ``(id, logprob)``, likeliest first (tokens the
    server named so that their id is not known are left out)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def known(self) -> dict[int, float]:
        """Every token whose log-probability this row gives."""
        return {**dict(self.top), self.token: self.logprob}

    def rank_of(self, token: int) -> int | None:
        """``token``'s rank (1: the likeliest) among the top-k, None beyond them."""
        for rank, (tid, _) in enumerate(self.top, 1):
            if tid == token:
                return rank
        return None


@dataclass(slots=True)
class RemoteRun:
    """A server's generation: each token's row, as the client measured it."""

    rows: list[KnownRow]
    finish_reason: str | None
    ttft_s: float | None
    tokens_per_s: float | None
    text: str = ""
    #: said about the run (e.g. tokens the server named by text only), shown with the report
    notes: list[str] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return [r.token for r in self.rows]


class Decoder(Protocol):
    """Token ids to text, as a server's ``/detokenize`` reads them (special tokens kept)."""

    vocab_size: int

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class RemoteModel(Protocol):
    """A model behind a server, as the A/B lab asks of it."""

    #: how the report names it (model @ server)
    name: str
    #: the top-k it is asked for at each position
    k: int

    def prompt_ids(self, text: str) -> list[int] | None:
        """``text`` as the server tokenizes it (without special tokens added), or None where
        the server has no tokenizer route."""
        ...

    def chat_prompt_ids(self, messages: list[dict[str, str]]) -> list[int] | None:
        """``messages`` through the server's chat template, as token ids ready to generate
        after (None: the server has no such route)."""
        ...

    def decoder(self) -> Decoder | None:
        """The server's tokenizer to read ids by (None: it has no ``/detokenize``)."""
        ...

    def generate(
        self, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float,
        seed: int | None, on_text: Callable[[str], None],
    ) -> RemoteRun:  # fmt: skip
        """Generate after ``prompt_ids`` (token ids, as given), streaming the text to
        ``on_text``; each token with its row."""
        ...

    def chat(
        self, messages: list[dict[str, str]], max_new_tokens: int, temperature: float,
        seed: int | None, on_text: Callable[[str], None],
    ) -> RemoteRun:  # fmt: skip
        """Answer ``messages`` through the server's chat route (its own template), streaming
        the text to ``on_text`` (rows where the server gives them)."""
        ...

    def score(self, prompt_ids: Sequence[int], ids: Sequence[int]) -> list[KnownRow] | None:
        """Teacher-forced rows on ``ids`` after ``prompt_ids``, or None where the server
        cannot score a given text (no ``echo``)."""
        ...


def pooled_kl(p: dict[int, float], q: dict[int, float]) -> float:
    """KL(p‖q) over the tokens both give (log-probabilities), the rest of each side pooled
    into one outcome: a lower bound on the full KL (see the module docstring)."""
    shared = p.keys() & q.keys()
    kl = 0.0
    mass_p = mass_q = 0.0
    for tid in shared:
        pi, qi = math.exp(p[tid]), math.exp(q[tid])
        mass_p += pi
        mass_q += qi
        if pi > 0.0:
            kl += pi * (p[tid] - q[tid])
    rest_p, rest_q = max(0.0, 1.0 - mass_p), max(0.0, 1.0 - mass_q)
    if rest_p > REST_FLOOR:
        kl += rest_p * (math.log(rest_p) - math.log(max(rest_q, REST_FLOOR)))
    return max(kl, 0.0)


def outside_mass(p: dict[int, float], q: dict[int, float]) -> float:
    """The probability ``p`` puts outside the tokens both give: how much the pooled KL may
    miss (0: it is the full KL)."""
    return max(0.0, 1.0 - sum(math.exp(p[t]) for t in p.keys() & q.keys()))


def overlap_bounds(p: dict[int, float], q: dict[int, float]) -> tuple[float, float]:
    """Bounds on Σ min(p, q) — speculative sampling's acceptance, 1 − TV(p, q) — from what
    both give: the shared tokens' sum, and that plus the smaller pooled rest."""
    shared = p.keys() & q.keys()
    low = sum(min(math.exp(p[t]), math.exp(q[t])) for t in shared)
    rest_p = max(0.0, 1.0 - sum(math.exp(p[t]) for t in shared))
    rest_q = max(0.0, 1.0 - sum(math.exp(q[t]) for t in shared))
    return low, min(1.0, low + min(rest_p, rest_q))
