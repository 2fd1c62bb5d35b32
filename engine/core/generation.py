"""One request driven to its end by stepping the engine (:meth:`LLMEngine.generate
<engine.core.engine.LLMEngine.generate>`): its events as they come, its result as it fills."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from engine.core.output import GenerationResult, TokenEvent, request_metrics
from engine.core.sampling import SamplingParams

if TYPE_CHECKING:
    from engine.core.engine import LLMEngine


class Generation:
    """One request driven to its end by stepping the engine; ``result`` fills in as it goes."""

    def __init__(
        self, engine: LLMEngine, prompt_ids: list[int], params: SamplingParams, priority: int
    ) -> None:
        self.engine = engine
        self.request_id = engine.add_request(prompt_ids, params, priority=priority)
        self._seq = engine.sequence(self.request_id)
        self.result = GenerationResult(prompt_ids=prompt_ids)

    def __iter__(self) -> Iterator[TokenEvent]:
        engine, result, seq = self.engine, self.result, self._seq
        try:
            while result.finish_reason is None:
                events = engine.step()
                if not events and engine.hold_s > 0:
                    time.sleep(min(engine.hold_s, 0.01))
                for event in events:
                    if event.request_id != self.request_id:
                        continue
                    if event.token_id is not None:
                        result.token_ids.append(event.token_id)
                    result.text += event.text
                    if event.finish_reason is not None:
                        result.finish_reason = event.finish_reason
                        timings = request_metrics(seq)
                        result.ttft_s = timings.time_to_first_token_seconds
                        result.tpot_s = timings.time_per_output_token_seconds
                    yield event
        finally:
            if result.finish_reason is None:  # the caller stopped iterating (or Ctrl-C)
                engine.cancel(self.request_id)
