"""The CUDA capability policy (engine/hardware/gpu.py), with no GPU: the seam is monkeypatched.

Below compute capability 8.0 bf16 is emulated, so bf16 is refused there, INT8 and mixed specs
compute in fp16, and INT4 (torch's kernel: sm80+, bf16 activations only) runs on 7.5 only
through our Triton kernels, in fp16, and is refused where they do not run; from 8.0 on nothing
changes. ``infersight plan`` plans and suggests only what the GPU it plans for runs natively.
The tests run Triton's interpreter, so our kernels do not run on a CUDA GPU here unless a test
says they do (:func:`triton_on_gpus`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from app.cli.main import main
from engine.errors import InvalidRequestError
from engine.hardware import gpu
from engine.hardware import memory as hw_memory
from engine.hardware.memory import MemoryFigures
from engine.kernels import triton_support
from engine.loader import memory_plan
from engine.loader.memory_plan import plan_memory
from engine.model.config import ModelConfig
from engine.quant.spec import PrecisionSpec, QuantKind, parse_precision_spec
from tests.conftest import WIDE_HEADS
from tests.probed import needs_int4

CONFIGS = Path(__file__).parent.parent / "resources" / "configs"
SHAPES = str(CONFIGS / "llama-3.1-8b.json")
GiB = 2**30
Cap = tuple[int, int]

TURING, AMPERE, AMPERE_GEFORCE, ADA, HOPPER = (7, 5), (8, 0), (8, 6), (8, 9), (9, 0)
CAPABILITIES = [TURING, AMPERE, AMPERE_GEFORCE, ADA, HOPPER]
INT8_SPECS = ("int8", "int8+head", "mixed:attn=int8,mlp=none", "mixed:attn=int8,mlp=int8,head=int8")
INT4_SPECS = (
    "int4-g32",
    "int4-g128+head",
    "mixed:attn=int8,mlp=int4-g32",
    "mixed:attn=int8,mlp=int8,mlp.2=int4-g64",  # an override alone is enough
)


def on_gpu(monkeypatch: pytest.MonkeyPatch, cap: tuple[int, int]) -> None:
    """Make every CUDA device report ``cap`` (the seam; no GPU is touched)."""
    monkeypatch.setattr(gpu, "capability", lambda device: cap if _is_cuda(device) else None)


def _is_cuda(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda"


@pytest.fixture
def triton_on_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Our Triton kernels run on CUDA GPUs, as on a GPU machine with Triton (and on this CPU
    where a test asks for them)."""
    monkeypatch.setattr(triton_support, "runs_on", lambda device: True)


def name(cap: tuple[int, int]) -> str:
    return f"{cap[0]}.{cap[1]}"


def suggested(suggestion: str) -> str | None:
    """The precision a plan's suggestion names (``try int8: it fits …``), if any."""
    match = re.match(r"try (\S+): it fits", suggestion)
    return match.group(1) if match else None


# -- the seam and the pure policy ------------------------------------------------------------


def test_the_seam_asks_torch_only_for_a_cuda_device(monkeypatch):
    asked = []

    def get_device_capability(device=None):
        asked.append(device)
        return (7, 5)

    monkeypatch.setattr(torch.cuda, "get_device_capability", get_device_capability)
    assert gpu.capability("cpu") is None and gpu.capability(torch.device("meta")) is None
    assert asked == []
    assert gpu.capability("cuda:1") == (7, 5)
    assert asked == [torch.device("cuda:1")]


@pytest.mark.parametrize("cap", CAPABILITIES, ids=name)
def test_the_policy_is_a_function_of_the_capability(cap):
    ampere = cap >= (8, 0)
    assert gpu.runs_bf16(cap) is ampere and gpu.runs_int4(cap) is ampere
    assert gpu.runs_int4(cap, triton=True)  # our kernels run from 7.5
    assert not gpu.runs_int4((7, 0), triton=True)  # Volta: they are not built for it
    assert gpu.compute_dtype_for(cap) == (torch.bfloat16 if ampere else torch.float16)
    # None: no CUDA GPU, or one not known; the engine computes in bf16 as it always did
    assert gpu.runs_bf16(None) and gpu.runs_int4(None)
    assert gpu.compute_dtype_for(None) == torch.bfloat16


