"""What a step gives back: a :class:`TokenEvent` per token, with the text it releases through
each request's detokenizer and stop strings, the finish rules (EOS, stop string, length), the
log-probabilities a request asks for, and each finished request's figures."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.core.instruments import MetricsCollector
from engine.core.metrics import RequestMetrics
from engine.core.sequence import FinishReason, Status
from engine.core.sequence import Sequence as Seq
from engine.core.structured import Grammars
from engine.hardware.transfer import fetch, upload
from engine.model.tokenizer import IncrementalDetokenizer, Tokenizer

#: a token's log-probability and ``(id, logprob)`` of the likeliest tokens at its step
Logprobs = tuple[float, tuple[tuple[int, float], ...]]


@dataclass(slots=True)
class TokenEvent:
    """What one step did for one request: the sampled token and the text it released
    (possibly empty: a held-back partial character or stop-string prefix). ``token_id`` is
    ``None`` for events without a token (cancelled, timed out). ``finish_reason`` is set on a
    request's last event: ``stop``, ``length``, ``cancelled`` or ``timeout``."""

    request_id: str
    token_id: int | None
    text: str
    finish_reason: str | None = None
    #: with ``SamplingParams.logprobs``: the token's log-probability and ``(id, logprob)`` of
    #: the likeliest tokens at its step, best first
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    #: with speculative decoding, how the token came: ``accepted`` (a draft the model
    #: accepted), ``corrected`` (the model's token where it rejected a draft) or ``bonus`` (its
    #: token after accepting every draft); empty for a step without drafts
    speculation: str = ""
    #: with ``SamplingParams.prompt_logprobs``, on a request's first token only: each prompt
    #: token's (the first's None, nothing precedes it)
    prompt_logprobs: list[Logprobs | None] | None = None


@dataclass(slots=True)
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    ttft_s: float | None = None  # request arrival → first token sampled
    tpot_s: float | None = None  # mean time per output token after the first

    def as_dict(self) -> dict[str, object]:
        return {
            "prompt_ids": self.prompt_ids,
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
        }


@dataclass(slots=True)
class _Stream:
    """Text state of one request: detokenizer, stop-string matcher, text so far."""

    detok: IncrementalDetokenizer
    stops: StopStringMatcher
    text: str = ""


class OutputProcessor:
    """Turns each sampled token into its :class:`TokenEvent` and decides whether the request
    ends there; records a finished request's figures. The engine removes a finished request
    from the scheduler and its own tables; this holds only the text streams."""

    def __init__(
        self, tokenizer: Tokenizer, eos_token_ids: frozenset[int], collector: MetricsCollector
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.collector = collector
        self._streams: dict[str, _Stream] = {}

    def open(self, seq: Seq) -> None:
        params = seq.params
        self._streams[seq.request_id] = _Stream(
            IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens),
            StopStringMatcher(params.stop, include=params.include_stop_str_in_output),
        )

    def token(self, seq: Seq, token: int, now: float) -> tuple[TokenEvent, FinishReason | None]:
        """Append ``token`` to ``seq``; its event, and why the request ends with it (None: it
        goes on)."""
        seq.output_ids.append(token)
        if seq.history is not None:
            seq.history[seq.num_tokens - 1] = token
        times = seq.times
        if times.first_token is None:
            times.first_token = now
        times.last_token = now
        times.token_times.append(now)
        stream = self._streams[seq.request_id]
        params = seq.params
        finish: FinishReason | None = None
        ends = token in params.extra_stop_token_ids
        ends |= not params.ignore_eos and token in self.eos_token_ids
        # before min_tokens nothing ends a reply (its end tokens are masked for sampling); a
        # grammar's reply ends where the grammar does
        early = len(seq.output_ids) <= params.min_tokens and seq.matcher is None
        ends &= not early
        grammar_done = seq.matcher is not None and Grammars.consume(seq.matcher, token)
        if ends:
            piece, finish = stream.stops.feed(stream.detok.flush(), final=True), FinishReason.STOP
        elif early:  # no stop string before min_tokens either (vLLM)
            piece = stream.detok.add(token)
            if len(seq.output_ids) >= seq.max_new_tokens:
                piece += stream.detok.flush()
                finish = FinishReason.LENGTH
        else:
            piece = stream.stops.feed(stream.detok.add(token), final=False)
            if stream.stops.hit:
                finish = FinishReason.STOP
            elif grammar_done or len(seq.output_ids) >= seq.max_new_tokens:
                piece += stream.stops.feed(stream.detok.flush(), final=True)
                finish = FinishReason.STOP if grammar_done else FinishReason.LENGTH
        stream.text += piece
        event = TokenEvent(seq.request_id, token, piece)
        if len(seq.output_ids) == 1 and seq.prompt_logprobs is not None:
            event.prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, None  # given once
        return event, finish

    def finish(self, seq: Seq, reason: FinishReason, now: float) -> TokenEvent:
        """Mark ``seq`` finished, record its figures and close its stream: its last event."""
        seq.status, seq.finish_reason = Status.FINISHED, reason
        seq.times.finished = now
        self.collector.record_request(now, request_metrics(seq))
        self._streams.pop(seq.request_id, None)
        return TokenEvent(seq.request_id, None, "", reason.value)


