"""``make gpu-check``: every CUDA path on a real GPU, in one process, in a few minutes.

Where torch sees no CUDA device it says so and exits 0. On a GPU it runs each check below,
prints one line per result and exits 1 if any failed:

1. kernels: the INT8 kernel probe, INT8 and INT4 layers against their dequantized reference,
   and a tied INT4 head read back as embedding rows from the CUDA packing, exactly;
2. the engine at every precision, tied ``int4-g32+head`` included: greedy text, decode speed
   with and without layer timing, a timing for every layer, the memory figures the plot shows
   (CUDA reserved, NVML used/total) and the peak of ``torch.cuda.max_memory_allocated``;
3. fp32 on the GPU against fp32 on the CPU: the first greedy tokens must agree;
4. the app's engine worker (Qt without a window): load ``int4-g32+head`` on the GPU, answer a
   chat message with layer timing on, on a stream of its own on that device;
5. the compiled decode step (``--decode-graph on``, bf16): its compile time, decode speed
   against the eager step of the same engine, and greedy ids against eager bf16's;
6. prefix caching (bf16): a five-turn chat through two engines, caching off and on, replies
   alike and each turn's TTFT (``bench --workload chat``'s harness);
7. the server's engine loop on the GPU: its memory margin held, a request served, then a step
   that runs out of memory for real (a tensor larger than the device) failing its request,
   the margin let go and the next request served.

Run: ``python -m tests.gpu_check [--model default|FOLDER] [--device cuda:N]`` (not collected by
pytest: it needs a GPU and several minutes).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.loader.load import load_model

PRECISIONS = ("fp32", "bf16", "fp16", "int8", "int8+head", "int4-g32", "int4-g32+head")
NEW_TOKENS = 64
AGREE_TOKENS = 8  # fp32 on GPU and CPU: greedy ids that must match (later ones may tie-break)
PROMPT = [{"role": "user", "content": "Explain in two sentences why the sky is blue."}]
BUDGET_S = 300
MIB = 2**20


class Check:
    """Runs named checks, keeps going after a failure and remembers it."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    def run(self, name: str, fn: Callable[[], None]) -> None:
        start = time.perf_counter()
        try:
            fn()
        except Exception as exc:
            traceback.print_exc()
            self.failures.append(f"{name}: {type(exc).__name__}: {exc}")
            print(f"FAIL {name} ({time.perf_counter() - start:.1f} s)", flush=True)
        else:
            print(f"ok   {name} ({time.perf_counter() - start:.1f} s)", flush=True)


def expect(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm())


# -- 1. kernels ---------------------------------------------------------------------------------


def check_kernels(device: torch.device, int4: bool) -> None:
    from engine.formats import dequantize_int4, dequantize_int8, quantize_int4
    from engine.quant.embedding import QuantizedEmbedding
    from engine.quant.int4 import Int4Linear
    from engine.quant.int8 import Int8Linear, int8_kernel_runs
    from engine.quant.spec import INT4_GROUPS

    runs = int8_kernel_runs(device)
    print(f"     int8 kernel on {device}: {'yes' if runs else 'no (converted per call)'}")
    gen = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(200, 576, device=device, generator=gen)
    x = torch.randn(5, 576, device=device, generator=gen).to(torch.bfloat16)
    int8 = Int8Linear(w, None, torch.bfloat16)
    ref8 = x.float() @ dequantize_int8(int8.weight, int8.scales).T
    expect(relative_error(int8(x), ref8) <= 1e-2, "Int8Linear disagrees with its reference")
    if not int4:
        return
    for group in INT4_GROUPS:
        layer = Int4Linear(w, None, group)
        padded = F.pad(w, (0, layer.padded_k, 0, layer.padded_n))
        dense = dequantize_int4(*quantize_int4(padded, group), group)[:200, :576]
        err = relative_error(layer(x), x.float() @ dense.T)
        expect(err <= 1e-2, f"Int4Linear g{group} disagrees with its reference ({err:.2e})")
        embed = QuantizedEmbedding(layer, torch.float32, torch.ones(576, device=device))
        ids = torch.tensor([0, 1, 7, 8, 9, 63, 64, 199], device=device)
        expect(torch.equal(embed(ids), dense[ids]), f"tied INT4 g{group} rows are wrong")
        layout = embed.cuda_layout
        assert layout is not None
        print(f"     int4 g{group}: layout tiles {layout.tile_rows}×{layout.tile_cols}, rows exact")


