"""Where the tuner's load goes: to the engine in this process (the worker's :class:`Tune`,
:class:`Retune`, :class:`StopTune`), or, where the tuner's target names a server, to that
OpenAI-compatible server (:class:`~app.endpoints.load.EndpointLoad` in threads of its own; a
timer here reads its figures into the view). The same buttons, sliders, sweep and reading
either way; a server's limits are its own, so only the load moves there."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from PySide6.QtCore import QObject, QTimer, Signal

from app.gui.commands import Command, Retune, StopTune, Tune, TuneStatus
from engine.bench.sweep_analysis import SweepPoint, SweepProgress

if TYPE_CHECKING:
    from app.endpoints.client import Endpoint
    from app.endpoints.load import EndpointLoad, EndpointRun
    from engine.bench.load_spec import SLO, LoadSpec
    from engine.bench.sweep_analysis import Setting
    from widgets.tuner import TunerView

log = logging.getLogger(__name__)

READ_MS = 500  # how often the live plots read a server's load
RESULT_EVERY = 2  # … and the figures line, every this many readings


@dataclass(slots=True)
class _Job:
    """One load or sweep on a server: its own cancel (a later job's start cannot undo it),
    its number (what it says once a later one has begun is not shown), the live load the
    sliders turn, and a sweep's step running now."""

    number: int
    cancel: threading.Event = field(default_factory=threading.Event)
    live: EndpointLoad | None = None
    step: EndpointLoad | None = None


class TuneRouter(QObject):
    """Routes the tuner's requests (see the module docstring)."""

    status = Signal(int, object)  # a job's number, its TuneStatus (from its thread)
    began = Signal(int, str)  # a live load of that job began on the server named

    def __init__(self, view: TunerView, post: Callable[[Command], None], parent: QObject) -> None:
        super().__init__(parent)
        self.view, self._post = view, post
        self._job: _Job | None = None  # the server's load or sweep, the last one started
        self._thread: threading.Thread | None = None
        self._readings = 0
        self.runs: list[EndpointRun] = []  # the last finished job's: a live run, or a sweep's
        self.endpoint: Endpoint | None = None  # the server of those runs, its model resolved
        view.start_load.connect(self._start_load)
        view.start_sweep.connect(self._start_sweep)
        view.stop_requested.connect(self.stop)
        view.load_turned.connect(self._turn)
        view.export_guidellm.connect(self.export_guidellm)
        self.status.connect(self._show)
        self.began.connect(self._began)
        self.timer = QTimer(self, interval=READ_MS)
        self.timer.timeout.connect(self._read)

    @property
    def remote(self) -> bool:
        """A server's load or sweep is running."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def live_load(self) -> EndpointLoad | None:
        """The live load on a server running now (None: none)."""
        return self._job.live if self._job is not None and self.remote else None

    # -- the view's requests ------------------------------------------------------------------
    def _start_load(self, spec: LoadSpec) -> None:
        target = self.view.endpoint()
        self.stop()
        if target is None:
            self._local()
            self._post(Tune(load=spec))
            return
        self._run_remote(target, lambda job, endpoint: self._live(job, endpoint, spec))

    def _start_sweep(self, settings: tuple[Setting, ...], slo: SLO | None) -> None:
        target = self.view.endpoint()
        self.stop()
        if target is None:
            self._local()
            self._post(Tune(settings=tuple(settings), slo=slo))
            return
        self._run_remote(target, lambda job, endpoint: self._sweep(job, endpoint, settings, slo))

    def _local(self) -> None:
        if self.view.live.remote is not None:
            self.view.live.show_remote(None)  # the engine's figures again

    def _turn(self, users: int, rate: float) -> None:
        if self.remote:
            live = self.live_load  # a sweep's steps are its own: the sliders leave them be
            if live is not None:
                live.retarget(users, rate)
        else:
            self._post(Retune(users, rate))

    def stop(self) -> None:
        """Stop a server's load or sweep (its streams close: the server cancels them), or the
        engine's tune."""
        job = self._job
        if not self.remote or job is None:
            self._post(StopTune())
            return
        job.cancel.set()
        for load in (job.live, job.step):
            if load is not None:
                load.stop()

    def export_guidellm(self, path: str) -> None:
        """The last load or sweep on a server as GuideLLM's report at ``path``; the view's
        line says where, or why not."""
        from app.endpoints.export import write_guidellm

        runs = [r for r in self.runs if r.records]
        if not runs or self.endpoint is None:
            self.view.set_status(self.remote, None, None, "GuideLLM's report holds a server's "
                                 "runs: run a load or a sweep on a server first")  # fmt: skip
            return
        try:
            write_guidellm(Path(path), runs, self.endpoint)
        except (OSError, ValueError) as exc:
            self.view.set_status(self.remote, None, None, f"could not write {path}: {exc}")
            return
        self.view.set_status(self.remote, None, None, f"GuideLLM's report of {len(runs)} "
                             f"run{'s' if len(runs) > 1 else ''}: {path}")  # fmt: skip

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop and wait (the window closes)."""
        self.stop()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- a server's runs, in a thread of their own -----------------------------------------------
    def _run_remote(self, target: tuple[str, str], body: Callable[[_Job, Endpoint], None]) -> None:
        self._post(StopTune())  # one load at a time: the engine's ends
        job = self._job = _Job(self._job.number + 1 if self._job is not None else 1)
        self.status.emit(job.number, TuneStatus(True, message=f"asking {target[0]} for its "
                                                "models…"))  # fmt: skip

        def run() -> None:
            from app.endpoints import keys
            from app.endpoints.client import Endpoint, EndpointError, with_model

            try:
                endpoint = with_model(Endpoint(target[0], target[1], keys.key(target[0])))
                body(job, endpoint)
            except EndpointError as exc:  # unreachable, a key refused, a model gone: one line
                self.status.emit(job.number, TuneStatus(False, message=str(exc)))
            except Exception as exc:  # the thread must end in a line, never silently
                log.exception("the server's load failed")
                line = f"{type(exc).__name__}: {exc}"
                self.status.emit(job.number, TuneStatus(False, message=line))

        self._thread = threading.Thread(target=run, daemon=True, name="infersight-tune-remote")
        self._thread.start()

    def _finished(self, job: _Job, runs: list[EndpointRun], endpoint: Endpoint) -> None:
        if job is self._job:  # a job a later one replaced keeps its runs to itself
            self.runs, self.endpoint = runs, endpoint

    def _live(self, job: _Job, endpoint: Endpoint, spec: LoadSpec) -> None:
        from app.endpoints.load import EndpointLoad

        load = EndpointLoad(endpoint, spec, stop=job.cancel)
        job.live = load.start()
        self.began.emit(job.number, endpoint.name)
        load.wait()
        run = load.run()
        self._finished(job, [run], endpoint)
        message = _failures(run, "stopped", "marked ▲ on the plot")
        self.status.emit(job.number, TuneStatus(False, load=run.result, message=message))

    def _sweep(
        self, job: _Job, endpoint: Endpoint, settings: tuple[Setting, ...], slo: SLO | None
    ) -> None:
        from app.endpoints.load import EndpointLoad

        points: list[SweepPoint] = []
        runs: list[EndpointRun] = []
        for i, setting in enumerate(settings):
            if job.cancel.is_set():
                break
            progress = SweepProgress(i, len(settings), setting.label(), 0, 0, tuple(points))
            self.status.emit(job.number, TuneStatus(True, sweep=progress, message=endpoint.name))
            load = EndpointLoad(endpoint, setting.load, slo, stop=threading.Event())
            job.step = load.start()
            while not load.wait(0.1):
                if job.cancel.is_set():
                    load.stop()
            run = load.run()
            if job.cancel.is_set():  # a step cut short by Cancel is no point of the sweep
                break
            runs.append(run)
            if run.result.completed:
                points.append(SweepPoint(setting, run.result))
            if run.failures and set(run.failures) & {"unreachable", "auth", "model"}:
                break  # no wait heals it: the sweep ends here, its marks say why
        self._finished(job, runs, endpoint)
        done = SweepProgress(len(settings), len(settings), "", 0, 0, tuple(points))
        failed = [(s.label(), r) for s, r in zip(settings, runs, strict=False) if r.failures]
        message = "; ".join(f"at {label}: {_failures(r, '', '')}" for label, r in failed)
        self.status.emit(job.number, TuneStatus(False, sweep=done, message=message or "sweep done"))

    # -- into the view ----------------------------------------------------------------------------
    def _began(self, number: int, name: str) -> None:
        """A live load on a server began: its plots start afresh."""
        if self._job is None or number != self._job.number:
            return
        self.view.live.show_remote(name)
        self._readings = 0
        self.timer.start()
        self.view.set_status(True, None, None, f"running on {name}")

    def _show(self, number: int, status: TuneStatus) -> None:
        if self._job is None or number != self._job.number:
            return  # a job a later one replaced
        view = self.view
        if not status.running:
            self.timer.stop()
            self._read()  # the last figures
        view.set_status(status.running, status.load, status.sweep, status.message)

    def _read(self) -> None:
        load = self._job.live if self._job is not None else None
        if load is None or not load.started or self.view.live.remote is None:
            return
        live = load.live()
        server = live.server
        nan = float("nan")
        self.view.live.add_point(
            load.started + live.time, live.output_tps, live.ttft_ms, live.tpot_ms,
            live.in_flight if server is None else server.running,
            nan if server is None else server.waiting,
            nan if server is None else 100.0 * server.kv_usage,
            nan if server is None else server.preemptions,
            tuple((load.started + t, kind) for t, kind in live.failures),
        )  # fmt: skip
        self._readings += 1
        if self._readings % RESULT_EVERY == 0 and not load.finished:
            run = load.run()
            running = f"running on {load.endpoint.name}"
            self.view.set_status(True, run.result, None, _failures(run, running, "marked ▲"))


def _failures(run: EndpointRun, otherwise: str, marked: str) -> str:
    """``the server failed requests (marked): 4 rate_limited, 1 dropped — <the first's
    line>``, or ``otherwise`` where none failed."""
    from app.endpoints.load import failure_counts

    if not run.failures:
        return otherwise
    return f"the server failed requests{f' ({marked})' if marked else ''}: {failure_counts(run)}"
