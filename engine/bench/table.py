"""``infersight bench --table``: each precision's batch-1 decode against the memory read
bandwidth limit measured in the same run (before and after), the kernels-only floor, and
llama.cpp alongside, in a process and environment of its own (:class:`LlamaCppPeer`), all in
turn within every repeat.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from engine.bench.speed import BenchConfig, RunTiming, bench_prompt, prefix_cache_state, run_ours
from engine.core.engine import LLMEngine
from engine.errors import InfersightError
from engine.hardware import verdicts
from engine.loader.load import load_model


def measure_read_bandwidth(
    mib: int = 256, repeats: int = 5, device: torch.device | str = "cpu"
) -> float:
    """Memory read bandwidth in bytes/s: the best of ``repeats`` sums over a buffer far larger
    than any cache, on the threads the engine uses (a sum is read-bound on every CPU here); on
    a GPU, of its memory (each sum waited for)."""
    data = torch.ones(mib * 2**20 // 4, dtype=torch.float32, device=device)

    def wait() -> None:
        if data.is_cuda:
            torch.cuda.synchronize(data.device)

    data.sum()  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        wait()
        started = time.perf_counter()
        data.sum()
        wait()
        best = min(best, time.perf_counter() - started)
    return data.numel() * 4 / best


@dataclass(slots=True)
class TableRow:
    engine: str  # infersight | llama.cpp
    precision: str
    mode: str  # eager | compiled | C step | the GGUF's file type
    read_mib: float  # weights a decode step reads
    decode_tok_s: float
    limit_tok_s: float  # bandwidth / read bytes
    fraction: float  # of the limit
    kernels_tok_s: float | None = None  # the step's matmuls and attention alone
    #: the format the LM head is read in (a side's head can differ from its body: llama.cpp's
    #: Q4_1 files keep a Q8_0 head, which ``int4-g32+head8`` matches)
    head: str = ""
    #: why an eager row of ours did not run its decode steps in one C call
    why: str = ""


def kernel_floor_ms(engine: LLMEngine, keys: int, repeats: int = 5) -> float:
    """Milliseconds of one batch-1 decode step's kernels with nothing between them: every
    linear of the model (the LM head included; of a mixture of experts, the ``k`` experts a
    token chooses) on one token, and one SDPA per layer over
    ``keys`` cached keys, back to back; the best of ``repeats``. No engine built this way can
    decode faster with these kernels: the floor under the Python, dispatch and small ops."""
    from torch.nn.functional import scaled_dot_product_attention

    from engine.model.inventory import decode_linears

    model, cfg = engine.model, engine.cfg
    linears = decode_linears(model)
    widths: list[int] = [getattr(m, "in_features") for m in linears]  # noqa: B009
    inputs = [torch.randn(1, width, dtype=engine.dtype) for width in widths]
    group = cfg.num_heads // cfg.num_kv_heads
    q = torch.randn(1, cfg.num_kv_heads, group, cfg.head_dim, dtype=engine.dtype)
    k = torch.randn(1, cfg.num_kv_heads, keys, cfg.head_dim, dtype=engine.dtype)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first round warms up
            started = time.perf_counter()
            for module, x in zip(linears, inputs, strict=True):
                module(x)
            for _ in range(cfg.num_layers):
                scaled_dot_product_attention(q, k, k)
            best = min(best, time.perf_counter() - started)
    return best * 1e3


class LlamaCppPeer:
    """llama.cpp in its own process and environment (:mod:`engine.bench.llamacpp_peer`): one JSON
    command per line in, one JSON object per line back (other output is passed over); every
    answer has a deadline, and a peer that fails to start or answer is killed."""

    def __init__(self, python: str, gguf: Path, threads: int, timeout_s: float = 600) -> None:
        import queue
        import subprocess
        import threading

        script = Path(__file__).with_name("llamacpp_peer.py")
        self.timeout_s = timeout_s
        try:
            self.proc = subprocess.Popen(
                [python, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
        except OSError as exc:
            raise InfersightError(
                f"cannot start {python} for llama.cpp ({exc.strerror}); give the Python of an "
                "environment with llama-cpp-python (`make bench-peers` builds .peers/venv)"
            ) from None
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.gguf = gguf
        try:
            self.info = str(self._ask("load", str(gguf), threads)["system_info"])
        except BaseException:
            self.close()
            raise

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)  # end of output: the process exited

    def _ask(self, *command: Any) -> dict[str, Any]:
        import json
        import queue
        import time as clock

        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
        except OSError:  # a broken pipe: it has exited already
            raise InfersightError(f"the llama.cpp process exited (asked: {command[0]})") from None
        deadline = clock.monotonic() + self.timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - clock.monotonic()))
            except queue.Empty:  # it hangs: killed at the deadline, not asked to quit
                self.proc.kill()
                self.proc.wait()
                raise InfersightError(
                    f"llama.cpp did not answer {command[0]!r} in {self.timeout_s:.0f} s"
                ) from None
            if line is None:
                raise InfersightError(
                    f"the llama.cpp process exited (asked: {command[0]}); does its Python have "
                    "llama-cpp-python? (`make bench-peers` builds .peers/venv)"
                )
            if line.startswith("{"):
                answer: dict[str, Any] = json.loads(line)
                break
        if "error" in answer:
            raise InfersightError(f"llama.cpp: {answer['error']}")
        return answer

    def quantize(self, dst: Path, ftype: str) -> None:
        self._ask("quantize", str(self.gguf), str(dst), ftype)

    def run(self, prompt: list[int], new_tokens: int) -> RunTiming:
        r = self._ask("run", prompt, new_tokens)
        return RunTiming(r["ttft_s"], r["decode_s"], r["new_tokens"])

    def close(self) -> None:
        """Ask it to quit; kill it if it does not within a few seconds."""
        import subprocess

        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write('["quit"]\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def gguf_file_type(path: Path) -> str:
    """The file type of a GGUF (``Q4_1``, ``F16`` …) by llama.cpp's name, from its header's
    ``general.file_type``."""
    from engine.bench.llamacpp_peer import FTYPES
    from engine.store.gguf_reader import gguf_metadata, open_gguf

    code = gguf_metadata(open_gguf(path)).get("general.file_type")
    names = {v: k for k, v in FTYPES.items()}
    if code is None or int(code) not in names:
        raise InfersightError(
            f"{path.name}: file type {code} is not one the bench knows ({', '.join(FTYPES)})"
        )
    return names[int(code)]


def gguf_decode_bytes(path: Path) -> int:
    """Bytes of a GGUF's tensors that a batch-1 decode step reads, as
    :func:`engine.quant.inventory.decode_read_bytes` counts ours: every tensor once but the
    embedding where the file has a head of its own (a token reads one row of it), and of a
    mixture of experts' 3-D expert tensors (``*_exps``) the ``expert_used_count`` of
    ``expert_count`` a token chooses."""
    from engine.store.gguf_reader import gguf_metadata, open_gguf

    reader = open_gguf(path)
    meta = gguf_metadata(reader)
    arch = str(meta.get("general.architecture", ""))
    count = int(meta.get(f"{arch}.expert_count") or 0)
    used = int(meta.get(f"{arch}.expert_used_count") or 0)
    names = {t.name for t in reader.tensors}
    total = 0
    for t in reader.tensors:
        if t.name == "token_embd.weight" and "output.weight" in names:
            continue
        nbytes = int(t.n_bytes)
        total += nbytes * used // count if count and "_exps" in t.name else nbytes
    return total


def gguf_head_type(path: Path) -> str:
    """The type a GGUF's LM head is stored in: its ``output.weight``'s, else (a tied head)
    the embedding's."""
    from engine.store.gguf_reader import open_gguf

    types = {t.name: t.tensor_type.name for t in open_gguf(path).tensors}
    return types.get("output.weight") or types.get("token_embd.weight", "?")


