"""Each of our Triton kernels is checked against its torch path before a load uses it
(engine/kernels/triton_check.py): a kernel that is wrong here is not used, and the load says
why (Triton's interpreter on these CPUs)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engine.errors import InfersightError
from engine.kernels import triton_check, triton_support
from engine.kernels.triton_kernels import decode_attention, quant_gemm
from engine.loader.load import load_model
from engine.quant.int8 import Int8Linear
from tests.conftest import WIDE_HEADS

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    """Verdicts are kept per device and dtype: each test starts without them."""
    caches = (triton_check._attention, triton_check._gemms, triton_check._fused)
    for cache in caches:
        cache.cache_clear()
    yield
    for cache in caches:
        cache.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_pass_their_check(dtype):
    assert triton_check.attention(CPU, dtype, 64, 9, 3) == ""
    assert triton_check.attention(CPU, dtype, 128, 4, 4) == ""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_norm_and_rope_pass_their_check(dtype):
    assert triton_check.fused(CPU, dtype, 576, 9, 3, 64) == ""  # SmolLM2's shapes
    assert triton_check.fused(CPU, dtype, 4096, 32, 8, 128) == ""  # Llama-3-8B's


def test_the_gemms_pass_their_check():
    assert triton_check.gemms(CPU, torch.bfloat16) == ""
    assert triton_check.gemms(CPU, torch.float16) == ""


def test_a_wrong_kernel_is_not_used_and_the_load_says_why(tiny_model_dir, monkeypatch):
    real = decode_attention.paged_decode_attention
    monkeypatch.setattr(
        decode_attention, "paged_decode_attention", lambda *a, **k: real(*a, **k) * 1.01
    )
    assert "decode attention kernel differs" in triton_check.attention(CPU, torch.float32, 64, 4, 2)
    triton_check._attention.cache_clear()
    folder, _ = tiny_model_dir("llama", False, **WIDE_HEADS)
    # auto, as on a GPU where ours would run: the torch path instead, and the reason
    monkeypatch.setattr(triton_support, "attention_chosen", lambda d, h: (True, "Triton kernels"))
    engine = load_model(folder)
    assert not engine.triton and "decode attention kernel differs" in engine.kernels
    monkeypatch.setenv("INFERSIGHT_KERNELS", "triton")  # asked for by hand: an error
    with pytest.raises(InfersightError, match="decode attention kernel differs"):
        load_model(folder)


def test_a_wrong_gemm_is_not_used_and_the_load_report_names_it(tiny_model_dir, monkeypatch):
    """Our GEMMs failing their check leave the quantized layers to torch: the load report
    says so, and ``engine.kernel_failures`` lists it (gpu-check fails on it)."""
    real = quant_gemm.int8_linear
    monkeypatch.setattr(quant_gemm, "int8_linear", lambda *a, **k: real(*a, **k) * 1.1)
    folder, _ = tiny_model_dir("llama", False, **WIDE_HEADS)
    # auto, as on a GPU where ours would run
    monkeypatch.setattr(triton_support, "chosen", lambda device: (True, "Triton kernels"))
    engine = load_model(folder, precision="int8")
    assert engine.triton  # the attention passed its check: ours attend
    layers = [m for m in engine.model.modules() if isinstance(m, Int8Linear)]
    assert layers and all(layer.triton is None for layer in layers)
    assert len(engine.kernel_failures) == 1
    assert engine.kernel_failures[0].startswith("our INT8 GEMM kernel differs from the torch path")
    assert f"quantized GEMMs in torch ({engine.kernel_failures[0]})" in engine.kernels


def test_a_gemm_that_raises_is_not_used(monkeypatch):
    def broken(*args: object, **kwargs: object) -> torch.Tensor:
        raise ValueError("out of resource: shared memory, Required: 232448")

    monkeypatch.setattr(quant_gemm, "int4_linear", broken)
    why = triton_check.gemms(CPU, torch.bfloat16)
    assert why.startswith("our INT4 GEMM kernel failed its check: ValueError: out of resource")


def test_a_kernel_that_crashes_the_gpu_is_an_error_not_a_fallback(monkeypatch):
    """After an illegal memory access the CUDA context is lost: no torch path can run in the
    process, so the load stops and says how to start without our kernels."""

    def crashed(*args: object, **kwargs: object) -> torch.Tensor:
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(quant_gemm, "int4_linear", crashed)
    triton_check._gemms.cache_clear()
    with pytest.raises(InfersightError, match=r"crashed the GPU.*INFERSIGHT_KERNELS=torch"):
        triton_check.gemms(CPU, torch.bfloat16)
