"""Per-request state: token ids, status, progress through the KV cache, timestamps."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.core.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # end-of-generation token or stop string
    LENGTH = "length"  # max_new_tokens or the context length
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"  # waited in the queue longer than its timeout


@dataclass(slots=True)
class Timestamps:
    """``time.perf_counter()`` values; ``None`` until the event happens."""

    arrival: float
    scheduled: float | None = None  # first admitted to the running set
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    token_times: list[float] = field(default_factory=list)


@dataclass(slots=True)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float
    priority: int = 0
    timeout_s: float | None = None
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_cached: int = 0  # prompt tokens found in the prefix cache (not computed) for its reply
    num_preemptions: int = 0
    max_new_tokens: int = 0  # params.max_new_tokens capped by the context length
    times: Timestamps = field(init=False)
    generator: torch.Generator | None = None
    history: torch.Tensor | None = None  # prompt + output ids, for the repetition penalty
    #: draft tokens to verify in the next step (speculative decoding; 0 = none), set by the
    #: engine's :class:`~engine.speculative.speculator.Speculator` before the scheduler
    #: reserves slots
    spec_k: int = 0
    #: with ``params.prompt_logprobs``: each prompt token's log-probabilities (index ``i`` for
    #: token ``i``; the first stays None), filled in as the prefill's chunks run
    prompt_logprobs: list[tuple[float, tuple[tuple[int, float], ...]] | None] | None = None
    #: with ``params.constraint``: its grammar's matcher (llguidance's), fed each token taken
    matcher: Any = None
    #: rotated by LongRoPE's long factors, every position (it grew past the pretraining
    #: context: :attr:`engine.model.transformer.RotaryEmbedding.long_after`)
    rope_long: bool = False

    def __post_init__(self) -> None:
        self.times = Timestamps(arrival=self.arrival)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def token(self, index: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[index] if index < n else self.output_ids[index - n]

    def tokens(self, start: int, end: int) -> list[int]:
        return [self.token(i) for i in range(start, end)]

    def effective_priority(self, now: float, aging_per_s: float) -> float:
        """Priority plus the credit of waiting: a request never starves behind newer ones."""
        return self.priority + aging_per_s * max(0.0, now - self.arrival)
