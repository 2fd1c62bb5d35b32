"""The A/B lab's engine thread (:class:`LabWorker`) and the jobs it runs; the glue to its view
is :class:`app.gui.lab.LabController`.

The lab runs apart from the chat's worker, on engines of its own, so a comparison never
disturbs a conversation and the chat's model keeps answering meanwhile. One job at a time:

* **A/B** (:class:`ABRequest`): load A and B (kept for the next run when unchanged), give both
  the same prompt and seed, step them in turns in this thread so that both columns stream
  side by side, then let each model score both outputs (:mod:`engine.evals.compare`). Each side's
  TTFT and tokens/s count only its own steps' time, since the two take turns on one thread.
  Last, A generates once more with B's model drafting for it, which measures speculative
  decoding's acceptance beside the predicted one
  (:func:`engine.evals.acceptance.measure_speculation`).
  Before loading, the lab checks that A and B fit in memory together; if they do not, it
  says how much is missing and runs them one after the other (A, then B, then A again to
  score B's answer), and speculative decoding, which needs both at once, is not measured.
* **Sensitivity scan** (:class:`ScanRequest`): :func:`engine.evals.sensitivity.scan_sensitivity` on
  a fixed text (the first tokens of the perplexity text, Twelfth Night).

Every job can be cancelled (:meth:`LabWorker.cancel`, any thread): the job stops at its next
step (speculative ones too), scoring pass or scanned block. Signals carry plain data (dicts,
lists, strings).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from PySide6.QtCore import QObject, Signal

from app.gui.threads import FRAME_S, OwnStreams, yield_to_the_ui
from app.loading import LoadSpec, load_engine, resolve_device, resolve_model_folder
from engine.errors import CancelledError, InfersightError, InvalidRequestError
from engine.kernels import lowbit

if TYPE_CHECKING:
    from engine.core.engine import LLMEngine
    from engine.evals.sides import SideRun
    from engine.kv_cache.window import CacheWindow

log = logging.getLogger(__name__)

MEMORY_HEADROOM = 0.9  # A and B may take this share of the free memory together
POOL_MIN_TOKENS = 1024  # a lab engine's KV pool holds at least this many tokens
SCAN_TEXT_TOKENS = 256  # the scan's fixed text: the first tokens of the perplexity text
SEQUENTIAL = "one after the other"
TOGETHER = "side by side"
NOT_TOGETHER = "A and B do not fit in memory together, and B can draft for A only beside it"


#: What a loaded engine is kept under: model, precision, device, low-bit kernels
SideKey = tuple[str, str, str, str]


@dataclass(frozen=True, slots=True)
class LabSide:
    """One side of an A/B: what to load and how it samples and caches."""

    model: str = "default"
    precision: str = "fp32"
    device: str = "auto"
    temperature: float = 0.0
    window: tuple[int, int] | None = None  # (sink, window) of a sliding cache window
    #: INT4/INT8 CPU kernels: "ours" (int8 activations), "torch" (float ones), None: as
    #: INFERSIGHT_LOWBIT says (:func:`engine.kernels.lowbit.choosing`)
    lowbit: str | None = None
    #: what its KV cache holds (:mod:`engine.kv_cache.dtypes`); not part of :attr:`key`: two
    #: sides that differ only there share one copy of the weights
    kv_dtype: str = "auto"
    #: an OpenAI-compatible server's URL instead of a local model (its key: the keyring's),
    #: and the model id to ask it for ("": the first it lists)
    endpoint: str = ""
    endpoint_model: str = ""

    @property
    def key(self) -> SideKey:
        return (self.model, self.precision, resolve_device(self.device), self.lowbit or "")


@dataclass(frozen=True, slots=True)
class ABRequest:
    a: LabSide
    b: LabSide
    messages: list[dict[str, str]]
    prompt: str  # as the report shows it (the last user message)
    max_new_tokens: int = 64
    seed: int = 0
    noise: bool = True
    speculate: bool = True  # measure speculative decoding with B drafting for A


@dataclass(frozen=True, slots=True)
class ScanRequest:
    model: str
    low: str  # the format each block is quantized to, e.g. "int4-g32"
    device: str = "auto"
    text_tokens: int = SCAN_TEXT_TOKENS


@dataclass(frozen=True, slots=True)
class _Stop:
    pass


@dataclass(frozen=True, slots=True)
class _Release:
    pass


Job = ABRequest | ScanRequest | _Stop | _Release
#: ``available(device)`` → bytes free for models on that device
MemoryProbe = Callable[[str], float]
#: ``loader(spec, progress, config=…)`` → an engine (``app.loading.load_engine``)
LabLoader = Callable[..., "LLMEngine"]


def free_memory(device: str) -> float:
    """Bytes a new model could take on ``device`` (:func:`engine.hardware.memory.free_memory`)."""
    import torch

    from engine.hardware.memory import free_memory as free

    return free(torch.device(device))


@dataclass(slots=True)
class _Streams:
    """Text waiting to reach the view, flushed at most once per frame."""

    pending: list[tuple[str, str]] = field(default_factory=list)
    flushed: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)


class LabWorker(QObject):
    status = Signal(str)  # what the job is doing now
    notice = Signal(str, str)  # text, level ("info" | "warning")
    deltas = Signal(list)  # [(side, text)], at most once per frame
    side_stats = Signal(str, str)  # side, its figures as a line
    report_ready = Signal(dict)  # an engine.compare report
    scan_progress = Signal(int, int)
    scan_ready = Signal(dict)  # engine.sensitivity.Scan.to_dict()
    failed = Signal(str)
    finished = Signal()  # a job ended (done, failed or cancelled)
    stopped = Signal()

    def __init__(
        self, loader: LabLoader = load_engine, available: MemoryProbe = free_memory
    ) -> None:
        super().__init__()
        self._loader = loader
        self._available = available
        self._jobs: queue.Queue[Job] = queue.Queue()
        self._cancel = threading.Event()
        self._engines: dict[SideKey, LLMEngine] = {}
        self._streams = _Streams()
        self._cuda_streams = OwnStreams()  # the lab's own CUDA stream on each device

    # -- any thread ------------------------------------------------------------------------
    def post(self, job: Job) -> None:
        self._cancel.clear()
        self._jobs.put(job)

    def cancel(self) -> None:
        self._cancel.set()

    def stop(self) -> None:
        self._cancel.set()
        self._jobs.put(_Stop())

    def release(self) -> None:
        """Drop the kept engines once the job in flight (if any) is over."""
        self._jobs.put(_Release())

    # -- the lab's thread ------------------------------------------------------------------
    def run(self) -> None:
        yield_to_the_ui()
        while True:
            job = self._jobs.get()
            if isinstance(job, _Stop):
                break
            if isinstance(job, _Release):
                self._keep_only(set())
                continue
            try:
                if isinstance(job, ABRequest):
                    self._run_ab(job)
                else:
                    self._run_scan(job)
            except CancelledError:
                self.status.emit("cancelled")
            except InfersightError as exc:
                self.failed.emit(str(exc))
            except Exception as exc:
                if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
                    self.failed.emit(
                        f"out of memory ({exc}); try smaller precisions, fewer new tokens, or "
                        "close the chat's model"
                    )
                else:  # a bug: say it, keep the lab alive
                    log.exception("lab job failed")
                    self.failed.emit(f"internal error: {type(exc).__name__}: {exc}")
            finally:
                self._flush(force=True)
                self.finished.emit()
        self._engines.clear()
        self._cuda_streams.restore()
        self.stopped.emit()

    def _check(self) -> None:
        if self._cancel.is_set():
            raise CancelledError("cancelled")

    def _progress(self, stage: str, done: int, total: int) -> None:
        self._check()
        if total:
            self.status.emit(f"{stage}: {done}/{total}")

    # -- engines ---------------------------------------------------------------------------
    def _engine(self, side: LabSide, tokens: int) -> LLMEngine:
        """``side``'s engine, loaded once and kept, with a KV pool that holds ``tokens``."""
        engine = self._engines.get(side.key)
        blocks = _pool_blocks(tokens)
        if engine is None:
            from engine.core.config import EngineConfig

            self.status.emit(f"loading {_side_name(side)}…")
            # made current before the load, so its copies and the steps share one stream
            self._cuda_streams.use(side.key[2])
            spec = LoadSpec(side.model, side.precision, side.device)
            config = EngineConfig(num_blocks=blocks, kv_dtype=side.kv_dtype)
            with lowbit.choosing(side.lowbit):
                engine = self._loader(spec, self._progress, config=config)
            self._engines[side.key] = engine
        elif engine.kv.manager.num_blocks < blocks or engine.config.kv_dtype != side.kv_dtype:
            engine = self._engines[side.key] = _with_pool(engine, blocks, side.kv_dtype)
        return engine

    def _keep_only(self, keys: set[SideKey]) -> None:
        for key in [k for k in self._engines if k not in keys]:
            del self._engines[key]
        _empty_cuda_cache()

    def _plan_memory(self, job: ABRequest, tokens: int) -> tuple[bool, str]:
        """Whether A and B fit in memory together, and the sentence that says so.

        What loading adds: each side's weights (:func:`engine.quant.sizes.estimate_weight_bytes`,
        exact) and KV pool, for a side not loaded yet, plus the comparison's score tables
        (six ``[new tokens, vocab]`` fp32 tables, in host memory)."""
        from engine.kv_cache import dtypes as kv_dtypes
        from engine.kv_cache.paged import PagedKVCache
        from engine.model.config import ModelConfig
        from engine.quant.sizes import estimate_weight_bytes
        from engine.quant.spec import parse_precision_spec

        self._keep_only({job.a.key, job.b.key})
        need: dict[str, float] = {"A": 0.0, "B": 0.0}
        vocab = 0
        for name, side in (("A", job.a), ("B", job.b)):
            folder = resolve_model_folder(side.model, self._progress)
            cfg = ModelConfig.from_file(folder / "config.json")
            vocab = max(vocab, cfg.vocab_size)
            device = resolve_device(side.device)
            spec = parse_precision_spec(side.precision, device)
            kv = kv_dtypes.planned(side.kv_dtype, spec.compute)
            pool = _pool_blocks(tokens) * PagedKVCache.bytes_per_block(cfg, 16, kv)
            if side.key in self._engines or (name == "B" and job.b.key == job.a.key):
                need[name] = pool  # loaded already, or B shares A's weights: a pool at most
                continue
            # a CPU may keep a oneDNN-packed copy of a tied head (the probe says); a GPU not
            packed = None if device == "cpu" else False
            need[name] = estimate_weight_bytes(cfg, spec, packed=packed) + pool
        tables = 6.0 * job.max_new_tokens * vocab * 4
        devices = {"A": resolve_device(job.a.device), "B": resolve_device(job.b.device)}
        on_device: dict[str, float] = {"cpu": tables}  # the tables live in host memory
        for name, device in devices.items():
            on_device[device] = on_device.get(device, 0.0) + need[name]
        usable = {d: MEMORY_HEADROOM * self._available(d) for d in on_device}
        mib = 2**-20
        # the tables are needed whichever way A and B run; their float64 work adds as much
        if 2 * tables > usable["cpu"]:
            raise InvalidRequestError(
                f"{job.max_new_tokens} new tokens need {2 * tables * mib:.0f} MiB for the "
                f"comparison's score tables ({vocab} tokens of vocabulary each) but "
                f"{usable['cpu'] * mib:.0f} MiB is free; ask for fewer new tokens"
            )
        sizes = (
            f"loading adds {need['A'] * mib:.0f} MiB for A and {need['B'] * mib:.0f} MiB for B, "
            f"and the score tables take {tables * mib:.0f} MiB"
        )
        short = {d: total - usable[d] for d, total in on_device.items() if total > usable[d]}
        if not short:
            free = ", ".join(f"{usable[d] * mib:.0f} MiB usable on {d}" for d in on_device)
            return True, f"A and B run side by side: {sizes}; {free}."
        lacking = ", ".join(f"{m * mib:.0f} MiB on {d}" for d, m in short.items())
        return False, (
            f"A and B do not fit side by side: {sizes}; {lacking} is missing. They run one "
            "after the other (A, then B, then A again to score B's answer)."
        )

    # -- an A/B ------------------------------------------------------------------------------
    def _run_ab(self, job: ABRequest) -> None:
        if job.a.endpoint or job.b.endpoint:
            self._run_remote_ab(job)
            return
        from engine.core.sampling import SamplingParams
        from engine.evals.acceptance import measure_speculation
        from engine.evals.compare import build_report
        from engine.evals.scoring import Scores, score_side
        from engine.evals.sides import check_same_tokenizer, prompt_ids_for, shared_prompt_ids
        from engine.kv_cache.window import CacheWindow

        windows = {
            "a": CacheWindow(*job.a.window) if job.a.window else None,
            "b": CacheWindow(*job.b.window) if job.b.window else None,
        }
        params = {
            key: SamplingParams(
                max_new_tokens=job.max_new_tokens, temperature=side.temperature, seed=job.seed
            )
            for key, side in (("a", job.a), ("b", job.b))
        }
        # a bound on the prompt before it is tokenized: its UTF-8 bytes (+ the template)
        tokens = sum(len(m["content"].encode()) for m in job.messages) + 256 + job.max_new_tokens
        together, message = self._plan_memory(job, tokens)
        if message:
            self.notice.emit(message, "info" if together else "warning")
        memory = {"mode": TOGETHER if together else SEQUENTIAL, "message": message}
        speculation: dict[str, Any] | None = None
        if together:
            a = self._engine(job.a, tokens)
            # the same model and precision on both sides: B shares A's weights, not its pool
            same = job.b.key == job.a.key
            b = (
                _with_pool(a, _pool_blocks(tokens), job.b.kv_dtype)
                if same
                else self._engine(job.b, tokens)
            )
            prompt_ids = shared_prompt_ids(a, b, job.messages)
            runs = self._generate({"a": a, "b": b}, prompt_ids, params, windows)
            run_a, run_b = runs["a"], runs["b"]
            self.status.emit("scoring: A reads both answers…")
            a_scores = score_side(a, prompt_ids, (run_a, run_b), windows["a"], noise=job.noise,
                                  check=self._check)  # fmt: skip
            self.status.emit("scoring: B reads both answers…")
            b_scores = score_side(b, prompt_ids, (run_a, run_b), windows["b"], check=self._check)
            if job.speculate:
                self.status.emit("speculative decoding: B drafts for A…")
                speculation = measure_speculation(
                    a, b, prompt_ids, params["a"], windows["a"], expected=run_a.token_ids,
                    check=self._check,
                )  # fmt: skip
        else:
            self._keep_only(set())
            a = self._engine(job.a, tokens)
            prompt_ids, a_vocab = prompt_ids_for(a, job.messages), a.cfg.vocab_size
            run_a = self._generate({"a": a}, prompt_ids, params, windows)["a"]
            del a
            self._keep_only(set())
            b = self._engine(job.b, tokens)
            b_ids = prompt_ids_for(b, job.messages)
            check_same_tokenizer(a_vocab, prompt_ids, b.cfg.vocab_size, b_ids)
            run_b = self._generate({"b": b}, prompt_ids, params, windows)["b"]
            self.status.emit("scoring: B reads both answers…")
            b_scores = score_side(b, prompt_ids, (run_a, run_b), windows["b"], check=self._check)
            del b
            self._keep_only(set())
            a = self._engine(job.a, tokens)
            self.status.emit("scoring: A reads both answers…")
            a_scores = score_side(a, prompt_ids, (run_a, run_b), windows["a"], noise=job.noise,
                                  check=self._check)  # fmt: skip
            if job.speculate:
                speculation = {"not_measured": NOT_TOGETHER}
        scores = Scores(a_scores[0], a_scores[1], b_scores[0], b_scores[1], a_scores[2],
                        a_scores[3])  # fmt: skip
        report = build_report(
            job.prompt, prompt_ids, run_a, run_b, scores, a.tokenizer, memory, speculation
        )
        for name, side in (("a", job.a), ("b", job.b)):
            if side.lowbit:  # the kernels asked for, which the header then names
                report[name]["lowbit"] = side.lowbit
        self.status.emit("done")
        self.report_ready.emit(report)

    def _run_remote_ab(self, job: ABRequest) -> None:
        """An A/B with a server on a side or both (:mod:`engine.evals.remote`): the servers
        stream in threads of their own, the local side steps here."""
        from app.endpoints import keys
        from app.endpoints.client import Endpoint, with_model
        from app.endpoints.remote import ServerSide
        from engine.core.sampling import SamplingParams
        from engine.evals.remote import compare_with_remote, ids_by_text

        tokens = sum(len(m["content"].encode()) for m in job.messages) + 256 + job.max_new_tokens
        self._keep_only({s.key for s in (job.a, job.b) if not s.endpoint})
        sides: dict[str, Any] = {}
        for name, side in (("a", job.a), ("b", job.b)):
            if side.endpoint:
                self.status.emit(f"asking {side.endpoint} for its models…")
                endpoint = Endpoint(side.endpoint, side.endpoint_model, keys.key(side.endpoint))
                sides[name] = ServerSide(with_model(endpoint))
            else:
                sides[name] = self._engine(side, tokens)
        local = next((s for s in sides.values() if not isinstance(s, ServerSide)), None)
        if local is not None:
            table: list[Any] = []  # the vocabulary's texts, read only if a server needs them

            def ids_of(text: str) -> int | None:
                if not table:
                    table.append(ids_by_text(local.tokenizer))
                result: int | None = table[0](text)
                return result

            for side in sides.values():
                if isinstance(side, ServerSide):
                    side.ids_of = ids_of
        params = {
            name: SamplingParams(
                max_new_tokens=job.max_new_tokens, temperature=side.temperature, seed=job.seed
            )
            for name, side in (("a", job.a), ("b", job.b))
        }
        self.status.emit("generating…")

        def on_text(side: str, text: str) -> None:
            with self._streams.lock:
                self._streams.pending.append((side, text))
            self._flush()

        report = compare_with_remote(sides, job.messages, job.prompt, params, on_text=on_text,
                                     check=self._check)  # fmt: skip
        self._flush(force=True)
        self.status.emit("done")
        self.report_ready.emit(report)

    def _generate(
        self,
        engines: dict[str, LLMEngine],
        prompt_ids: list[int],
        params: dict[str, Any],
        windows: dict[str, CacheWindow | None],
    ) -> dict[str, SideRun]:
        """Generate on each engine, a step of each in turn, streaming both."""
        from engine.evals.sides import SideRun

        rids: dict[str, str] = {}
        ids: dict[str, list[int]] = {side: [] for side in engines}
        busy = dict.fromkeys(engines, 0.0)
        first: dict[str, float | None] = dict.fromkeys(engines)
        finish: dict[str, str] = {}
        self.status.emit("generating…")
        try:
            for side, engine in engines.items():
                engine.set_window(windows[side])
                rids[side] = engine.add_request(prompt_ids, params[side])
            while len(finish) < len(engines):
                self._check()
                for side, engine in engines.items():
                    if side in finish:
                        continue
                    started = time.perf_counter()
                    events = engine.step()
                    busy[side] += time.perf_counter() - started
                    for event in events:
                        if event.request_id != rids[side]:
                            continue
                        if event.token_id is not None:
                            ids[side].append(event.token_id)
                            if first[side] is None:
                                first[side] = busy[side]
                        if event.text:
                            self._streams.pending.append((side, event.text))
                        if event.finish_reason is not None:
                            finish[side] = event.finish_reason
                self._flush()
        finally:
            # the text so far reaches the view before anything else this job sends
            self._flush(force=True)
            for side, rid in rids.items():
                if side not in finish:  # a kept engine must not carry this request on
                    with contextlib.suppress(Exception):
                        engines[side].cancel(rid)
                        engines[side].step()
        runs: dict[str, SideRun] = {}
        for side, engine in engines.items():
            n, ttft = len(ids[side]), first[side]
            tps = (n - 1) / (busy[side] - ttft) if ttft is not None and n > 1 else None
            runs[side] = SideRun.of(
                engine, params[side], windows[side], ids[side], finish[side], ttft, tps
            )
            self.side_stats.emit(side, side_stats_text(runs[side]))
        return runs

    def _flush(self, *, force: bool = False) -> None:
        """Send the waiting text (any thread: a server's side streams in one of its own)."""
        s = self._streams
        with s.lock:
            now = time.perf_counter()
            if not s.pending or not (force or now - s.flushed >= FRAME_S):
                return
            merged: dict[str, str] = {}
            for side, text in s.pending:
                merged[side] = merged.get(side, "") + text
            s.pending, s.flushed = [], now
        self.deltas.emit(list(merged.items()))

    # -- a sensitivity scan ------------------------------------------------------------------
    def _run_scan(self, job: ScanRequest) -> None:
        from engine.evals.perplexity import default_text
        from engine.evals.sensitivity import scan_sensitivity
        from engine.model.tokenizer import Tokenizer

        self._keep_only(set())  # the scan holds the model in fp32 beside nothing else
        self.status.emit("preparing the scan…")
        folder = resolve_model_folder(job.model, self._progress)
        text = default_text().read_text(encoding="utf-8")
        ids = Tokenizer.from_folder(folder).encode(text)[: job.text_tokens]

        def progress(done: int, total: int) -> None:
            self._check()
            self.scan_progress.emit(done, total)
            self.status.emit(f"scanning: block {done}/{total}")

        scan = scan_sensitivity(
            folder, job.low, text_ids=ids, device=resolve_device(job.device), progress=progress
        )
        self.status.emit("scan done")
        self.scan_ready.emit(scan.to_dict())


