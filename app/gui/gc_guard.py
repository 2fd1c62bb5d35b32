"""Garbage collection only in the UI thread, and never over the model's objects.

Python's cyclic garbage collector runs in whichever thread happens to allocate when a
threshold is crossed. In this app that is often the engine worker or the model loader, and
if the garbage then holds Qt objects of the UI thread (a closed window, a removed message),
Qt destroys them from the wrong thread and the process can crash. So while the app runs,
automatic collection is off and a timer in the UI thread collects instead, generation by
generation as the automatic collector would (pyqtgraph's ``GarbageCollector`` does the same).

A collection stops the UI thread for as long as it takes to traverse its generation. Right
after a model loads, the young generations hold every object the load created (modules,
parameters, tokenizer tables): collecting them took 80–240 ms on a 2-core AVX2 CPU, a visible
freeze in the middle of a reply. :func:`settle` is called in the UI thread once a load is
done: one full collection, then ``gc.freeze()`` moves every survivor into the permanent
generation, which later collections skip, so they only traverse what was made since.
Before freezing it unfreezes and collects, so a model dropped since the last load (and any
cycle it was in) is reclaimed then.
"""

from __future__ import annotations

import gc
import logging
import time

from PySide6.QtCore import QObject, QTimer

log = logging.getLogger(__name__)


class GuiGarbageCollector(QObject):
    def __init__(self, interval_ms: int = 500, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.threshold = gc.get_threshold()
        self.was_enabled = gc.isenabled()
        gc.disable()
        self.timer = QTimer(self, interval=interval_ms)
        self.timer.timeout.connect(self.check)
        self.timer.start()

    def check(self) -> None:
        counts = gc.get_count()
        for generation in (2, 1, 0):
            if counts[generation] > self.threshold[generation]:
                gc.collect(generation)
                return

    def stop(self) -> None:
        """Collect once here, in the UI thread, and give collection back to Python."""
        self.timer.stop()
        gc.unfreeze()
        gc.collect()
        if self.was_enabled:
            gc.enable()


def settle() -> None:
    """Collect everything once and freeze the survivors (after a load; see above)."""
    started = time.perf_counter()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    log.debug(
        "gc settled in %.0f ms; %d objects frozen",
        (time.perf_counter() - started) * 1e3,
        gc.get_freeze_count(),
    )
