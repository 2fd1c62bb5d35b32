"""The engine's thread.

:class:`EngineWorker` is a ``QObject`` that lives in its own ``QThread`` and owns the engine.
The UI talks to it only through :meth:`EngineWorker.post` (a thread-safe command queue) and
listens to its signals, which carry plain data (no tensors). Its loop drains the queue, runs
``engine.step()`` while there is work, coalesces token text to at most one signal per frame
and sends a metrics view a few times a second.

Loading runs on a third, short-lived thread so the current model keeps answering; when the new
one is ready it takes new requests and the old one finishes what it was doing, then is dropped.
A failed load leaves the current model in place. A step that runs out of memory is recovered
from as ``infersight serve`` does (:mod:`engine.core.recovery`): a smaller prefill chunk, or
only the largest reply ended, with a message in the chat; any other exception inside ``step()``
ends that engine's replies with an error; either way the worker carries on.

Two workers can run side by side (one engine each), which is what an A/B view needs.

The loop itself, with the replies, served requests and the tuner's load it steps, is
:class:`app.gui.worker_loop.WorkerLoop`; what crosses the thread boundary is in
:mod:`app.gui.commands`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any

from PySide6.QtCore import Signal

from app.gui.commands import (
    Command,
    Load,
    ModelInfo,
    Resize,
    Speculate,
    _Loaded,
    _LoadFailed,
    _Unload,
)
from app.gui.worker_loop import OOM_MARGIN_MIB, WorkerLoop
from app.loading import LoadSpec, load_engine, needs_download, plan_load
from engine.core.engine import LLMEngine
from engine.errors import CancelledError, InfersightError
from engine.speculative.config import SpeculativeConfig, parse_speculative

log = logging.getLogger(__name__)

LOAD_JOIN_S = 120.0  # a stopping worker waits this long for a load to notice its cancel


#: ``loader(spec, progress)`` → a loaded engine. ``progress(stage, done, total)``.
Loader = Callable[[LoadSpec, Callable[[str, int, int], None]], LLMEngine]
#: ``planner(spec, reclaimable=N)`` → the memory plan (:func:`app.loading.plan_load`)
Planner = Callable[..., Any]


class EngineWorker(WorkerLoop):
    """Owns one engine at a time (plus, briefly, the one it replaces)."""

    loading = Signal(object)  # LoadSpec
    load_progress = Signal(str, int, int)  # stage, done, total
    loaded = Signal(object)  # ModelInfo
    load_failed = Signal(str)
    unloaded = Signal(str)  # the model went before a load that needs its memory; why
    planned = Signal(object)  # the memory plan of the load starting (a MemoryPlan)
    #: the speculation in force after a Speculate or a new engine: its text ("" off), k, and
    #: why the change asked for failed ("" when it did not)
    speculation_applied = Signal(str, int, str)
    #: what the engine's KV pool holds after a Resize (``--kv-dtype``'s name), whether or
    #: not the change asked for went through
    kv_dtype_applied = Signal(str)

    def __init__(self, loader: Loader = load_engine, planner: Planner = plan_load) -> None:
        super().__init__()
        self._loader = loader
        self._planner = planner
        self._spec: LoadSpec | None = None  # what the current engine was loaded from
        self._unloaded_for: LoadSpec | None = None  # the spec of a model unloaded for a load
        #: a KV pool (MiB, dtype) waiting for the replies to end
        self._resize_to: tuple[float, str] | None = None
        self._loading: LoadSpec | None = None
        self._load_thread: threading.Thread | None = None
        self._load_cancel = threading.Event()

    def _handle(self, command: Command) -> None:
        """The commands about which engine runs and how it drafts; the loop takes the rest."""
        if isinstance(command, Load):
            self._start_load(command.spec)
        elif isinstance(command, Speculate):
            self._speculate(command)
        elif isinstance(command, Resize):
            self._resize_to = (command.kv_memory_mib, command.kv_dtype)
            self._maybe_resize()
        elif isinstance(command, _Loaded):
            self._spec = command.spec
            self._unloaded_for = None
            tried = (command.speculation, command.speculation_error)
            self._swap_in(command.engine, command.info, tried)
        elif isinstance(command, _LoadFailed):
            self._load_failed(command)
        elif isinstance(command, _Unload):
            self._unload(command)
        else:
            super()._handle(command)

    # -- speculative decoding ---------------------------------------------------------------
    def _speculate(self, command: Speculate) -> None:
        """Start, change or stop speculative decoding on the current engine (a self-draft or
        draft model loads its weights here, in seconds); kept for the engines loaded later.
        A failure leaves the engine's speculation and the setting as they were."""
        s = self._settings
        try:
            config = speculative_config(command.text, command.k)
            if self.engine is not None:
                self.engine.set_speculation(config)
        except Exception as exc:
            message = _speculation_error(command.text, exc)
            self.speculation_applied.emit(s.speculation, s.draft_k, message)
            self.error.emit(f"{message}; speculative decoding stays {s.speculation or 'off'}")
            return
        s.speculation, s.draft_k = command.text.strip(), command.k
        self.speculation_applied.emit(s.speculation, s.draft_k, "")
        self._emit_metrics()

    def _reapply_speculation(self, engine: LLMEngine, tried: tuple[tuple[str, int], str]) -> None:
        """Give a new engine (a load, a new KV pool) the speculation in force. ``tried``: what
        the loader thread started on it and why that failed. A drafter this engine cannot
        take (a draft model with another tokenizer, say) switches speculation off, never the
        model."""
        s = self._settings
        want = (s.speculation, s.draft_k)
        (attempted, failed) = tried
        error = failed if failed and attempted == want else ""
        if not error and (s.speculation or getattr(engine, "speculator", None) is not None):
            try:  # instant when the loader (or the old engine's pool) has this drafter
                engine.set_speculation(speculative_config(*want))
            except Exception as exc:
                error = _speculation_error(s.speculation, exc)
        if error:
            with contextlib.suppress(Exception):
                engine.set_speculation(None)
            self.error.emit(f"{error}; speculative decoding is off for {engine.name}")
            s.speculation = ""
        self.speculation_applied.emit(s.speculation, s.draft_k, error)

    # -- loading -----------------------------------------------------------------------------
    def _start_load(self, spec: LoadSpec) -> None:
        if self._loading is not None:
            raise InfersightError(
                f"{self._loading.model} ({self._loading.precision}) is still loading; "
                "wait for it to finish before loading another model"
            )
        self._loading = spec
        self.recovery.release()  # the load's plan counts free memory: the margin's is free
        self._free_memory()
        self.loading.emit(spec)
        self._load_cancel = threading.Event()
        speculation = (self._settings.speculation, self._settings.draft_k)
        self._load_thread = threading.Thread(
            target=self._load_in_background,
            args=(spec, self._reclaimable(), speculation),
            name="infersight-load",
            daemon=True,
        )
        self._load_thread.start()

    def _report_progress(self, stage: str, done: int, total: int) -> None:
        """The loader's progress callback (loader thread); where a Stop cancels the load."""
        if self._load_cancel.is_set():
            raise CancelledError("the load was cancelled because the engine is stopping")
        self.load_progress.emit(stage, done, total)

    def _wait_for_loader(self) -> None:
        """On Stop: cancel a load in flight and wait for its thread, so that nothing of this
        worker runs on after it has stopped (its signals could reach deleted objects)."""
        thread = self._load_thread
        if thread is None:
            return
        self._load_cancel.set()
        thread.join(LOAD_JOIN_S)
        if thread.is_alive():
            log.warning("the model loader did not stop within %.0f s", LOAD_JOIN_S)

    def _reclaimable(self) -> int:
        """Bytes that unloading the current model (and any retiring one) would give back."""
        return sum(e.weights_bytes + e.kv.nbytes for e in self._engines())

    def _load_in_background(
        self, spec: LoadSpec, reclaimable: int = 0, speculation: tuple[str, int] = ("", 8)
    ) -> None:
        try:
            self._plan_and_make_room(spec, reclaimable)
            engine = self._loader(spec, self._report_progress)
            spec_error = _start_speculation(engine, *speculation)
            _finish_loader_work(engine)
            info = model_info(engine, spec)
        except InfersightError as exc:
            self.post(_LoadFailed(spec, str(exc)))
        except Exception as exc:
            log.exception("loading %s failed", spec.model)
            self.post(
                _LoadFailed(spec, f"could not load {spec.model}: {type(exc).__name__}: {exc}")
            )
        else:
            self.post(_Loaded(engine, info, spec, speculation, spec_error))

    def _plan_and_make_room(self, spec: LoadSpec, reclaimable: int) -> None:
        """(Loader thread.) Plan the load and show the plan. When it says the new model fits
        only once the current one is gone, have the worker unload it first, and wait for
        that. A model that would not fit either way is left running: the loader refuses the
        load with the plan's numbers. A model still to be downloaded is planned by the loader
        once it is here (the download reports its own progress)."""
        if needs_download(spec.model):
            return
        try:
            now = self._planner(spec, self._report_progress)
            later = self._planner(spec, reclaimable=reclaimable) if reclaimable else now
        except CancelledError:
            raise
        except InfersightError:  # the loader says what is wrong with this spec
            return
        self.planned.emit(later if not now.fits and later.fits else now)
        if now.fits or not later.fits:
            return
        self._unload_first(spec, "it and the model loading do not fit in memory together")

    def _unload_first(self, spec: LoadSpec, why: str) -> None:
        """(Loader thread.) Have the worker unload the current model before ``spec`` loads,
        saying ``why``, and wait for that."""
        done = threading.Event()
        self.post(_Unload(spec, why, done))
        while not done.wait(0.05):
            if self._load_cancel.is_set():
                raise CancelledError("the load was cancelled because the engine is stopping")

    def _unload(self, command: _Unload) -> None:
        """Let the current model go so that ``command.spec`` can load; its replies end
        (cancelled), the conversation stays in the window."""
        info = self.info
        if info is not None:
            self._unloaded_for = self._spec
            for rid in list(self._replies):
                self._replies[rid].engine.cancel(rid)
            self._cancel_served()
            self._step_all()  # the cancellations reach their replies before the engine goes
            self._flush()
            self._end_tune("the model was unloaded")
            for engine in self._engines():  # a split model's ranks stop now, not when collected
                if engine.parallel is not None:
                    engine.parallel.close()
            self.engine, self.info, self._retiring = None, None, []
            self.recovery.release()
            self._free_memory()
            self.unloaded.emit(
                f"Unloaded {info.name} ({info.precision}) before loading "
                f"{command.spec.model} ({command.spec.precision}): {command.why}. The "
                "conversation is kept."
            )
        command.done.set()

    def _load_failed(self, command: _LoadFailed) -> None:
        """A failed load leaves the previous model running; if it was unloaded for this one,
        it is loaded again."""
        self._loading = None
        self.load_failed.emit(command.message)
        previous, self._unloaded_for = self._unloaded_for, None
        if previous is not None and self.engine is None:
            self.notice.emit(f"Loading {previous.model} ({previous.precision}) again")
            self._start_load(previous)

    def _maybe_resize(self) -> None:
        """Give the current model a KV pool of the size asked for, once it has no replies in
        progress: the same weights behind a new pool; nothing is loaded again."""
        engine, asked = self.engine, self._resize_to
        busy = self._tune is not None or self._retiring  # a tune owns the engine until it ends
        if engine is None or asked is None or engine.has_work() or busy:
            return
        mib, kv_dtype = asked
        self._resize_to = None
        self.recovery.release()  # room for the new pool beside the old one
        self._free_memory()
        try:
            resized = engine.with_pool(kv_memory=mib * 2**20, kv_dtype=kv_dtype)
        except InfersightError as exc:
            self.error.emit(f"{exc}; the KV pool stays as it was")
            self.kv_dtype_applied.emit(engine.config.kv_dtype)
            return
        except Exception as exc:  # torch out of memory, say: the engine keeps its pool
            log.exception("resizing the KV pool failed")
            self.error.emit(f"could not resize the KV pool ({exc}); it stays as it was")
            self.kv_dtype_applied.emit(engine.config.kv_dtype)
            return
        self.kv_dtype_applied.emit(resized.config.kv_dtype)
        self._spec = _with_pool_size(self._spec, pool_mib(resized, mib), kv_dtype)
        spec = self._spec or LoadSpec(
            engine.name, engine.precision.text, str(engine.device), mib, kv_dtype=kv_dtype
        )
        del engine
        self.engine = None
        self._free_memory()
        self._settings.limits.pop("kv_blocks", None)
        self._swap_in(resized, model_info(resized, spec))  # it kept the old pool's drafter
        with contextlib.suppress(InfersightError):  # the Memory line: the pool it now has
            held = resized.weights_bytes + resized.kv.nbytes
            self.planned.emit(self._planner(spec, reclaimable=held))
        self.notice.emit(
            f"KV pool of {resized.kv.format.name} now {resized.kv.nbytes / 2**20:.0f} MiB "
            f"({resized.kv.manager.num_blocks} blocks of {resized.kv.block_size} tokens); the "
            "weights were not reloaded"
        )

    def _swap_in(
        self, engine: LLMEngine, info: ModelInfo, tried: tuple[tuple[str, int], str] = (("", 8), "")
    ) -> None:
        self._loading = None
        self._resize_to = None  # a resize asked for the old model: the new one has its pool
        self._end_tune("a new model was loaded")
        self._settings.limits.pop("kv_blocks", None)  # a cap on the old pool; the new has its own
        try:
            self._apply_settings(engine)
        except InfersightError as exc:
            self.error.emit(f"{exc}; the new model runs with default limits")
        self._reapply_speculation(engine, tried)
        if self.engine is not None and self.engine.has_work():
            self._retiring.append(self.engine)  # finishes its replies, then goes
        self._use_device_stream(engine)
        self.engine, self.info = engine, info
        # held back on a GPU only: on a CPU, running out of memory is not recovered from
        self.recovery.margin_bytes = OOM_MARGIN_MIB << 20 if engine.device.type == "cuda" else 0
        self._free_memory()
        self.loaded.emit(info)
        self._emit_metrics()

    def _margin_wanted(self) -> bool:
        """No margin while a load or a new KV pool waits for the memory."""
        return self._loading is None and self._resize_to is None

    def _step_all(self) -> None:
        """A step of every engine, then the resize that waited for their replies to end."""
        super()._step_all()
        if self._resize_to is not None:
            self._maybe_resize()


