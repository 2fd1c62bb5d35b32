"""The CUDA and NVIDIA paths, tested where no GPU exists: NVML and torch.cuda replaced by fakes,
the CUDA INT4 packing by a Python transcription of torch's kernel. ``make gpu-check`` runs the
real thing on a GPU (checks/gpu/)."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from engine.core.instruments import LayerTimer, memory_by_kind
from engine.errors import InvalidRequestError
from engine.formats import int4 as int4_format
from engine.formats.int4 import dequantize_int4, probe_int4_layout, quantize_int4
from engine.hardware import nvml
from engine.kernels import lowbit
from engine.quant import int8
from engine.quant.embedding import QuantizedEmbedding
from engine.quant.int4 import Int4Linear
from engine.quant.int8 import Int8Linear

pynvml = pytest.importorskip("pynvml")
GIB = 2**30
A, B = "aaaaaaaa-0000-0000-0000-000000000000", "bbbbbbbb-0000-0000-0000-000000000000"

# -- NVML ----------------------------------------------------------------------------------------


class FakeNvml:
    """Two GPUs as NVML numbers them (PCI order), each with a UUID, a bus id and memory."""

    def __init__(self) -> None:
        self.gpus = {
            f"GPU-{A}": ("00000000:01:00.0", 1 * GIB, 10 * GIB),
            f"GPU-{B}": ("00000000:41:00.0", 5 * GIB, 80 * GIB),
        }
        self.init_calls = 0
        self.memory_calls = 0
        self.init_error: Exception | None = None
        self.lost: set[str] = set()

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(nvml, "_STATE", nvml.NvmlState())
        monkeypatch.setattr(pynvml, "nvmlInit", self.init)
        monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByUUID", self.by_uuid)
        monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByPciBusId", self.by_bus)
        monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", self.by_index)
        monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", self.memory)
        monkeypatch.setattr(pynvml, "nvmlDeviceGetUtilizationRates", self.utilization)

    def init(self) -> None:
        self.init_calls += 1
        if self.init_error is not None:
            raise self.init_error

    def by_uuid(self, uuid: str) -> str:
        if uuid not in self.gpus:
            raise pynvml.NVMLError_NotFound()
        return uuid

    def by_bus(self, bus: str) -> str:
        for uuid, (bus_id, _, _) in self.gpus.items():
            if bus_id == bus:
                return uuid
        raise pynvml.NVMLError_NotFound()

    def by_index(self, index: int) -> str:
        raise AssertionError("NVML's index is not torch's; look devices up by UUID")

    def memory(self, handle: str) -> SimpleNamespace:
        self.memory_calls += 1
        if handle in self.lost:
            raise pynvml.NVMLError_GpuIsLost()
        _, used, total = self.gpus[handle]
        return SimpleNamespace(used=used, total=total, free=total - used)

    def utilization(self, handle: str) -> SimpleNamespace:
        if handle in self.lost:
            raise pynvml.NVMLError_GpuIsLost()
        return SimpleNamespace(gpu=37 if handle == f"GPU-{A}" else 91, memory=0)


def torch_sees(monkeypatch: pytest.MonkeyPatch, *props: SimpleNamespace) -> None:
    """torch.cuda as it looks with ``props[i]`` for cuda:i."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def gpu(uuid: str | None, domain: int = 0, bus: int = 0, dev: int = 0) -> SimpleNamespace:
    return SimpleNamespace(uuid=uuid, pci_domain_id=domain, pci_bus_id=bus, pci_device_id=dev)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    fake = FakeNvml()
    fake.install(monkeypatch)
    return fake


def test_utilization_is_read_for_the_torch_device_and_absent_where_nvml_cannot_say(
    fake, monkeypatch
):
    torch_sees(monkeypatch, gpu(B), gpu(A))
    assert nvml.device_utilization(torch.device("cuda", 0)) == 91
    assert nvml.device_utilization(torch.device("cuda", 1)) == 37
    assert nvml.device_utilization(torch.device("cpu")) is None
    fake.lost.add(f"GPU-{B}")
    assert nvml.device_utilization(torch.device("cuda", 0)) is None


def test_torch_devices_are_found_by_uuid_under_a_reordering_of_visible_devices(fake, monkeypatch):
    # CUDA_VISIBLE_DEVICES=1,0: torch's cuda:0 is NVML's GPU 1 and the other way round.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    torch_sees(monkeypatch, gpu(B), gpu(A))
    assert nvml.device_memory(torch.device("cuda", 0)) == nvml.NvmlMemory(5 * GIB, 80 * GIB)
    assert nvml.device_memory(torch.device("cuda", 1)) == nvml.NvmlMemory(1 * GIB, 10 * GIB)
    assert nvml.device_memory(torch.device("cuda")) == nvml.NvmlMemory(5 * GIB, 80 * GIB)
    assert fake.init_calls == 1