@pytest.mark.parametrize(
    ("text", "cap"), [("7.5", (7, 5)), ("8.6", (8, 6)), ("sm_89", (8, 9)), (" sm90 ", (9, 0))]
)
def test_a_capability_is_read_as_nvidia_writes_it(text, cap):
    assert gpu.parse_capability(text) == cap


@pytest.mark.parametrize("text", ["seven", "75.5", "", "8", "1.0", "8.6.1"])
def test_a_bad_capability_says_how_to_write_one(text):
    with pytest.raises(InvalidRequestError, match=r"major\.minor, e\.g\. 7\.5"):
        gpu.parse_capability(text)


# -- the precision spec on a GPU of each capability --------------------------------------------


@pytest.mark.parametrize("cap", CAPABILITIES, ids=name)
def test_which_specs_parse_and_what_they_compute_in(monkeypatch, cap):
    on_gpu(monkeypatch, cap)
    ampere = cap >= (8, 0)
    for device, given in (("cuda", None), ("meta", cap)):  # this GPU, or one planned for

        def parse(text: str, device: str = device, given: Cap | None = given) -> PrecisionSpec:
            return parse_precision_spec(text, device, capability=given)

        assert parse("fp32").compute == torch.float32
        assert parse("fp16").compute == torch.float16
        for text in INT8_SPECS:
            assert parse(text).compute == (torch.bfloat16 if ampere else torch.float16), text
        if ampere:
            assert parse("bf16").compute == torch.bfloat16
            for text in INT4_SPECS:
                assert parse(text).compute == torch.bfloat16, text
            continue
        with pytest.raises(InvalidRequestError):
            parse("bf16")
        for text in INT4_SPECS:
            with pytest.raises(InvalidRequestError):
                parse(text)


def test_bf16_below_8_0_is_refused_naming_fp16(monkeypatch):
    on_gpu(monkeypatch, TURING)
    with pytest.raises(InvalidRequestError) as caught:
        parse_precision_spec("bf16", "cuda")
    message = str(caught.value)
    assert message.startswith(
        "bf16 needs compute capability 8.0 or newer (this GPU is 7.5); use fp16"
    )
    assert "int8 (which computes in fp16 here)" in message
    with pytest.raises(InvalidRequestError, match=r"\(the GPU planned for is 7\.5\); use fp16"):
        parse_precision_spec("bf16", "meta", capability=TURING)


@pytest.mark.parametrize("text", INT4_SPECS)
def test_int4_below_8_0_is_refused_suggesting_only_what_runs_there(monkeypatch, text):
    on_gpu(monkeypatch, TURING)
    with pytest.raises(InvalidRequestError) as caught:
        parse_precision_spec(text, "cuda")
    message = str(caught.value)
    assert "compute capability 8.0 or newer" in message and "this GPU is 7.5" in message
    advice = message.split("Use ", 1)[1]
    assert "int8" in advice and "fp16" in advice and "bf16" not in advice
    for instead in re.findall(r"\b(int8|fp16|bf16|int4\S*)\b", advice):
        parse_precision_spec(instead, "cuda")  # what it suggests parses on this GPU


def test_int4_runs_on_7_5_through_our_triton_kernels_in_fp16(monkeypatch, capsys, triton_on_gpus):
    on_gpu(monkeypatch, TURING)
    for device, given in (("cuda", None), ("meta", TURING)):  # this GPU, or one planned for
        for text in INT4_SPECS:
            assert parse_precision_spec(text, device, capability=given).compute == torch.float16
    with pytest.raises(InvalidRequestError, match="use fp16"):
        parse_precision_spec("bf16", "cuda")  # bf16 stays refused
    code, out, _ = plan_cli(capsys, "--memory", "11GiB", "--capability", "7.5", "--json")
    planned = [p["precision"] for p in json.loads(out)]
    assert code == 0 and planned == ["fp16", "int8", "int8+head", "int4-g32", "int4-g32+head",
                                     "int4-g128+head"]  # fmt: skip
    on_gpu(monkeypatch, (7, 0))  # Volta: our kernels are not built for it
    with pytest.raises(InvalidRequestError, match=r"Triton kernels; this GPU is 7\.0"):
        parse_precision_spec("int4-g32", "cuda")


