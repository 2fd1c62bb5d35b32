"""The memory plan of the path that runs: where our Triton kernels run (the default on a CUDA
GPU), INT4 is packed a chunk of rows at a time and attention reads the paged pool in place, so
the plan counts neither torch's whole-matrix INT4 packing nor a gathered K/V; the torch paths
keep their figures. Whether ours run is answered in one place for the plan and the load
(:func:`engine.kernels.triton_support.planned`), without a device for a GPU that is not here.

On these CPUs our kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by
tests/conftest.py, with ``INFERSIGHT_KERNELS=triton``): the load's code is the one a GPU runs,
and the CPU allocator's record of every allocation gives its real peak."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import formats
from engine.attention import PagedBackend, TritonBackend
from engine.core import pool_profile
from engine.core.config import EngineConfig
from engine.core.scheduler import SchedulerLimits
from engine.kernels import triton_support
from engine.loader import memory_plan, memory_terms
from engine.loader.load import load_model
from engine.loader.random_weights import SyntheticCheckpoint
from engine.loader.weights import load_transformer
from engine.model.config import ModelConfig
from engine.quant.int4 import Int4Linear
from engine.quant.int8 import Int8Linear
from engine.quant.spec import parse_precision_spec
from tests.conftest import WIDE_HEADS
from tests.test_pool_profile import FakeGpu, fake_gpu

GiB, MiB = 2**30, 2**20
HOPPER = (9, 0)
CONFIGS = Path(__file__).resolve().parent.parent / "resources" / "configs"
#: A head large enough that its INT4 temporaries dominate the load (32768 × 512: 64 MiB in
#: fp32; torch's whole-matrix packing would add 48 MiB beside it, ours 8 MiB), one small
#: layer, tied (the head is read straight in fp32 and quantized; no float embedding beside it).
HEAVY_HEAD = {
    "model_type": "llama",
    "vocab_size": 32768,
    "hidden_size": 512,
    "intermediate_size": 512,
    "num_hidden_layers": 1,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
}

needs_triton = pytest.mark.skipif(not triton_support.installed(), reason="Triton is not installed")


def llama_8b() -> ModelConfig:
    return ModelConfig.from_file(CONFIGS / "llama-3.1-8b.json")


def workspace(backend, cfg: ModelConfig, dtype: torch.dtype, limits) -> int:
    return backend.workspace_bytes_per_token(
        cfg, dtype, limits.max_batch_size, limits.max_tokens_per_step
    )


def on_a_cuda_gpu(monkeypatch: pytest.MonkeyPatch, kernels: str) -> None:
    """The environment of a CUDA machine (Triton compiles there: no interpreter), with
    ``INFERSIGHT_KERNELS=kernels``."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("INFERSIGHT_KERNELS", kernels)


def peak_allocated(run: Callable[[], Any]) -> tuple[Any, int, int]:
    """``run()``'s result, the most bytes torch's CPU allocator held at once over it (above
    what it held before), and what it still held after: summed from the profiler's record of
    every allocation and free (exact sizes, no sampling, no allocator cache)."""
    import gc

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    gc.collect()  # an earlier test's garbage freed now, not counted against this run
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = run()
    held = peak = 0
    for event in sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns()):
        if event.name() == "[memory]" and event.device_type() == DeviceType.CPU:
            held += event.nbytes()
            peak = max(peak, held)
    return out, peak, held


@needs_triton
def test_the_plan_bounds_the_triton_int4_load_within_10_percent(monkeypatch):
    """The plan for a GPU where our kernels run against that load's code run here: the
    largest tensor in fp32 and the packed rows joined beside it, not torch's 4-bit values a
    byte each. One quantization chunk of 1 MiB and no allocator slack, as an exact count of
    the allocations has none: what is compared is what grows with the model."""
    cfg = ModelConfig.from_dict(HEAVY_HEAD)
    monkeypatch.setattr(formats, "QUANT_CHUNK_BYTES", MiB)
    monkeypatch.setattr(memory_terms, "QUANT_CHUNK_BYTES", MiB)
    monkeypatch.setattr(memory_terms, "LOAD_SLACK_BYTES", 0)
    on_a_cuda_gpu(monkeypatch, "triton")
    plan = memory_plan.plan_memory(cfg, "int4-g32+head", "cuda", memory=64 * GiB, capability=HOPPER)
    bound = plan.load_bytes - plan.runtime_bytes  # the weights, the tables, the overhead

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # ours, run here: the same loader code
    spec = parse_precision_spec("int4-g32+head", "cpu")
    source = SyntheticCheckpoint(cfg, dtype=torch.float32)  # the device's fp32 copy only
    model, peak, kept = peak_allocated(
        lambda: load_transformer(
            Path("heavy-head"), cfg, spec.compute, torch.device("cpu"), spec.kind_for, source=source
        )
    )
    layers = [m for m in model.modules() if isinstance(m, Int4Linear)]
    assert len(layers) == 5 and all(m.triton is not None for m in layers)  # ours ran
    # 86 MiB here: the head in fp32 (64), its packed rows (8) and their joined copy (8)
    assert peak <= bound <= 1.10 * peak, f"peak {peak / MiB:.1f} MiB, plan {bound / MiB:.1f} MiB"
    # what the load keeps is the plan's weights and RoPE's tables: the count is honest
    assert kept == pytest.approx(plan.weight_bytes + memory_plan.rope_bytes(cfg), rel=0.02)
    assert plan.triton_gemms


