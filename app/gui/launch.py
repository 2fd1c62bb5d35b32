"""Opening the window: display checks, the QApplication, the style sheet, the data folder."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.errors import InfersightError

if TYPE_CHECKING:
    from collections.abc import Callable

    from app.gui.main_window import MainWindow

#: a testing and scripting aid: ``INFERSIGHT_AUTOSEND="text" infersight`` sends ``text`` once,
#: as the user would, as soon as the first model is loaded
AUTOSEND_ENV = "INFERSIGHT_AUTOSEND"

NO_DISPLAY = """\
infersight: no display found, so the window cannot open.
  * on a desktop session, run it there (DISPLAY or WAYLAND_DISPLAY must be set);
  * on a server, use a virtual screen:  xvfb-run -a .venv/bin/infersight
    (Debian: apt install xvfb xauth libxcb-icccm4 libxcb-keysyms1 libxcb-cursor0);
  * for a terminal chat instead:        .venv/bin/infersight chat --model default
  * for screenshots without any screen: make screenshots"""


def data_dir() -> Path:
    """Chats and settings: ``$INFERSIGHT_HOME/data``, else the platform's user data folder."""
    override = os.environ.get("INFERSIGHT_HOME")
    if override:
        return Path(override).expanduser() / "data"
    import platformdirs

    return Path(platformdirs.user_data_dir("infersight", appauthor=False))


def has_display() -> bool:
    platform = os.environ.get("QT_QPA_PLATFORM", "")
    if platform or sys.platform in ("win32", "darwin"):
        return True
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def make_application() -> object:
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("Infersight")
    app.setOrganizationName("Infersight")
    QApplication.setDesktopFileName("infersight")
    return app


def run_gui(args: argparse.Namespace) -> int:
    if not has_display():
        print(NO_DISPLAY, file=sys.stderr)
        return 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from PySide6.QtWidgets import QApplication
    except ImportError as exc:
        raise InfersightError(
            f"Qt could not be imported ({exc}); install the app's dependencies with "
            "`make run`, or use `infersight chat` in a terminal"
        ) from exc
    from app.gui.gc_guard import GuiGarbageCollector, settle
    from app.gui.main_window import MainWindow
    from app.gui.signals import forward_signals

    app = make_application()
    assert isinstance(app, QApplication)
    GuiGarbageCollector(parent=app)  # owned by the app: lives as long as it
    # Qt, torch and our modules are imported: collect once and freeze them before the window
    # exists, so that no collection in the UI thread traverses them while the first model is
    # pulled and converted (a full one took ~250 ms on a 2-core CPU: a freeze on first start)
    settle()
    window: MainWindow | None = None

    def close(signum: int) -> None:
        """SIGTERM (a logout, a shutdown) or SIGINT (Ctrl+C): what the close button does, so
        the reply being streamed is kept, marked stopped; then the event loop ends."""
        if window is not None:
            window.close()
        app.quit()

    # armed before the window exists: a signal during start-up closes it once the loop runs
    with forward_signals(close):
        folder = Path(args.data_dir) if args.data_dir else data_dir()
        window = MainWindow(folder, overrides=start_overrides(args))
        window.resize(1280, 800)
        window.show()
        autosend, shown = os.environ.get(AUTOSEND_ENV), window
        if getattr(args, "serve", None) is not None:
            shown.controls.serve_port.set_value(args.serve)
            when_loaded(shown, lambda: shown.controls.serve_on.setChecked(True))
        if autosend:
            when_loaded(shown, lambda: shown.send(autosend))
        return int(app.exec())


def start_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """What the command line asks of the first load: only what it was given (``--device
    auto``, the default, asks nothing); the rest is what the user last chose, kept in
    settings.ini (:meth:`MainWindow._saved_spec`)."""
    given = {
        "model": args.model,
        "precision": args.precision,
        "device": None if args.device in (None, "auto") else args.device,
    }
    out: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    world = getattr(args, "tensor_parallel", 1)
    if world > 1:
        out["tensor_parallel"] = world
    return out


def when_loaded(window: MainWindow, action: Callable[[], object]) -> None:
    """Do ``action`` once, in the UI thread, when the window's first model is loaded (as the
    user would: send a message, tick *Serve on localhost*)."""
    from PySide6.QtCore import QObject

    class Once(QObject):
        # a method of a QObject of the UI thread runs in that thread (a bare function would
        # run in the worker's), queued after the window's own _on_loaded: the model is set
        def run(self, _info: object) -> None:
            window.worker.loaded.disconnect(self.run)
            action()

    window.worker.loaded.connect(Once(window).run)