def head_format(engine: LLMEngine) -> str:
    """The format our LM head is read in: the spec's head part, else the compute dtype."""
    from engine.quant.spec import dtype_name

    kind = engine.precision.parts.get("head")
    return kind.name if kind is not None else dtype_name(engine.dtype)


def _decode_tok_s(runs: list[RunTiming]) -> float:
    return statistics.median((r.new_tokens - r.batch) / r.decode_s for r in runs)


def run_table(
    folder: Path,
    precisions: list[str],
    cfg: BenchConfig,
    *,
    engine_config: Any = None,
    llama_python: str | None = None,
    gguf: Path | None = None,
    gguf_types: tuple[str, ...] = ("Q4_1",),
    ready: dict[str, Path] | None = None,
    log: Callable[[str], None] = lambda _: None,
    tensor_parallel: int = 1,
) -> dict[str, Any]:
    """Batch-1 decode of each precision (as the load settled it: eager, in one C call, or
    compiled and eager where it compiled),
    llama.cpp on ``gguf`` in each of ``gguf_types`` if ``llama_python`` is given (the file as
    it is for its own type, requantized by llama.cpp from it for the others; ``ready``: files
    of a type written already, run as they are), all in turn
    within every repeat, with the memory read bandwidth measured before and after."""
    from engine.quant.inventory import decode_read_bytes

    bandwidth = [measure_read_bandwidth()]
    runners: list[tuple[str, str, str, float, Callable[[list[int], int], RunTiming]]] = []
    heads: list[str] = []  # each runner's LM head format
    whys: list[str] = []  # each eager runner's reason
    prompt: list[int] | None = None
    floors: dict[str, float] = {}
    #: each run's ms per step in products and attention, by the C step's clocks
    clocked: dict[str, list[float]] = {}
    cache = "off"
    for precision in precisions:
        log(f"loading {precision}")
        engine = load_model(
            folder, precision=precision, config=engine_config, tensor_parallel=tensor_parallel
        )
        cache = prefix_cache_state(engine)  # the same config for every precision
        prompt = prompt or bench_prompt(engine, cfg.prompt_len, cfg.seed)
        read = float(decode_read_bytes(engine.model))
        # a decode step in one C call (engine.executor.c_step) is the engine's own mode
        # where the load planned it; "eager" runs every module (as layer timings do)
        own = "C step" if engine.runner.executor.c_step is not None else "eager"
        modes = ["compiled", "eager"] if engine.graph.compiled else [own]
        if own == "C step":  # its kernels as its own clocks time them, in the runs below
            clocked[precision] = []
        else:
            keys = cfg.prompt_len + cfg.new_tokens // 2
            floors[precision] = 1e3 / kernel_floor_ms(engine, keys)
        for mode in modes:
            run = _mode_runner(engine, mode, clocked.get(precision))
            runners.append(("infersight", precision, mode, read, run))
            heads.append(head_format(engine))
            # why the engine's own mode is eager (not a compiled engine's side-by-side row)
            whys.append(engine.runner.executor.c_step_why if modes == ["eager"] else "")
    info = None
    with contextlib.ExitStack() as stack:
        if llama_python is not None:
            ready = ready or {}
            if gguf is None and not set(gguf_types) <= set(ready):
                raise InfersightError(
                    f"the llama.cpp comparison in {', '.join(gguf_types)} needs the model's "
                    f"GGUF file (this model has {', '.join(ready) or 'none'})"
                )
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="infersight-")))
            threads = torch.get_num_threads()
            shipped = gguf_file_type(gguf) if gguf is not None else None
            for ftype in gguf_types:
                path = ready.get(ftype) or gguf
                assert path is not None
                if ftype not in ready and ftype != shipped:
                    log(f"llama.cpp: requantizing {path.name} ({shipped}) to {ftype}")
                    quantizer = LlamaCppPeer(llama_python, path, threads)
                    path = tmp / f"{ftype}.gguf"
                    try:
                        quantizer.quantize(path, ftype)
                    finally:
                        quantizer.close()
                peer = LlamaCppPeer(llama_python, path, threads)
                stack.callback(peer.close)
                info = peer.info
                size = float(gguf_decode_bytes(path))  # its weights a token reads
                runners.append(("llama.cpp", ftype, "llama.cpp", size, peer.run))
                heads.append(gguf_head_type(path))
                whys.append("")
        assert prompt is not None
        timings: list[list[RunTiming]] = [[] for _ in runners]
        for _, _, _, _, run in runners:  # warm-up
            run(prompt, min(8, cfg.new_tokens))
        for i in range(cfg.repeats):
            for (name, precision, mode, _, run), runs in zip(runners, timings, strict=True):
                log(f"repeat {i + 1}/{cfg.repeats}: {name} {precision} {mode}")
                runs.append(run(prompt, cfg.new_tokens))
    bandwidth.append(measure_read_bandwidth())
    best = max(bandwidth)
    rows = []
    for (name, precision, mode, read, _), runs, head, why in zip(
        runners, timings, heads, whys, strict=True
    ):
        tok_s = _decode_tok_s(runs)
        limit = best / read
        floor = floors.get(precision) if name == "infersight" else None
        if name == "infersight" and clocked.get(precision):
            floor = 1e3 / statistics.median(clocked[precision])
        fraction = tok_s / limit
        rows.append(
            TableRow(name, precision, mode, read / 2**20, tok_s, limit, fraction, floor, head, why)
        )
    return {
        "model": str(folder),
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "repeats": cfg.repeats,
        "new_tokens": cfg.new_tokens,
        "bandwidth_gb_s": [b / 1e9 for b in bandwidth],
        "prefix_cache": cache,  # ours (llama.cpp is reset before each run)
        "llama_cpp_system_info": info,
        "rows": [asdict(r) for r in rows],
        "kernel_verdicts": verdicts.this_machine(),
    }


def _mode_runner(
    engine: LLMEngine, mode: str, clocked: list[float] | None = None
) -> Callable[[list[int], int], RunTiming]:
    """A run of ``engine`` in ``mode``; a C step's also appends its kernels' ms per step (its
    own clocks: products and attention) to ``clocked``."""

    def run(prompt: list[int], new_tokens: int) -> RunTiming:
        if mode == "eager":
            engine.runner.executor.eager_reasons.add("bench: eager row")
        step = engine.runner.executor.c_step
        clocks = getattr(step, "clocked", None)
        try:
            if clocked is None or clocks is None:
                return run_ours(engine, prompt, new_tokens)
            with clocks() as per_step:
                timing = run_ours(engine, prompt, new_tokens)
            if per_step:
                clocked.append(sum(per_step))
            return timing
        finally:
            engine.runner.executor.eager_reasons.discard("bench: eager row")

    return run
