"""The one harness every load-time check of our kernels uses: how a kernel's output is
compared with its reference, and what a failure means.

* :func:`differs`: the largest absolute difference from the reference, relative to the
  reference's largest magnitude, against the check's tolerance (NaN fails); one line that
  says by how much where it differs. Each check states its tolerance beside its reference
  (the float64 products of the CPU kernels, the torch path of the Triton ones), by the dtype
  it computes in.
* :func:`guarded`: a check that raises fails, its kernel not used, the torch path in its
  place; except a CUDA error that poisons the process's context (:data:`STICKY`), after which
  no kernel runs on the device in this process, the torch path's neither: that is fatal, with
  what to do, never a quiet fallback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch import Tensor

from engine.errors import InfersightError

log = logging.getLogger(__name__)

#: What a CUDA error that poisons the process's context says (torch raises AcceleratorError,
#: a RuntimeError, for these): after one, no kernel runs on the device in this process.
STICKY = ("illegal memory access", "illegal instruction", "misaligned address",
          "unspecified launch failure", "device-side assert")  # fmt: skip


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