# -- 2. and 3. the engine -----------------------------------------------------------------------


def check_precision(
    model: Path, device: torch.device, precision: str, results: dict[str, list[int]]
) -> None:
    from engine.core.config import EngineConfig
    from engine.core.sampling import SamplingParams

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    config = EngineConfig(kv_memory=256 * MIB)
    engine = load_model(model, precision=precision, device=str(device), config=config)
    load_s = time.perf_counter() - start
    check_load_plan(model, device, precision, config, engine)
    prompt = engine.chat_prompt_ids(PROMPT)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)

    engine.enable_layer_timing(True)
    timed = engine.generate(prompt, params)
    for _ in timed:
        pass
    snapshot = engine.metrics()
    engine.enable_layer_timing(False)
    plain = engine.generate(prompt, params)
    for _ in plain:
        pass
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)

    result, layers = plain.result, snapshot.layer_timings
    expect(len(result.token_ids) == NEW_TOKENS, f"{len(result.token_ids)} tokens, not {NEW_TOKENS}")
    expect(bool(result.text.strip()), "empty text")
    expect(len(layers) == engine.cfg.num_layers, f"{len(layers)} layer timings")
    expect(all(t.attention_s > 0 and t.mlp_s > 0 for t in layers), "a layer timed 0 s")
    mem = snapshot.memory
    expect((mem.cuda_reserved_bytes or 0) > 0, "no CUDA reserved figure")
    nvml = (
        f"NVML {mem.nvml_used_bytes / MIB:.0f}/{mem.nvml_total_bytes / MIB:.0f} MiB"
        if mem.nvml_used_bytes is not None and mem.nvml_total_bytes is not None
        else "NVML n/a"
    )
    tps = 1 / result.tpot_s if result.tpot_s else float("nan")
    timed_tps = 1 / timed.result.tpot_s if timed.result.tpot_s else float("nan")
    layer_ms = sum(t.attention_s + t.mlp_s for t in layers) * 1e3
    print(
        f"     {precision:<14} load {load_s:4.1f} s, decode {tps:6.1f} tok/s "
        f"({timed_tps:.1f} timed, layers {layer_ms:.1f} ms/step), peak allocated "
        f"{peak / MIB:7.1f} MiB, reserved {(mem.cuda_reserved_bytes or 0) / MIB:.0f} MiB, "
        f"{nvml}: {result.text[:48]!r}"
    )
    results[precision] = result.token_ids
    results[f"peak {precision}"] = [peak]


def check_load_plan(
    model: Path, device: torch.device, precision: str, config: object, engine: object
) -> None:
    """The memory plan against this load: weights within 1%, the load's peak
    (``max_memory_allocated`` since the reset before it) within the plan's bound, and what
    the CUDA runtime takes beside the allocator (NVML used − reserved), the figure the plan
    estimates as ``CUDA_RUNTIME_BYTES``."""
    from engine.hardware.nvml import device_memory
    from engine.loader.memory_plan import CUDA_RUNTIME_BYTES, plan_for_folder

    plan = plan_for_folder(model, precision, str(device), config=config)  # type: ignore[arg-type]
    weights, pool = engine.weights_bytes, engine.kv.nbytes  # type: ignore[attr-defined]
    peak = torch.cuda.max_memory_allocated(device)
    bound = plan.weight_bytes + plan.load_overhead_bytes + pool
    expect(abs(plan.weight_bytes - weights) <= 0.01 * weights,
           f"plan {plan.weight_bytes} B of weights, load {weights} B")  # fmt: skip
    expect(peak <= bound, f"load peak {peak / MIB:.0f} MiB > bound {bound / MIB:.0f} MiB")
    nvml = device_memory(device)  # every process on the GPU: alone there, this one
    runtime = "n/a"
    if nvml is not None:
        runtime = f"{(nvml.used_bytes - torch.cuda.memory_reserved(device)) / MIB:.0f} MiB"
    print(
        f"     {precision:<14} plan: weights {plan.weight_bytes / MIB:.1f} MiB (loaded "
        f"{weights / MIB:.1f}), load peak {peak / MIB:.0f} MiB ≤ bound {bound / MIB:.0f} MiB; "
        f"CUDA runtime beside the allocator {runtime} (planned {CUDA_RUNTIME_BYTES / MIB:.0f})"
    )


