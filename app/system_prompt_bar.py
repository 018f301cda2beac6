"""Above a chat: its preset, and its system prompt (its own, the preset's, or the default from the settings), edited in
place."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QInputDialog,
    QLabel,
    QMenu,
    QPlainTextEdit,
    QPushButton,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from . import theme


class SystemPromptBar(QWidget):
    """One line saying what the model is told first in this chat; Edit opens it. `changed(text or None)`."""

    changed = Signal(object)  # str: this chat's own prompt; None: follow the default again
    preset_chosen = Signal(object)  # a preset's id, or None: no preset
    preset_saved = Signal(str)  # the name to save this chat's prompt and sampling under
    preset_deleted = Signal(int)  # a preset's id

    def __init__(self, parent=None):
        super().__init__(parent)
        self.own: str | None = None
        self.default = ""
        self.default_name = "default"  # whose the default is: the settings' or a preset's
        self._line = ""  # the summary before eliding
        self.summary = QLabel()
        theme.tint(self.summary, "muted")
        self.summary.setTextFormat(Qt.TextFormat.PlainText)
        self.summary.setMinimumWidth(50)  # elided to the chat's width, never widening it
        self.preset = QComboBox()
        self.preset.setAccessibleName("This chat's preset")
        self.preset.setToolTip("A saved system prompt with its sampling, for this chat")
        self.preset.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToContents)
        self.preset_menu_button = QToolButton()
        self.preset_menu_button.setText("Presets")
        self.preset_menu_button.setPopupMode(QToolButton.ToolButtonPopupMode.InstantPopup)
        menu = QMenu(self.preset_menu_button)
        menu.addAction("Save this chat's prompt and sampling as a preset…", self.ask_preset_name)
        self.delete_preset_action = menu.addAction("Delete the chosen preset", self._delete_preset)
        self.preset_menu_button.setMenu(menu)
        self.edit_button = QPushButton("Edit")
        self.edit_button.setToolTip("This chat's own system prompt (the default one is in the settings)")
        self.editor = QPlainTextEdit()
        self.editor.setAccessibleName("This chat's system prompt")
        self.editor.setFixedHeight(70)
        self.save_button = QPushButton("Save")
        self.default_button = QPushButton("Use the default")
        self.default_button.setToolTip("Follow the default system prompt in the settings")
        self.cancel_button = QPushButton("Cancel")
        line = QHBoxLayout()
        line.setContentsMargins(0, 0, 0, 0)
        line.addWidget(self.preset)
        line.addWidget(self.summary, 1)
        line.addWidget(self.edit_button)
        line.addWidget(self.preset_menu_button)
        buttons = QHBoxLayout()
        buttons.addStretch(1)
        for b in (self.default_button, self.cancel_button, self.save_button):
            buttons.addWidget(b)
        self.editing = QWidget()
        editing = QVBoxLayout(self.editing)
        editing.setContentsMargins(0, 0, 0, 0)
        editing.addWidget(self.editor)
        editing.addLayout(buttons)
        self.editing.hide()
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(line)
        layout.addWidget(self.editing)
        self.edit_button.clicked.connect(self.start_edit)
        self.cancel_button.clicked.connect(self.stop_edit)
        self.save_button.clicked.connect(lambda: self._finish(self.editor.toPlainText().strip()))
        self.default_button.clicked.connect(lambda: self._finish(None))
        self.preset.activated.connect(lambda _: self.preset_chosen.emit(self.preset.currentData()))
        self.set_presets([], None)

    @property
    def prompt(self) -> str:
        """What the model is told first: the chat's own prompt, or the default."""
        return self.default if self.own is None else self.own

    def set_presets(self, presets, chosen_id: int | None) -> None:
        """The presets to choose from (store.Preset), `chosen_id` chosen (None: no preset)."""
        self.preset.blockSignals(True)
        self.preset.clear()
        self.preset.addItem("No preset", None)
        for preset in presets:
            self.preset.addItem(preset.name, preset.id)
        self.preset.setCurrentIndex(max(0, self.preset.findData(chosen_id)) if chosen_id is not None else 0)
        self.preset.blockSignals(False)
        self.delete_preset_action.setEnabled(chosen_id is not None)

    def ask_preset_name(self) -> None:
        name, ok = QInputDialog.getText(self, "Save preset", "Save this chat's system prompt and sampling as:",
                                        text=self.preset.currentText() if self.preset.currentIndex() > 0 else "")
        if ok and name.strip():
            self.preset_saved.emit(name.strip())

    def _delete_preset(self) -> None:
        if self.preset.currentData() is not None:
            self.preset_deleted.emit(self.preset.currentData())

    def show_prompt(self, own: str | None, default: str, default_name: str = "default") -> None:
        self.own, self.default, self.default_name = own, default, default_name
        whose = default_name if own is None else "this chat's own"
        text = " ".join(self.prompt.split())
        self._line = f"System prompt ({whose}): {text}" if text else f"No system prompt ({whose})"
        self.summary.setToolTip(self.prompt)
        self.default_button.setEnabled(own is not None)
        self._elide()

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self._elide()

    def _elide(self) -> None:
        width = max(self.summary.width(), 50)
        self.summary.setText(self.summary.fontMetrics().elidedText(self._line, Qt.TextElideMode.ElideRight, width))

    def start_edit(self) -> None:
        self.editor.setPlainText(self.prompt)
        self.editing.show()
        self.edit_button.hide()
        self.editor.setFocus()

    def stop_edit(self) -> None:
        self.editing.hide()
        self.edit_button.show()

    def _finish(self, own: str | None) -> None:
        self.stop_edit()
        self.changed.emit(own)
