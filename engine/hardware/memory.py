"""How much memory a new model or KV pool could take on a device, now; and the CUDA memory
figures the KV pool is sized from (:mod:`engine.core.pool_profile`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


def free_memory(device: torch.device) -> float:
    """Bytes a new model or pool could take on ``device``: the GPU's free memory, or the RAM
    the OS reports available."""
    if device.type == "cuda":
        return float(CudaMemory(device).read().free)
    import psutil

    return float(psutil.virtual_memory().available)


@dataclass(frozen=True, slots=True)
class MemoryFigures:
    """One reading of a GPU's memory, in bytes."""

    total: int  # the device's memory
    free: int  # what the driver says is free (torch's cached blocks are not)
    reserved: int  # what torch's caching allocator holds, in use or cached
    allocated: int  # what live tensors take now
    peak: int  # the most live tensors took since the last :meth:`DeviceMemory.reset_peak`

    @property
    def non_torch(self) -> int:
        """Memory in use that is not torch's: the CUDA context, cuBLAS and cuDNN workspaces,
        other processes on the GPU."""
        return max(0, self.total - self.free - self.reserved)


class DeviceMemory(Protocol):
    """The memory interface the KV pool is sized through: the seam where tests put a fake
    GPU, so that the sizing logic (and its warm-up forward) runs on a CPU."""

    def reset_peak(self) -> None:
        """Start counting :attr:`MemoryFigures.peak` from what is allocated now."""

    def read(self) -> MemoryFigures:
        """The figures now."""

    def release(self) -> None:
        """Give the allocator's cached blocks back to the device."""


class CudaMemory:
    """:class:`DeviceMemory` of a CUDA device, through ``torch.cuda``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def read(self) -> MemoryFigures:
        """The figures now; where the process's allocator is held to a share of the device
        (``torch.cuda.set_per_process_memory_fraction``: a GPU shared, or a smaller card
        emulated), the device as this process can use it: that share for torch, beside what
        is not torch's."""
        free, total = torch.cuda.mem_get_info(self.device)
        reserved = int(torch.cuda.memory_reserved(self.device))
        share = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch ≥ 2.6
        fraction = 1.0 if share is None else share(self.device)
        if fraction < 1.0:
            not_torch = max(0, total - free - reserved)
            total = min(total, int(total * fraction) + not_torch)
            free = min(free, max(0, total - not_torch - reserved))
        return MemoryFigures(
            total=int(total),
            free=int(free),
            reserved=reserved,
            allocated=int(torch.cuda.memory_allocated(self.device)),
            peak=int(torch.cuda.max_memory_allocated(self.device)),
        )

    def release(self) -> None:
        torch.cuda.empty_cache()


def device_memory(device: torch.device) -> DeviceMemory | None:
    """The memory interface of ``device`` where its KV pool is sized by a profiled warm-up
    (a CUDA GPU); None elsewhere (a CPU's pool is a share of its RAM). Tests monkeypatch this
    to size a CPU's pool as a GPU's."""
    return CudaMemory(device) if device.type == "cuda" else None