def test_int4_on_7_5_without_our_kernels_says_why(monkeypatch):
    on_gpu(monkeypatch, TURING)
    monkeypatch.setattr(triton_support, "installed", lambda: False)
    with pytest.raises(InvalidRequestError) as caught:
        parse_precision_spec("int4-g32", "cuda")
    assert "or 7.5 with Infersight's Triton kernels, but the engine here runs torch kernels " \
           "(Triton is not installed); this GPU is 7.5" in str(caught.value)  # fmt: skip
    monkeypatch.setenv("INFERSIGHT_KERNELS", "torch")
    with pytest.raises(InvalidRequestError, match=r"runs torch kernels \(INFERSIGHT_KERNELS=torch"):
        parse_precision_spec("int4-g32", "cuda")


def test_a_cpu_is_not_asked_and_keeps_bf16(monkeypatch):
    def no_gpu(device=None):
        raise AssertionError("a CPU spec asked torch.cuda for a capability")

    monkeypatch.setattr(torch.cuda, "get_device_capability", no_gpu)
    assert parse_precision_spec("bf16", "cpu").compute == torch.bfloat16
    for text in INT8_SPECS:
        assert parse_precision_spec(text, "cpu").compute == torch.bfloat16
    assert parse_precision_spec("int8", "meta").compute == torch.bfloat16  # a plan, GPU unknown


def test_an_int8_model_computing_in_fp16_stays_in_fp16(monkeypatch, tiny_model_dir):
    """What runs below 8.0: INT8 layers built for fp16 activations (scales and bias in fp16), so
    nothing promotes the hidden stream to fp32. Run on this CPU by making it report 7.5."""
    from engine.core.sampling import SamplingParams
    from engine.loader.load import load_model
    from engine.quant.int8 import Int8Linear

    monkeypatch.setattr(gpu, "capability", lambda device: TURING)
    folder, _ = tiny_model_dir("qwen2", False)  # q/k/v biases: a quantized layer's bias too
    engine = load_model(folder, precision="int8+head", pack=False)
    layers = [m for m in engine.model.modules() if isinstance(m, Int8Linear)]
    assert layers and engine.dtype == torch.float16
    assert {m.scales.dtype for m in layers} == {torch.float16}
    biases = [m.bias for m in layers if m.bias is not None]
    assert biases and {b.dtype for b in biases} == {torch.float16}
    outputs: list[torch.dtype] = []
    for layer in layers:
        layer.register_forward_hook(lambda module, args, out: outputs.append(out.dtype))
    run = engine.generate([5, 6, 7, 8], SamplingParams(max_new_tokens=4, ignore_eos=True))
    list(run)
    assert len(run.result.token_ids) == 4
    assert outputs and set(outputs) == {torch.float16}


@needs_int4
def test_an_int4_model_on_7_5_computes_in_fp16_through_our_kernels(
    monkeypatch, tiny_model_dir, triton_on_gpus
):
    """What runs on 7.5: INT4 layers in our Triton layout, fp16 in and out, biases and the tied
    head's embedding rows too. Run on this CPU (Triton's interpreter) reporting 7.5."""
    from engine.core.sampling import SamplingParams
    from engine.loader.load import load_model
    from engine.quant.int4 import Int4Linear

    monkeypatch.setattr(gpu, "capability", lambda device: TURING)
    monkeypatch.setenv("INFERSIGHT_KERNELS", "triton")
    folder, _ = tiny_model_dir("qwen2", True, **WIDE_HEADS)  # q/k/v biases, a tied head
    engine = load_model(folder, precision="int4-g32+head", pack=False)
    layers = [m for m in engine.model.modules() if isinstance(m, Int4Linear)]
    assert layers and engine.dtype == torch.float16
    assert all(m.triton is not None and m.out_dtype == torch.float16 for m in layers)
    biases = [m.bias for m in layers if m.bias is not None]
    assert biases and {b.dtype for b in biases} == {torch.float16}
    outputs: list[torch.dtype] = []
    for layer in layers:
        layer.register_forward_hook(lambda module, args, out: outputs.append(out.dtype))
    # a prefill (the GEMM kernel) and one decode step (the GEMV kernel)
    run = engine.generate([5, 6, 7, 8], SamplingParams(max_new_tokens=2, ignore_eos=True))
    list(run)
    assert len(run.result.token_ids) == 2
    assert outputs and set(outputs) == {torch.float16}