def test_the_pci_bus_id_finds_a_device_whose_uuid_nvml_does_not_know(fake, monkeypatch):
    torch_sees(monkeypatch, gpu(None, bus=0x41), gpu("cccccccc-0000-0000-0000-000000000000"))
    assert nvml.device_memory(torch.device("cuda", 0)) == nvml.NvmlMemory(5 * GIB, 80 * GIB)
    assert nvml.device_memory(torch.device("cuda", 1)) is None  # neither UUID nor bus known


@pytest.mark.parametrize("error", ["NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded"])
def test_a_missing_driver_gives_no_figures_and_one_log_line(fake, monkeypatch, caplog, error):
    fake.init_error = getattr(pynvml, error)()
    torch_sees(monkeypatch, gpu(A))
    with caplog.at_level(logging.WARNING, logger="engine.nvml"):
        for _ in range(3):
            assert nvml.device_memory(torch.device("cuda", 0)) is None
    assert fake.init_calls == 1  # not retried every frame
    assert len(caplog.records) == 1


def test_without_pynvml_there_are_no_figures(fake, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    torch_sees(monkeypatch, gpu(A))
    assert nvml.device_memory(torch.device("cuda", 0)) is None


def test_a_device_that_disappears_stops_being_asked(fake, monkeypatch, caplog):
    torch_sees(monkeypatch, gpu(A))
    assert nvml.device_memory(torch.device("cuda", 0)) is not None
    fake.lost.add(f"GPU-{A}")
    with caplog.at_level(logging.WARNING, logger="engine.nvml"):
        for _ in range(3):
            assert nvml.device_memory(torch.device("cuda", 0)) is None
    assert fake.memory_calls == 2
    assert len(caplog.records) == 1


def test_memory_by_kind_on_cuda_carries_reserved_and_nvml(fake, monkeypatch):
    torch_sees(monkeypatch, gpu(A))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 700)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 1024)
    mem = memory_by_kind(400, 200, torch.device("cuda", 0))
    assert (mem.cuda_allocated_bytes, mem.cuda_reserved_bytes) == (700, 1024)
    assert mem.workspace_bytes == 700 - 400 - 200
    assert (mem.nvml_used_bytes, mem.nvml_total_bytes) == (1 * GIB, 10 * GIB)
    cpu = memory_by_kind(400, 200, torch.device("cpu"))
    assert cpu.nvml_used_bytes is None and cpu.cuda_reserved_bytes is None
    assert fake.init_calls == 1  # the CPU model did not ask NVML


# -- the INT8 fallback rule --------------------------------------------------------------------


def raising(error: BaseException) -> Any:
    def kernel(*args: object) -> torch.Tensor:
        raise error

    return kernel


def test_out_of_memory_in_the_int8_probe_propagates(monkeypatch):
    monkeypatch.setattr(int8, "_INT8_KERNEL", {})
    monkeypatch.setattr(torch, "_weight_int8pack_mm", raising(torch.cuda.OutOfMemoryError("oom")))
    with pytest.raises(torch.cuda.OutOfMemoryError):
        int8.int8_kernel_runs(torch.device("cpu"))
    assert int8._INT8_KERNEL == {}  # nothing decided: the next load probes again


def test_a_missing_int8_kernel_switches_to_converting_once(monkeypatch):
    monkeypatch.setattr(int8, "_INT8_KERNEL", {})
    missing = raising(NotImplementedError("no CUDA kernel for aten::_weight_int8pack_mm"))
    monkeypatch.setattr(torch, "_weight_int8pack_mm", missing)
    assert int8.int8_kernel_runs(torch.device("cpu")) is False
    assert int8._INT8_KERNEL == {"cpu": False}


@pytest.mark.parametrize(
    "error", [torch.cuda.OutOfMemoryError("CUDA out of memory"), NotImplementedError("gone")]
)
def test_an_error_in_the_int8_kernel_propagates_and_keeps_the_path(monkeypatch, error):
    w = torch.randn(16, 32)
    layer = Int8Linear(w, None, torch.bfloat16)
    layer.use_kernel = True
    monkeypatch.setattr(torch, "_weight_int8pack_mm", raising(error))
    with pytest.raises(type(error)):
        layer(torch.randn(2, 32, dtype=torch.bfloat16))
    assert layer.use_kernel  # a transient failure is not a verdict on the kernel


def test_the_converting_int8_path_equals_the_kernel_reference():
    w = torch.randn(16, 32)
    layer = Int8Linear(w, None, torch.bfloat16)
    layer.use_kernel = False
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    ref = torch.nn.functional.linear(x.float(), layer.weight.float()) * layer.scales.float()
    assert torch.allclose(layer(x).float(), ref, rtol=2e-2, atol=2e-2)


# -- reading embedding rows from the CUDA INT4 layout ----------------------------------------------


