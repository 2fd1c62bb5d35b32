"""The batching tuner's sweep: a :class:`Sweep` is a :class:`~engine.bench.loadgen.Driver` like a
single :class:`~engine.bench.loadgen.LoadGenerator`: it runs one generator per
:class:`~engine.bench.sweep_analysis.Setting` in turn on the same live engine (limits applied
between points, the engine's own limits put back at the end), so ``infersight tune`` and the
app's sweep view run exactly the same thing. Reading a sweep (its table, Pareto front, knee,
capacity) is :mod:`engine.bench.sweep_analysis`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict

from engine.bench.load_spec import SLO
from engine.bench.loadgen import LoadGenerator
from engine.bench.sweep_analysis import LIMIT_NAMES, Setting, SweepPoint, SweepProgress
from engine.core.engine import LLMEngine
from engine.core.output import TokenEvent
from engine.errors import InvalidRequestError


class Sweep:
    """Runs ``settings`` one after the other on ``engine``."""

    def __init__(
        self, engine: LLMEngine, settings: Sequence[Setting], *, slo: SLO | None = None
    ) -> None:
        if not settings:
            raise InvalidRequestError("a sweep needs at least one setting")
        for s in settings:
            if s.load.requests is None and s.load.duration_s is None:
                raise InvalidRequestError(
                    "each sweep setting needs a request count or a duration, or it never ends"
                )
        self.engine = engine
        self.settings = list(settings)
        self.slo = slo
        self.points: list[SweepPoint] = []
        self._saved = {**asdict(engine.scheduler.limits), "kv_blocks": engine.kv.manager.capacity}
        self._index = -1
        self._current: LoadGenerator | None = None
        self.stopped = False
        self._next()

    def _next(self) -> None:
        self._index += 1
        if self._index >= len(self.settings):
            self._current = None
            self._restore()
            return
        setting = self.settings[self._index]
        limits = {k: self._saved[k] for k in LIMIT_NAMES} | setting.limits
        self.engine.update_limits(**limits)
        # each setting starts as the first did: no prompt found cached from an earlier setting
        self.engine.clear_prefix_cache()
        self._current = LoadGenerator(
            self.engine, setting.load, slo=self.slo, setting=setting.as_dict(),
            id_prefix=f"sweep{self._index}",
        )  # fmt: skip

    def _restore(self) -> None:
        self.engine.update_limits(**{k: self._saved[k] for k in LIMIT_NAMES})

    @property
    def finished(self) -> bool:
        return self._current is None

    def tick(self, now: float) -> None:
        if self._current is not None:
            self._current.tick(now)
            self._advance()

    def observe(self, events: list[TokenEvent]) -> None:
        if self._current is not None:
            self._current.observe(events)
            self._advance()

    def _advance(self) -> None:
        current = self._current
        if current is not None and current.finished:
            self.points.append(SweepPoint(self.settings[self._index], current.result()))
            self._next()

    def next_arrival_in(self, now: float) -> float | None:
        """The running point's (a point that has not started yet is due at once)."""
        return None if self._current is None else self._current.next_arrival_in(now)

    def stop(self) -> None:
        """Cancel the running point (it is not kept) and put the engine's limits back."""
        if self._current is not None:
            self._current.stop()
            self._current = None
            self.stopped = True
            self._restore()

    def progress(self) -> SweepProgress:
        current = self._current
        index = min(self._index, len(self.settings))
        return SweepProgress(
            index=index, total=len(self.settings),
            label=self.settings[index].label() if current is not None else "done",
            sent=current.sent if current is not None else 0,
            completed=len(current.records) if current is not None else 0,
            points=tuple(self.points),
        )  # fmt: skip
