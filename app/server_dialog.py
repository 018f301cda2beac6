"""Server…: the address and key of an OpenAI-compatible server whose models the model list then offers."""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QCheckBox, QDialog, QDialogButtonBox, QFormLayout, QLabel, QLineEdit

from .remote_source import normalize_url


class ServerDialog(QDialog):
    """Emits `chosen(base_url, api_key or None, remember_key)` on OK; the window then asks the server."""

    chosen = Signal(str, object, bool)

    def __init__(self, parent=None, url: str = "", api_key: str | None = None):
        super().__init__(parent)
        self.setWindowTitle("Add a remote server")
        self.url = QLineEdit(url)
        self.url.setPlaceholderText("http://192.168.1.20:8000/v1")
        self.url.setAccessibleName("Server address")
        self.key = QLineEdit(api_key or "")
        self.key.setEchoMode(QLineEdit.EchoMode.Password)
        self.key.setPlaceholderText("none")
        self.key.setAccessibleName("API key")
        self.remember = QCheckBox("Remember the key on this computer")
        self.remember.setToolTip("Saved unencrypted in Stowage's settings file (there is no system keyring to "
                                 "keep it in); unticked, the key is kept until Stowage closes.")
        note = QLabel("Any OpenAI-compatible server: vLLM, Ray Serve LLM, llama.cpp's server, Ollama, another "
                      "Stowage. Its models join the model list; they run on that machine, so no memory forecast "
                      "or graphs are shown for them.\nA remembered key is saved unencrypted in the settings file.")
        note.setWordWrap(True)
        note.setStyleSheet("color: #555;")
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        form = QFormLayout(self)
        form.addRow("Address", self.url)
        form.addRow("API key", self.key)
        form.addRow("", self.remember)
        form.addRow(note)
        form.addRow(self.buttons)
        self.buttons.accepted.connect(self.accept)
        self.buttons.rejected.connect(self.reject)
        self.url.textChanged.connect(self._check)
        self._check()
        self.resize(460, self.sizeHint().height())

    def _check(self) -> None:
        self.buttons.button(QDialogButtonBox.StandardButton.Ok).setEnabled(bool(normalize_url(self.url.text())))

    def accept(self) -> None:
        self.chosen.emit(normalize_url(self.url.text()), self.key.text().strip() or None, self.remember.isChecked())
        super().accept()
