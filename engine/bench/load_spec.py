"""What the batching tuner's load is, as plain data: how requests arrive
(:class:`LoadSpec`), what they look like (:class:`PromptMix`), the per-request service level
(:class:`SLO`) and one run's figures (:class:`LoadResult`). No torch and no engine here, so
the app's views build and read them without either; :mod:`engine.bench.loadgen` sends such
load to an engine.

Two ways to make load, as in GuideLLM and ``vllm bench serve``:

* **closed loop**: ``users`` concurrent users, each sending its next request as soon as its
  last one finished (a fixed concurrency);
* **open loop**: requests arriving at ``rate`` per second whatever the engine does, evenly
  spaced (``constant``) or with gamma-distributed gaps (``poisson``; ``burstiness`` is the
  gamma shape: 1 is a Poisson process, below 1 burstier, above 1 steadier, vLLM's meaning).
"""

from __future__ import annotations

import json
import math
import random
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from engine.errors import InfersightError, InvalidRequestError

if TYPE_CHECKING:
    from engine.core.metrics import RequestMetrics

Mode = Literal["closed", "constant", "poisson"]
MODES: tuple[Mode, ...] = ("closed", "constant", "poisson")


@dataclass(frozen=True, slots=True)
class PromptMix:
    """What the requests look like. Shares not given to documents or conversations are
    single questions. Conversations are sampled uniformly in ``conversation_tokens``; output
    lengths from a log-normal with median ``output_median`` and shape ``output_sigma``,
    clipped to ``[output_min, output_max]``."""

    documents: float = 0.25
    conversations: float = 0.15
    conversation_tokens: tuple[int, int] = (500, 1200)
    output_median: int = 96
    output_sigma: float = 0.6
    output_min: int = 16
    output_max: int = 320

    def __post_init__(self) -> None:
        shares = (self.documents, self.conversations)
        if min(shares) < 0 or sum(shares) > 1:
            raise InvalidRequestError("the document and conversation shares must sum to <= 1")
        lo, hi = self.conversation_tokens
        if not 0 < lo <= hi:
            raise InvalidRequestError("conversation_tokens must be (low, high), 0 < low <= high")
        if not 1 <= self.output_min <= self.output_median <= self.output_max:
            raise InvalidRequestError("need 1 <= output_min <= output_median <= output_max")
        if not self.output_sigma >= 0:
            raise InvalidRequestError("output_sigma must be >= 0")


#: the faults a load can inject (:class:`Traffic`): a client that hangs up mid-stream, one
#: that hangs up once the server took the request (a cancel before its first token), one that
#: reads slowly, a body over the server's limit, a prompt far past the model's context, and a
#: body that is not JSON
FAULTS = ("disconnect", "cancel", "slow_reader", "oversize_body", "over_context", "malformed")
#: faults only a streamed request can carry
STREAM_FAULTS = frozenset({"disconnect", "cancel", "slow_reader"})


@dataclass(frozen=True, slots=True)
class Shape:
    """How one request is sent (drawn by :func:`draw_shape`): to ``/v1/completions`` (the
    messages as one text) or ``/v1/chat/completions``, streamed or not, with a sampling seed
    (None: greedy), the fault it carries ("" none), and a slow reader's pause per chunk."""

    route: Literal["chat", "completions"] = "chat"
    stream: bool = True
    seed: int | None = None
    fault: str = ""
    pause_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Traffic:
    """How a load's requests are sent to a server, beyond what they say (:class:`PromptMix`):
    the shares sent as text completions rather than chat, not streamed, and sampled at
    ``temperature`` (each with its own seed) rather than greedy; and ``faults``, each at its
    share of the requests (names from :data:`FAULTS`). The default is the tuner's load:
    streamed greedy chat, no faults. :meth:`parse` reads ``completions=0.5,sampled=0.4,
    disconnect=0.06``."""

    completions: float = 0.0
    unstreamed: float = 0.0
    sampled: float = 0.0
    temperature: float = 0.8
    faults: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        for name in ("completions", "unstreamed", "sampled"):
            if not 0 <= getattr(self, name) <= 1:
                raise InvalidRequestError(f"the {name} share must be in [0, 1]")
        if not 0 <= self.temperature <= 2:
            raise InvalidRequestError("the sampled requests' temperature must be in [0, 2]")
        for name, share in self.faults:
            if name not in FAULTS:
                raise InvalidRequestError(f"no fault {name!r}: the faults are {', '.join(FAULTS)}")
            if not 0 <= share <= 1:
                raise InvalidRequestError(f"the {name} share must be in [0, 1]")
        if sum(share for _, share in self.faults) > 1:
            raise InvalidRequestError("the fault shares must sum to <= 1")

    @classmethod
    def parse(cls, text: str) -> Traffic:
        """``completions=0.5,unstreamed=0.4,sampled=0.4,disconnect=0.06,cancel=0.04`` (shares;
        ``temperature=`` too); a name not given keeps its default."""
        values: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, raw = part.partition("=")
            key = key.strip().lower()
            try:
                value = float(raw) if sep else math.nan
            except ValueError:
                value = math.nan
            known = key in FAULTS or key in ("completions", "unstreamed", "sampled", "temperature")
            if not known or math.isnan(value):
                names = ", ".join(("completions", "unstreamed", "sampled", "temperature", *FAULTS))
                raise InvalidRequestError(
                    f"cannot read the traffic {text!r} at {part!r}: give name=share pairs, the "
                    f"names {names}"
                )
            values[key] = value
        faults = tuple((name, values.pop(name)) for name in FAULTS if name in values)
        return cls(**values, faults=faults)

    def describe(self) -> str:
        """The shares and faults given, ``name=share`` (empty: the default load)."""
        default = Traffic()
        parts = [f"{name}={getattr(self, name):g}"
                 for name in ("completions", "unstreamed", "sampled", "temperature")
                 if getattr(self, name) != getattr(default, name)]  # fmt: skip
        return ",".join(parts + [f"{name}={share:g}" for name, share in self.faults])