def check_fp32_against_cpu(model: Path, results: dict[str, list[int]]) -> None:
    from engine.core.sampling import SamplingParams

    expect("fp32" in results, "fp32 on the GPU did not run")
    engine = load_model(model, precision="fp32")
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    gen = engine.generate(engine.chat_prompt_ids(PROMPT), params)
    for _ in gen:
        pass
    gpu, cpu = results["fp32"], gen.result.token_ids
    same = next((i for i, (a, b) in enumerate(zip(gpu, cpu, strict=True)) if a != b), len(cpu))
    print(f"     fp32 greedy ids: GPU and CPU agree on the first {same} of {len(cpu)}")
    expect(same >= AGREE_TOKENS, f"GPU and CPU fp32 differ at token {same}")


def check_decode_graph(model: Path, device: torch.device, results: dict[str, list[int]]) -> None:
    from engine.core.config import EngineConfig
    from engine.core.sampling import SamplingParams

    config = EngineConfig(kv_memory=256 * MIB, decode_graph="on")
    engine = load_model(model, precision="bf16", device=str(device), config=config)
    print(f"     {engine.graph.summary()}")
    expect(engine.graph.compiled, "the decode step did not compile")
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    speeds = {}
    for mode in ("compiled", "eager", "compiled"):
        if mode == "eager":
            engine.model.eager_reasons.add("gpu-check")
        gen = engine.generate(engine.chat_prompt_ids(PROMPT), params)
        for _ in gen:
            pass
        engine.model.eager_reasons.discard("gpu-check")
        speeds[mode] = 1 / gen.result.tpot_s if gen.result.tpot_s else float("nan")
        ids = gen.result.token_ids
    print(f"     decode {speeds['compiled']:.1f} tok/s compiled, {speeds['eager']:.1f} eager")
    if "bf16" in results:
        pairs = enumerate(zip(ids, results["bf16"], strict=True))
        same = next((i for i, (a, b) in pairs if a != b), len(ids))
        print(f"     greedy ids: compiled and eager bf16 agree on the first {same}")
        expect(same >= AGREE_TOKENS, f"compiled and eager differ at token {same}")


def check_ab(model: Path, device: torch.device) -> None:
    """The A/B comparison on the GPU (fp32 against bf16): its scoring through the paged cache
    on the device agrees with the CPU's scoring of the same tokens."""
    from engine.core.sampling import SamplingParams
    from engine.evals.compare import compare_prompt
    from engine.evals.scoring import score
    from engine.evals.sides import Side

    a = load_model(model, precision="fp32", device=str(device))
    b = load_model(model, precision="bf16", device=str(device))
    greedy = Side(SamplingParams(max_new_tokens=16))
    report = compare_prompt(a, b, PROMPT[-1]["content"], greedy, greedy)
    s = report["summary"]
    print(f"     fp32 vs bf16 on {device}: mean KL {s['kl_mean']:.2e}, top-1 "
          f"{s['top1_agreement']:.0%}, noise {s['noise_kl_mean']:.1e}")  # fmt: skip
    expect(s["kl_mean"] < 0.05 and s["top1_agreement"] >= 0.8, f"fp32 vs bf16 on GPU: {s}")
    cpu = load_model(model, precision="fp32")
    prompt = a.chat_prompt_ids(PROMPT[-1:])
    ids = report["a"]["token_ids"]
    on_gpu, on_cpu = score(a, prompt, ids), score(cpu, prompt, ids)
    worst = float((on_gpu.exp() - on_cpu.exp()).abs().max())
    print(f"     fp32 scores, GPU against CPU: largest probability difference {worst:.1e}")
    expect(worst < 1e-3, f"GPU and CPU fp32 scores differ by {worst}")


