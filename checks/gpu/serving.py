"""The engine as the ecosystem and the app meet it: transformers' own Llama on the same weights
(greedy ids by the tie rule, decode side by side), the server's engine loop recovering a step
that ran out of memory for real (on the 12 GB card emulated, so the fill is quick), and the
app's engine worker on the device (skipped where PySide6 is not installed: the lent GPU image
has none, and its wheels are larger than the tree that travels there)."""

from __future__ import annotations

import contextlib
import os
import queue
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from checks.gpu.common import (
    DRY,
    GiB,
    MiB,
    Scale,
    Skip,
    _version,
    card,
    decode_figures,
    expect,
    expect_ours,
    fitting,
    greedy,
    native_choice,
    parting,
    pool_config,
    release,
)
from engine.bench.speed import HFRunner, bench_prompt, run_ours
from engine.core.engine import LLMEngine
from engine.core.sampling import SamplingParams
from engine.errors import InvalidRequestError
from engine.loader.random_weights import SyntheticCheckpoint
from engine.loader.synthetic import build_engine, write_folder
from engine.model.config import ModelConfig
from engine.quant.inventory import decode_read_bytes
from engine.quant.spec import parse_precision_spec

# -- 4. transformers ----------------------------------------------------------------------------


class Transformers(HFRunner):
    """The bench's transformers runner on a model built here (not loaded from a folder)."""

    def __init__(self, model: Any, device: torch.device) -> None:
        self.model, self.device = model, device


