"""Our Triton kernels: whether they run here, which are chosen, and their ahead-of-time build.

The kernels themselves live in :mod:`engine.kernels.triton_kernels`, one module per kind, each
beside the torch path that is its fallback and its reference. They run on a CUDA GPU; on a
CPU only under Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton is imported),
which runs each program of a kernel's grid with numpy on CPU tensors: slow, exact, and how
the tests check every kernel on machines without a GPU.

``INFERSIGHT_KERNELS`` picks by hand: ``triton`` (ours, an error where they cannot run),
``torch`` (the torch paths), or ``auto`` (the default: ours on a CUDA GPU with Triton
installed, the torch paths elsewhere).

Every kernel module declares the configurations it launches (:class:`KernelConfig`: the
signature, the compile-time constants, warps and stages). :func:`compile_for` builds one for
an NVIDIA architecture with no GPU present, as ``python -m engine.kernels.triton_aot`` does
for every configuration and every architecture from sm_75 to sm_90: the compiler rejects what
a real build would, and the shared memory each needs is checked against the architecture's
limit.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.errors import InfersightError

ENV = "INFERSIGHT_KERNELS"
MODES = ("auto", "triton", "torch")
#: The NVIDIA architectures the kernels are built for ahead of time: Turing (RTX 20xx, T4),
#: Ampere (A100; RTX 30xx), Ada (RTX 40xx), Hopper (H100).
TARGETS = (75, 80, 86, 89, 90)
#: The head dimensions the attention kernels are built for (Llama-3's 128, SmolLM2's and
#: Qwen2-0.5B's 64, Gemma 3's 256); a model with others runs the torch paths.
HEAD_DIMS = (64, 128, 256)
#: Shared memory one thread block may use on each, in bytes (the opt-in maximum; CUDA C
#: Programming Guide, "Technical Specifications per Compute Capability").
SHARED_MEMORY = {75: 64 * 1024, 80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
#: The dtypes our kernels compute in on a GPU, by their Triton names, with the oldest
#: architecture each runs on there; the ahead-of-time build compiles these only. fp32 has no
#: tensor-core path: a model in fp32 attends (and so norms) through torch on a GPU, and our
#: kernels compute fp32 only under the interpreter, as the reference the tests check. bf16
#: needs sm_80's MMA, below which the engine computes in fp16 (engine/hardware/gpu.py).
GPU_DTYPES = {torch.float16: ("fp16", 75), torch.bfloat16: ("bf16", 80)}


def installed() -> bool:
    """Whether Triton can be imported here (a CUDA build of torch on Linux brings it; the
    dev extras install it for the tests)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


def requested() -> str:
    chosen = (os.environ.get(ENV) or "auto").strip().lower()
    if chosen not in MODES:
        raise InfersightError(f"{ENV} must be one of {', '.join(MODES)}, not {chosen!r}")
    return chosen


def runs_on(device: torch.device) -> bool:
    """Whether our Triton kernels run for tensors on ``device``: a CUDA GPU with Triton, or a
    CPU under Triton's interpreter."""
    if not installed():
        return False
    if device.type == "cuda":
        return not interpreting()
    return device.type == "cpu" and interpreting()


def _decide(device_type: str) -> tuple[bool, str, str]:
    """Whether the engine on a device of type ``device_type`` runs our Triton kernels, why
    (one line for the load report), and where ``INFERSIGHT_KERNELS=triton`` asks for them and
    they cannot run, the error to raise ("" otherwise): what :func:`chosen` and
    :func:`planned` both answer from."""
    mode = requested()
    if mode == "torch":
        return False, f"torch kernels ({ENV}=torch)", ""
    if runs_on(torch.device(device_type)):  # a device of that type: none is asked
        if device_type == "cpu":
            if mode == "triton":
                return True, "Triton kernels, interpreted on the CPU (TRITON_INTERPRET=1)", ""
            return False, "torch kernels (Triton's interpreter runs only when asked for)", ""
        return True, "Triton kernels", ""
    why = (
        "Triton is not installed"
        if not installed()
        else "Triton runs on a CUDA GPU, or on a CPU only with TRITON_INTERPRET=1"
    )
    refused = (
        f"{ENV}=triton, but {why}; unset it to use the torch kernels" if mode == "triton" else ""
    )
    return False, f"torch kernels ({why})", refused