def test_the_plan_keeps_torchs_int4_packing_where_torch_runs(monkeypatch):
    """The torch path's bound is unchanged: torch's CUDA packing holds the whole matrix's
    4-bit values a byte each and its temporaries (3 bytes a value of the INT4 head)."""
    cfg = llama_8b()
    on_a_cuda_gpu(monkeypatch, "torch")
    torch_plan = memory_plan.plan_memory(
        cfg, "int4-g32+head", "cuda", memory=80 * GiB, capability=HOPPER
    )
    head = cfg.vocab_size * cfg.hidden_size
    fixed = 4 * memory_terms.QUANT_CHUNK_BYTES + memory_terms.LOAD_SLACK_BYTES
    assert not torch_plan.triton_gemms
    assert torch_plan.load_overhead_bytes == head * 4 + head * 3 + fixed
    if triton_support.installed():
        on_a_cuda_gpu(monkeypatch, "auto")
        ours = memory_plan.plan_memory(
            cfg, "int4-g32+head", "cuda", memory=80 * GiB, capability=HOPPER
        )
        assert ours.triton_gemms and ours.load_overhead_bytes == head * 4 + head // 2 + fixed


def test_the_pool_reserves_no_gather_where_triton_attends():
    """size_pool: the torch path's decode gather (padded K/V rows of a full batch) where it
    runs, none where our kernels read the pool in place: the room goes to the pool."""
    cfg, config = llama_8b(), EngineConfig()
    sized = functools.partial(
        pool_profile.size_pool, cfg, config, torch.bfloat16,
        total=12 * GiB, peak=6 * GiB, non_torch=512 * MiB, measured=False,
    )  # fmt: skip
    cuda = torch.device("cuda")
    torch_path, ours = sized(attention=PagedBackend(cuda)), sized(attention=TritonBackend())
    gather = workspace(PagedBackend(cuda), cfg, torch.bfloat16, config.limits)
    assert torch_path.gather_per_token == gather > 0
    # 16 padded rows of a token's K and V, its mask element and its slot (int64): the decode
    # term is the larger
    assert gather == config.limits.max_batch_size * (2 * 8 * 128 * 2 + 2 + 8)
    assert torch_path.gather_bytes > 0
    assert ours.gather_per_token == ours.gather_bytes == 0
    assert ours.room == torch_path.room and ours.blocks > torch_path.blocks
    assert ours.pool_bytes + ours.block_bytes > torch_path.pool_bytes + torch_path.gather_bytes


@needs_triton
@pytest.mark.parametrize("gib", [12, 80])
def test_the_plan_reserves_no_gather_where_triton_attends(monkeypatch, gib):
    cfg = llama_8b()
    on_a_cuda_gpu(monkeypatch, "auto")  # the default on a CUDA GPU: ours
    ours = memory_plan.plan_memory(
        cfg, "int4-g32+head", "cuda", memory=gib * GiB, capability=HOPPER
    )
    config = EngineConfig()
    step = memory_plan.workspace_bytes(cfg, torch.bfloat16, config)
    assert ours.pool_sizing is not None and ours.pool_sizing.gather_per_token == 0
    assert ours.workspace_bytes == step and ours.triton_attention
    on_a_cuda_gpu(monkeypatch, "torch")
    torch_plan = memory_plan.plan_memory(
        cfg, "int4-g32+head", "cuda", memory=gib * GiB, capability=HOPPER
    )
    sizing = torch_plan.pool_sizing
    gather = workspace(PagedBackend(torch.device("cuda")), cfg, torch.bfloat16, config.limits)
    assert sizing is not None and sizing.gather_per_token == gather > 0
    assert torch_plan.workspace_bytes == step + gather * sizing.gather_tokens
    assert ours.kv_pool_bytes > torch_plan.kv_pool_bytes