def draw_shape(rng: random.Random, traffic: Traffic) -> Shape:
    """The next request's :class:`Shape` as ``traffic`` describes it (the default takes no
    draw: a load without traffic sends what it always sent)."""
    if traffic == Traffic():
        return Shape()
    fault, roll = "", rng.random()
    for name, share in traffic.faults:
        if roll < share:
            fault = name
            break
        roll -= share
    route: Literal["chat", "completions"] = (
        "completions" if rng.random() < traffic.completions else "chat"
    )
    stream = fault in STREAM_FAULTS or rng.random() >= traffic.unstreamed
    seed = rng.randint(0, (1 << 31) - 1) if rng.random() < traffic.sampled else None
    pause = rng.uniform(0.05, 0.25) if fault == "slow_reader" else 0.0
    return Shape(route, stream, seed, fault, pause)


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """How much load and for how long. With neither ``requests`` nor ``duration_s`` the load
    runs until stopped (the app's live tuning). After ``duration_s`` no new request is sent
    and the ones in flight finish."""

    mode: Mode = "closed"
    users: int = 8
    rate: float = 1.0  # requests per second, open loop
    burstiness: float = 1.0
    requests: int | None = 64
    duration_s: float | None = None
    seed: int = 0
    mix: PromptMix = field(default_factory=PromptMix)
    traffic: Traffic = field(default_factory=Traffic)  # a server's load only

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InvalidRequestError(f"load mode must be one of {', '.join(MODES)}")
        if self.users < 1:
            raise InvalidRequestError(f"users must be >= 1, got {self.users}")
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise InvalidRequestError(f"rate must be > 0 requests/s, got {self.rate}")
        if not self.burstiness > 0:
            raise InvalidRequestError(f"burstiness must be > 0, got {self.burstiness}")
        if self.requests is not None and self.requests < 1:
            raise InvalidRequestError(f"requests must be >= 1, got {self.requests}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise InvalidRequestError(f"duration must be > 0 s, got {self.duration_s}")

    @property
    def load(self) -> float:
        """The offered load on one axis: users (closed loop) or requests/s (open loop)."""
        return float(self.users) if self.mode == "closed" else self.rate

    def describe(self) -> str:
        if self.mode == "closed":
            return f"{self.users} users"
        shape = "" if self.mode == "constant" or self.burstiness == 1 else f" b{self.burstiness:g}"
        return f"{self.rate:g} req/s {self.mode}{shape}"


@dataclass(frozen=True, slots=True)
class SLO:
    """A per-request service level: TTFT and TPOT at most these (seconds). A request that
    meets both counts towards goodput (vLLM's ``--goodput``)."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def met_by(self, m: RequestMetrics) -> bool:
        if self.ttft_s is not None and (m.time_to_first_token_seconds or 0.0) > self.ttft_s:
            return False
        tpot = m.time_per_output_token_seconds
        return self.tpot_s is None or tpot is None or tpot <= self.tpot_s

    @classmethod
    def parse(cls, text: str) -> SLO:
        """``ttft=500ms,tpot=100ms`` (units ms or s; a bare number is milliseconds)."""
        values: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, raw = part.partition("=")
            key = key.strip().lower()
            if not sep or key not in ("ttft", "tpot"):
                raise InvalidRequestError(
                    f"cannot read the SLO {text!r}: give e.g. ttft=500ms,tpot=100ms"
                )
            values[key] = _seconds(raw.strip(), text)
        if not values:
            raise InvalidRequestError("the SLO is empty: give e.g. ttft=500ms,tpot=100ms")
        return cls(values.get("ttft"), values.get("tpot"))

    def describe(self) -> str:
        parts = []
        if self.ttft_s is not None:
            parts.append(f"ttft<={self.ttft_s * 1e3:g}ms")
        if self.tpot_s is not None:
            parts.append(f"tpot<={self.tpot_s * 1e3:g}ms")
        return ",".join(parts)


def _seconds(raw: str, text: str) -> float:
    scale = 1e-3
    for suffix, unit in (("ms", 1e-3), ("s", 1.0)):
        if raw.endswith(suffix):
            raw, scale = raw[: -len(suffix)], unit
            break
    try:
        value = float(raw) * scale
    except ValueError:
        raise InvalidRequestError(
            f"cannot read the SLO {text!r}: give e.g. ttft=500ms,tpot=100ms"
        ) from None
    if not value > 0:
        raise InvalidRequestError(f"SLO times must be > 0 in {text!r}")
    return value


@dataclass(frozen=True, slots=True)
class LoadResult:
    """One run's figures, keyed as ``vllm bench serve`` keys its result JSON (times in ms,
    throughputs per second), plus what the tuner explains them with."""

    setting: dict[str, Any]
    load: str
    completed: int
    failed: int  # turned away (open loop), could not run, or ended by an error or a timeout
    duration: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: dict[str, float]  # mean, median, p95, p99
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2el_ms: dict[str, float]
    queue_ms: dict[str, float]
    preemptions: int
    mean_batch_size: float
    mean_tokens_per_request: float
    slo: str = ""
    request_goodput: float | None = None  # requests/s that met the SLO
    slo_attainment: float | None = None  # share of completed requests that met it
    stopped: bool = False  # Stop ended it before its requests or duration were done
    refused: int = 0  # times the full waiting queue turned a request away (closed loop: resent)

    def as_json(self) -> dict[str, Any]:
        """Flat vLLM-bench keys: ``mean_ttft_ms``, ``median_ttft_ms``, ``p99_ttft_ms`` …"""
        out: dict[str, Any] = {}
        for key, value in asdict(self).items():
            if isinstance(value, dict) and key.endswith("_ms"):
                name = key[:-3]
                for stat, v in value.items():
                    out[f"{stat}_{name}_ms"] = v
            else:
                out[key] = value
        return out


# -- the requests, as text (the engine's generator tokenizes them; a remote server does) ------

PROMPT_SET = Path(__file__).resolve().parents[2] / "resources" / "prompts" / "chat.json"


@cache
def prompt_set(path: Path = PROMPT_SET) -> dict[str, list[str]]:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise InfersightError(f"cannot read the tuner's prompt set {path}: {exc}") from exc
    keys = ("questions", "answers", "documents", "document_questions")
    if not all(isinstance(raw.get(k), list) and raw[k] for k in keys):
        raise InfersightError(f"{path} needs non-empty lists {', '.join(keys)}")
    return {k: [str(x) for x in raw[k]] for k in keys}


def draw_request(
    rng: random.Random, mix: PromptMix, texts: dict[str, list[str]],
    count: Callable[[str], int], room: int,
) -> tuple[str, list[dict[str, str]], int]:  # fmt: skip
    """The next request ``mix`` describes, drawn from ``rng``: its kind (question, document,
    conversation), its chat messages, and its output length (at most half of ``room``
    tokens, what the prompt and the reply may take; ``count``: a text's tokens)."""
    out = round(math.exp(rng.gauss(math.log(mix.output_median), mix.output_sigma)))
    out = max(1, min(max(mix.output_min, min(mix.output_max, out)), room // 2))
    draw = rng.random()
    if draw < mix.documents:
        content = rng.choice(texts["documents"]) + "\n\n" + rng.choice(texts["document_questions"])
        return "document", [{"role": "user", "content": content}], out
    if draw < mix.documents + mix.conversations:
        target = min(rng.randint(*mix.conversation_tokens), room - out)
        return "conversation", _conversation(rng, texts, count, target), out
    return "question", [{"role": "user", "content": rng.choice(texts["questions"])}], out


def _conversation(
    rng: random.Random, texts: dict[str, list[str]], count: Callable[[str], int], target: int
) -> list[dict[str, str]]:
    """Turns of questions and answers until the templated conversation reaches ``target``
    tokens (estimated from each turn's own length), ending on a user's question."""
    messages: list[dict[str, str]] = []
    tokens = 0
    while True:
        question = rng.choice(texts["questions"] + texts["documents"])
        messages.append({"role": "user", "content": question})
        tokens += count(question) + 5
        if tokens >= target:
            return messages
        answer = rng.choice(texts["answers"])
        messages.append({"role": "assistant", "content": answer})
        tokens += count(answer) + 5


def stats_ms(values: list[float]) -> dict[str, float]:
    """Mean, median, p95 and p99 of ``values`` (seconds) in milliseconds (NaN: none)."""
    if not values:
        return {"mean": math.nan, "median": math.nan, "p95": math.nan, "p99": math.nan}
    ordered = sorted(values)
    return {
        "mean": statistics.fmean(ordered) * 1e3,
        "median": statistics.median(ordered) * 1e3,
        "p95": quantile(ordered, 0.95) * 1e3,
        "p99": quantile(ordered, 0.99) * 1e3,
    }


def quantile(ordered: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default, what vLLM reports)."""
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