def _finish_loader_work(engine: LLMEngine) -> None:
    """Wait, in the loader thread, until its copies to the GPU have landed.

    They ran on the loader thread's current stream of the engine's device; the worker runs the
    engine on a stream of its own, which does not wait for that one, so without this its first
    step could read weights or a KV pool still being written.
    """
    if engine.device.type == "cuda":
        import torch

        torch.cuda.current_stream(engine.device).synchronize()


def speculative_config(text: str, k: int) -> SpeculativeConfig | None:
    """The engine's config for ``--speculative`` text (``""``: off); raises
    ``InvalidRequestError`` with what to write instead."""
    return parse_speculative(text, k=k) if text.strip() else None


def _speculation_error(text: str, exc: Exception) -> str:
    if isinstance(exc, InfersightError):
        return f"speculative decoding with {text.strip()} could not start: {exc}"
    log.error("starting speculative decoding (%s) failed", text, exc_info=exc)
    return f"speculative decoding with {text.strip()} could not start: {type(exc).__name__}: {exc}"


def _start_speculation(engine: LLMEngine, text: str, k: int) -> str:
    """(Loader thread.) Start speculative decoding on a freshly loaded engine, before it
    serves, so a self-draft's or draft model's weights load while the old model still
    answers. Returns why it failed ("" when it did not); the model loads either way."""
    if not text.strip():
        return ""
    try:
        engine.set_speculation(speculative_config(text, k))
    except Exception as exc:
        return _speculation_error(text, exc)
    return ""


