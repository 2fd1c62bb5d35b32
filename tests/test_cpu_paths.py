"""Every CPU path on every machine: the probe's answer is forced with the one switch
(``INFERSIGHT_CPU_CAPABILITY``), each precision then runs the path the probe chose, and its
logits equal the reference for that precision."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch

from engine.core.engine import LLMEngine
from engine.errors import InvalidRequestError
from engine.hardware.cpu_paths import FORCE_ENV, CpuPaths, cpu_paths, native_level
from engine.kernels import paged_decode
from engine.kernels.packed_linear import PackedLinear
from engine.loader.load import load_model
from tests.probed import cpu_flags
from tests.test_quant import _dequantized_reference, _relative_error

LEVELS = [None, "AVX2", "DEFAULT"]  # None: what this CPU really has


@pytest.fixture(params=LEVELS, ids=lambda level: level or "native")
def paths(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[CpuPaths]:
    if request.param is None:
        monkeypatch.delenv(FORCE_ENV, raising=False)
    else:
        monkeypatch.setenv(FORCE_ENV, request.param)
    cpu_paths.cache_clear()
    paged_decode.kernel.cache_clear()  # the decode attention kernel follows the level too
    yield cpu_paths()
    cpu_paths.cache_clear()  # the next test probes under its own environment
    paged_decode.kernel.cache_clear()


def test_the_switch_only_lowers_what_the_cpu_has(paths: CpuPaths) -> None:
    assert paths.capability == torch.backends.cpu.get_cpu_capability()
    if paths.forced == "DEFAULT":
        for probe in (paths.packed_fp32, paths.packed_bf16, paths.int8_kernel, paths.int4_kernel):
            assert not probe.ok and FORCE_ENV in probe.why
    if paths.forced in ("AVX2", "DEFAULT"):
        assert not paths.packed_bf16.ok  # an AVX2-only CPU cannot repack bf16 for oneDNN
    if paths.forced is None and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert not paths.packed_bf16.ok and "avx512" in paths.packed_bf16.why
    assert paths.summary().startswith(f"CPU {paths.capability}")


def test_the_probes_find_what_the_cpu_says_it_has(paths: CpuPaths) -> None:
    """An anchor for every test that takes its expectation from the probes: were a probe to
    fail everywhere, those would pass on the fallbacks. What each path needs is read here from
    the CPU's own flags, apart from the probes, at the level this process is held to."""
    flags = cpu_flags()
    if "avx2" not in flags or not torch.backends.mkldnn.is_available():
        pytest.skip("the expectations below are for x86 CPUs with AVX2 and a oneDNN build")
    level = paths.forced or native_level()
    avx2_up = level in ("AVX2", "AVX512")
    # oneDNN repacks bf16 with AVX-512 BW/VL/DQ, or with AVX-NE-CONVERT
    bf16 = {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags
    expected = {
        "packed_fp32": avx2_up,
        "packed_bf16": bf16 and (paths.forced is None or level == "AVX512"),
        "int8_kernel": avx2_up,
        "int4_kernel": avx2_up,
    }
    found = {name: getattr(paths, name).ok for name in expected}
    assert found == expected, {name: getattr(paths, name).why for name in expected}


def _packed_dtypes(engine: LLMEngine) -> set[torch.dtype]:
    return {m.dtype for m in engine.model.modules() if isinstance(m, PackedLinear)}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_float_precisions_take_the_probed_path_and_match_transformers(
    paths: CpuPaths, tiny_model_dir, precision: str
) -> None:
    folder, hf = tiny_model_dir("qwen2", False)
    engine = load_model(folder, precision=precision)
    dtype = engine.dtype
    assert (dtype in _packed_dtypes(engine)) == paths.packed(dtype).ok
    forms = {g.form for g in engine.weight_groups if g.kind in ("attention", "mlp")}
    forms = {f for f in forms if "(" in f}  # the linears' weights, not Qwen2's biases
    path = "oneDNN-packed" if paths.packed(dtype).ok else "nn.Linear"
    assert forms == {f"{precision} ({path})"}
    ids = list(range(3, 40))
    ours = engine.runner.forward_logits(ids, engine.runner.new_cache(len(ids)), 0).float()
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0].float()
    limit = 1e-5 if precision == "fp32" else 2e-2
    assert _relative_error(ours, theirs) <= limit


@pytest.mark.parametrize("precision", ["int8", "int4-g32", "int8+head"])
def test_quantized_precisions_take_the_probed_path_or_are_refused_by_name(
    paths: CpuPaths, tiny_model_dir, precision: str
) -> None:
    folder, _ = tiny_model_dir("llama", True)
    probe = paths.int8_kernel if precision.startswith("int8") else paths.int4_kernel
    if precision.startswith("int4") and not probe.ok:
        with pytest.raises(InvalidRequestError, match="int4-g32 cannot run on this CPU"):
            load_model(folder, precision=precision)
        return
    engine = load_model(folder, precision=precision)
    kernel = {
        "int8": "int8 kernel" if probe.ok else "int8 converted per call",
        "int4-g32": "int4 kernel",
        "int8+head": "int8 kernel" if probe.ok else "int8 converted per call",
    }[precision]
    forms = {g.form.split(",")[0] for g in engine.weight_groups if g.kind in ("attention", "mlp")}
    assert forms == {f"{precision.removesuffix('+head')} ({kernel})"}  # ", K padded +16" cut
    reference = _dequantized_reference(folder, precision)
    ids = list(range(3, 40))
    ours = engine.runner.forward_logits(ids, engine.runner.new_cache(len(ids)), 0)
    theirs = reference.runner.forward_logits(ids, reference.runner.new_cache(len(ids)), 0)
    assert _relative_error(ours, theirs) <= 2e-2


def test_the_load_report_names_the_cpu_paths(
    paths: CpuPaths, tiny_model_dir, caplog: pytest.LogCaptureFixture
) -> None:
    folder, _ = tiny_model_dir("llama", True)
    with caplog.at_level(logging.INFO, logger="engine"):
        load_model(folder, precision="bf16")
    assert paths.summary() in caplog.text
    path = "oneDNN-packed" if paths.packed_bf16.ok else "nn.Linear"
    assert f"bf16 ({path})" in caplog.text
