"""Our C kernels' entry points under hypothesis (checks/kernel_fuzz.py, briefly; ``make asan``
runs it at length with the kernels under AddressSanitizer): each case matches the torch
reference or raises a Python error. And what the fuzzing found, kept: a weight one short of
the row read one float past it, a non-contiguous INT8 weight was read as if contiguous, a slot
past the pool or a length past the table was read through."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings

from checks import kernel_fuzz
from engine.kernels import gemv, layer_ops, paged_decode
from engine.model import transformer

BRIEF = settings(max_examples=40, deadline=None, derandomize=True,
                 suppress_health_check=list(HealthCheck))  # fmt: skip


@pytest.mark.parametrize("name", list(kernel_fuzz.FUZZERS))
def test_each_case_matches_the_reference_or_raises(name):
    kernel_fuzz.COUNTS.clear()
    BRIEF(kernel_fuzz.FUZZERS[name])()
    assert sum(n for (_, result), n in kernel_fuzz.COUNTS.items() if result == "matched") > 0


def test_a_norm_weight_that_does_not_fit_the_row_is_not_read_past():
    lib = layer_ops.library()
    if not lib.available:
        pytest.skip(lib.why)
    ops = layer_ops.c_ops(lib)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError):  # torch's own refusal: the C kernel is not called
        ops.rms_norm(x, torch.randn(63), 1e-6)
    got = ops.rms_norm(x, torch.randn(64).t(), 1e-6)
    assert got.shape == x.shape


def test_gemv_refuses_weights_it_would_misread():
    lib = gemv.library()
    if not lib.available:
        pytest.skip(lib.why)
    w = torch.randint(-127, 127, (8, 8), dtype=torch.int8)
    x, scales = torch.randn(1, 8), torch.rand(8)
    with pytest.raises(ValueError, match="contiguous"):
        gemv.product(lib, x, w.t(), scales, torch.float32)
    with pytest.raises(ValueError, match="8 contiguous float32 scales"):
        gemv.product(lib, x, w, scales[:7], torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        gemv.product(lib, torch.randn(1, 9), w, scales, torch.float32)
    want = x @ (w.float() * scales[:, None]).t()
    assert torch.allclose(gemv.product(lib, x, w, scales, torch.float32), want, atol=1e-4)


@pytest.mark.parametrize(("slot", "length"), [(40, 3), (-1, 3), (0, 4)])
def test_paged_attention_refuses_a_slot_past_the_pool_or_a_length_past_the_table(slot, length):
    kernel = paged_decode.kernel()
    if not kernel.available:
        pytest.skip(kernel.why)
    pool, q = torch.randn(40, 2, 16), torch.randn(1, 2, 16)
    slots = torch.tensor([[0, 1, slot]])
    with pytest.raises(ValueError, match="outside"):
        paged_decode._call(kernel, q, pool, slots, torch.tensor([length]), None)
    if not 0 <= slot < 40:  # the prefill reads every slot it is given
        with pytest.raises(ValueError, match="outside"):
            paged_decode._call_prefill(kernel, q.expand(3, 2, 16), pool, slots.view(-1),
                                       torch.arange(3), 0, 0, 0)  # fmt: skip


def test_the_reference_norm_is_torchs():  # the oracle the fuzzing compares with
    x, w = torch.randn(3, 16), torch.randn(16)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    assert torch.allclose(transformer.rms_norm(x, w, 1e-6), want, atol=1e-6)
