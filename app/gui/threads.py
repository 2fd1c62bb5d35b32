"""What the app's engine threads (the chat's worker, the A/B lab's) share: a frame's length,
a lower CPU priority than the UI's, and a CUDA stream of their own on each device."""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

log = logging.getLogger(__name__)

FRAME_S = 1 / 60  # token text is flushed at most this often
ENGINE_NICENESS = 5  # how much lower than the UI the engine thread (and its helpers) runs


def yield_to_the_ui() -> None:
    """Lower the calling thread's CPU priority (Linux), so that the UI thread runs first.

    The engine keeps every core busy (torch's intra-op threads, which this thread's first
    parallel region creates and which inherit its priority, as Linux threads do). At equal
    priority the UI thread got under half a core while a reply streamed on a 2-core CPU, and a
    20 ms repaint took 50–60 ms. The UI needs a few percent of one core, so a lower engine
    priority costs the engine almost nothing. Linux only: elsewhere the call would change the
    whole process, so it does nothing there.
    """
    if not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)  # on Linux: this thread alone
        os.setpriority(os.PRIO_PROCESS, tid, min(current + ENGINE_NICENESS, 19))
    except OSError as exc:  # a sandbox that forbids it: run at the same priority
        log.debug("could not lower the engine thread's priority: %s", exc)


class OwnStreams:
    """A thread's own CUDA stream on each device it works on (the engine worker's, the lab's).

    torch keeps a current stream per device and thread, so once :meth:`use` has run for a
    device everything this thread runs there (steps, a new request's tensors, layer-timing
    events) goes to that stream, whichever engine launches it; engines on one device share
    it. It is created only for a CUDA device: a CPU model creates no CUDA context, and
    ``cuda:1`` work never lands on cuda:1's default stream. The current device is left as it
    was (``set_stream`` alone would change it). Call from the thread itself.
    """

    def __init__(self) -> None:
        self._streams: dict[int, Any] = {}  # CUDA device index → the stream there

    @property
    def by_device(self) -> dict[int, Any]:
        """CUDA device index → this thread's stream there."""
        return dict(self._streams)

    def use(self, device: str) -> None:
        if not device.startswith("cuda"):
            return
        import torch

        index = torch.device(device).index
        index = torch.cuda.current_device() if index is None else index
        if index in self._streams:
            return
        stream = torch.cuda.Stream(device=index)  # type: ignore[no-untyped-call]
        self._streams[index] = stream
        with torch.cuda.device(index):
            torch.cuda.set_stream(stream)

    def restore(self) -> None:
        """Put each device's default stream back (the thread is ending)."""
        if not self._streams:
            return
        import torch

        for index in self._streams:
            with torch.cuda.device(index):
                torch.cuda.set_stream(torch.cuda.default_stream(index))
        self._streams.clear()
