"""A strip above the input box that says what happened and offers what to do next, as buttons."""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPushButton

from . import theme


class ChatNotice(QFrame):
    """One notice at a time: `show_notice(text, [(button text, action), ...])`; a button runs its action and closes
    the notice. Hidden until shown."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setObjectName("chatNotice")
        self.label = QLabel()
        self.label.setWordWrap(True)
        self.buttons: list[QPushButton] = []
        self._row = QHBoxLayout(self)
        self._row.setContentsMargins(8, 4, 8, 4)
        self._row.addWidget(self.label, 1)
        self.kind = ""  # what the notice is about ("overflow", "repeat", ...), for whoever replaces it
        theme.watch(self, self._restyle)
        self.hide()

    def _restyle(self) -> None:
        c = theme.colors()
        self.setStyleSheet(f"#chatNotice {{ border: 1px solid {c.warning}; border-radius: 4px; }}"
                           f"#chatNotice QLabel {{ color: {c.text}; }}")

    def show_notice(self, kind: str, text: str, actions: list[tuple[str, Callable[[], None]]]) -> None:
        self.clear()
        self.kind = kind
        self.label.setText(text)
        for title, action in actions:
            button = QPushButton(title)
            button.clicked.connect(lambda _=False, act=action: (self.clear(), act()))
            self._row.addWidget(button)
            self.buttons.append(button)
        self.show()

    def clear(self) -> None:
        for button in self.buttons:
            self._row.removeWidget(button)
            button.deleteLater()
        self.buttons.clear()
        self.kind = ""
        self.hide()

    def button(self, title: str) -> QPushButton:
        return next(b for b in self.buttons if b.text() == title)
