"""How much memory a new model or KV pool could take on a device, now."""

from __future__ import annotations

import torch


def free_memory(device: torch.device) -> float:
    """Bytes a new model or pool could take on ``device``: the GPU's free memory, or the RAM
    the OS reports available."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free)
    import psutil

    return float(psutil.virtual_memory().available)
