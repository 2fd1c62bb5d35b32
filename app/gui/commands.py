"""What crosses the engine worker's thread boundary, as plain data (no tensors): the views
it sends the UI (:class:`ModelInfo`, :class:`Delta`, :class:`ReplyStats`, :class:`EngineView`,
:class:`TuneStatus`) and the commands it takes through ``EngineWorker.post``
(:data:`Command`), the UI's and the loader thread's own.

:class:`~app.loading.LoadSpec` (what to load) is defined with the one loader every front end
uses, :mod:`app.loading`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from app.loading import LoadSpec
from engine.bench.load_spec import SLO, LoadResult
from engine.bench.load_spec import LoadSpec as LoadGen
from engine.bench.sweep_analysis import Setting, SweepProgress
from engine.core.engine import LLMEngine
from engine.core.metrics import MetricsSnapshot, RequestMetrics
from engine.core.sampling import SamplingParams
from engine.kv_cache.window import CacheWindow

# -- views (worker → UI) ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    path: str
    precision: str
    device: str  # where it runs: "auto" resolved ("cpu", "cuda" …)
    context_length: int
    num_parameters: int
    weights_bytes: int
    kv_blocks: int
    block_size: int
    kv_memory_mib: float
    requested_device: str = "auto"  # as the user chose it ("auto", "cpu", "cuda:1" …)
    tensor_parallel: int = 1  # the processes the model is split over
    #: the model's own sampling (``SamplingParams`` keyword arguments, generation_config.json)
    default_sampling: dict[str, Any] = field(default_factory=dict, hash=False)
    #: the CPU paths probed and each kind of weight's format and kernel (the load report)
    paths: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Delta:
    """New text of one candidate of one reply; ``finish`` is set on its last delta.

    With speculative decoding ``pieces`` splits ``text`` by how each token came:
    ``(text, kind)`` with ``kind`` one of ``accepted`` (a draft the model accepted),
    ``corrected`` (the model's own token where it rejected a draft), ``bonus`` (its token
    after accepting every draft) or ``""`` (a step without drafts). Their texts joined are
    ``text``; empty when no token of the delta came from a speculative step."""

    tag: str
    candidate: int
    text: str
    finish: str | None = None  # stop | length | cancelled | timeout | error
    error: str | None = None
    pieces: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class ReplyStats:
    """The engine's own figures for one finished candidate."""

    tag: str
    candidate: int
    request_id: str
    model: str
    precision: str
    metrics: RequestMetrics

    @property
    def tokens_per_s(self) -> float | None:
        tpot = self.metrics.time_per_output_token_seconds
        return 1.0 / tpot if tpot else None


@dataclass(frozen=True, slots=True)
class EngineView:
    """One metrics snapshot plus what the app needs to label it."""

    model: ModelInfo
    snapshot: MetricsSnapshot


# -- commands (UI → worker) ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Send:
    tag: str
    messages: list[dict[str, str]]
    sampling: dict[str, Any]
    candidates: int = 1


@dataclass(frozen=True, slots=True)
class Cancel:
    tag: str


@dataclass(frozen=True, slots=True)
class Load:
    spec: LoadSpec


@dataclass(frozen=True, slots=True)
class Configure:
    """Live settings; ``None`` leaves a setting as it is. ``window=False`` turns it off.
    ``clear_prefix_cache`` forgets the current engine's cached prefixes (once)."""

    limits: dict[str, float] | None = None
    window: CacheWindow | bool | None = None
    layer_timing: bool | None = None
    prefix_caching: bool | None = None
    clear_prefix_cache: bool = False


@dataclass(frozen=True, slots=True)
class Speculate:
    """Speculative decoding on the current engine and every engine loaded after it:
    ``text`` as ``--speculative`` takes it (``self:int4-g32+head``, ``lookup``,
    ``model:DIR``; empty: off) with at most ``k`` draft tokens a step. A change that fails
    leaves the speculation in force as it was; either way ``speculation_applied`` says what
    runs."""

    text: str
    k: int = 8


@dataclass(frozen=True, slots=True)
class Pause:
    paused: bool


@dataclass(frozen=True, slots=True)
class Stop:
    pass


@dataclass(frozen=True, slots=True)
class Tune:
    """Start the tuner's load on the current engine: one :class:`LoadGen` spec (live tuning,
    limits moved by :class:`Configure` as it runs) or a sweep over ``settings``. A tune
    already running is stopped first."""

    load: LoadGen | None = None
    settings: tuple[Setting, ...] = ()
    slo: SLO | None = None


@dataclass(frozen=True, slots=True)
class StopTune:
    """Cancel every request of the running tune; its blocks go back at once."""


@dataclass(frozen=True, slots=True)
class Retune:
    """Turn the live load as it runs: closed loop, ``users``; open loop, ``rate``."""

    users: int | None = None
    rate: float | None = None


@dataclass(frozen=True, slots=True)
class TuneStatus:
    """The tuner's progress, a few times a second and once at the end (``running`` False).
    ``load`` is the live load's figures so far; ``sweep`` a sweep's points and position."""

    running: bool
    load: LoadResult | None = None
    sweep: SweepProgress | None = None
    sent: int = 0
    outstanding: int = 0
    message: str = ""


@dataclass(frozen=True, slots=True)
class Resize:
    """A KV pool of ``kv_memory_mib`` holding ``kv_dtype`` for the current model: the same
    weights behind a new pool (no reload), once the replies in progress have finished."""

    kv_memory_mib: float
    kv_dtype: str = "auto"


@dataclass(frozen=True, slots=True)
class Serve:
    """A request from outside (the app's OpenAI-compatible server): queued on the current
    engine beside the chat's, its events handed to ``sink`` on this thread (an error, too)."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    timeout_s: float
    sink: Callable[[Any], None]
    priority: int = 0


@dataclass(frozen=True, slots=True)
class CancelServe:
    request_id: str


# -- the loader thread's, to the worker itself --------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Loaded:
    """A loaded engine; the loader thread has already tried to start ``speculation`` on it
    (the setting when the load began), and ``speculation_error`` says why that failed."""

    engine: LLMEngine
    info: ModelInfo
    spec: LoadSpec
    speculation: tuple[str, int] = ("", 8)
    speculation_error: str = ""


@dataclass(frozen=True, slots=True)
class _Unload:
    """The loader thread asks for the current model to go before it loads ``spec``, for
    ``why`` (the plan says both do not fit at once; one split model at a time). ``done`` is
    set once it is gone."""

    spec: LoadSpec
    why: str
    done: threading.Event


@dataclass(frozen=True, slots=True)
class _LoadFailed:
    spec: LoadSpec
    message: str


Command = (
    Send | Cancel | Load | Configure | Speculate | Pause | Stop | Tune | StopTune | Retune | Resize
    | Serve | CancelServe | _Loaded | _LoadFailed | _Unload
)  # fmt: skip
