"""The messages of one conversation, top to bottom, with the reply streaming into the last one."""

from __future__ import annotations

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import QFrame, QLabel, QScrollArea, QVBoxLayout, QWidget

from . import theme, tool_messages
from .message_widget import MessageWidget
from .store import Message

# Re-rendering Markdown costs time proportional to the reply; at most this often keeps long replies cheap.
RENDER_INTERVAL_MS = 50


class ChatView(QScrollArea):
    """Shows messages; `edit_submitted(message_id, text)` comes from a user message's Edit."""

    edit_submitted = Signal(int, str)
    alternative_chosen = Signal(int)  # a message id: show that version (and the branch below it)
    delete_requested = Signal(int)  # a message id: delete that message
    reply_rendered = Signal(str)  # the reply's text so far, each time the view redraws it

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setWidgetResizable(True)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self._inner = QWidget()
        self._inner.setObjectName("chatInner")
        self._column = QVBoxLayout(self._inner)
        self._column.setContentsMargins(10, 10, 10, 10)
        self._column.setSpacing(8)
        self._column.addStretch(1)
        self.setWidget(self._inner)
        self.widgets: list[MessageWidget] = []
        self.memory_marker: QLabel | None = None
        self.placeholder = QLabel()
        self.placeholder.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.placeholder.setWordWrap(True)
        self._column.insertWidget(0, self.placeholder)
        self.reply: MessageWidget | None = None
        self._reply_text = ""
        self._reply_calls: list[dict] = []  # the streaming reply's tool calls so far
        self._render_timer = QTimer(self)
        self._render_timer.setSingleShot(True)
        self._render_timer.setInterval(RENDER_INTERVAL_MS)
        self._render_timer.timeout.connect(self._render_reply)
        self.verticalScrollBar().rangeChanged.connect(self._follow)
        self._at_bottom = True
        self.verticalScrollBar().valueChanged.connect(self._track_bottom)
        self._alternatives_enabled = True
        theme.watch(self, self._restyle)

    def _restyle(self) -> None:
        c = theme.colors()
        self._inner.setStyleSheet(f"#chatInner {{ background: {c.chat_background}; }}")
        self.placeholder.setStyleSheet(f"color: {c.muted}; font-size: 14px; padding: 40px;")
        if self.memory_marker is not None:
            self.memory_marker.setStyleSheet(f"color: {c.marker}; font-style: italic;")

    def set_placeholder(self, text: str) -> None:
        self.placeholder.setText(text)
        self.placeholder.setVisible(bool(text) and not self.widgets)

    def set_messages(self, messages: list[Message], memory_start_id: int | None = None) -> None:
        self.clear()
        # The reply written after the gap opened says whether a head stayed ('truncate the middle').
        kept_head = next((m.meta.get("kept_head", 0) for m in reversed(messages) if m.role == "assistant"), 0)
        for message in messages:
            if memory_start_id is not None and message.id == memory_start_id:
                self._add_memory_marker(kept_head)
            self._add(message)
        self.placeholder.setVisible(not self.widgets and bool(self.placeholder.text()))
        self._at_bottom = True

    def clear(self) -> None:
        self._render_timer.stop()
        self.reply = None
        for widget in self.widgets:
            widget.deleteLater()
        self.widgets.clear()
        if self.memory_marker is not None:
            self.memory_marker.deleteLater()
            self.memory_marker = None

    def add_message(self, message: Message) -> MessageWidget:
        self.placeholder.hide()
        self._at_bottom = True
        return self._add(message)

    def _add(self, message: Message) -> MessageWidget:
        widget = MessageWidget(message)
        widget.edit_submitted.connect(self.edit_submitted)
        widget.edit_started.connect(lambda: self._warn_edit(widget))
        widget.alternative_chosen.connect(self.alternative_chosen)
        widget.delete_requested.connect(self.delete_requested)
        widget.set_alternatives_enabled(self._alternatives_enabled)
        self._column.insertWidget(self._column.count() - 1, widget)
        self.widgets.append(widget)
        return widget

    def _warn_edit(self, widget: MessageWidget) -> None:
        """Sending an edit answers it afresh, beside the version there now: say so, and how to go back."""
        num_versions = max(len(widget.message.siblings), 1) + 1
        later = len(self.widgets) - self.widgets.index(widget) - 1
        kept = f" with the {later} messages after it" if later > 1 else " with the reply after it" if later else ""
        widget.set_edit_note(f"Sending makes version {num_versions} of this message and answers it; the one there "
                             f"now is kept{kept} (‹ › switches back).")
        # The editor may be far above the newest message: bring it into view once it is laid out, and stop following
        # the bottom, which would pull the view away from it.
        self._at_bottom = False
        QTimer.singleShot(0, lambda: self._show_editor(widget))

    def _show_editor(self, widget: MessageWidget) -> None:
        if widget in self.widgets and widget.editor.isVisible():
            self._at_bottom = False
            self.ensureWidgetVisible(widget.editor, 10, 40)

    def set_alternatives_enabled(self, enabled: bool) -> None:
        self._alternatives_enabled = enabled
        for widget in self.widgets:
            widget.set_alternatives_enabled(enabled)

    def _add_memory_marker(self, kept_head: int = 0) -> None:
        text = ("— The model still remembers the first exchange, but not the messages between it and this line —"
                if kept_head else "— The model no longer remembers the messages above this line —")
        self.memory_marker = QLabel(text)
        self.memory_marker.setWordWrap(True)
        self.memory_marker.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.memory_marker.setStyleSheet(f"color: {theme.colors().marker}; font-style: italic;")
        self._column.insertWidget(self._column.count() - 1, self.memory_marker)

    def mark_memory_start(self, message_id: int | None, kept_head: int = 0) -> None:
        """Draw the line where the model's memory resumes after a gap (None: remove it); `kept_head` messages
        above the gap are remembered too."""
        if self.memory_marker is not None:
            self.memory_marker.deleteLater()
            self.memory_marker = None
        for widget in self.widgets:
            if message_id is not None and widget.message.id == message_id:
                self._add_memory_marker(kept_head)
                self._column.removeWidget(self.memory_marker)
                self._column.insertWidget(self._column.indexOf(widget), self.memory_marker)
                return

    # -- the streaming reply --------------------------------------------------------------------
    def begin_reply(self) -> MessageWidget:
        self._reply_text = ""
        self._reply_calls = []
        self.reply = self.add_message(Message(-1, "assistant", ""))
        self.reply.note.setText("thinking…")
        return self.reply

    def append_reply(self, text: str) -> None:
        self._reply_text += text
        if not self._render_timer.isActive():
            self._render_timer.start()

    def show_reply_calls(self, calls: list[dict]) -> None:
        """The streaming reply's tool calls so far, shown under its text as they grow."""
        self._reply_calls = calls
        if not self._render_timer.isActive():
            self._render_timer.start()

    def end_reply(self, message: Message) -> None:
        """The reply is done and stored: show its final text and meta under its stored id."""
        self._render_timer.stop()
        if self.reply is None:
            return
        self.reply.show_message(message)
        self.reply.set_alternatives_enabled(self._alternatives_enabled)
        self.reply = None

    @property
    def reply_text(self) -> str:
        return self._reply_text

    def _render_reply(self) -> None:
        if self.reply is not None:
            message = Message(-1, "assistant", self._reply_text, {"tool_calls": self._reply_calls})
            self.reply.set_text(tool_messages.markdown(message) if self._reply_calls else self._reply_text)
            self.reply.note.setText("calling a tool…" if self._reply_calls else "writing…")
            self.reply_rendered.emit(self._reply_text)

    # -- keep the newest text in view unless the user scrolled up to read ----------------------
    def _track_bottom(self, value: int) -> None:
        bar = self.verticalScrollBar()
        self._at_bottom = value >= bar.maximum() - 4

    def _follow(self, _minimum: int, maximum: int) -> None:
        if self._at_bottom:
            self.verticalScrollBar().setValue(maximum)
