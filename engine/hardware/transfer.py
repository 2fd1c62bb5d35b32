"""Moving a step's data between host and device without making the host wait more than once.

On a GPU the host runs ahead of the device, queueing kernels. It waits whenever it copies
pageable memory to the device (the driver stages it first) and whenever it reads a value back.
A step's inputs (token ids, positions, KV slots, sampling settings) go up through pinned
memory with ``non_blocking=True``, which queues the copy and returns; what the host needs back
(the sampled tokens, any log-probabilities) comes down in one transfer, the step's one wait.

Pinned buffers come from torch's caching host allocator, which keeps each one until the copy
that reads it has run, so a buffer is never overwritten under a pending copy. On a CPU both
functions are plain tensor operations.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def to_device(host: Tensor, device: torch.device) -> Tensor:
    """``host`` (a CPU tensor) on ``device``: queued without a host wait on a GPU (pinned,
    ``non_blocking``); ``host`` itself on a CPU."""
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def upload(values: Sequence[int], device: torch.device, dtype: torch.dtype = torch.long) -> Tensor:
    """A Python list on ``device`` (:func:`to_device`)."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def fetch(*tensors: Tensor) -> list[list[float]]:
    """The values of ``tensors`` on the host, each flattened, in one transfer: the one wait.

    They travel as one float64 tensor, which holds every token id (< 2**53) and every fp32
    value exactly; a caller takes ``int()`` of what were ids."""
    if not tensors:
        return []
    flat = [t.reshape(-1).to(torch.float64) for t in tensors]
    values = (flat[0] if len(flat) == 1 else torch.cat(flat)).tolist()
    out, start = [], 0
    for t in tensors:
        out.append(values[start : start + t.numel()])
        start += t.numel()
    return out
