"""The message box: Enter sends, Shift+Enter starts a new line."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QPlainTextEdit


class ChatInput(QPlainTextEdit):
    submitted = Signal()
    PLACEHOLDER = "Message (Enter sends, Shift+Enter for a new line)"

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setPlaceholderText(self.PLACEHOLDER)
        self.setAccessibleName("Message")
        self.setTabChangesFocus(True)  # keyboard users move on with Tab instead of typing one
        self.setFixedHeight(80)

    def keyPressEvent(self, event) -> None:
        is_enter = event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter)
        if is_enter and not event.modifiers() & Qt.KeyboardModifier.ShiftModifier:
            self.submitted.emit()
            return
        super().keyPressEvent(event)
