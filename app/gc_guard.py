"""Garbage collection only in the UI thread.

Python's cyclic garbage collector runs in whichever thread happens to allocate when a
threshold is crossed. In this app that is often the engine worker or the model loader, and
if the garbage then holds Qt objects of the UI thread (a closed window, a removed message),
Qt destroys them from the wrong thread and the process can crash. So while the app runs,
automatic collection is off and a timer in the UI thread collects instead, generation by
generation as the automatic collector would (pyqtgraph's ``GarbageCollector`` does the same).
"""

from __future__ import annotations

import gc

from PySide6.QtCore import QObject, QTimer


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
        gc.collect()
        if self.was_enabled:
            gc.enable()
