"""One message of a conversation: rendered Markdown, with copy (and edit-and-resend for the user's)."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QMenu,
    QPlainTextEdit,
    QPushButton,
    QVBoxLayout,
)

from . import theme
from . import tool_messages
from .markdown_view import MarkdownView
from .store import Message

TITLES = {"user": "You", "assistant": "Assistant", "system": "System", "tool": "Tool"}


class MessageWidget(QFrame):
    """A message; `edit_submitted(message_id, text)` when the user edits theirs and presses Send."""

    edit_submitted = Signal(int, str)
    edit_started = Signal()  # the view answers with set_edit_note: what sending the edit would do
    alternative_chosen = Signal(int)  # the id of the version of this message to show instead ("‹ 1/2 ›")
    delete_requested = Signal(int)  # this message's id: delete it (and only it) from the chat

    def __init__(self, message: Message, parent=None):
        super().__init__(parent)
        self.message = message
        self.title = QLabel(f"<b>{TITLES.get(message.role, message.role)}</b>")
        self.note = QLabel()
        self.note.setObjectName("note")
        self.note.setWordWrap(True)  # the figures must not widen a narrow chat
        self.copy_button = _small_button("Copy", "Copy this message")
        self.edit_button = _small_button("Edit", "Edit this message and resend it")
        self.edit_button.setVisible(message.role == "user")
        self.delete_button = _small_button("Delete", "Delete this message from the chat (the others stay)")
        self.previous_button = _small_button("‹", "The previous version of this message")
        self.next_button = _small_button("›", "The next version of this message")
        self.version = QLabel()
        self.version.setObjectName("version")
        self.version.setAccessibleName("Version of this message")
        header = QHBoxLayout()
        header.addWidget(self.title)
        header.addWidget(self.previous_button)
        header.addWidget(self.version)
        header.addWidget(self.next_button)
        header.addWidget(self.note, 1)
        header.addWidget(self.copy_button)
        header.addWidget(self.edit_button)
        header.addWidget(self.delete_button)
        self.body = MarkdownView()
        self.editor = QPlainTextEdit()
        self.editor.hide()
        self.save_button = QPushButton("Send")
        self.cancel_button = QPushButton("Cancel")
        self.edit_note = QLabel()
        self.edit_note.setObjectName("editNote")
        self.edit_note.setWordWrap(True)
        edit_row = QHBoxLayout()
        edit_row.addWidget(self.edit_note, 1)
        edit_row.addWidget(self.cancel_button)
        edit_row.addWidget(self.save_button)
        self.edit_buttons = [self.save_button, self.cancel_button, self.edit_note]
        for b in self.edit_buttons:
            b.hide()
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 6, 8, 6)
        layout.setSpacing(2)
        layout.addLayout(header)
        layout.addWidget(self.body)
        layout.addWidget(self.editor)
        layout.addLayout(edit_row)
        self.copy_button.clicked.connect(self.copy)
        self.edit_button.clicked.connect(self.start_edit)
        self.delete_button.clicked.connect(lambda: self.delete_requested.emit(self.message.id))
        self.cancel_button.clicked.connect(self.stop_edit)
        self.save_button.clicked.connect(self._submit_edit)
        self.previous_button.clicked.connect(lambda: self._step(-1))
        self.next_button.clicked.connect(lambda: self._step(1))
        self.show_message(message)
        theme.watch(self, self._restyle)

    def _restyle(self) -> None:
        """Background, border and text in the palette's colours: readable in light and dark."""
        c = theme.colors()
        background, border = ((c.user_background, c.user_border) if self.message.role == "user"
                              else (c.assistant_background, c.assistant_border))
        self.setStyleSheet(
            f"MessageWidget {{ background: {background}; border: 1px solid {border}; border-radius: 6px; }}"
            f"QLabel, QTextBrowser {{ color: {c.text}; }}"
            f"QLabel#note, QLabel#version {{ color: {c.muted}; }} QLabel#editNote {{ color: {c.warning}; }}"
            f"QPushButton#small {{ color: {c.link}; border: none; padding: 0 4px; background: transparent; }}"
            f"QPushButton#small:disabled {{ color: {c.muted}; }}")

    def show_message(self, message: Message) -> None:
        """Show `message` (a reply once stored, with its final text, figures and versions)."""
        self.message = message
        self.set_text(tool_messages.markdown(message))
        self.set_meta(message.meta)
        versions = message.siblings
        at = versions.index(message.id) if message.id in versions else 0
        self.version.setText(f"{at + 1}/{len(versions)}")
        for widget in (self.previous_button, self.version, self.next_button):
            widget.setVisible(len(versions) > 1)
        self.previous_button.setEnabled(at > 0)
        self.next_button.setEnabled(at < len(versions) - 1)
        self.delete_button.setVisible(message.id >= 0)  # a reply still streaming is not stored yet

    def set_alternatives_enabled(self, enabled: bool) -> None:
        """Switching versions and deleting wait while a reply streams (it would land on the branch left)."""
        versions = self.message.siblings
        at = versions.index(self.message.id) if self.message.id in versions else 0
        self.previous_button.setEnabled(enabled and at > 0)
        self.next_button.setEnabled(enabled and at < len(versions) - 1)
        self.delete_button.setEnabled(enabled)

    def contextMenuEvent(self, event) -> None:
        menu = QMenu(self)
        menu.addAction("Copy", self.copy)
        if self.edit_button.isVisible():
            menu.addAction("Edit and resend", self.start_edit)
        if self.delete_button.isVisible():
            menu.addAction("Delete", self.delete_button.click).setEnabled(self.delete_button.isEnabled())
        menu.exec(event.globalPos())

    def _step(self, by: int) -> None:
        versions = self.message.siblings
        at = versions.index(self.message.id) + by
        if 0 <= at < len(versions):
            self.alternative_chosen.emit(versions[at])

    @property
    def text(self) -> str:
        return self.body.markdown

    def set_text(self, text: str) -> None:
        self.body.set_markdown(text)

    def set_meta(self, meta: dict) -> None:
        """Under a reply: time to its first token, both speeds, and why it ended when not by the model's choice."""
        parts = []
        if meta.get("first_token_s"):
            parts.append(f"{meta['first_token_s']:.2f} s to first token")
        if meta.get("prompt_tokens_per_s"):
            parts.append(f"{meta['prompt_tokens_per_s']:,.0f} prompt tokens/s")
        if meta.get("tokens_per_s"):
            parts.append(f"{meta['tokens_per_s']:.1f} tokens/s")
        reason = meta.get("finish_reason")
        if reason and reason != "stop":
            # "interrupted": the app ended while it streamed; what was saved of it is shown.
            parts.append({"cancelled": "stopped", "length": "hit max new tokens", "context_full": "context full",
                          "interrupted": "interrupted", "error": "cut short by an error",
                          "tool_calls": "called a tool"}.get(reason, reason))
        self.note.setText(" · ".join(parts))

    def copy(self) -> None:
        QGuiApplication.clipboard().setText(self.text)

    def start_edit(self) -> None:
        self.editor.setPlainText(self.text)
        self.body.hide()
        self.editor.show()
        for b in self.edit_buttons:
            b.show()
        self.edit_note.clear()
        self.edit_started.emit()
        self.editor.setFocus()

    def set_edit_note(self, text: str) -> None:
        self.edit_note.setText(text)

    def stop_edit(self) -> None:
        self.editor.hide()
        self.body.show()
        for b in self.edit_buttons:
            b.hide()

    def _submit_edit(self) -> None:
        text = self.editor.toPlainText().strip()
        if text:
            self.stop_edit()
            self.edit_submitted.emit(self.message.id, text)


def _small_button(text: str, tip: str) -> QPushButton:
    button = QPushButton(text)
    button.setToolTip(tip)
    button.setFlat(True)
    button.setObjectName("small")  # styled by the message (MessageWidget._restyle)
    button.setCursor(Qt.CursorShape.PointingHandCursor)
    return button
