"""Start the desktop app: `stowage` with no subcommand, or `stowage-gui`."""

from __future__ import annotations

import os
import signal
import sys


def main(argv: list[str] | None = None) -> int:
    from PySide6.QtCore import QTimer
    from PySide6.QtGui import QIcon, QPixmap
    from PySide6.QtWidgets import QApplication, QSplashScreen

    from . import paths

    app = QApplication.instance() or QApplication(sys.argv if argv is None else [sys.argv[0], *argv])
    # Named before the first window: on X11 the splash fixes WM_CLASS (class = the application name, else
    # the script's name, "stowage-gui"), and the launcher's StartupWMClass=Stowage must match it. The
    # desktop file name is what Wayland docks match (packaging/stowage.desktop).
    app.setApplicationName(paths.APP_NAME)
    app.setOrganizationName(paths.APP_NAME)
    app.setDesktopFileName("stowage")
    # Importing torch and the engine takes seconds on a cold start: show something at once.
    splash = QSplashScreen(QPixmap(str(paths.icons_dir() / "stowage-256.png")))
    splash.showMessage("Starting Stowage…")
    splash.show()
    app.processEvents()

    from .main_window import MainWindow
    from .stall_probe import StallProbe

    icon = QIcon()
    for png in sorted(paths.icons_dir().glob("stowage-*.png")):
        icon.addFile(str(png))
    app.setWindowIcon(icon)
    window = MainWindow()
    window.show()
    splash.finish(window)
    # Ctrl+C in the terminal closes the window (freeing the model) instead of being ignored: Python runs
    # signal handlers only between bytecodes, so a timer wakes the interpreter a few times a second.
    signal.signal(signal.SIGINT, lambda *_: window.close())
    wake = QTimer()
    wake.timeout.connect(lambda: None)
    wake.start(250)
    # STOWAGE_STALL_PROBE=1 prints the longest event-loop stall at exit (the GUI must never freeze).
    probe = None
    if os.environ.get("STOWAGE_STALL_PROBE"):
        probe = StallProbe()
        probe.start()
    code = app.exec()
    if probe is not None:
        print(f"longest event-loop stall: {probe.stop() * 1000:.1f} ms", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