def _with_pool_size(spec: LoadSpec | None, mib: float, kv_dtype: str) -> LoadSpec | None:
    return None if spec is None else dataclasses.replace(spec, kv_memory_mib=mib, kv_dtype=kv_dtype)


def pool_mib(engine: LLMEngine, asked: float | None) -> float:
    """The KV pool's size to show and keep: the size asked for where the pool is that but for
    its rounding to whole blocks; else the pool's own (profiled, or clamped to what the
    model can use or the memory holds)."""
    actual = engine.kv.nbytes / 2**20
    block = actual / max(1, engine.kv.manager.num_blocks)
    if asked is not None and abs(actual - asked) <= block:
        return asked
    return float(round(actual))


def model_info(engine: LLMEngine, spec: LoadSpec) -> ModelInfo:
    return ModelInfo(
        name=engine.name,
        path=spec.model,
        precision=engine.precision.text,
        device=str(engine.device),
        context_length=engine.context_length,
        num_parameters=engine.num_parameters,
        weights_bytes=engine.weights_bytes,
        kv_blocks=engine.kv.manager.num_blocks,
        block_size=engine.kv.block_size,
        # the size the load chose where the spec left it to the load
        kv_memory_mib=pool_mib(engine, spec.kv_memory_mib),
        requested_device=spec.device,
        tensor_parallel=spec.tensor_parallel,
        default_sampling=dict(engine.default_sampling),
        paths=compute_paths(engine),
    )


def compute_paths(engine: LLMEngine) -> tuple[str, ...]:
    """What the load report says about how the model computes: on a CPU which fast paths the
    probe found and the thread count, our Triton kernels or torch's, whether decode steps run
    compiled or as CUDA graphs, then each kind of weight with its format and path."""
    from engine.hardware.cpu_paths import cpu_paths
    from engine.kernels import paged_decode

    head: tuple[str, ...] = ()
    if engine.device.type == "cpu":
        head = (cpu_paths().summary(), engine.threads_report)
        if not engine.triton:
            head += (f"decode attention: {paged_decode.status()}",)
    head += (f"kernels: {engine.kernels}", engine.graph.summary(), engine.graphs.summary())
    if engine.parallel is not None:  # the ranks of a tensor-parallel model, by process
        ranks = ", ".join(
            f"rank {r} pid {p.pid}" for r, p in enumerate(engine.parallel.processes, start=1)
        )
        head += (f"tensor parallel: rank 0 in this process, {ranks}",)
    if engine.pool_sizing is not None:  # why a GPU's pool has its size
        head += (f"KV pool: {engine.pool_sizing.summary()}",)
    return head + tuple(f"{g.kind}: {g.form}" for g in engine.weight_groups)