@pytest.mark.parametrize("cap", [TURING, AMPERE])
def test_the_int8_probe_and_the_sensitivity_scan_use_the_gpus_compute_dtype(
    monkeypatch, tiny_model_dir, cap
):
    """The INT8 kernel is probed, and blocks are scanned, in the dtype a quantized model
    computes in on that GPU: fp16 below 8.0, bf16 from 8.0 (run on this CPU, reporting
    ``cap``)."""
    from engine.evals import sensitivity
    from engine.loader.weights import load_transformer
    from engine.quant import int8

    want = torch.float16 if cap < AMPERE else torch.bfloat16
    monkeypatch.setattr(gpu, "capability", lambda device: cap)
    probed: list[torch.dtype] = []
    real = torch._weight_int8pack_mm

    def kernel(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        probed.append(x.dtype)
        return real(x.float(), w, scales.float()).to(x.dtype)

    monkeypatch.setattr(torch, "_weight_int8pack_mm", kernel)
    monkeypatch.setattr(int8, "_INT8_KERNEL", {})
    assert int8.int8_kernel_runs(torch.device("cpu"))
    assert probed == [want]

    folder, _ = tiny_model_dir("llama", False)
    cfg = ModelConfig.from_file(folder / "config.json")
    model = load_transformer(folder, cfg, torch.float32, torch.device("cpu"))
    casts: set[torch.dtype] = set()
    real_cast = sensitivity.CastActivations

    def cast(inner: torch.nn.Module, compute: torch.dtype) -> torch.nn.Module:
        casts.add(compute)
        return real_cast(inner, compute)

    monkeypatch.setattr(sensitivity, "CastActivations", cast)
    scan = sensitivity.scan_model(model, QuantKind(8), None, [5, 6, 7, 8, 9])
    assert len(scan.blocks) == 2 * cfg.num_layers and casts == {want}


# -- the memory plan and `infersight plan` -----------------------------------------------------


def llama_8b() -> ModelConfig:
    return ModelConfig.from_file(Path(SHAPES))


def int4_only_budget() -> int:
    """Memory where no INT8 spec fits Llama-3.1-8B but INT4-g32 does (from the plans): just
    under what the smallest INT8 load holds at its peak, before any KV pool."""
    cfg = llama_8b()
    loading = []
    for text in ("int8", "int8+head"):
        plan = plan_memory(cfg, text, "cuda", memory=64 * GiB, capability=HOPPER)
        loading.append(plan.weight_bytes + plan.runtime_bytes + plan.load_overhead_bytes)
    budget = min(loading) - 1
    for text in ("int8", "int8+head"):
        assert not plan_memory(cfg, text, "cuda", memory=budget, capability=HOPPER).fits
    assert plan_memory(cfg, "int4-g32", "cuda", memory=budget, capability=HOPPER).fits
    return budget


@pytest.mark.parametrize("cap", CAPABILITIES, ids=name)
def test_the_plan_of_this_gpu_suggests_only_what_it_runs(monkeypatch, cap):
    """Through the seam: the plan of "the GPU here" asks its capability."""
    on_gpu(monkeypatch, cap)
    # the GPU here, its context (not torch's) as a plan for memory= estimates it
    total = int4_only_budget()
    figures = MemoryFigures(total, total - memory_plan.CUDA_RUNTIME_BYTES, 0, 0, 0)
    reader = SimpleNamespace(read=lambda: figures)
    monkeypatch.setattr(hw_memory, "device_memory", lambda device: reader)
    plan = plan_memory(llama_8b(), "fp16", "cuda")
    assert plan.capability == cap and f"compute capability {name(cap)}" in plan.lines()[0]
    assert not plan.fits
    if cap >= (8, 0):
        assert suggested(plan.suggestion) == "int4-g32"
    else:
        assert suggested(plan.suggestion) is None and "no precision fits" in plan.suggestion
        with pytest.raises(InvalidRequestError, match="use fp16"):
            plan_memory(llama_8b(), "bf16", "cuda")


@pytest.mark.parametrize("cap", CAPABILITIES, ids=name)
def test_no_suggestion_is_a_precision_the_gpu_cannot_run(cap):
    cfg = llama_8b()
    seen = set()
    for gib in (3, 5, 7, 9, 11, 13, 16, 24):
        for text in ("fp32", "fp16", "int8", "mixed:attn=int8,mlp=none"):
            plan = plan_memory(cfg, text, "cuda", memory=gib * GiB, capability=cap)
            other = suggested(plan.suggestion)
            if other is None:
                continue
            seen.add(other)
            parse_precision_spec(other, "meta", capability=cap)  # runs there: no refusal
            if cap < (8, 0):
                assert "int4" not in other and "bf16" not in other
    assert seen  # some budget made a suggestion
    assert any("int4" in s for s in seen) is (cap >= (8, 0))


def test_a_plan_for_memory_asks_the_gpu_only_when_it_is_here(monkeypatch):
    on_gpu(monkeypatch, TURING)
    monkeypatch.setattr(gpu, "present", lambda device: True)
    with pytest.raises(InvalidRequestError, match=r"this GPU is 7\.5"):
        plan_memory(llama_8b(), "int4-g32", "cuda", memory=11 * GiB)
    monkeypatch.setattr(gpu, "present", lambda device: False)  # planned on a laptop
    plan = plan_memory(llama_8b(), "int4-g32", "cuda", memory=11 * GiB)
    assert plan.capability is None
    assert any("compute capability unknown" in note and "--capability" in note
               for note in plan.notes)  # fmt: skip


def test_a_capability_is_only_for_a_cuda_plan():
    with pytest.raises(InvalidRequestError, match="--device cuda"):
        plan_memory(llama_8b(), "fp16", "cpu", memory=11 * GiB, capability=TURING)


def plan_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["plan", "--model", SHAPES, "--device", "cuda", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("cap", CAPABILITIES, ids=name)
def test_infersight_plan_with_a_capability_plans_what_that_gpu_runs(capsys, cap):
    code, out, _ = plan_cli(capsys, "--memory", "11GiB", "--capability", name(cap), "--json")
    assert code == 0
    plans = json.loads(out)
    planned = [p["precision"] for p in plans]
    assert all(p["capability"] == list(cap) for p in plans)
    int4 = ["int4-g32", "int4-g32+head", "int4-g128+head"]
    assert planned == ["fp16", "int8", "int8+head", *(int4 if cap >= (8, 0) else [])]
    code, out, _ = plan_cli(capsys, "--memory", "11GiB", "--capability", name(cap))
    assert f"on cuda (compute capability {name(cap)})" in out.splitlines()[0]
    assert ("not planned: int4-g32, int4-g32+head, int4-g128+head" in out) is (cap < (8, 0))


@pytest.mark.parametrize("cap", CAPABILITIES, ids=name)
def test_infersight_plan_suggests_per_capability(capsys, cap):
    budget = str(int4_only_budget())
    code, out, _ = plan_cli(capsys, "--memory", budget, "--capability", name(cap),
                            "--precision", "fp16")  # fmt: skip
    assert code == 3
    suggestion = next(line for line in out.splitlines() if "suggestion" in line)
    if cap >= (8, 0):
        assert "try int4-g32: it fits" in suggestion
    else:
        assert "int4" not in suggestion and "no precision fits" in suggestion


def test_infersight_plan_refuses_bf16_for_a_turing_gpu(capsys):
    code, out, err = plan_cli(capsys, "--memory", "11GiB", "--capability", "7.5",
                              "--precision", "bf16")  # fmt: skip
    assert code == 2 and out == ""
    assert err.startswith("infersight: error: bf16 needs compute capability 8.0 or newer")
    assert "(the GPU planned for is 7.5); use fp16" in err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--capability", "seven", "--memory", "11GiB"], "e.g. 7.5"),
        (["--capability", "7.5", "--memory", "11GiB", "--device", "cpu"], "--device cuda"),
    ],
)
def test_infersight_plan_says_how_to_give_a_capability(capsys, argv, needle):
    code = main(["plan", "--model", SHAPES, *argv])
    _, err = capsys.readouterr()
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1


def test_a_plan_for_a_gpu_not_known_is_unchanged(capsys, monkeypatch):
    monkeypatch.setattr(gpu, "present", lambda device: False)  # no --capability, no GPU here
    code, out, _ = plan_cli(capsys, "--memory", "11GiB")
    assert code == 0 and "not planned" not in out and "int4-g32+head" in out