def chosen(device: torch.device) -> tuple[bool, str]:
    """Whether the engine on ``device`` runs our Triton kernels, and why (one line for the
    load report). ``INFERSIGHT_KERNELS=triton`` where they cannot run is an error."""
    ours, why, refused = _decide(device.type)
    if refused:
        raise InfersightError(refused)
    return ours, why


def planned(
    device_type: str,
    capability: tuple[int, int] | None = None,
    *,
    head_dim: int | None = None,
    dtype: torch.dtype | None = None,
) -> bool:
    """Whether the engine on a device of type ``device_type`` (``cuda``, ``cpu``) runs our
    Triton kernels, answered without the device (the memory plan's question, for a GPU that
    may not be here): its quantized GEMMs, or with ``head_dim`` its attention of heads that
    wide computing in ``dtype`` on compute capability ``capability`` (None: not known,
    planned as 8.0 or newer). It decides as :func:`chosen` and :func:`attention_chosen` do,
    and as the prefill kernel's refusals of a dtype do (fp32 on a GPU, bf16 below 8.0); the
    load's checks against the torch path (:mod:`engine.kernels.triton_check`) are assumed to
    pass. Where ``INFERSIGHT_KERNELS=triton`` cannot be met it answers False (the load is
    what refuses)."""
    ours = _decide(device_type)[0]
    if not ours or head_dim is None:
        return ours
    if head_dim not in HEAD_DIMS:
        return False
    if dtype is not None and device_type == "cuda":
        if dtype == torch.float32:  # no tensor-core path: SDPA
            return False
        if dtype == torch.bfloat16 and capability is not None and capability < (8, 0):
            return False
    return True


@dataclass(frozen=True, slots=True)
class KernelConfig:
    """One configuration a kernel is launched with: what :func:`compile_for` needs to build it
    for an architecture. ``signature`` maps each argument to its Triton type (``*fp16``,
    ``i32``, ``constexpr`` …); ``constants`` gives each ``constexpr`` its value."""

    name: str
    fn: Any  # the @triton.jit function
    signature: dict[str, str]
    constants: dict[str, Any] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 2
    #: the oldest architecture it is built for (a kernel may need bf16 or a newer MMA)
    min_target: int = 75
    #: whether the compiler may contract a multiply and an add into an FMA (off for a kernel
    #: that must round each product and sum as the torch path does); passed at launch too
    enable_fp_fusion: bool = True


@dataclass(frozen=True, slots=True)
class Compiled:
    """What building a configuration for one architecture gave."""

    name: str
    target: int
    shared_bytes: int
    num_warps: int
    cubin_bytes: int

    @property
    def fits(self) -> bool:
        return self.shared_bytes <= SHARED_MEMORY[self.target]


