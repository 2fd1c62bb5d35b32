"""The one compatibility table of decode-step executors and attention backends.

An executor runs a whole decode step; an attention backend is what each layer's attention
runs on. Not every pair works: a CUDA graph replays fixed shapes, which only our Triton
kernels keep; the compiled graph calls the torch paths' attention op; the C step calls the
paged C kernel. Each refusal is stated here once, with its reason, and every place that
decides or reports asks :func:`refusal`: the load (:mod:`engine.core.engine`), the memory
plan, ``make gpu-check`` and the tests of each pair.
"""

from __future__ import annotations

#: the executors, in the order a step tries them: the first that applies runs it
EXECUTORS = ("cuda-graphs", "compiled", "c-step", "eager")
#: the attention backends: our Triton kernels (block tables, in place), the paged C kernel
#: (a CPU pool), torch (one padded gather, then SDPA)
BACKENDS = ("triton", "c", "torch")

_FIXED_SHAPES = (
    "a graph replays fixed shapes, and this attention reads padded slot rows whose width "
    "changes every step (graphs need our Triton kernels, which read fixed-width block tables: "
    "INFERSIGHT_KERNELS=triton where they run)"
)
_C_ATTENTION = "the C step's attention is the paged C kernel"

#: (executor, backend) → why the pair is refused; a pair not listed runs
REFUSED: dict[tuple[str, str], str] = {
    ("cuda-graphs", "c"): _FIXED_SHAPES,
    ("cuda-graphs", "torch"): _FIXED_SHAPES,
    ("compiled", "triton"): "the compiled graph's attention op is the torch paths' (ours run "
    "outside any graph of Inductor's)",
    ("c-step", "triton"): _C_ATTENTION,
    ("c-step", "torch"): _C_ATTENTION,
}

#: executor → why it does not run under tensor parallelism (eager does)
TENSOR_PARALLEL: dict[str, str] = {
    "cuda-graphs": "a graph would replay the step without telling the other ranks",
    "compiled": "the other ranks run the eager forward",
    "c-step": "each layer's products end in an all-reduce, which the C step does not make",
}

#: executor → why it does not run a mixture of experts (eager does)
EXPERTS: dict[str, str] = {
    "cuda-graphs": "a step's tokens go to experts the host learns of only as it runs",
    "compiled": "a step's tokens are grouped by expert on the host, which a graph cannot hold",
    "c-step": "its layer is Llama's dense one",
}


def refusal(
    executor: str, backend: str, *, tensor_parallel: bool = False, experts: bool = False
) -> str:
    """Why ``executor`` cannot run decode steps whose attention runs on ``backend`` (of a
    model split over ranks, of a mixture of ``experts``); "" where it can."""
    if executor not in EXECUTORS or backend not in BACKENDS:
        raise ValueError(f"no executor {executor!r} or attention backend {backend!r}")
    if tensor_parallel and executor in TENSOR_PARALLEL:
        return f"{executor} refused under tensor parallelism: {TENSOR_PARALLEL[executor]}"
    if experts and executor in EXPERTS:
        return f"{executor} refused for a mixture of experts: {EXPERTS[executor]}"
    why = REFUSED.get((executor, backend))
    return f"{executor} refused with {backend} attention: {why}" if why else ""


def rows() -> list[dict[str, str]]:
    """The table as rows (executor, backend, "" or the refusal): for the docs and reports."""
    return [
        {"executor": e, "backend": b, "refused": refusal(e, b)} for e in EXECUTORS for b in BACKENDS
    ]