def nv_pack(q: torch.Tensor, tiles: int) -> torch.Tensor:
    """torch's CUDA ``_convert_weight_to_int4pack`` (NVIDIA branch of
    aten/src/ATen/native/cuda/int4mm.cu, matrix_to_m16n8k16_Bint4_layout) in Python: warp lane
    ``t`` of tile (n_tile, k_outer) packs rows ``8·n_tile + t/4`` and bytes ``t%4 (+4)`` of
    each pair of 16-column k-tiles into one int32."""
    n, k = q.shape
    b = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.int64)  # the uint8 [n, k/2] the op takes
    out = torch.zeros(n // 8, k // (16 * tiles), 32, tiles // 2, dtype=torch.int64)
    lane = torch.arange(32)
    for n_tile in range(n // 8):
        rows = n_tile * 8 + lane // 4
        for outer in range(k // (16 * tiles)):
            for inner in range(0, tiles, 2):
                base = (outer * tiles + inner) * 8
                byte = base + lane % 4
                v = [b[rows, c] for c in (byte, byte + 4, byte + 8, byte + 12)]
                lo, hi = [x & 0xF for x in v], [x & 0xF0 for x in v]
                word = lo[3] << 28 | lo[2] << 24 | lo[1] << 20 | lo[0] << 16
                word |= hi[3] << 8 | hi[2] << 4 | hi[1] | hi[0] >> 4
                out[n_tile, outer, :, inner // 2] = word
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def shuffled_tiles_pack(tile_rows: int) -> Any:
    """Another layout (ROCm's tiles are 16 rows): a fixed permutation inside each tile."""

    def pack(q: torch.Tensor, tiles: int) -> torch.Tensor:
        n, k = q.shape
        cols = 16 * tiles
        size = tile_rows * cols
        perm = torch.randperm(size, generator=torch.Generator().manual_seed(1))
        t = q.reshape(n // tile_rows, tile_rows, k // cols, cols).permute(0, 2, 1, 3)
        flat = t.reshape(-1, size)[:, perm].reshape(-1, 8).to(torch.int64)
        words = (flat << (4 * torch.arange(8))).sum(dim=1)
        return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)

    return pack


@pytest.mark.parametrize("tiles", [2, 4, 8])
def test_the_probe_reads_the_nvidia_layout(tiles):
    layout = probe_int4_layout(torch.device("cpu"), tiles, nv_pack)
    assert layout is not None and (layout.tile_rows, layout.tile_cols) == (8, 16 * tiles)
    q = torch.randint(0, 16, (48, 4 * 16 * tiles), dtype=torch.int32)
    ids = torch.tensor([47, 0, 9, 9, 23])
    assert torch.equal(layout.read_rows(nv_pack(q, tiles), ids, q.shape[1]), q[ids])


def test_the_probe_finds_other_tile_shapes_and_refuses_what_is_no_permutation():
    layout = probe_int4_layout(torch.device("cpu"), 2, shuffled_tiles_pack(16))
    assert layout is not None and layout.tile_rows == 16
    xored = shuffled_tiles_pack(8)
    assert probe_int4_layout(torch.device("cpu"), 2, lambda q, t: xored(q ^ 8, t)) is None


def cuda_like_head(monkeypatch: pytest.MonkeyPatch, pack: Any) -> tuple[Int4Linear, torch.Tensor]:
    """An Int4Linear whose weight is laid out as on CUDA (by ``pack``) and the dequantized
    matrix it holds."""
    monkeypatch.setattr(int4_format, "_CUDA_INT4_LAYOUTS", {})
    monkeypatch.setattr(int4_format, "pack_int4_cuda", pack)
    torch.manual_seed(0)
    w = torch.randn(40, 96)  # N padded to 48, K padded to 128 for g64
    with lowbit.choosing("torch"):  # torch's packing, whose shape CUDA's shares
        head = Int4Linear(w, None, 64)
    padded = torch.nn.functional.pad(w, (0, head.padded_k, 0, head.padded_n))
    q, scale, zero = quantize_int4(padded, 64)
    head.weight = pack(q, head.inner_k_tiles)
    head.on_cuda, head.packing = True, int4_format.TORCH_CUDA
    return head, dequantize_int4(q, scale, zero, 64)[:40, :96]


def test_a_tied_int4_head_on_cuda_serves_embedding_rows_from_its_packed_weight(monkeypatch):
    head, dense = cuda_like_head(monkeypatch, nv_pack)
    embed = QuantizedEmbedding(head, torch.float32, torch.ones(96))
    ids = torch.tensor([[3, 39, 0], [17, 17, 8]])
    assert torch.equal(embed(ids), dense[ids])


def test_a_cuda_int4_layout_that_cannot_be_read_is_refused_by_name(monkeypatch):
    head, _ = cuda_like_head(monkeypatch, nv_pack)
    monkeypatch.setattr(int4_format, "pack_int4_cuda", lambda q, t: nv_pack(q ^ 8, t))
    with pytest.raises(InvalidRequestError, match="int8\\+head"):
        QuantizedEmbedding(head, torch.float32, torch.ones(96))


# -- layer timings on the model's device --------------------------------------------------------


class FakeEvent:
    def __init__(self, log: list[str], enable_timing: bool = False) -> None:
        self.log = log
        self.index = sum(1 for line in log if line.startswith("record"))  # its order

    def record(self, stream: object = None) -> None:
        self.index = sum(1 for line in self.log if line.startswith("record"))
        self.log.append(f"record on {stream}")

    def synchronize(self) -> None:
        self.log.append(f"wait for event {self.index}")

    def elapsed_time(self, end: FakeEvent) -> float:
        return 2.0  # ms


def test_layer_timer_records_and_waits_on_the_models_device(monkeypatch):
    """Events on the model's device and stream; read back waiting for the last one only (they
    are recorded in order on one stream), never the whole device: the A/B lab's stream goes
    on."""
    log: list[str] = []

    @contextlib.contextmanager
    def device(d: object) -> Iterator[None]:
        log.append(f"enter {d}")
        yield

    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=False: FakeEvent(log))
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: f"stream of {d}")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: log.append(f"sync {d}"))
    layers = nn.ModuleList(
        nn.ModuleDict({"attn": nn.Identity(), "mlp": nn.Identity()}) for _ in range(2)
    )
    timer = LayerTimer(layers, torch.device("cuda", 1))
    timer.enable()
    for layer in layers:
        layer["attn"](torch.ones(1))
        layer["mlp"](torch.ones(1))
    timings = timer.collect()
    assert [t.attention_s for t in timings] == [0.002, 0.002]
    assert set(log) == {"enter cuda:1", "record on stream of cuda:1", "wait for event 7"}
    assert log.count("wait for event 7") == 1  # the 8th and last event: 2 layers × 2 parts × 2


# -- the worker's stream ---------------------------------------------------------------------------


class FakeCuda:
    """torch.cuda's streams as the worker uses them, recording what it asks."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.created: list[int] = []
        self.current: dict[int, str] = {}
        self.device_now = 0
        self.synced: list[str] = []
        for name in ("Stream", "device", "set_stream", "default_stream", "current_device"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name.lower()))
        monkeypatch.setattr(torch.cuda, "current_stream", self.current_stream)

    def stream(self, device: int) -> str:
        self.created.append(device)
        return f"worker stream {device}"

    @contextlib.contextmanager
    def device(self, index: int) -> Iterator[None]:
        before, self.device_now = self.device_now, index
        yield
        self.device_now = before

    def set_stream(self, stream: str) -> None:
        self.current[self.device_now] = stream

    def default_stream(self, index: int) -> str:
        return f"default {index}"

    def current_device(self) -> int:
        return self.device_now

    def current_stream(self, device: torch.device) -> SimpleNamespace:
        return SimpleNamespace(synchronize=lambda: self.synced.append(str(device)))


def on(device: str) -> Any:
    return SimpleNamespace(device=torch.device(device))


def test_the_worker_makes_a_stream_only_for_a_cuda_engine_and_on_its_device(monkeypatch):
    from app.gui.worker import EngineWorker

    cuda = FakeCuda(monkeypatch)
    worker = EngineWorker()
    with worker._device_stream():
        worker._use_device_stream(on("cpu"))
        assert cuda.created == []  # a CPU model: no CUDA context at all
        worker._use_device_stream(on("cuda:1"))
        worker._use_device_stream(on("cuda:1"))  # a reload on the same GPU shares it
        worker._use_device_stream(on("cuda"))
        assert cuda.created == [1, 0]
        assert cuda.current == {1: "worker stream 1", 0: "worker stream 0"}
        assert cuda.device_now == 0  # the current device is left alone
    assert cuda.current == {1: "default 1", 0: "default 0"}


def test_the_loader_waits_for_its_gpu_copies_before_handing_the_engine_over(monkeypatch):
    from app.gui import worker as worker_module
    from app.gui.commands import _Loaded
    from app.gui.worker import EngineWorker
    from app.loading import LoadSpec

    cuda = FakeCuda(monkeypatch)
    worker = EngineWorker(loader=lambda spec, progress: on("cuda:1"))
    posted: list[object] = []
    monkeypatch.setattr(worker_module, "model_info", lambda engine, spec: "info")
    monkeypatch.setattr(worker, "post", lambda command: posted.append((list(cuda.synced), command)))
    worker._load_in_background(LoadSpec(device="cuda:1"))
    [(synced_before, command)] = posted
    assert isinstance(command, _Loaded) and synced_before == ["cuda:1"]
