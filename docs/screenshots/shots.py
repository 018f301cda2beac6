"""What the screenshot drivers share (drive.py, drive_models.py, drive_replies.py, hub.py): the test factories on the
path, a window opened as the app opens it, and waiting for a state from the event loop."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "support"))  # gguf_factory, moe_factory, hub_server: files to show

from PySide6.QtCore import QTimer  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402


def when(condition, then, interval_ms=100):
    """Call `then` once `condition()` holds, polling from the event loop."""
    def poll():
        if condition():
            then()
        else:
            QTimer.singleShot(interval_ms, poll)
    QTimer.singleShot(interval_ms, poll)


def planned(window):
    """Whether the window's chosen model has its forecast (the first thing a fresh window does)."""
    return lambda: window.settings_panel.plan is not None and window.forecast is not None


def open_window(size=(1280, 800)):
    """(the application, a main window at the screen's corner, shown, at `size`; None: the size it opens at): the
    window imported only now, after a driver has set the environment it reads (HF_ENDPOINT)."""
    from stowage.app.main_window import MainWindow

    app = QApplication.instance() or QApplication(sys.argv)
    window = MainWindow()
    window.move(0, 0)
    if size is not None:
        window.resize(*size)
    window.show()
    return app, window