def check_prefix_cache(model: Path, device: torch.device) -> None:
    from engine.bench.chat import format_chat_report, run_chat_bench

    report = run_chat_bench(
        model, turns=5, message_tokens=100, reply_tokens=32, system_tokens=64,
        precision="bf16", device=str(device),
    )  # fmt: skip
    print("     " + format_chat_report(report).replace("\n", "\n     "))
    turns = report["turns"]
    expect(all(t["cached_tokens"] > 0 for t in turns[1:]), "a later turn reused nothing")
    expect(report["replies_identical"], "caching changed a greedy reply on the GPU")


def check_speculative(model: Path, device: torch.device, int4: bool) -> None:
    """Speculative decoding on the GPU (fp32 target, where a verify pass and a decode step
    agree to rounding): greedy output with prompt lookup and with a self-draft equals plain
    greedy output, and the bench reports each drafter's speed on chat and input-grounded
    prompts."""
    from engine.bench.speculative import format_spec_report, run_spec_bench
    from engine.core.config import EngineConfig

    engine = load_model(
        model, precision="fp32", device=str(device), config=EngineConfig(kv_memory=256 * MIB)
    )
    drafters = ["lookup", "self:int4-g32+head" if int4 else "self:int8+head"]
    report = run_spec_bench(engine, drafters, [2, 4, 8], new_tokens=64, repeats=1)
    print("     " + format_spec_report(report).replace("\n", "\n     "))
    expect(all(r["same_output"] for r in report["rows"]), "speculation changed a greedy reply")
    expect(any((r["acceptance_rate"] or 0) > 0 for r in report["rows"]), "no draft was accepted")


def check_server_loop(model: Path, device: torch.device) -> None:
    import queue as queue_module

    from app.server.engine_loop import EngineLoop
    from app.server.metrics import ServerMetrics
    from engine.core.config import EngineConfig
    from engine.core.sampling import SamplingParams

    engine = load_model(
        model, precision="bf16", device=str(device), config=EngineConfig(kv_memory=256 * MIB)
    )
    loop = EngineLoop(engine, ServerMetrics("gpu-check"), margin_bytes=256 * MIB)
    expect(loop.margin_held, "the OOM margin was not taken")
    real_step, calls = engine.step, []

    def step() -> list:
        calls.append(1)
        if len(calls) == 2:  # really out of memory: more than the device holds
            torch.empty(torch.cuda.get_device_properties(device).total_memory * 2,
                        dtype=torch.uint8, device=device)  # fmt: skip
        return real_step()

    engine.step = step  # type: ignore[method-assign]

    def served(rid: str) -> object:
        got: queue_module.Queue[object] = queue_module.Queue()
        prompt = engine.chat_prompt_ids(PROMPT)
        loop.submit(rid, prompt, SamplingParams(max_new_tokens=8), 60.0, got.put)
        while True:
            item = got.get(timeout=120)
            if isinstance(item, BaseException) or getattr(item, "finish_reason", None):
                return item

    loop.start()
    try:
        failed = served("a")
        expect(isinstance(failed, torch.OutOfMemoryError), f"expected an OOM, got {failed!r}")
        after = served("b")
        expect(getattr(after, "finish_reason", None) == "length", f"not served after: {after!r}")
        print(f"     OOM steps {loop.out_of_memory}, KV blocks in use "
              f"{engine.kv.manager.num_used}, margin held again: {loop.margin_held}")  # fmt: skip
        expect(engine.kv.manager.num_used == 0, "blocks were left in use")
    finally:
        loop.stop()


# -- 4. the worker ------------------------------------------------------------------------------


