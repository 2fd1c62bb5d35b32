"""The rows a step sends between a GPU's model and a layer's experts kept in host memory
(``--cpu-experts``), and back.

A layer whose routed experts stay on the CPU (a 12 GB card that cannot hold a mixture of
experts' weights: llama.cpp users' ``-ot exps=CPU``) routes its tokens on the GPU, then its
tokens' rows, their chosen experts and weights cross to the host, the CPU kernels run the
experts (:mod:`engine.kernels.experts`), and the sum crosses back. What this costs beside the
experts' own time is the crossing, so it is made once a layer and as little of a wait as it
can be:

* **down**: the three tensors are copied into page-locked (pinned) host buffers of this
  layer's, asynchronously on the step's stream, and one event is recorded after them. The
  host waits on that event only (:meth:`HostCrossing.wait`), not on the stream: what the GPU
  was given after the copies (the shared expert of Qwen2-MoE, queued before the wait) runs
  while the CPU runs the routed experts.
* **up**: the experts' sum is copied into a pinned buffer and sent to the GPU asynchronously,
  so the host goes on queuing the next layer; the buffer is written again only once the
  event recorded after that copy has passed.

Pageable copies would each wait for the stream to drain (three waits a layer, and a
blocking upload). The experts' weights themselves are not pinned: the CPU reads them where
they are, and page-locking tens of GiB would take them from the OS for nothing.

On a CPU (both sides the CPU: a test, a machine without a GPU) nothing crosses and nothing
waits: the same code runs with every tensor where it is.
"""

from __future__ import annotations

import torch
from torch import Tensor


class HostCrossing:
    """One layer's crossings to the host and back (the module's docstring). Each ``lane`` (a
    micro-batch of the step: :mod:`engine.model.lanes`) has buffers and events of its own,
    so two can be in flight at once."""

    def __init__(self, device: torch.device) -> None:
        #: the model's device (the GPU's), where the rows come from and go back to
        self.device = device
        self._pinned = device.type == "cuda"
        # (each event is recorded on the model's device's stream, which need not be the
        # current device's: an engine on cuda:1)
        self._buffers: dict[tuple[str, int], Tensor] = {}
        self._copied: dict[int, torch.cuda.Event] = {}
        self._returned: dict[int, torch.cuda.Event] = {}

    def down(self, *tensors: Tensor, lane: int = 0) -> list[Tensor]:
        """``tensors`` on the host: copies queued into the lane's pinned buffers (wait with
        :meth:`wait` before reading them), or the tensors themselves on a CPU."""
        if not self._pinned:
            return [t.to("cpu") for t in tensors]
        out = [
            self._buffer(f"down{i}", lane, t).copy_(t, non_blocking=True)
            for i, t in enumerate(tensors)
        ]
        self._copied[lane] = event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))
        return out

    def wait(self, lane: int = 0) -> None:
        """Until the lane's rows sent :meth:`down` are on the host (not until the GPU is
        idle)."""
        if lane in self._copied:
            self._copied[lane].synchronize()

    def up(self, y: Tensor, lane: int = 0) -> Tensor:
        """The host's result ``y`` on the model's device, its copy queued."""
        if not self._pinned:
            return y.to(self.device)
        if lane in self._returned:  # the buffer's last upload has left it
            self._returned[lane].synchronize()
        staged = self._buffer("up", lane, y).copy_(y)
        out = staged.to(self.device, non_blocking=True)
        self._returned[lane] = event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))
        return out

    def _buffer(self, name: str, lane: int, like: Tensor) -> Tensor:
        """A pinned buffer shaped as ``like``, grown (never shrunk) as steps need."""
        held = self._buffers.get((name, lane))
        if held is None or held.dtype != like.dtype or held.numel() < like.numel():
            held = torch.empty(like.numel(), dtype=like.dtype, pin_memory=True)
            self._buffers[name, lane] = held
        return held[: like.numel()].view(like.shape)
