"""Serve: the loaded model for other programs (editors, agents, scripts) through the engine's own OpenAI API.

The app's engine is a `stowage serve` child (engine/process/engine_process.py); while nothing is served it listens on a
private Unix socket (a loopback port where there are none) with a key of its own. Serve on restarts it on the
chosen port, on this computer or on every address ("Allow other computers"), with the key kept between runs, and
with "Sequences" generated at once so that another program's request does not wait behind the window's chat.
Changing any of these (or New key) restarts it with them; Serve off takes the key given out back at once.
"""

from __future__ import annotations

from dataclasses import replace

from PySide6.QtCore import Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (QCheckBox, QFormLayout, QGroupBox, QHBoxLayout, QLabel, QLineEdit, QPushButton,
                               QSpinBox, QWidget)

from . import theme
from .serve_settings import MAX_SEQUENCES, ServeSettings, new_key, url_for_others


class ServeSwitch(QGroupBox):
    """`changed(ServeSettings)` when the user changes anything; `set_endpoint` says what the engine serves now."""

    changed = Signal(object)  # ServeSettings

    def __init__(self, parent=None):
        super().__init__("Serve", parent)
        self.settings = ServeSettings(api_key=new_key())  # until set_settings shows the one kept
        self.switch = QCheckBox("Serve the loaded model to other programs")
        self.switch.setToolTip("Programs that speak OpenAI's API reach the model at the URL with the key shown")
        self.port = QSpinBox()
        self.port.setRange(0, 65535)
        self.port.setSpecialValueText("Any free port")
        self.port.setAccessibleName("Serve port")
        self.port.setToolTip("The port other programs connect to; the engine restarts on it")
        self.others = QCheckBox("Allow other computers")
        self.others.setToolTip("Listen on every network address of this computer (0.0.0.0): other computers on "
                               "the network reach the model, with the key")
        self.sequences = QSpinBox()
        self.sequences.setRange(1, MAX_SEQUENCES)
        self.sequences.setAccessibleName("Sequences")
        self.sequences.setToolTip("Replies generated at once (the chat here and other programs' requests): each "
                                  "holds a whole context of KV cache, which the forecast counts")
        for box in (self.port, self.sequences):
            box.setKeyboardTracking(False)  # a value once typed, not one restart per digit
        self.url = _copyable("Server URL")
        self.key = _copyable("Server API key")
        self.new_key = QPushButton("New key")
        self.new_key.setToolTip("Replace the key: programs given the old one are refused from now on")
        self.note = QLabel()
        self.note.setWordWrap(True)
        theme.tint(self.note, "muted")
        self.endpoint: tuple[str, str, str] | None = None
        self.why_not = ""
        form = QFormLayout(self)
        form.addRow(self.switch)
        form.addRow("Port", self.port)
        form.addRow(self.others)
        form.addRow("Sequences", self.sequences)
        self.url_row, self.key_row = _with_copy(self.url), _with_copy(self.key, self.new_key)
        form.addRow("URL", self.url_row)
        form.addRow("API key", self.key_row)
        form.addRow(self.note)
        self.form = form
        self._show_values()
        self.switch.toggled.connect(self._edited)
        self.others.toggled.connect(self._edited)
        self.port.valueChanged.connect(self._edited)
        self.sequences.valueChanged.connect(self._edited)
        self.new_key.clicked.connect(self._rotate_key)
        self.set_endpoint(None, "Load a model to serve it.")

    @property
    def is_on(self) -> bool:
        return self.settings.on

    def set_settings(self, settings: ServeSettings) -> None:
        """Show settings (remembered between runs) without asking for anything."""
        self.settings = settings
        self._show_values()
        self._show()

    def set_endpoint(self, endpoint: tuple[str, str, str] | None, why_not: str = "") -> None:
        """(URL, key, model name) where other programs reach the engine now, or None with the reason nothing is
        served."""
        self.endpoint = endpoint
        self.why_not = why_not
        self._show()

    def _show_values(self) -> None:
        s = self.settings
        for widget, set_value in ((self.switch, lambda: self.switch.setChecked(s.on)),
                                  (self.others, lambda: self.others.setChecked(s.other_computers)),
                                  (self.port, lambda: self.port.setValue(s.port)),
                                  (self.sequences, lambda: self.sequences.setValue(s.num_seqs))):
            widget.blockSignals(True)
            set_value()
            widget.blockSignals(False)

    def _edited(self, *_) -> None:
        self._emit(replace(self.settings, on=self.switch.isChecked(), other_computers=self.others.isChecked(),
                           port=self.port.value(), num_seqs=self.sequences.value()))

    def _rotate_key(self) -> None:
        self._emit(replace(self.settings, api_key=new_key()))

    def _emit(self, settings: ServeSettings) -> None:
        if settings == self.settings:
            return
        self.settings = settings
        self._show()
        self.changed.emit(settings)

    def _show(self) -> None:
        s = self.settings
        for widget in (self.port, self.others, self.sequences):
            self.form.setRowVisible(widget, s.on)
        served = s.on and self.endpoint is not None
        url, _, model = self.endpoint or ("", "", "")
        url = url_for_others(url, s) if served else ""
        for line, text in ((self.url, url), (self.key, s.api_key if s.on else "")):
            line.setText(text)
            line.setCursorPosition(0)  # the start of a long key, as it is read
        self.form.setRowVisible(self.url_row, served)
        self.form.setRowVisible(self.key_row, s.on)
        if not s.on:
            self.note.setText(self.why_not or "Other programs cannot use the model: it listens for this app alone.")
        elif self.endpoint is None:
            self.note.setText(self.why_not)
        else:
            self.note.setText(_served_note(s, self.endpoint[0], url, model))


def _served_note(s: ServeSettings, local_url: str, url: str, model: str) -> str:
    where = ("This computer only." if not s.other_computers else
             f"Other computers too (here also {local_url}; a firewall may have to allow the port).")
    at_once = f"{s.num_seqs} replies at once." if s.num_seqs > 1 else "One reply at a time: the chat here waits."
    return f"Model name \"{model}\". {where} {at_once} The key lasts until New key."


def _copyable(name: str) -> QLineEdit:
    line = QLineEdit()
    line.setReadOnly(True)
    line.setAccessibleName(name)
    return line


def _with_copy(line: QLineEdit, *extra: QWidget) -> QWidget:
    row = QWidget()
    layout = QHBoxLayout(row)
    layout.setContentsMargins(0, 0, 0, 0)
    layout.addWidget(line, 1)
    copy = QPushButton("Copy")
    copy.setToolTip(f"Copy the {line.accessibleName().removeprefix('Server ')}")
    copy.clicked.connect(lambda: QGuiApplication.clipboard().setText(line.text()))
    layout.addWidget(copy)
    for widget in extra:
        layout.addWidget(widget)
    return row