def test_the_rope_tables_are_planned_on_a_gpu():
    """RoPE's fp32 cos and sin of every position: on the device from the load's start, so in
    its bound and beside the pool (128 MiB for Llama-3.1-8B); a CPU's plans leave them out."""
    cfg = llama_8b()
    assert memory_plan.rope_bytes(cfg) == 128 * MiB
    from engine.model.transformer import RotaryEmbedding

    small = ModelConfig.from_dict(HEAVY_HEAD)
    tables = RotaryEmbedding(small)
    assert memory_plan.rope_bytes(small) == sum(t.nbytes for t in tables.buffers())
    half = small.head_dim // 2
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * half, "long_factor": [2.0] * half}
    phi = ModelConfig.from_dict(
        {**HEAVY_HEAD, "model_type": "phi3", "rope_scaling": longrope,
         "original_max_position_embeddings": small.max_position_embeddings // 4}
    )  # fmt: skip
    long_tables = RotaryEmbedding(phi)
    assert memory_plan.rope_bytes(phi) == sum(t.nbytes for t in long_tables.buffers())
    assert memory_plan.rope_bytes(phi) == 2 * memory_plan.rope_bytes(small)
    plan = memory_plan.plan_memory(cfg, "int4-g32+head", "cuda", memory=12 * GiB, capability=HOPPER)
    assert plan.rope_bytes == 128 * MiB
    assert plan.load_bytes == (
        plan.weight_bytes + plan.rope_bytes + plan.runtime_bytes + plan.load_overhead_bytes
    )
    assert plan.pool_sizing is not None
    assert plan.pool_sizing.peak == plan.weight_bytes + plan.rope_bytes + (
        memory_plan.workspace_bytes(cfg, torch.bfloat16, EngineConfig())
    )
    assert memory_plan.plan_memory(cfg, "int4-g32+head", "cpu", memory=64 * GiB).rope_bytes == 0


LIMITS = SchedulerLimits(max_batch_size=4, max_tokens_per_step=32)


@needs_triton
@pytest.mark.parametrize("kernels", ["triton", "torch"])
def test_the_loads_pool_reserves_no_gather_where_triton_attends(
    tiny_model_dir, monkeypatch, kernels
):
    """The load sizes its pool (a fake GPU's figures, the warm-up run here) with the gather
    of the attention it runs: none through ours, the torch path's otherwise."""
    monkeypatch.setenv("INFERSIGHT_KERNELS", kernels)
    folder, _ = tiny_model_dir("llama", False, **WIDE_HEADS)
    fake_gpu(monkeypatch, FakeGpu(64 * MiB, 40 * MiB, 16 * MiB, 0, 8 * MiB))
    config = EngineConfig(limits=LIMITS, decode_graph="off", gpu_memory_utilization=0.5)
    engine = load_model(folder, precision="fp32", pack=False, config=config)
    sizing = engine.pool_sizing
    assert sizing is not None and engine.triton is (kernels == "triton")
    cfg = ModelConfig.from_file(folder / "config.json")
    gather = workspace(PagedBackend(torch.device("cpu")), cfg, torch.float32, LIMITS)
    assert sizing.gather_per_token == (0 if engine.triton else gather) and gather > 0


@needs_triton
@pytest.mark.parametrize("kernels", ["auto", "torch", "triton"])
def test_the_plan_and_the_load_agree_on_whether_triton_runs(tiny_model_dir, monkeypatch, kernels):
    """On the device that is here (this CPU, the interpreter on): the plan's answer is what
    the load chose, for the quantized GEMMs and for attention; for a GPU that is not here, it
    is :func:`~engine.kernels.triton_support.chosen`'s for a CUDA device, interpreter off."""
    monkeypatch.setenv("INFERSIGHT_KERNELS", kernels)
    folder, _ = tiny_model_dir("llama", False, **WIDE_HEADS)
    engine = load_model(
        folder,
        precision="int8+head",
        pack=False,
        config=EngineConfig(num_blocks=8, decode_graph="off"),
    )
    layers = [m for m in engine.model.modules() if isinstance(m, Int8Linear)]
    gemms = triton_support.planned("cpu")
    assert layers and {m.triton is not None for m in layers} == {gemms}
    assert gemms is (kernels == "triton")
    head_dim = engine.cfg.head_dim
    assert triton_support.planned("cpu", head_dim=head_dim, dtype=engine.dtype) is engine.triton
    assert triton_support.planned("cpu", head_dim=8) is False  # not built for 8-wide heads
    assert triton_support.planned("cuda") is False  # the interpreter runs CPU tensors only
    on_a_cuda_gpu(monkeypatch, kernels)
    cuda = torch.device("cuda")
    assert triton_support.planned("cuda", HOPPER) is triton_support.chosen(cuda)[0]
    assert triton_support.planned("cuda", HOPPER) is (kernels != "torch")
    ours = kernels != "torch"
    assert triton_support.planned("cuda", HOPPER, head_dim=128, dtype=torch.bfloat16) is ours
    # the prefill kernel's refusals: fp32 on a GPU (no tensor cores), bf16 below 8.0
    assert triton_support.planned("cuda", HOPPER, head_dim=128, dtype=torch.float32) is False
    assert triton_support.planned("cuda", (7, 5), head_dim=128, dtype=torch.bfloat16) is False
    assert triton_support.planned("cuda", (7, 5), head_dim=128, dtype=torch.float16) is ours
