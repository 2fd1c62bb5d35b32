"""The one harness of our kernels' load-time checks (engine/kernels/verify.py): a difference
over the tolerance fails and says by how much, NaN fails, and a check that crashes the GPU's
context is fatal where any other error is a fallback to the torch path."""

from __future__ import annotations

import pytest
import torch

from engine.errors import InfersightError
from engine.kernels import verify

pytestmark = pytest.mark.no_engine_paths


def test_the_check_harness_fails_a_difference_over_its_tolerance_and_nan():
    want = torch.tensor([[2.0, -4.0]])
    assert verify.differs("k", want + 3e-4, want, 1e-4) == ""  # within 1e-4 of |4|
    assert "differs from its reference by 0.001" in verify.differs("k", want + 1e-3, want, 1e-4)
    assert verify.differs("k", torch.tensor([[float("nan"), 0.0]]), want, 1.0) != ""


def test_a_sticky_cuda_error_in_a_check_is_fatal_and_another_error_a_fallback():
    def sticky() -> str:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def broken() -> str:
        raise ValueError("no such tile")

    with pytest.raises(InfersightError, match=r"unusable in this process.*set X, and report"):
        verify.guarded("decode", sticky, what_to_do="set X")
    assert verify.guarded("decode", broken, what_to_do="set X") == (
        "our decode kernel failed its check: ValueError: no such tile"
    )
