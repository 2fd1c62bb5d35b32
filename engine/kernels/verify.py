"""The one harness every load-time check of our kernels uses: how far a kernel's output may
be from its reference, how it is compared, and what a failure means.

* :func:`tolerance`: the one policy, the largest error a check allows relative to the
  reference's largest magnitude, from the unit roundoff of the dtype the result is rounded to
  and of the accumulation, growing with the length of the reduction behind a result. Each
  check asks it with its own dtype, reduction length and roundings, never a constant of its
  own; the two that keep a floor of their own (the Triton kernels' fp32, the whole model's
  fp32 logits) say why beside it.
* :func:`differs`: the largest absolute difference from the reference, relative to the
  reference's largest magnitude, against the tolerance (NaN fails); one line that says by
  how much where it differs.
* :func:`quantized`: int8 values with per-row scales against the reference's quantization:
  scales within the tolerance, a value one step off only where the reference sits within a
  rounding of the tie between the two steps.
* :func:`guarded`: a check that raises fails, its kernel not used, the torch path in its
  place; except a CUDA error that poisons the process's context (:data:`STICKY`), after which
  no kernel runs on the device in this process, the torch path's neither: that is fatal, with
  what to do, never a quiet fallback.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
from torch import Tensor

from engine.errors import InfersightError

log = logging.getLogger(__name__)

#: What a CUDA error that poisons the process's context says (torch raises AcceleratorError,
#: a RuntimeError, for these): after one, no kernel runs on the device in this process.
STICKY = ("illegal memory access", "illegal instruction", "misaligned address",
          "unspecified launch failure", "device-side assert")  # fmt: skip

#: The unit roundoff of each dtype a result is rounded to, ``u = 2^-p`` for ``p``
#: significant bits: a correctly rounded value is within ``u`` of the exact one, relatively.
UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.float16: 2.0**-11,
                 torch.bfloat16: 2.0**-8}  # fmt: skip
#: How many ``√K·u`` of the accumulation a reduction of length K may move a result
#: (:func:`tolerance`)
SPREAD = 32
#: The finest any check resolves, relative to the reference's largest magnitude
#: (:func:`tolerance`)
FINEST = 2.0**-16


def tolerance(
    dtype: torch.dtype, reduction: int, *, roundings: int = 2,
    accumulate: torch.dtype = torch.float32, finest: float = FINEST,
) -> float:  # fmt: skip
    """The largest error a result rounded to ``dtype``, behind which lies a sum of
    ``reduction`` (K) terms in ``accumulate``, may have against its reference, relative to
    the reference's largest magnitude::

        max(finest, roundings · u(dtype) + SPREAD · √K · u(accumulate))

    * ``roundings · u(dtype)``: a value rounded to ``dtype`` is within ``u`` of its exact
      value, relatively; each rounding to it that the kernel and the reference make apart
      may fall on the other side, moving a result by ``u`` of its size, at most ``u`` of the
      largest. Two at least (the kernel's output and the reference's); a check counts those
      between (probabilities rounded to V's dtype, a normalised value before its weight).
    * ``SPREAD · √K · u(accumulate)``: a sum of K terms rounded at each addition errs, in any
      order (in sequence, in blocks, a vector's lanes in a tree), as a random walk does: by
      ``√K·u`` of its terms' size, not the worst case's ``K·u``, which real sums never near
      (Higham and Mary, "A new approach to probabilistic rounding error analysis", 2019:
      ``λ·√K·u``, exceeded with probability under ``2·exp(−λ²/2)``). :data:`SPREAD` = 32
      holds λ ≈ 6 (one in thirty million), the partial sums' size against the result's,
      and both sides' orders differing from the exact sum. On the CPU kernels here the
      checks measure 0.1–0.7 ``√K·u`` (1–6 fp32 ulps): 50 to 300 times under it, and no
      tighter than the 1e-5 their constants allowed at their shortest K (40).
    * ``finest`` (:data:`FINEST` = 2⁻¹⁶ ≈ 1.5e-5): no check resolves finer. That is 256
      fp32 ulps, a thirty-second of an fp16 rounding; below it an fp32 check measures only
      the order of a machine's sums and its ``exp`` (Cephes's against libm's), never a
      wrong kernel. It binds only fp32 results of short reductions.

    A wrong row, a scale off by 1 %, a dropped or swapped group moves results by a whole
    fraction of the largest: over every fp32 (≤ 2.5e-4 at the Ks checked) and fp16 bound
    (≤ 2.2e-3). bf16 rounds by 0.4 %: two roundings (0.8 %) still refuse a 1 % scale, four
    or more (the Triton kernels', the paged kernel's, the logits') do not."""
    if reduction < 1 or roundings < 0:
        raise ValueError(f"a reduction of {reduction} terms, {roundings} roundings")
    unit = UNIT_ROUNDOFF[dtype]
    sums = SPREAD * math.sqrt(reduction) * UNIT_ROUNDOFF[accumulate]
    return max(finest, roundings * unit + sums)


def differs(
    name: str, got: Tensor, want: Tensor, tolerance: float, reference: str = "its reference"
) -> str:
    """Why ``got`` is not ``want`` (``reference``) within ``tolerance`` of ``want``'s largest
    magnitude ("" where it is), compared in float64."""
    err = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    scale = (want.double().abs().max().item() if want.numel() else 0.0) or 1.0
    if not err <= tolerance * scale:  # NaN fails too
        shape = "×".join(map(str, got.shape))
        bound = tolerance * scale
        return f"{name} differs from {reference} by {err:.3g} (over {bound:.3g}; [{shape}])"
    return ""


def quantized(
    name: str, got: tuple[Tensor, Tensor], want: tuple[Tensor, Tensor], values: Tensor,
    tolerance: float, reference: str = "its reference",
) -> str:  # fmt: skip
    """Why ``got``, int8 ``q [M, K]`` and ``scale [M, 1]``, is not ``want``, the reference's
    quantization of ``values [M, K]`` (``q = round(values / scale)``, clamped), within
    ``tolerance`` of each row's largest magnitude ("" where it is): every scale within
    ``tolerance`` of the reference's, relatively, and every value the reference's, or one
    step off where the reference's quotient lies within a rounding of the tie between the two
    steps. Values and a scale each within ``tolerance`` move a quotient ``t`` by at most
    ``tolerance · (max|row| / scale + |t|)``: a step off further from a tie is a wrong value,
    not a rounding."""
    (q, scale), (want_q, want_scale) = got, want
    if q.shape != want_q.shape or scale.shape != want_scale.shape:
        return f"{name} gives {tuple(q.shape)} values, {reference} {tuple(want_q.shape)}"
    s, ws = scale.double(), want_scale.double()
    # equal scales are no difference, zeros (a row of zeros) included
    gap = torch.where(s == ws, 0.0, (s - ws).abs() / ws.abs())
    apart = gap.max().item() if ws.numel() else 0.0
    if not apart <= tolerance:  # NaN fails too
        return (
            f"{name}'s scales differ from {reference}'s by {apart:.3g} of theirs "
            f"(over {tolerance:.3g})"
        )
    steps = (q.int() - want_q.int()).abs()
    most = int(steps.max()) if steps.numel() else 0
    if most > 1:
        return f"{name}'s int8 values differ from {reference}'s by up to {most} steps"
    quotient = values.double() / ws
    reach = tolerance * (values.double().abs().amax(dim=-1, keepdim=True) / ws + quotient.abs())
    off = (quotient - (q.double() + want_q.double()) / 2).abs()  # from the tie between them
    far = (steps > 0) & ~(off <= reach)
    if far.any():
        first = far.nonzero()[0].tolist()
        return (
            f"{name}'s int8 values are a step from {reference}'s {int(far.sum())} times away "
            f"from a tie (at {first}: {off[tuple(first)].item():.3g} of a step from it, over "
            f"{reach[tuple(first)].item():.3g})"
        )
    return ""


def guarded(name: str, check: Callable[[], str], *, what_to_do: str) -> str:
    """``check()``'s verdict ("" where the kernel passed); a check that raises is a failure
    (logged), a sticky CUDA error an :class:`~engine.errors.InfersightError` saying
    ``what_to_do``."""
    try:
        why = check()
    except Exception as exc:  # a kernel that raises here is not used
        text = str(exc).splitlines()[0] if str(exc) else ""
        if any(s in text for s in STICKY):  # the torch path cannot run after it either
            raise InfersightError(
                f"our {name} kernel crashed the GPU in its check ({type(exc).__name__}: "
                f"{text}); the device is unusable in this process, so the torch path cannot "
                f"take over: {what_to_do}, and report this"
            ) from exc
        why = f"our {name} kernel failed its check: {type(exc).__name__}: {text}"
    if why:
        log.warning("%s; the torch path runs instead", why)
    return why
