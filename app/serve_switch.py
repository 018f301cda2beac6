"""Serve: the loaded model for other programs (editors, agents, scripts) through the engine's own OpenAI API.

The app's engine already is a `stowage serve` child on a loopback port with a private random key
(engine/engine_process.py): only a program that knows the key can use it. Serve on shows that URL and key to copy;
Serve off asks the window to restart the engine with a new key, so the key given out stops working.
"""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QCheckBox, QFormLayout, QGroupBox, QHBoxLayout, QLabel, QLineEdit, QPushButton, QWidget


class ServeSwitch(QGroupBox):
    """`switched(on)` when the user flips it; `set_endpoint` says what the engine listens on now."""

    switched = Signal(bool)

    def __init__(self, parent=None):
        super().__init__("Serve", parent)
        self.switch = QCheckBox("Serve the loaded model to other programs")
        self.switch.setToolTip("Programs on this computer that speak OpenAI's API reach the model at the URL "
                               "with the key shown")
        self.url = _copyable("Server URL")
        self.key = _copyable("Server API key")
        self.note = QLabel()
        self.note.setWordWrap(True)
        self.note.setStyleSheet("color: #555;")
        self.endpoint: tuple[str, str, str] | None = None
        form = QFormLayout(self)
        form.addRow(self.switch)
        self.url_row, self.key_row = _with_copy(self.url), _with_copy(self.key)
        form.addRow("URL", self.url_row)
        form.addRow("API key", self.key_row)
        form.addRow(self.note)
        self.form = form
        self.switch.toggled.connect(self._toggled)
        self.set_endpoint(None, "Load a model to serve it.")

    @property
    def is_on(self) -> bool:
        return self.switch.isChecked()

    def set_on(self, on: bool) -> None:
        """Restore the switch (remembered between runs) without asking for anything."""
        self.switch.blockSignals(True)
        self.switch.setChecked(on)
        self.switch.blockSignals(False)
        self._show()

    def set_endpoint(self, endpoint: tuple[str, str, str] | None, why_not: str = "") -> None:
        """(URL, key, model name) of the loaded engine, or None with the reason nothing can be served."""
        self.endpoint = endpoint
        self.why_not = why_not
        self._show()

    def _toggled(self, on: bool) -> None:
        self._show()
        self.switched.emit(on)

    def _show(self) -> None:
        shown = self.is_on and self.endpoint is not None
        url, key, model = self.endpoint or ("", "", "")
        for line, text in ((self.url, url), (self.key, key)):
            line.setText(text if shown else "")
            line.setCursorPosition(0)  # the start of a long key, as it is read
        self.form.setRowVisible(self.url_row, shown)
        self.form.setRowVisible(self.key_row, shown)
        if self.endpoint is None:
            self.note.setText(self.why_not)
        elif shown:
            self.note.setText(f"Give the program this base URL and API key, and the model name \"{model}\". "
                              "This computer only; a new port and key at each Load, and Serve off changes the key "
                              "at once (the engine restarts).")
        else:
            self.note.setText("Other programs cannot use the model: its key is private.")


def _copyable(name: str) -> QLineEdit:
    line = QLineEdit()
    line.setReadOnly(True)
    line.setAccessibleName(name)
    return line


def _with_copy(line: QLineEdit) -> QWidget:
    row = QWidget()
    layout = QHBoxLayout(row)
    layout.setContentsMargins(0, 0, 0, 0)
    layout.addWidget(line, 1)
    copy = QPushButton("Copy")
    copy.setToolTip(f"Copy the {line.accessibleName().removeprefix('Server ')}")
    copy.clicked.connect(lambda: QGuiApplication.clipboard().setText(line.text()))
    layout.addWidget(copy)
    return row
