"""A GPU's KV pool sized from a profiled warm-up (:mod:`engine.core.pool_profile`), on a CPU:
a fake GPU memory interface stands behind the seam (:func:`engine.hardware.memory.device_memory`)
while the warm-up forward really runs. The pool equals the formula to the block, the warm-up
runs the largest step and frees its scratch pool, a size given skips it, a budget with no
block is refused, and the memory plan sizes the same pool as the load."""

from __future__ import annotations

import gc
import json
import logging
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from app.cli.main import main
from engine.attention import paged as attention_paged
from engine.core.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.core.scheduler import SchedulerLimits
from engine.errors import InvalidRequestError
from engine.hardware import gpu
from engine.hardware import memory as device_memory
from engine.hardware.memory import MemoryFigures
from engine.kernels import paged_decode
from engine.loader import memory_plan
from engine.loader.load import load_model
from engine.model.config import ModelConfig
from tests.conftest import build_tiny_hf, save_tiny

MiB = 2**20
# The tiny Llama of tests/conftest.py, fp32: 3 layers, 8 query heads over 2 KV heads of 8.
TOKEN_BYTES = 2 * 3 * 2 * 8 * 4  # K and V of a token in every layer: 384 B
ROW_BYTES = 2 * 2 * 8 * 4  # K and V of a token in one layer: 128 B
CONTEXT = 256
CHUNK = 96  # max_tokens_per_step
BATCH = 5  # max_batch_size
BLOCK = 16
# the analytic gather per token read, on the torch path a GPU without our kernels runs (and
# this CPU with the paged C kernel off): the prefill chunk's slot, K/V and mask column
# (group of 4: the mask, its repeated copy and its fp32 additive one), or the decode step's
# padded rows (a row's K/V, its mask element and slot; 24 B while its context is built), the
# larger (and a GPU's SDPA may hold the boolean mask negated: a byte more a query there);
# tests/test_attention_workspace.py measures both terms against the CPU's allocator
GATHER = max(8 + ROW_BYTES + CHUNK * (1 + 4 * (1 + 1 + 4)), BATCH * max(24, ROW_BYTES + 4 + 8))
# the warm-up's scratch pool: the chunk's blocks and the zero pad slot
SCRATCH = (-(-CHUNK // BLOCK) * BLOCK + 1) * TOKEN_BYTES
USEFUL = BATCH * CONTEXT // BLOCK  # blocks the running set can use at full context
LIMITS = SchedulerLimits(max_batch_size=BATCH, max_tokens_per_step=CHUNK)


@dataclass
class FakeGpu:
    """A GPU's memory interface with fixed figures; it records what was asked of it."""

    total: int
    free: int
    reserved: int
    allocated: int
    peak: int
    calls: list[str] = field(default_factory=list)

    def reset_peak(self) -> None:
        self.calls.append("reset")

    def read(self) -> MemoryFigures:
        self.calls.append("read")
        return MemoryFigures(self.total, self.free, self.reserved, self.allocated, self.peak)

    def release(self) -> None:
        self.calls.append("release")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = build_tiny_hf("llama", tied=False, max_position_embeddings=CONTEXT)
    return save_tiny(model, tmp_path_factory.mktemp("llama-pool"))


@pytest.fixture(autouse=True)
def _the_torch_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Attention on the torch path, as on a GPU without our kernels (the paged C kernel off
    for the test, and as this process had it after)."""
    monkeypatch.setenv(paged_decode.ENV, "gather")
    monkeypatch.setattr(attention_paged, "negates_mask", lambda device: True)  # as a GPU's
    paged_decode.kernel.cache_clear()
    yield
    monkeypatch.undo()
    paged_decode.kernel.cache_clear()
    paged_decode.kernel()


def fake_gpu(monkeypatch: pytest.MonkeyPatch, fake: FakeGpu) -> FakeGpu:
    """Every device (this CPU too) sized as a GPU through ``fake``."""
    monkeypatch.setattr(device_memory, "device_memory", lambda device: fake)
    return fake


def config(**kwargs: Any) -> EngineConfig:
    return EngineConfig(limits=LIMITS, decode_graph="off", **kwargs)


def load(folder: Path, conf: EngineConfig) -> LLMEngine:
    return load_model(folder, precision="fp32", pack=False, config=conf)


def expected_blocks(room: float) -> int:
    """The module's formula by hand: blocks + pad slot + gather × min(context, pool tokens)
    = room."""
    room -= TOKEN_BYTES  # the pool's zero pad slot
    full = room - GATHER * CONTEXT
    budget = full if full >= TOKEN_BYTES * CONTEXT else room * TOKEN_BYTES / (TOKEN_BYTES + GATHER)
    return min(int(budget // (BLOCK * TOKEN_BYTES)), USEFUL)


@pytest.mark.parametrize(
    ("room", "blocks"),
    [
        (500_000, 10),  # short of a full context: the gather counted at the pool's own reach
        (1 * MiB, 64),  # a full context's gather beside a pool of more than one context
        (64 * MiB, USEFUL),  # more than the running set can use: the full-context pool
    ],
)
def test_the_pool_is_the_formula_to_the_block(folder, monkeypatch, caplog, room, blocks):
    u, total, free, reserved = 0.5, 64 * MiB, 40 * MiB, 16 * MiB
    non_torch = total - free - reserved
    peak = int(total * u - room - non_torch)  # what the warm-up measured, its scratch left out
    fake = fake_gpu(monkeypatch, FakeGpu(total, free, reserved, 0, peak + SCRATCH))
    with caplog.at_level(logging.INFO, logger="engine.loader.load"):
        engine = load(folder, config(gpu_memory_utilization=u))
    sizing = engine.pool_sizing
    assert sizing is not None and sizing.measured
    assert (sizing.total, sizing.utilization, sizing.peak) == (total, u, peak)
    assert (sizing.non_torch, sizing.gather_per_token, sizing.room) == (non_torch, GATHER, room)
    assert expected_blocks(room) == blocks
    assert engine.kv.manager.num_blocks == sizing.blocks == blocks
    assert engine.kv.nbytes == (blocks * BLOCK + 1) * TOKEN_BYTES
    # the pool and the gather at its reach never take more than the room
    assert sizing.pool_bytes + TOKEN_BYTES + sizing.gather_bytes <= room
    assert fake.calls == ["reset", "read", "release"]
    report = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("loaded"))
    assert f"KV pool {blocks} blocks × 16 tokens" in report and sizing.summary() in report
    assert "0.50 × 0.06 GiB total" in report and "(analytic)" in report


def test_the_warm_up_runs_the_largest_step_and_frees_its_scratch_pool(folder, monkeypatch):
    from engine.core import pool_profile
    from engine.loader import load as loading

    fake = fake_gpu(monkeypatch, FakeGpu(64 * MiB, 40 * MiB, 16 * MiB, 0, 8 * MiB))
    seen: list[tuple[int, int, list[str]]] = []  # tokens in, logits rows out, fake's calls
    pools: list[weakref.ref[torch.Tensor]] = []

    def hook(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        pools.append(weakref.ref(args[2].cache.kv[0]))
        seen.append((args[0].numel(), out.shape[0], list(fake.calls)))

    real_load = loading.load_transformer

    def load_hooked(*args: object, **kwargs: object) -> torch.nn.Module:
        model = real_load(*args, **kwargs)
        model.register_forward_hook(hook)
        return model

    monkeypatch.setattr(loading, "load_transformer", load_hooked)
    sampled: list[int] = []
    real_sample = pool_profile.sample

    def sample(logits: torch.Tensor, *args: object) -> torch.Tensor:
        sampled.append(len(logits))
        return real_sample(logits, *args)

    monkeypatch.setattr(pool_profile, "sample", sample)
    engine = load(folder, config())
    # one forward before the engine serves: the largest chunk and a full batch of logits,
    # sampled, between the peak's reset and its reading
    assert seen == [(CHUNK, BATCH, ["reset"])]
    assert sampled == [BATCH]
    assert fake.calls == ["reset", "read", "release"]
    gc.collect()
    assert pools[0]() is None  # the scratch pool is gone
    assert engine.pool_sizing is not None


@pytest.mark.parametrize(
    ("given", "blocks"),
    [({"num_blocks": 7}, 7), ({"kv_memory": 200 * 1024}, 200 * 1024 // (BLOCK * TOKEN_BYTES))],
)
def test_a_size_given_skips_the_profile(folder, monkeypatch, given, blocks):
    fake = fake_gpu(monkeypatch, FakeGpu(64 * MiB, 40 * MiB, 16 * MiB, 0, 8 * MiB))
    engine = load(folder, config(**given))
    assert fake.calls == [] and engine.pool_sizing is None
    assert engine.kv.manager.num_blocks == blocks


def test_a_utilization_that_leaves_nothing_is_refused_with_the_figures(folder, monkeypatch):
    fake_gpu(monkeypatch, FakeGpu(64 * MiB, 40 * MiB, 16 * MiB, 0, 8 * MiB))
    with pytest.raises(InvalidRequestError) as refused:
        load(folder, config(gpu_memory_utilization=0.05))
    text = str(refused.value)
    assert "leaves no room for a KV block" in text and "0.05 × 0.06 GiB total" in text
    assert "raise --gpu-memory-utilization" in text


def test_a_warm_up_out_of_memory_says_what_to_lower(folder, monkeypatch):
    from engine.core import pool_profile
    from engine.errors import OutOfMemoryError

    fake = fake_gpu(monkeypatch, FakeGpu(64 * MiB, 40 * MiB, 16 * MiB, 0, 8 * MiB))

    def sample(*args: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(pool_profile, "sample", sample)
    with pytest.raises(
        OutOfMemoryError,
        match=r"the largest step \(96 tokens of prompt, the "
        r"logits of 5 rows\) does not fit .* lower --max-tokens-per-step",
    ):
        load(folder, config())
    assert fake.calls == ["reset", "release"]


@pytest.mark.parametrize("u", [0.0, -0.1, 1.01])
def test_the_utilization_is_a_share_in_0_1(u):
    with pytest.raises(InvalidRequestError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        EngineConfig(gpu_memory_utilization=u)


def test_a_resize_to_the_default_profiles_again_without_the_old_pool(folder, monkeypatch):
    fake = fake_gpu(monkeypatch, FakeGpu(64 * MiB, 40 * MiB, 16 * MiB, 0, 23 * MiB))
    engine = load(folder, config(gpu_memory_utilization=0.5))
    first = engine.kv.manager.num_blocks
    small = engine.with_pool(num_blocks=3)
    assert small.pool_sizing is None and small.kv.manager.num_blocks == 3
    fake.peak += small.kv.nbytes  # the old pool is allocated while the warm-up runs
    again = small.with_pool()
    assert again.kv.manager.num_blocks == first and again.pool_sizing == engine.pool_sizing


@pytest.mark.parametrize("measured", [True, False], ids=["this GPU", "--memory"])
def test_the_plan_and_the_load_size_the_same_pool(folder, monkeypatch, measured):
    """The same device figures; the warm-up measures what the plan estimated (the weights,
    RoPE's tables and the step's workspace, beside the tensors already there): the same
    blocks."""
    conf = config(gpu_memory_utilization=0.5)
    cfg = ModelConfig.from_file(folder / "config.json")
    monkeypatch.setattr(gpu, "capability", lambda device: (8, 9))
    weights = memory_plan.plan_memory(cfg, "fp32", "cuda", memory=2**30, config=conf).weight_bytes
    step = memory_plan.workspace_bytes(cfg, torch.float32, conf)
    tables = memory_plan.rope_bytes(cfg)  # on the device, as a warm-up's peak counts them
    others = 3 * MiB if measured else 0  # tensors this process holds beside the model
    non_torch = 5 * MiB if measured else memory_plan.CUDA_RUNTIME_BYTES
    total = 2 * (non_torch + others + weights + tables + step + MiB)  # a room of 1 MiB at 0.5
    reserved = others + 2 * MiB
    fake = fake_gpu(monkeypatch, FakeGpu(total, total - non_torch - reserved, reserved, others, 0))
    plan = memory_plan.plan_memory(
        cfg, "fp32", "cuda", memory=None if measured else total, config=conf
    )
    fake.peak = SCRATCH + others + weights + tables + step
    engine = load(folder, conf)
    assert plan.weight_bytes == engine.weights_bytes == weights
    assert plan.pool_sizing is not None and engine.pool_sizing is not None
    assert plan.pool_sizing.room == engine.pool_sizing.room == MiB
    assert plan.pool_sizing.blocks == engine.kv.manager.num_blocks == expected_blocks(MiB)
    assert plan.kv_pool_bytes == engine.kv.nbytes
    assert plan.budget_bytes == total and plan.usable_bytes == total // 2
    assert plan.runtime_bytes == non_torch + others
    assert plan.max_context == CONTEXT  # (a load's transient overhead is another matter)
    # the plan's own sum: its usable share less all but the pool leaves the pool, to a block
    assert 0 <= plan.kv_room_bytes - plan.kv_pool_bytes < BLOCK * TOKEN_BYTES


def test_the_plan_command_takes_the_flag(folder, capsys):
    code = main(["plan", "--model", str(folder / "config.json"), "--device", "cuda",
                 "--memory", "2GiB", "--precision", "fp32", "--gpu-memory-utilization", "0.5",
                 "--json"])  # fmt: skip
    assert code == 0
    (plan,) = json.loads(capsys.readouterr().out)
    assert plan["budget_bytes"] == 2 * 2**30 and plan["utilization"] == 0.5
    assert plan["pool_sizing"]["utilization"] == 0.5 and plan["fits"]
    code = main(["plan", "--model", str(folder / "config.json"), "--device", "cuda",
                 "--memory", "64MiB", "--gpu-memory-utilization", "1.5"])  # fmt: skip
    assert code == 2
    assert "gpu_memory_utilization must be in (0, 1]" in capsys.readouterr().err


def test_the_app_leaves_a_gpu_pool_to_the_load_until_the_user_sets_one(
    folder, monkeypatch, tmp_path
):
    """The window asks for no size on a GPU until the user sets one (a CPU keeps the
    control's), the load then profiles, and the model's info carries the size it chose."""
    from types import SimpleNamespace

    from PySide6.QtCore import QSettings

    import app.loading
    from app.gui.main_window import MainWindow
    from app.gui.worker import model_info
    from app.loading import LoadSpec, engine_config

    settings = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)
    window = SimpleNamespace(settings=settings, controls=SimpleNamespace(kv_memory_mib=lambda: 96))
    assert MainWindow._kv_memory_mib(window, "cuda:0") is None  # type: ignore[arg-type]
    assert MainWindow._kv_memory_mib(window, "cpu") == 96  # type: ignore[arg-type]
    settings.setValue("kv_pool_chosen", True)  # what an edit of the control records
    assert MainWindow._kv_memory_mib(window, "cuda:0") == 96  # type: ignore[arg-type]

    assert engine_config(LoadSpec(str(folder), device="cpu", kv_memory_mib=None)).kv_memory == (
        512 * MiB
    )
    monkeypatch.setattr(app.loading, "resolve_device", lambda device: device)
    spec = LoadSpec(str(folder), device="cuda", kv_memory_mib=None)
    conf = engine_config(spec)
    assert conf.kv_memory is None and conf.num_blocks is None  # profiled
    fake_gpu(monkeypatch, FakeGpu(64 * MiB, 40 * MiB, 16 * MiB, 0, 23 * MiB))
    engine = load(folder, config(gpu_memory_utilization=0.5))
    info = model_info(engine, spec)
    assert info.kv_memory_mib == round(engine.kv.nbytes / MiB)
    assert f"KV pool: {engine.pool_sizing.summary()}" in info.paths  # type: ignore[union-attr]


def test_a_share_of_the_device_reads_as_the_card_this_process_can_use(monkeypatch):
    """Where the allocator is held to a share of the GPU (``set_per_process_memory_fraction``:
    a GPU shared, or gpu-check's 12 GB card on a bigger one), the pool is sized from that
    share beside what is not torch's, not from the whole device. torch.cuda's readings are
    given here (no GPU on these machines); the arithmetic is the engine's."""
    from engine.hardware import memory

    GiB = 2**30
    cuda = torch.cuda
    readings = {"mem_get_info": lambda d: (70 * GiB, 80 * GiB),  # 10 GiB in use
                "memory_reserved": lambda d: 9 * GiB,  # of which torch holds 9
                "memory_allocated": lambda d: 8 * GiB, "max_memory_allocated": lambda d: 8 * GiB,
                "get_per_process_memory_fraction": lambda d: 0.15}  # fmt: skip
    for name, value in readings.items():
        monkeypatch.setattr(cuda, name, value)
    figures = memory.CudaMemory(torch.device("cuda", 0)).read()
    assert figures.total == int(80 * GiB * 0.15) + 1 * GiB  # torch's share + not torch's 1 GiB
    assert figures.non_torch == 1 * GiB
    assert figures.free == figures.total - 1 * GiB - 9 * GiB
    assert memory.free_memory(torch.device("cuda", 0)) == figures.free
    monkeypatch.setattr(cuda, "get_per_process_memory_fraction", lambda d: 1.0)
    whole = memory.CudaMemory(torch.device("cuda", 0)).read()
    assert (whole.total, whole.free, whole.non_torch) == (80 * GiB, 70 * GiB, 1 * GiB)