def check_worker(model: Path, device: torch.device, int4: bool) -> None:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtCore import QCoreApplication, Qt, QThread

    from app.gui.commands import Configure, Delta, EngineView, Load, Send, Stop
    from app.gui.gc_guard import GuiGarbageCollector
    from app.gui.worker import EngineWorker
    from app.loading import LoadSpec

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

    precision = "int4-g32+head" if int4 else "int8+head"
    thread.start()
    try:
        worker.post(Load(LoadSpec(str(model), precision, str(device), 256.0)))
        wait(lambda: bool(loaded), "loaded model")
        worker.post(Configure(layer_timing=True))
        sampling = {"max_new_tokens": 32, "temperature": 0.0}
        worker.post(Send("gpu-check", PROMPT, sampling))
        wait(lambda: any(d.finish for d in deltas), "finished reply")
        seen = len(views)
        wait(lambda: len(views) > seen and bool(views[-1].snapshot.layer_timings), "metrics")
        text = "".join(d.text for d in deltas)
        expect(bool(text.strip()), "the worker's reply is empty")
        finishes = [d.finish for d in deltas if d.finish]
        expect(finishes in (["length"], ["stop"]), f"the reply finished with {finishes}")
        mem = views[-1].snapshot.memory
        expect((mem.cuda_reserved_bytes or 0) > 0, "no CUDA reserved figure from the worker")
        streams = {index: stream.device for index, stream in worker._streams.by_device.items()}
        expect(streams == {device.index: device}, f"worker streams {streams}, not on {device}")
        print(f"     worker {precision} on {device}, own stream: {text[:60]!r}")
    finally:
        worker.post(Stop())
        wait(lambda: thread.isFinished(), "worker stop", 60.0)
        collector.stop()


# -- main ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", default="default", help="default, or a model folder")
    parser.add_argument("--device", default="cuda:0", help="the CUDA device to check")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        print(f"gpu-check skipped: torch {torch.__version__} ({build}) sees no CUDA device")
        return 0
    from engine.store.model_store import resolve_model

    device = torch.device(args.device)
    if device.index is None:  # "cuda": the current device, by its number
        device = torch.device("cuda", torch.cuda.current_device())
    major, minor = torch.cuda.get_device_capability(device)
    int4 = major >= 8
    print(f"gpu-check on {torch.cuda.get_device_name(device)} ({device}, sm{major}{minor}), "
          f"torch {torch.__version__}, CUDA {torch.version.cuda}")  # fmt: skip
    if not int4:
        print("     INT4 needs sm80+: the int4 precisions are skipped on this GPU")
    model = resolve_model(args.model)
    start = time.perf_counter()
    check = Check()
    results: dict[str, list[int]] = {}
    check.run("kernels", lambda: check_kernels(device, int4))
    for precision in PRECISIONS:
        if precision.startswith("int4") and not int4:
            continue
        check.run(
            f"engine {precision}", partial(check_precision, model, device, precision, results)
        )
    check.run("fp32 GPU against CPU", lambda: check_fp32_against_cpu(model, results))
    check.run("A/B comparison", lambda: check_ab(model, device))
    check.run("worker", lambda: check_worker(model, device, int4))
    check.run("decode graph", lambda: check_decode_graph(model, device, results))
    check.run("prefix caching", lambda: check_prefix_cache(model, device))
    check.run("server loop", lambda: check_server_loop(model, device))
    check.run("speculative decoding", lambda: check_speculative(model, device, int4))
    peaks = {k[5:]: v[0] for k, v in results.items() if k.startswith("peak ")}
    if peaks:
        worst = max(peaks, key=lambda k: peaks[k])
        print(f"peak max_memory_allocated: {peaks[worst] / MIB:.1f} MiB ({worst})")
    elapsed = time.perf_counter() - start
    over = f" (over its {BUDGET_S} s budget)" if elapsed > BUDGET_S else ""
    print(f"gpu-check took {elapsed:.0f} s{over}")
    for failure in check.failures:
        print(f"FAILED {failure}")
    return 1 if check.failures else 0


if __name__ == "__main__":
    sys.exit(main())