def _side_name(side: LabSide) -> str:
    name = "the default model" if side.model == "default" else Path(side.model).name
    kv = "" if side.kv_dtype == "auto" else f", KV {side.kv_dtype}"
    return f"{name} ({side.precision}{kv})"


def side_stats_text(run: SideRun) -> str:
    """A column's figures: TTFT and speed (its own steps' time), weights and KV pool."""
    parts = []
    if run.ttft_s is not None:
        parts.append(f"TTFT {run.ttft_s * 1e3:.0f} ms")
    if run.tokens_per_s is not None:
        parts.append(f"{run.tokens_per_s:.1f} tok/s")
    parts.append(f"{len(run.token_ids)} tokens")
    parts.append(f"weights {run.weights_bytes / 2**20:.0f} MiB")
    parts.append(f"KV {run.kv_dtype} {run.kv_bytes / 2**20:.0f} MiB".replace("  ", " "))
    return " · ".join(parts)


def _pool_blocks(tokens: int, block_size: int = 16) -> int:
    return -(-max(tokens, POOL_MIN_TOKENS) // block_size) + 2


def _with_pool(engine: LLMEngine, blocks: int, kv_dtype: str = "auto") -> LLMEngine:
    """The same model and tokenizer behind a new engine whose KV pool has ``blocks`` blocks
    of ``kv_dtype`` (the weights are shared, not loaded again)."""
    from engine.core.config import EngineConfig
    from engine.core.engine import LLMEngine

    new = LLMEngine(
        engine.model, engine.tokenizer, engine.cfg, eos_token_ids=sorted(engine.eos_token_ids),
        dtype=engine.dtype, device=engine.device, name=engine.name,
        num_parameters=engine.num_parameters,
        config=EngineConfig(num_blocks=blocks, kv_dtype=kv_dtype),
        precision=engine.precision,
    )  # fmt: skip
    new.default_sampling = dict(getattr(engine, "default_sampling", {}))
    return new


def _empty_cuda_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