def compile_for(config: KernelConfig, target: int) -> Compiled:
    """Build ``config`` for NVIDIA compute capability ``target`` (75 for sm_75 …) with no GPU
    present. Raises what Triton's compiler raises for code a real build would reject. Needs
    Triton's real JIT: not under ``TRITON_INTERPRET=1``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset
    source = ASTSource(fn=config.fn, signature=config.signature, constexprs=config.constants)
    kernel = triton.compile(
        source,
        target=GPUTarget("cuda", target, 32),
        options={
            "num_warps": config.num_warps,
            "num_stages": config.num_stages,
            "enable_fp_fusion": config.enable_fp_fusion,
        },
    )
    return Compiled(
        config.name, target, int(kernel.metadata.shared), int(kernel.metadata.num_warps),
        len(kernel.asm["cubin"]),
    )  # fmt: skip


def fix_interpreter_bf16_dot() -> None:
    """Make Triton's interpreter multiply bf16 in ``tl.dot`` as a GPU does.

    The interpreter keeps bf16 values as their raw 16 bits and its ``tl.dot`` multiplies those
    bits (triton-lang/triton#11584: "the interpreter does not support bf16"). Converted to fp32
    first (exactly, as its casts already do), the products and their fp32 sum are what a bf16
    MMA with fp32 accumulation computes. Applied once where Triton interprets (the kernel
    package does on import); the compiled kernels are untouched."""
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "bf16_fixed", False):
        return
    plain = builder.create_dot

    def create_dot(self: Any, a: Any, b: Any, acc: Any, *args: Any) -> Any:
        if a.dtype.scalar == tl.bfloat16:
            a, b = self.cast_impl(a, tl.float32), self.cast_impl(b, tl.float32)
        return plain(self, a, b, acc, *args)

    create_dot.bf16_fixed = True  # type: ignore[attr-defined]
    builder.create_dot = create_dot


def fix_interpreter_scalar_index() -> None:
    """Let Triton's interpreter take a kernel's scalars as loop bounds under NumPy 2.4.

    The interpreter holds every scalar (an argument, a ``tl.program_id``, a loaded value) as a
    1-element array, and up to Triton 3.6 its ``range(start, end)`` converts a bound with
    ``int(array)``, which NumPy 2.4 refuses for arrays of one dimension ("only 0-dimensional
    arrays can be converted to Python scalars": triton-lang/triton#9171). Triton 3.9 squeezes
    the array first; this does the same on older ones. Applied once where Triton interprets
    (the kernel package does on import); the compiled kernels are untouched."""
    from triton.runtime import interpreter

    plain = interpreter._patch_lang_tensor
    if getattr(plain, "index_fixed", False):
        return

    def index(self: Any) -> int:
        return int(self.handle.data.squeeze())

    def patch_lang_tensor(tensor: Any, *scope: Any) -> None:
        plain(tensor, *scope)
        if scope:  # newer Triton: patched for the kernel's run, then restored
            scope[0].set_attr(tensor, "__index__", index)
        else:
            tensor.__index__ = index

    patch_lang_tensor.index_fixed = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_lang_tensor


@functools.cache
def sm_count(device: torch.device, interpreted: int) -> int:
    """The streaming multiprocessors of a CUDA ``device`` (asked once per device); elsewhere
    ``interpreted``, what a kernel's launch plan takes for the interpreter (which runs one
    program at a time): the one place our kernels read it."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return interpreted


def split_k(programs: int, units: int, sms: int, *, per_sm: int, min_units: int, most: int) -> int:
    """The ways a reduction of ``units`` (blocks of K, keys) is split so that ``programs``
    output programs become about ``per_sm`` programs per SM of ``sms``, no split over fewer
    than ``min_units``, at most ``most``; 1 where the outputs fill the GPU by themselves (or
    ``sms`` is 0). The one split-K heuristic of our kernels (decode attention's partitions of
    the keys, the quantized GEMMs' of K)."""
    wanted = -(-per_sm * sms // max(1, programs))
    return max(1, min(wanted, units // min_units, most))


#: The oldest architecture heads wider than 128 are built and run for: Turing computes in
#: fp16 only, where Gemma 3's activations overflow, and its 64 KiB of shared memory leaves a
#: 256-wide tile spilling (its compile alone takes half a minute)
WIDE_HEADS_FROM = 80


def head_target(head_dim: int, target: int) -> int:
    """The oldest architecture a kernel for heads ``head_dim`` wide is built for, where its
    dtype's is ``target``."""
    return max(target, WIDE_HEADS_FROM) if head_dim > 128 else target


def head_dims() -> str:
    """:data:`HEAD_DIMS` in words (``64, 128 or 256``)."""
    *most, last = map(str, HEAD_DIMS)
    return f"{', '.join(most)} or {last}" if most else last


def attention_chosen(device: torch.device, head_dim: int) -> tuple[bool, str]:
    """:func:`chosen`, for the attention of a model with heads ``head_dim`` wide: our
    attention kernels are built for :data:`HEAD_DIMS` only."""
    ours, why = chosen(device)
    if not ours or head_dim in HEAD_DIMS:
        return ours, why
    built = f"our attention kernels are built for heads {head_dims()} wide"
    if requested() == "triton":
        raise InfersightError(f"{ENV}=triton, but {built}, not {head_dim}; unset it")
    return False, f"torch kernels ({built}, this model's are {head_dim})"