def logprobs(seq: Seq, logits: torch.Tensor, tokens: list[int]) -> list[Logprobs | None]:
    """Each token's log-probability under the model (row ``i`` for token ``i``) and the
    likeliest tokens there, where the request asks for them (one transfer for them all)."""
    k = seq.params.logprobs
    if k is None:
        return [None] * len(tokens)
    host = fetch(*logprob_tensors(logits, upload(tokens, logits.device), k))
    return [read_logprobs(host, i, k, k) for i in range(len(tokens))]


def logprob_tensors(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> list[torch.Tensor]:
    """On the device, for rows ``logits: [R, V]`` and their ``tokens: [R]``: each token's
    log-probability, then (``k`` > 0) the ``k`` likeliest log-probabilities and their ids,
    best first, for :func:`read_logprobs` once they are on the host."""
    table = torch.log_softmax(logits.float(), dim=-1)
    chosen = table.gather(1, tokens[:, None])
    if not k:
        return [chosen]
    best = table.topk(k)
    return [chosen, best.values, best.indices]


def read_logprobs(host: list[list[float]], row: int, width: int, k: int) -> Logprobs:
    """Row ``row``'s :data:`Logprobs` from :func:`logprob_tensors`' values on the host (taken
    with ``width`` ≥ ``k`` likeliest per row), keeping ``k`` of them."""
    top: tuple[tuple[int, float], ...] = ()
    if k:
        at = row * width
        ids, values = host[2][at : at + k], host[1][at : at + k]
        top = tuple((int(i), v) for i, v in zip(ids, values, strict=True))
    return host[0][row], top


def request_metrics(seq: Seq) -> RequestMetrics:
    """A request's figures so far (all of them once it has finished)."""
    t = seq.times
    end = t.finished if t.finished is not None else time.perf_counter()
    gaps = tuple(b - a for a, b in itertools.pairwise(t.token_times))
    n = len(seq.output_ids)
    return RequestMetrics(
        request_id=seq.request_id,
        finish_reason=seq.finish_reason.value if seq.finish_reason else "",
        prompt_tokens=len(seq.prompt_ids),
        output_tokens=n,
        request_queue_time_seconds=None if t.scheduled is None else t.scheduled - t.arrival,
        time_to_first_token_seconds=None if t.first_token is None else t.first_token - t.arrival,
        prefill_time_seconds=(
            None if t.first_token is None or t.scheduled is None else t.first_token - t.scheduled
        ),
        cached_prompt_tokens=seq.num_cached,
        time_per_output_token_seconds=(
            (t.last_token - t.first_token) / (n - 1)
            if n > 1 and t.first_token is not None and t.last_token is not None
            else None
        ),
        e2e_request_latency_seconds=end - t.arrival,
        inter_token_latency_seconds=gaps,
        preemptions=seq.num_preemptions,
    )


class StopStringMatcher:
    """Releases streamed text, holding back any tail that could still become a stop string."""

    def __init__(self, stops: Sequence[str], *, include: bool = False) -> None:
        self.stops = tuple(stops)
        self.include = include  # the stop string that ends the text is released with it
        self.held = ""
        self.hit = False

    def feed(self, delta: str, *, final: bool) -> str:
        if self.hit:
            return ""
        text = self.held + delta
        if not self.stops:
            self.held = ""
            return text
        found = [(i, -len(s)) for i, s in ((text.find(s), s) for s in self.stops) if i >= 0]
        if found:  # the earliest stop (the longest of those starting there)
            cut, minus_len = min(found)
            self.hit, self.held = True, ""
            return text[: cut - minus_len] if self.include else text[:cut]
        if final:
            self.held = ""
            return text
        keep = max((_overlap(text, s) for s in self.stops), default=0)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``stop``."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
