"""The row under a chat's message box: speed and context used, the reply's format and tools, completion mode (for a
base model), Regenerate, Stop and Send."""

from __future__ import annotations

from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QWidget

from . import theme
from .reply_options_button import ReplyOptionsButton


class ChatControls(QWidget):
    """The buttons a chat panel connects, enabled by `set_generating` as a reply starts and ends."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.send_button = QPushButton("Send")
        self.stop_button = QPushButton("Stop")
        self.stop_button.setEnabled(False)
        self.stop_button.setToolTip("Stop the reply (Esc)")
        self.stop_button.setShortcut("Esc")
        self.regenerate_button = QPushButton("Regenerate")
        self.completion_button = QPushButton("Completion mode")
        self.completion_button.setCheckable(True)
        self.completion_button.setToolTip("The model continues your text as written, without a chat template: what a "
                                          "base model was trained to do")
        self.completion_button.hide()  # for a base model only
        self.reply_options = ReplyOptionsButton()
        self.counter = QLabel()
        theme.tint(self.counter, "muted")
        self.counter.setAccessibleName("Speed and context used")
        self.counter.setWordWrap(True)  # it grows with the numbers: in a narrow chat it wraps, never widens the window
        row = QHBoxLayout(self)
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(self.counter, 1)
        for widget in (self.reply_options, self.completion_button, self.regenerate_button, self.stop_button,
                       self.send_button):
            row.addWidget(widget)

    def set_generating(self, generating: bool, *, can_regenerate: bool, greedy: bool) -> None:
        """While a reply streams only Stop; after it, Regenerate where there is a question and a model."""
        self.send_button.setEnabled(not generating)
        self.stop_button.setEnabled(generating)
        self.regenerate_button.setEnabled(not generating and can_regenerate)
        self.regenerate_button.setToolTip(
            "Write the last reply again (the old one stays: ‹ › on the reply switches)"
            + (". At temperature 0 it comes out the same, word for word." if greedy else ""))
