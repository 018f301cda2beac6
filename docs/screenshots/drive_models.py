"""Open the app and drive it into a state of the model and settings side (issue 30) for a screenshot, under Xvfb
(../shared/tools/screenshot). Usage: STOWAGE_DATA_DIR=$(mktemp -d) python docs/screenshots/drive_models.py STATE

States: folder (1024x640: a Downloads folder of two GGUF files opened, both listed, a Q4_1 one chosen and described
by its quantization, 10,000,000 typed in the context box), predicted (the demo model loaded 5 s into the graphs'
history: the predicted RAM starts at Load, beside the engine's measured RAM), dark (the dark theme, the demo model
loaded, Serve on a port another program holds).
"""

from __future__ import annotations

import socket
import sys
import tempfile
from pathlib import Path

from PySide6.QtCore import Qt, QTimer
from PySide6.QtTest import QTest
from shots import open_window, planned, when

from stowage.app import theme
from stowage.app.paths import demo_model_dir


def type_context(window, text):
    spin = window.settings_panel.context.spin
    spin.setFocus()
    spin.lineEdit().selectAll()
    QTest.keyClicks(spin.lineEdit(), text)
    QTest.keyClick(spin.lineEdit(), Qt.Key.Key_Return)


def folder(window):
    from gguf_factory import write_gguf

    downloads = Path(tempfile.mkdtemp()) / "Downloads"
    downloads.mkdir()
    write_gguf(demo_model_dir(), downloads / "SmolLM2-135M-Instruct-Q8_0.gguf", "q8_0")
    write_gguf(demo_model_dir(), downloads / "Demo-Model-Instruct-v0.1-Q4_1.gguf", "q4_1")
    window.resize(1024, 640)
    when(planned(window), lambda: window.settings_panel.picker.open_path(str(downloads)))  # after the demo's plan
    when(lambda: window.forecast is not None and window.forecast.info.model_dir.suffix == ".gguf",
         lambda: type_context(window, "10000000"))


def load_later(window, after_ms):
    when(planned(window), lambda: QTimer.singleShot(after_ms, window.load))


def predicted(window):
    load_later(window, 5_000)


def dark(window, held):
    theme.choose(window.qsettings, "dark")
    held.bind(("127.0.0.1", 0))
    held.listen()
    serve = window.settings_panel.serve
    serve.port.setValue(held.getsockname()[1])
    serve.switch.click()
    load_later(window, 500)
    when(lambda: "is taken" in serve.note.text(),
         lambda: window.settings_panel.scroll.ensureWidgetVisible(serve.note))


def main() -> int:
    state = sys.argv[1]
    app, window = open_window(None)
    held = socket.socket()  # "another program" on Serve's port while the app runs
    {"folder": folder, "predicted": predicted}.get(state, lambda w: dark(w, held))(window)
    return app.exec()


if __name__ == "__main__":
    sys.exit(main())
