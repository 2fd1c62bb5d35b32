"""GPU memory as the driver sees it (NVML), for the torch CUDA device a model runs on.

torch numbers GPUs after ``CUDA_VISIBLE_DEVICES`` (and ``CUDA_DEVICE_ORDER``) picked and
ordered them; NVML numbers every GPU of the machine in PCI order. So torch's ``cuda:1`` is
found in NVML by its UUID (or, failing that, its PCI bus id), never by its index.

NVML is an instrument, not a need: without the library, without a driver, or once a GPU has
fallen off the bus, :func:`device_memory` answers ``None`` (the memory plot then shows what it
can), says why once in the log, and does not ask again.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NvmlMemory:
    used_bytes: int  # by every process on the GPU, this one included
    total_bytes: int


@dataclass(slots=True)
class NvmlState:
    """What this process learnt about NVML: whether it started, and each device's handle."""

    ready: bool | None = None  # None: not tried yet; False: unavailable for good
    handles: dict[int, Any] = field(default_factory=dict)  # torch index → handle or None
    logged: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)


_STATE = NvmlState()


def device_memory(device: torch.device) -> NvmlMemory | None:
    """Used and total memory of the GPU behind ``device``; ``None`` where NVML cannot say."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _STATE.lock:  # two workers (an A/B view) may ask at once
        handle = _handle(index)
        if handle is None:
            return None
        import pynvml

        try:
            info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        except pynvml.NVMLError as exc:  # GpuIsLost, Unknown …: the handle is no good now
            _STATE.handles[index] = None
            _log_once(f"lost {index}", "NVML lost cuda:%d (%s); GPU memory not shown", index, exc)
            return None
    return NvmlMemory(int(info.used), int(info.total))


def device_utilization(device: torch.device) -> int | None:
    """Percent of NVML's last sample period the GPU behind ``device`` was busy; ``None``
    where NVML cannot say (no GPU, no driver, a lost device)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _STATE.lock:
        handle = _handle(index)
        if handle is None:
            return None
        import pynvml

        try:
            return int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        except pynvml.NVMLError:
            return None


def _handle(index: int) -> Any:
    """NVML's handle for torch's device ``index`` (cached, ``None`` included)."""
    if index not in _STATE.handles:
        _STATE.handles[index] = _find_handle(index) if _started() else None
    return _STATE.handles[index]


def _started() -> bool:
    """Start NVML once per process; remember a failure so it is not retried every frame."""
    if _STATE.ready is None:
        try:
            import pynvml
        except ImportError:
            _STATE.ready = False
            _log_once("import", "pynvml is not installed; GPU memory (NVML) is not shown")
            return False
        try:
            pynvml.nvmlInit()
            _STATE.ready = True
        except pynvml.NVMLError as exc:  # LibraryNotFound, DriverNotLoaded, NoPermission …
            _STATE.ready = False
            _log_once("init", "NVML is unavailable (%s); GPU memory (NVML) is not shown", exc)
    return bool(_STATE.ready)


def _find_handle(index: int) -> Any:
    import pynvml

    props = torch.cuda.get_device_properties(index)
    for uuid in _nvml_uuids(props):
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(uuid)
        except pynvml.NVMLError:
            continue
    bus_id = _pci_bus_id(props)
    if bus_id is not None:
        try:
            return pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)
        except pynvml.NVMLError:
            pass
    _log_once(f"find {index}", "NVML does not know cuda:%d; GPU memory not shown", index)
    return None


def _nvml_uuids(props: Any) -> list[str]:
    """NVML's spellings of the device's UUID: torch prints it bare, NVML prefixes ``GPU-``
    (or ``MIG-`` for a MIG instance, whose memory is then what NVML reports)."""
    uuid = getattr(props, "uuid", None)
    if uuid is None:
        return []
    text = str(uuid)
    if text.startswith(("GPU-", "MIG-")):
        return [text]
    return [f"GPU-{text}", f"MIG-{text}"]


def _pci_bus_id(props: Any) -> str | None:
    """``domain:bus:device.0`` in NVML's spelling, where torch exposes the three numbers."""
    parts = [
        getattr(props, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")
    ]
    if any(not isinstance(p, int) for p in parts):
        return None
    domain, bus, dev = parts
    return f"{domain:08X}:{bus:02X}:{dev:02X}.0"


def _log_once(key: str, message: str, *args: object) -> None:
    if key not in _STATE.logged:
        _STATE.logged.add(key)
        log.warning(message, *args)