def transformers_model(raw: dict[str, Any], device: torch.device, dtype: torch.dtype) -> Any:
    """transformers' Llama of the config ``raw`` on the very weights the engine got: the
    synthetic checkpoint drawn again, tensor by tensor, into the model built on the device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(LlamaConfig(**raw))
    finally:
        torch.set_default_dtype(default)
    checkpoint = SyntheticCheckpoint(ModelConfig.from_dict(raw), device=device)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in checkpoint.tensors(dtype):
            params[name].copy_(tensor)
    return model.eval()  # type: ignore[no-untyped-call]


def their_logprobs(model: Any, prompt: list[int], output: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + output], device=model.device)
    with torch.inference_mode():
        return F.log_softmax(model(ids).logits[0, -1].float(), dim=-1).cpu()


def their_greedy(model: Any, prompt: list[int], tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(prompt) :].tolist()]


def check_transformers(
    scale: Scale, device: torch.device, state: dict[str, Any], figures: dict[str, Any]
) -> None:
    if _version("transformers") is None:
        raise Skip("transformers is not installed (a dev extra: pip install -e '.[dev]')")
    try:
        parse_precision_spec("fp16", device)
    except InvalidRequestError as exc:
        raise Skip(f"fp16 is not native on {device}: {exc}") from None
    raw = fitting(scale, "fp16", device)
    figures["layers"] = raw["num_hidden_layers"]
    config = pool_config(scale, raw, "fp16", device)
    ours = build_engine(raw, "fp16", str(device), config=config, name=scale.name)
    expect_ours(ours, device, figures)
    prompt = bench_prompt(ours, scale.short_prompt, seed=0)
    our_ids = greedy(ours, prompt, scale.compare_tokens)
    run_ours(ours, prompt, min(8, scale.decode_tokens))  # warm-up
    our_runs = [run_ours(ours, prompt, scale.decode_tokens) for _ in range(scale.repeats)]
    our_read = decode_read_bytes(ours.model)
    del ours
    release(device)

    model = transformers_model(raw, device, torch.float16)
    theirs = Transformers(model, device)
    theirs.run(prompt, min(8, scale.decode_tokens))  # warm-up
    their_runs = [theirs.run(prompt, scale.decode_tokens) for _ in range(scale.repeats)]
    their_ids = their_greedy(model, prompt, scale.compare_tokens)
    part = parting(our_ids, their_ids, partial(their_logprobs, model, prompt))
    their_read = decode_read_bytes(model)
    del model, theirs
    release(device)

    bandwidth = state.get("bandwidth")
    for who, runs, read in (("ours", our_runs, our_read), ("transformers", their_runs, their_read)):
        result = decode_figures(scale, runs, len(prompt))
        if bandwidth:
            result["bandwidth_fraction"] = result["decode_tok_s"] * read / bandwidth
        figures[who] = result
    figures["speed_ratio"] = (
        figures["ours"]["decode_tok_s"] / figures["transformers"]["decode_tok_s"]
    )
    figures["greedy"] = part
    print(
        f"     fp16 decode {figures['ours']['decode_tok_s']:.1f} tok/s ours, "
        f"{figures['transformers']['decode_tok_s']:.1f} transformers; greedy ids: {part}"
    )
    expect(part["compared"] > 0, "no greedy ids to compare")
    expect(
        part["agree"],
        f"greedy ids part from transformers' at token {part['same']}, not at a tie: {part}",
    )


# -- 5. out of memory ---------------------------------------------------------------------------


@contextlib.contextmanager
def device_filled(device: torch.device) -> Iterator[dict[str, Any]]:
    """Every block the allocator can still get on ``device`` taken, 1 GiB at a time down to
    2 MiB (its large blocks' rounding), for as long as the context lasts."""
    release(device)
    held: list[torch.Tensor] = []
    size = GiB
    while size >= 2 * MiB:
        try:
            held.append(torch.empty(size, dtype=torch.uint8, device=device))
        except torch.OutOfMemoryError:
            size //= 2
    try:
        yield {"pressure": "real: the device filled", "filled_bytes": sum(t.numel() for t in held)}
    finally:
        del held
        release(device)


@contextlib.contextmanager
def failing_once(engine: LLMEngine) -> Iterator[dict[str, Any]]:
    """The model's next forward raises the error a full device would (a CPU has no allocator
    limit to reach)."""
    real, calls = engine.model.forward, [0]

    def forward(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            raise torch.OutOfMemoryError("out of memory (injected: the dry run's CPU)")
        return real(*args, **kwargs)

    engine.model.forward = forward  # type: ignore[method-assign]
    try:
        yield {"pressure": "injected (CPU)"}
    finally:
        del engine.model.forward


def check_out_of_memory(
    scale: Scale, device: torch.device, card_bytes: int | None, figures: dict[str, Any]
) -> None:
    with card(device, card_bytes) as emulated:
        figures["card"] = emulated
        out_of_memory(scale, device, figures)


def out_of_memory(scale: Scale, device: torch.device, figures: dict[str, Any]) -> None:
    from app.server.engine_loop import EngineLoop
    from app.server.metrics import ServerMetrics

    precision = native_choice(device)
    raw = fitting(scale, precision, device)
    figures.update(precision=precision, layers=raw["num_hidden_layers"])
    engine = build_engine(
        raw,
        precision,
        str(device),
        name=scale.name,
        config=pool_config(scale, raw, precision, device),
    )
    expect_ours(engine, device, figures)
    prompt = bench_prompt(engine, scale.prompt_tokens, seed=1)
    run_ours(engine, prompt[:16], 2)  # kernels and library handles made before memory runs out
    loop = EngineLoop(engine, ServerMetrics(scale.name), margin_bytes=scale.margin_mib * MiB)
    expect(loop.margin_held, f"the server's {scale.margin_mib} MiB margin was not taken")
    chunk = engine.scheduler.limits.max_tokens_per_step
    pressure = device_filled(device) if device.type == "cuda" else failing_once(engine)
    with pressure as how:
        figures.update(how)
        loop.start()
        try:
            first = served(loop, "long", prompt, scale.batch_tokens)
            second = served(loop, "next", prompt[: scale.short_prompt], scale.batch_tokens)
        finally:
            loop.stop()
    figures.update(
        out_of_memory_steps=loop.out_of_memory,
        chunks_lowered=loop.recovery.chunks_lowered,
        requests_failed=loop.recovery.requests_failed,
        prefill_chunk=[chunk, engine.scheduler.limits.max_tokens_per_step],
        first=repr(first),
        next=repr(second),
        kv_blocks_in_use=engine.kv.manager.num_used,
    )
    del engine, loop
    release(device)
    expect(figures["out_of_memory_steps"] >= 1, "no step ran out of memory")
    expect(first == "length", f"the request whose step ran out ended with {first!r}")
    expect(second == "length", f"the next request ended with {second!r}")
    expect(figures["chunks_lowered"] >= 1, "the prefill chunk was not lowered")
    expect(figures["kv_blocks_in_use"] == 0, "KV blocks were left in use")


#: The longest a request of the out-of-memory check may take (its check's limit is 120 s).
SERVED_S = 60.0


def served(loop: Any, rid: str, prompt: list[int], tokens: int) -> object:
    """Submit one request to the engine loop and wait for its end: the finish reason, or the
    error it failed with."""
    got: queue.Queue[object] = queue.Queue()
    params = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    loop.submit(rid, prompt, params, SERVED_S, got.put)
    while True:
        item = got.get(timeout=SERVED_S)
        if isinstance(item, BaseException):
            return item
        reason = getattr(item, "finish_reason", None)
        if reason is not None:
            return reason


# -- 7. the app's worker ------------------------------------------------------------------------


def check_worker(device: torch.device, figures: dict[str, Any]) -> None:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    try:
        from PySide6.QtCore import QCoreApplication, Qt, QThread
    except ImportError as exc:
        raise Skip(
            f"PySide6 is not installed here ({exc}): the app's worker is a Qt object "
            "(app/gui/worker_loop.py), and PySide6's wheels are larger than the tree a lent "
            "GPU machine takes"
        ) from None
    from app.gui.commands import Configure, Delta, EngineView, Load, Send, Stop
    from app.gui.gc_guard import GuiGarbageCollector
    from app.gui.worker import EngineWorker
    from app.loading import LoadSpec

    precision = native_choice(device)
    folder = write_folder(DRY.raw, Path(tempfile.mkdtemp(prefix="gpu-check-")) / "tiny")
    app = QCoreApplication.instance() or QCoreApplication([])
    collector = GuiGarbageCollector()
    worker, thread = EngineWorker(), QThread()
    worker.moveToThread(thread)
    thread.started.connect(worker.run)
    worker.stopped.connect(thread.quit, Qt.ConnectionType.DirectConnection)
    deltas: list[Delta] = []
    views: list[EngineView] = []
    errors: list[str] = []
    loaded: list[object] = []
    # Plain callables run in the worker's thread; appending to a list is safe there.
    worker.deltas.connect(lambda batch: deltas.extend(batch))
    worker.metrics.connect(lambda view: views.append(view))
    worker.loaded.connect(lambda info: loaded.append(info))
    worker.load_failed.connect(lambda message: errors.append(message))
    worker.error.connect(lambda message: errors.append(message))

    def wait(done: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
        deadline = time.perf_counter() + timeout_s
        while not done():
            expect(not errors, f"worker error while waiting for {what}: {errors}")
            expect(time.perf_counter() < deadline, f"no {what} within {timeout_s:.0f} s")
            app.processEvents()
            time.sleep(0.02)

    thread.start()
    try:
        worker.post(Load(LoadSpec(str(folder), precision, str(device), 64.0)))
        wait(lambda: bool(loaded), "loaded model")
        worker.post(Configure(layer_timing=True))
        messages = [{"role": "user", "content": "t5 t6 t7 t8"}]
        worker.post(Send("gpu-check", messages, {"max_new_tokens": 16, "temperature": 0.0}))
        wait(lambda: any(d.finish for d in deltas), "finished reply")
        seen = len(views)
        wait(lambda: len(views) > seen and bool(views[-1].snapshot.layer_timings), "metrics")
        text = "".join(d.text for d in deltas)
        finishes = [d.finish for d in deltas if d.finish]
        figures.update(precision=precision, reply=text[:80], finish=finishes)
        expect(bool(text.strip()), "the worker's reply is empty")
        expect(finishes in (["length"], ["stop"]), f"the reply finished with {finishes}")
        if device.type == "cuda":
            mem = views[-1].snapshot.memory
            expect((mem.cuda_reserved_bytes or 0) > 0, "no CUDA reserved figure from the worker")
            streams = {i: stream.device for i, stream in worker._streams.by_device.items()}
            expect(streams == {device.index: device}, f"worker streams {streams}, not {device}")
    finally:
        worker.post(Stop())
        wait(lambda: thread.isFinished(), "worker stop", 60.0)
        collector.stop()
    release(device)
