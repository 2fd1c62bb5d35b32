"""SIGTERM and SIGINT for a Qt event loop: the app closes as if its window's close button
was clicked (a logout, a shutdown, Ctrl+C in the terminal).

Python runs a signal handler only when the interpreter next executes bytecode in the main
thread, and while ``QApplication.exec()`` waits for events that can be never: the loop is C++.
Python's C-level handler also writes the signal number, one byte, to the file descriptor given
to :func:`signal.set_wakeup_fd`. :class:`SignalForwarder` hands it one end of a socket pair and
watches the other with a ``QSocketNotifier``, so a signal wakes the event loop at once and the
callback runs there, as an ordinary event: between two slots, never in the middle of one
(which a handler doing the work itself could be). No timer ticks while nothing happens, unlike
the other common pattern (a ``QTimer`` every ~200 ms just to let Python in), and a socket pair
rather than a pipe works on Windows too.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
from collections.abc import Callable, Iterator, Sequence
from types import FrameType

from PySide6.QtCore import QObject, QSocketNotifier

log = logging.getLogger(__name__)

#: what asks a desktop app to close: the session ending (SIGTERM) and Ctrl+C (SIGINT)
CLOSING_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _note(signum: int, frame: FrameType | None) -> None:
    """The Python-level handler: nothing to do, the byte on the wakeup socket does the work.

    It must exist all the same: with ``SIG_DFL`` the process would just die, and only a
    Python-level handler makes the interpreter write to the wakeup socket.
    """


class SignalForwarder(QObject):
    """Calls ``callback(signum)`` in the Qt event loop for each of ``signals`` received.

    Must be created in the main thread (the only one Python lets install handlers) while a
    ``QCoreApplication`` exists; :meth:`restore` puts back the previous handlers and wakeup
    descriptor. :func:`forward_signals` does both around a block.
    """

    def __init__(
        self,
        callback: Callable[[int], object],
        signals: Sequence[signal.Signals] = CLOSING_SIGNALS,
        parent: QObject | None = None,
    ) -> None:
        super().__init__(parent)
        self.callback = callback
        self.signals = frozenset(signals)
        self._read, self._write = socket.socketpair()
        self._read.setblocking(False)
        self._write.setblocking(False)  # the C handler must never block
        self._notifier = QSocketNotifier(self._read.fileno(), QSocketNotifier.Type.Read, self)
        self._notifier.activated.connect(self._drain)
        self._previous_fd = signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)
        self._previous = {s: signal.signal(s, _note) for s in signals}

    def _drain(self) -> None:
        try:
            data = self._read.recv(64)
        except (BlockingIOError, InterruptedError):
            return
        for signum in data:  # one byte per signal received, ours or another handler's
            if signum not in self.signals:
                continue
            log.info("received %s", signal.Signals(signum).name)
            self.callback(signum)

    def restore(self) -> None:
        """Put back the previous handlers and wakeup descriptor; idempotent."""
        if not self._previous:
            return
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
        signal.set_wakeup_fd(self._previous_fd)
        self._notifier.setEnabled(False)
        self._read.close()
        self._write.close()


@contextlib.contextmanager
def forward_signals(
    callback: Callable[[int], object], signals: Sequence[signal.Signals] = CLOSING_SIGNALS
) -> Iterator[SignalForwarder]:
    """:class:`SignalForwarder` for the duration of a block (typically ``app.exec()``)."""
    forwarder = SignalForwarder(callback, signals)
    try:
        yield forwarder
    finally:
        forwarder.restore()
