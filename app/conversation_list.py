"""The list of conversations: new, rename (in place), delete, export."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (
    QAbstractItemView,
    QFileDialog,
    QHBoxLayout,
    QListWidget,
    QListWidgetItem,
    QMenu,
    QMessageBox,
    QPushButton,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from . import export
from .store import ConversationStore

ID_ROLE = Qt.ItemDataRole.UserRole


class ConversationList(QWidget):
    """Reads and writes `store`; `selected(conversation_id)` when the user picks one (or one is created)."""

    selected = Signal(int)
    deleted = Signal(int)  # before the next one is selected

    def __init__(self, store: ConversationStore, parent=None):
        super().__init__(parent)
        self.store = store
        self.list = QListWidget()
        self.list.setAccessibleName("Conversations")
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.list.setEditTriggers(QAbstractItemView.EditTrigger.EditKeyPressed
                                  | QAbstractItemView.EditTrigger.DoubleClicked)
        self.new_button = QPushButton("New chat")
        self.new_button.setToolTip("Start a new conversation (Ctrl+N)")
        self.rename_button = QToolButton()
        self.rename_button.setText("Rename")
        self.delete_button = QToolButton()
        self.delete_button.setText("Delete")
        self.export_button = QToolButton()
        self.export_button.setText("Export")
        self.export_button.setPopupMode(QToolButton.ToolButtonPopupMode.InstantPopup)
        menu = QMenu(self.export_button)
        menu.addAction("Markdown…", lambda: self.export_dialog("md"))
        menu.addAction("JSON…", lambda: self.export_dialog("json"))
        self.export_button.setMenu(menu)
        buttons = QHBoxLayout()
        buttons.addWidget(self.rename_button)
        buttons.addWidget(self.delete_button)
        buttons.addWidget(self.export_button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.new_button)
        layout.addWidget(self.list, 1)
        layout.addLayout(buttons)
        delete_action = QAction(self)
        delete_action.setShortcut(QKeySequence.StandardKey.Delete)
        delete_action.setShortcutContext(Qt.ShortcutContext.WidgetShortcut)
        delete_action.triggered.connect(self.confirm_delete)
        self.list.addAction(delete_action)

        self.new_button.clicked.connect(self.new_conversation)
        self.rename_button.clicked.connect(self.rename_current)
        self.delete_button.clicked.connect(self.confirm_delete)
        self.list.currentItemChanged.connect(self._current_changed)
        self.list.itemChanged.connect(self._renamed)
        self.refresh()

    @property
    def current_id(self) -> int | None:
        item = self.list.currentItem()
        return None if item is None else item.data(ID_ROLE)

    def refresh(self, select_id: int | None = None) -> None:
        """Reload from the store, keeping (or moving to) the selection."""
        keep = select_id if select_id is not None else self.current_id
        self.list.blockSignals(True)
        self.list.clear()
        for row in self.store.conversations():
            item = QListWidgetItem(row.title)
            item.setData(ID_ROLE, row.id)
            item.setFlags(item.flags() | Qt.ItemFlag.ItemIsEditable)
            self.list.addItem(item)
            if row.id == keep:
                self.list.setCurrentItem(item)
        self.list.blockSignals(False)
        has = self.current_id is not None
        for button in (self.rename_button, self.delete_button, self.export_button):
            button.setEnabled(has)

    def select(self, conversation_id: int) -> None:
        self.refresh(conversation_id)
        self.selected.emit(conversation_id)

    def new_conversation(self) -> int:
        conversation_id = self.store.create()
        self.select(conversation_id)
        return conversation_id

    def delete(self, conversation_id: int) -> None:
        self.store.delete(conversation_id)
        self.deleted.emit(conversation_id)
        rows = self.store.conversations()
        if rows:
            self.select(rows[0].id)
        else:
            self.refresh()
            self.selected.emit(-1)

    def export(self, conversation_id: int, path: Path) -> None:
        row = self.store.conversation(conversation_id)
        messages = self.store.messages(conversation_id)
        text = export.to_json(row.title, messages) if path.suffix == ".json" else export.to_markdown(row.title, messages)
        path.write_text(text, encoding="utf-8")

    def _current_changed(self, current, _previous) -> None:
        if current is not None:
            for button in (self.rename_button, self.delete_button, self.export_button):
                button.setEnabled(True)
            self.selected.emit(current.data(ID_ROLE))

    def rename_current(self) -> None:
        item = self.list.currentItem()
        if item is not None:
            self.list.editItem(item)

    def _renamed(self, item: QListWidgetItem) -> None:
        title = item.text().strip()
        if title:
            self.store.rename(item.data(ID_ROLE), title)
        else:  # an empty title is refused: show the stored one again
            self.refresh()

    def confirm_delete(self) -> None:
        item = self.list.currentItem()
        if item is None:
            return
        answer = QMessageBox.question(self, "Delete conversation", f"Delete “{item.text()}” and all its messages?")
        if answer == QMessageBox.StandardButton.Yes:
            self.delete(item.data(ID_ROLE))

    def export_dialog(self, kind: str) -> None:
        conversation_id = self.current_id
        if conversation_id is None:
            return
        title = self.store.conversation(conversation_id).title
        filters = "Markdown (*.md)" if kind == "md" else "JSON (*.json)"
        name, _ = QFileDialog.getSaveFileName(self, "Export conversation", f"{title}.{kind}", filters)
        if name:
            path = Path(name)
            if path.suffix != f".{kind}":
                path = path.with_suffix(f".{kind}")
            try:
                self.export(conversation_id, path)
            except OSError as e:
                QMessageBox.warning(self, "Export failed", f"Could not write {path}: {e.strerror or e}")
