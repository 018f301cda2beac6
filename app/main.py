"""Start the desktop app: `stowage` with no subcommand, or `stowage-gui`."""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    from PySide6.QtWidgets import QApplication

    from . import paths
    from .main_window import MainWindow
    from .stall_probe import StallProbe

    app = QApplication.instance() or QApplication(sys.argv if argv is None else [sys.argv[0], *argv])
    app.setApplicationName(paths.APP_NAME)
    app.setOrganizationName(paths.APP_NAME)
    window = MainWindow()
    window.show()
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
