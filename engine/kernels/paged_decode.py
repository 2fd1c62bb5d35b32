"""Attention that reads K/V through the block tables, with no padded copy: decode, and
prefill chunks (flash attention that skips what the causal mask and the window hide).

The portable decode path (:func:`engine.kernels.gather_attention.gather_attention`) gathers
every decoding sequence's keys and values into a padded ``[B, W, 2·Hkv, D]`` tensor, then runs
SDPA over it: each step writes a copy of every K/V it reads and reads it again. At batch 16 with
512-token contexts that copy is most of the attention's time. ``csrc/paged_decode.c`` reads
each key and value once, straight from the pool, for all the query heads that share it (GQA).

A prefill chunk's portable path gathers its sequence's keys, then runs SDPA with an explicit
``[L, T]`` mask repeated per query group: every score of the square is computed, half of them
to be masked away. ``infersight_paged_prefill`` (the same library) tiles the queries over the
keys with an online softmax and never reads a tile that no query of its tile can see.

It is C, built once per machine for this CPU (:mod:`engine.kernels.native`; off under
``INFERSIGHT_CPU_CAPABILITY=DEFAULT``) and called through ``ctypes``. Like every fast path it is
probed: the build, then one call checked against the portable path; a machine without a
compiler, or a failed check, runs the portable path, and :func:`status` says why.
``INFERSIGHT_ATTENTION`` picks by hand: ``paged`` (this kernel, an error if it is not
available) or ``gather``."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from engine.errors import InfersightError
from engine.formats import kv as kv_format
from engine.hardware import isolated
from engine.kernels import lowbit, native, verify

log = logging.getLogger(__name__)

SOURCE = native.CSRC / "paged_decode.c"
ENV = "INFERSIGHT_ATTENTION"
MODES = ("auto", "paged", "gather")
#: the compute dtypes the kernels take
DTYPES = (torch.float32, torch.bfloat16)
#: the pools they read (:mod:`engine.formats.kv`): a float pool of those dtypes, or int8 rows
POOL_DTYPES = (*DTYPES, torch.int8)


@dataclass(frozen=True, slots=True)
class Kernel:
    """The loaded kernel, or why there is none."""

    fn: Any  # the ctypes function, or None
    why: str
    prefill: Any = None  # the prefill entry of the same library

    @property
    def available(self) -> bool:
        return self.fn is not None


def requested() -> str:
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{ENV}={mode!r}: use one of {', '.join(MODES)}")
    return mode


@cache
def kernel() -> Kernel:
    """Build (once per machine), load and check the kernel. With ``INFERSIGHT_ATTENTION=
    paged`` a kernel that cannot run here is an error, not a fallback."""
    found = _kernel()
    if requested() == "paged" and not found.available:
        raise InfersightError(f"{ENV}=paged, but {found.why}; unset it to fall back")
    return found


def _kernel() -> Kernel:
    from engine.hardware.cpu_paths import FORCE_ENV, forced_level

    if requested() == "gather":
        return Kernel(None, f"gather + SDPA ({ENV}=gather)")
    if forced_level() == "DEFAULT":
        return Kernel(None, f"gather + SDPA (forced off by {FORCE_ENV}=DEFAULT)")
    path, why = native.built(SOURCE, native.isa_flags())
    if path is None:
        return Kernel(None, f"gather + SDPA (the paged kernel: {why})")
    # The first load and check run in a child process, once per build: C that crashes there
    # leaves this process running on the portable path.
    problem = isolated.verdict("paged decode kernel", PROBE, str(path))
    if problem:
        log.warning("the paged decode kernel failed its check (%s); not using it", problem)
        return Kernel(None, f"gather + SDPA (the paged kernel failed its check: {problem})")
    try:
        return _load(path)
    except OSError as exc:
        return Kernel(None, f"gather + SDPA (the paged kernel did not load: {exc})")


def _load(path: Path) -> Kernel:
    library = ctypes.CDLL(str(path))
    fn = library.infersight_paged_decode
    fn.restype = ctypes.c_int
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    f32 = ctypes.c_float
    fn.argtypes = [p, p, ctypes.c_int, p, p, p, p, i64, i64, i64, i64, i64, f32, f32,
                   ctypes.c_int, i64]  # fmt: skip
    prefill = library.infersight_paged_prefill
    prefill.restype = ctypes.c_int
    prefill.argtypes = [p, p, ctypes.c_int, p, p, p, i64, i64, i64, i64, i64, i64, f32, f32,
                        i64, i64, ctypes.c_int, i64]  # fmt: skip
    return Kernel(fn, "paged kernels (K/V read through the block tables)", prefill)


def _probe_build() -> str:
    """The first check (run in the child by :func:`_kernel`): the library this process would
    build loads, and agrees with the portable path; "" if so."""
    cc = native.compiler()
    if cc is None:
        return "no C compiler"
    try:
        found = _load(native.library_path(SOURCE, cc, native.isa_flags()))
    except OSError as exc:
        return f"it did not load: {exc}"
    return _check(found)


#: The check :func:`_kernel` runs in a child process (``module:function``; tests swap it).
PROBE = f"{__name__}:_probe_build"


#: The roundings to the dtype between the kernel and the portable path: both outputs', the
#: probabilities' (SDPA rounds them to V's dtype), and the scores' where SDPA takes torch's math
#: backend, which ``exp`` carries into the probabilities times the score's size (three here)
ROUNDINGS = 6


def _tolerance(dtype: torch.dtype, head_dim: int, keys: int) -> float:
    """The policy's bound (:func:`engine.kernels.verify.tolerance`) for attention over
    ``keys`` positions: a score sums ``head_dim`` products, an output ``keys`` values."""
    return verify.tolerance(dtype, head_dim + keys, roundings=ROUNDINGS)


def _check(k: Kernel) -> str:
    """One small call of each dtype against the portable path, within :func:`_tolerance`:
    '' if they agree."""
    from engine.kernels.gather_attention import gather_attention
    from engine.model.attention import capped_decode_attention

    gen = torch.Generator().manual_seed(0)
    # each compute dtype's float pool, and int8 rows read by fp32 queries
    for dtype, quantized in (
        (torch.float32, False),
        (torch.bfloat16, False),
        (torch.float32, True),
    ):
        pool = torch.randn(70, 6, 32, generator=gen).to(dtype)
        if quantized:  # int8 rows (a zero pad slot, as a pool has)
            pool = kv_format.quantize(pool, kv_format.INT8)
            pool[-1].view(torch.uint8).zero_()
        slots = torch.randint(0, 69, (3, 21), generator=gen)
        lens = torch.tensor([21, 5, 13])
        slots[1, 5:] = slots[2, 13:] = 69
        mask = torch.zeros(3, 21)
        mask[1, 5:] = mask[2, 13:] = float("-inf")
        mask[0, 2:7] = float("-inf")
        q = torch.randn(3, 6, 32, generator=gen).to(dtype)
        tolerance = _tolerance(dtype, 32, slots.shape[1])
        for cap in (0.0, CHECK_CAP):  # plain, and soft-capped scores (Gemma 2's)
            if cap:
                want = capped_decode_attention(
                    q, pool, slots, mask[:, None, None, :].to(dtype), cap
                )
            else:
                want = gather_attention(q, pool, slots, mask[:, None, None, :].to(dtype))
            got = _call(k, q, pool, slots, lens, mask, cap)
            what = f"{_name(pool)} {'soft-capped ' if cap else ''}decode"
            if why := verify.differs(what, got, want, tolerance):
                return why
        # a prefill chunk of 21 queries after 40 cached keys, under a window with a sink
        held = torch.cat([torch.arange(4), torch.arange(20, 61)])  # the window gave 4..19 back
        chunk = torch.randn(21, 6, 32, generator=gen).to(dtype)
        kept = slots.view(-1)[: held.numel()].contiguous()
        tolerance = _tolerance(dtype, 32, held.numel())
        for cap in (0.0, CHECK_CAP):
            want = prefill_reference(chunk, pool, kept, held, 40, 4, 24, cap)
            got = _call_prefill(k, chunk, pool, kept, held, 40, 4, 24, cap)
            what = f"{_name(pool)} {'soft-capped ' if cap else ''}prefill"
            if why := verify.differs(what, got, want, tolerance):
                return why
    return ""


#: the soft cap the check runs at: low enough that the scores of its random data reach it
CHECK_CAP = 1.5


def _name(pool: Tensor) -> str:
    """A pool's format as the check's messages name it."""
    return kv_format.of_pool(pool).name


#: off inside :func:`portable`, for side-by-side measurements
_SWITCH = native.Switch()
#: run the portable gather + SDPA path inside this block (``bench --attention``)
portable = _SWITCH.turned_off


# The kernel as a torch op, so that a compiled graph calls it as one opaque kernel (an eager
# step calls it directly, recorded under the op's name while ``bench --profile`` runs).
_LIB = torch.library.Library("infersight", "FRAGMENT")  # type: ignore[no-untyped-call]
_LIB.define(  # type: ignore[no-untyped-call]
    "paged_attention_kernel(Tensor q, Tensor pool, Tensor slots, Tensor lens, Tensor? mask) "
    "-> Tensor"
)


def _kernel_op(q: Tensor, pool: Tensor, slots: Tensor, lens: Tensor, mask: Tensor | None) -> Tensor:
    return _call(kernel(), q, pool, slots, lens, mask)


_LIB.impl("paged_attention_kernel", _kernel_op, "CPU")  # type: ignore[no-untyped-call]


@torch.library.register_fake("infersight::paged_attention_kernel", lib=_LIB)  # type: ignore[untyped-decorator]
def _(q: Tensor, pool: Tensor, slots: Tensor, lens: Tensor, mask: Tensor | None) -> Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


def usable(q: Tensor, pool: Tensor) -> bool:
    return (
        not _SWITCH.off
        and q.device.type == "cpu"
        and pool.dtype in POOL_DTYPES
        and kernel().available
    )


def pool_format(pool: Tensor) -> int:
    """The code of ``pool``'s format for the C kernels (``csrc/kv_rows.h``: fp32 0, bf16 1,
    int8 rows 2)."""
    return {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}[pool.dtype]


def paged_attention(
    q: Tensor, pool: Tensor, slots: Tensor, lens: Tensor, mask: Tensor | None,
    softcap: float = 0.0,
) -> Tensor:  # fmt: skip
    """``q: [B, H, D]`` over the keys in the first ``lens[b]`` columns of ``slots[b]``
    (``mask``: additive, ``[B, W]`` or ``[B, 1, 1, W]``, or None), each score soft-capped to
    ``softcap·tanh(s / softcap)`` where ``softcap > 0``. Returns ``[B, H·D]`` in ``q``'s
    dtype. Call where :func:`usable` said yes. An eager step calls the kernel directly (the
    torch op's dispatch costs about what the call of a small step does), recorded under the
    op's name while ``bench --profile`` runs; a compiled graph (no cap) calls the op."""
    if torch.compiler.is_compiling() and not softcap:
        return torch.ops.infersight.paged_attention_kernel(q, pool, slots, lens, mask)
    return native.call(
        "infersight::paged_attention_kernel", _call, kernel(), q, pool, slots, lens, mask,
        softcap,
    )  # fmt: skip


def _call(
    k: Kernel, q: Tensor, pool: Tensor, slots: Tensor, lens: Tensor, mask: Tensor | None,
    softcap: float = 0.0,
) -> Tensor:  # fmt: skip
    assert k.fn is not None
    # raw pointers cross into C: the layouts it assumes are checked here, the block tables'
    # contents in C (returns -2), one pass over B×W integers, small beside reading K and V
    if slots.dtype != torch.long or lens.dtype != torch.long or not pool.is_contiguous():
        raise ValueError("paged attention needs int64 slots and lens and a contiguous pool")
    if q.dim() != 3 or pool.dim() != 3 or slots.dim() != 2:
        raise ValueError("paged attention needs q [B, H, D], a pool [S, 2·Hkv, D], slots [B, W]")
    b, heads, dim = q.shape
    kv_heads = pool.shape[1] // 2
    row = dim + 4 if pool.dtype == torch.int8 else dim  # an int8 row carries its scale
    if (kv_heads == 0 or pool.shape[1] % 2 or heads % kv_heads or pool.shape[2] != row
            or slots.shape[0] != b or lens.shape != (b,)
            or (mask is not None and mask.numel() != b * slots.shape[1])):  # fmt: skip
        raise ValueError(
            f"paged attention: shapes do not fit (q {tuple(q.shape)}, pool {tuple(pool.shape)}, "
            f"slots {tuple(slots.shape)}, lens {tuple(lens.shape)})"
        )
    # (an eager step calls this directly: no operator where nothing needs converting)
    qf = q if q.dtype == torch.float32 and q.is_contiguous() else q.float().contiguous()
    out = torch.empty_like(qf)
    slots = slots if slots.is_contiguous() else slots.contiguous()
    lens = lens if lens.is_contiguous() else lens.contiguous()
    m = None if mask is None else mask.reshape(b, -1).float().contiguous()
    rc = k.fn(
        qf.data_ptr(), pool.data_ptr(), pool_format(pool), slots.data_ptr(),
        lens.data_ptr(), None if m is None else m.data_ptr(), out.data_ptr(), b,
        slots.shape[1], heads, kv_heads, dim, dim**-0.5, softcap, torch.get_num_threads(),
        pool.shape[0],
    )  # fmt: skip
    if rc == -2:
        raise ValueError(f"paged attention: a length outside [0, {slots.shape[1]}] or a slot "
                         f"outside the pool's {pool.shape[0]}")  # fmt: skip
    if rc != 0:
        raise MemoryError("the paged decode kernel ran out of memory for its scratch space")
    out = out.view(b, heads * dim)
    return out if q.dtype == torch.float32 else out.to(q.dtype)


# The prefill kernel as a torch op too, for the same reasons.
_LIB.define(  # type: ignore[no-untyped-call]
    "paged_prefill_kernel(Tensor q, Tensor pool, Tensor slots, Tensor positions, int start, "
    "int sink, int window, float softcap=0.) -> Tensor"
)


def _prefill_op(
    q: Tensor, pool: Tensor, slots: Tensor, positions: Tensor, start: int, sink: int,
    window: int, softcap: float = 0.0,
) -> Tensor:  # fmt: skip
    return _call_prefill(kernel(), q, pool, slots, positions, start, sink, window, softcap)


_LIB.impl("paged_prefill_kernel", _prefill_op, "CPU")  # type: ignore[no-untyped-call]


@torch.library.register_fake("infersight::paged_prefill_kernel", lib=_LIB)  # type: ignore[untyped-decorator]
def _(
    q: Tensor, pool: Tensor, slots: Tensor, positions: Tensor, start: int, sink: int,
    window: int, softcap: float = 0.0,
) -> Tensor:  # fmt: skip
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


def reads_pool(pool: Tensor) -> bool:
    """Whether the kernels attend over ``pool`` (prefill chunks, and the C decode step's
    decode: :mod:`engine.executor.c_step`): a CPU pool of a dtype they read."""
    return (
        not _SWITCH.off
        and pool.device.type == "cpu"
        and pool.dtype in POOL_DTYPES
        and kernel().available
    )


def paged_prefill(
    q: Tensor, pool: Tensor, slots: Tensor, positions: Tensor, start: int, sink: int,
    window: int, softcap: float = 0.0,
) -> Tensor:  # fmt: skip
    """One sequence's chunk ``q: [L, H, D]`` at positions ``start …`` over the keys in
    ``slots`` (positions ``positions``, ascending); a key is seen by query ``p`` when its
    position is ``<= p`` and, with ``window > 0``, ``> p - window`` or ``< sink``; scores
    soft-capped where ``softcap > 0``. Returns ``[L, H·D]`` in ``q``'s dtype. Call where
    :func:`reads_pool` said yes."""
    if torch.compiler.is_compiling():
        return torch.ops.infersight.paged_prefill_kernel(
            q, pool, slots, positions, start, sink, window, softcap
        )
    return native.call(
        "infersight::paged_prefill_kernel", _call_prefill, kernel(), q, pool, slots, positions,
        start, sink, window, softcap,
    )  # fmt: skip


def prefill_reference(
    q: Tensor, pool: Tensor, slots: Tensor, positions: Tensor, start: int, sink: int,
    window: int, softcap: float = 0.0,
) -> Tensor:  # fmt: skip
    """What :func:`paged_prefill` computes, the portable way: gather, mask, SDPA (the
    textbook computation where scores are soft-capped)."""
    from engine.model.attention import capped_attention, grouped_attention

    kv_heads = pool.shape[1] // 2
    rows = kv_format.gather(pool, slots, q.dtype).transpose(0, 1)
    queries = torch.arange(start, start + q.shape[0])
    mask = positions[None, :] <= queries[:, None]
    if window > 0:
        mask &= (positions[None, :] > queries[:, None] - window) | (positions[None, :] < sink)
    if softcap:
        return capped_attention(q, rows[:kv_heads], rows[kv_heads:], mask, softcap)
    return grouped_attention(q, rows[:kv_heads], rows[kv_heads:], mask)


def _call_prefill(
    k: Kernel,
    q: Tensor,
    pool: Tensor,
    slots: Tensor,
    positions: Tensor,
    start: int,
    sink: int,
    window: int,
    softcap: float = 0.0,
) -> Tensor:
    assert k.prefill is not None
    if slots.dtype != torch.long or positions.dtype != torch.long or not pool.is_contiguous():
        raise ValueError("paged prefill needs int64 slots and positions and a contiguous pool")
    if q.dim() != 3 or pool.dim() != 3:
        raise ValueError("paged prefill needs q [L, H, D] and a pool [S, 2·Hkv, D]")
    length, heads, dim = q.shape
    kv_heads = pool.shape[1] // 2
    row = dim + 4 if pool.dtype == torch.int8 else dim
    if (kv_heads == 0 or pool.shape[1] % 2 or heads % kv_heads or pool.shape[2] != row
            or positions.numel() != slots.numel() or slots.numel() == 0):  # fmt: skip
        raise ValueError(
            f"paged prefill: shapes do not fit (q {tuple(q.shape)}, pool {tuple(pool.shape)}, "
            f"slots {tuple(slots.shape)}, positions {tuple(positions.shape)})"
        )
    qf = q.float().contiguous()
    out = torch.empty_like(qf)
    slots, positions = slots.contiguous(), positions.contiguous()
    # bit 0: a bf16 pool; bit 1: queries of bf16 values too, so Q.K may take bf16 dot
    # products; bit 2: an int8 pool (rows dequantized as each tile is copied)
    formats = (
        int(pool.dtype == torch.bfloat16)
        | int(q.dtype == torch.bfloat16) << 1
        | int(pool.dtype == torch.int8) << 2
    )
    rc = k.prefill(
        qf.data_ptr(), pool.data_ptr(), formats, slots.data_ptr(),
        positions.data_ptr(), out.data_ptr(), length, slots.numel(), start, heads,
        pool.shape[1] // 2, dim, dim**-0.5, softcap, sink, window, torch.get_num_threads(),
        pool.shape[0],
    )  # fmt: skip
    if rc == -2:
        raise ValueError(f"paged prefill: a slot outside the pool's {pool.shape[0]}")
    if rc != 0:
        raise MemoryError("the paged prefill kernel ran out of memory for its copy of K/V")
    return out.view(length, heads * dim).to(q.dtype)


def status() -> str:
    """One line for the load report: which decode attention runs and why."""
    return kernel().why


# -- prefill: the kernel, or torch's flash attention, whichever measured faster here -----------

#: the chunk the choice is timed on: a 512-token prompt's, over its own keys
CHOICE_TOKENS = 512


def prefill_faster(dtype: torch.dtype, heads: int, kv_heads: int, dim: int) -> bool:
    """Whether prefill chunks of this dtype and shape take the paged prefill kernel rather
    than the portable path (gather, mask, SDPA: torch's flash attention, which on a CPU with
    AMX computes its tiles there, as our kernel does not): measured once per machine, build
    and thread count on a :data:`CHOICE_TOKENS`-token chunk (:func:`time_prefill`) and kept
    in ``kernels.json``; always where ``INFERSIGHT_ATTENTION=paged``."""
    return prefill_choice(dtype, heads, kv_heads, dim)[0]


def prefill_choice(dtype: torch.dtype, heads: int, kv_heads: int, dim: int) -> tuple[bool, str]:
    """:func:`prefill_faster`, and the load report's line on it."""
    if not kernel().available:
        return False, "prefill attention: gather + SDPA"
    if requested() == "paged":
        return True, f"prefill attention: the paged kernel ({ENV}=paged)"
    if _measured_faster(dtype, heads, kv_heads, dim):
        return True, "prefill attention: the paged kernel (measured faster here than SDPA)"
    return False, "prefill attention: gather + SDPA (measured faster here than the paged kernel)"


@cache
def _measured_faster(dtype: torch.dtype, heads: int, kv_heads: int, dim: int) -> bool:
    name = str(dtype).removeprefix("torch.")
    key = f"prefill attention {name} {heads}/{kv_heads}x{dim} {CHOICE_TOKENS} tokens"
    build = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    return lowbit.faster(
        f"paged prefill kernel {build}, torch {torch.__version__}", key,
        lambda: time_prefill(dtype, heads, kv_heads, dim),
    )  # fmt: skip


def time_prefill(dtype: torch.dtype, heads: int, kv_heads: int, dim: int) -> lowbit.Timing:
    """The paged prefill kernel against gather + SDPA on one :data:`CHOICE_TOKENS`-token
    chunk over a pool of random keys (ms per chunk, best of three interleaved rounds)."""
    from engine.hardware import measured

    gen = torch.Generator().manual_seed(0)
    n = CHOICE_TOKENS
    pool = torch.randn(n + 1, 2 * kv_heads, dim, generator=gen).to(dtype)
    q = torch.randn(n, heads, dim, generator=gen).to(dtype)
    slots = torch.randperm(n, generator=gen)
    positions = torch.arange(n)
    ours_ms, theirs_ms = measured.best_of_three(
        [
            lambda: _call_prefill(kernel(), q, pool, slots, positions, 0, 0, 0),
            lambda: prefill_reference(q, pool, slots, positions, 0, 0, 0),
        ],
        1,
    )
    return lowbit.Timing(ours_ms=ours_ms, torch_ms=theirs_ms)
