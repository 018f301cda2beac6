"""The list of conversations: search, new, rename (in place), delete, export; each with its date."""

from __future__ import annotations

import time
from pathlib import Path

from PySide6.QtCore import QEvent, Qt, Signal
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (
    QAbstractItemView,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMenu,
    QMessageBox,
    QPushButton,
    QStyle,
    QStyledItemDelegate,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from . import export, theme
from .store import ConversationStore

ID_ROLE = Qt.ItemDataRole.UserRole
DATE_ROLE = Qt.ItemDataRole.UserRole + 1  # "14:05", "Yesterday", "Mon", "3 Nov", "3 Nov 2025"
MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")


def when(updated: float, now: float) -> str:
    """When a conversation last changed, as short as the distance allows (local time, English like the rest)."""
    then, today = time.localtime(updated), time.localtime(now)
    days = (time.mktime(today[:3] + (0, 0, 0, 0, 0, -1)) - time.mktime(then[:3] + (0, 0, 0, 0, 0, -1))) / 86400
    if days < 0.5:
        return f"{then.tm_hour:02d}:{then.tm_min:02d}"
    if days < 1.5:
        return "Yesterday"
    if days < 6.5:
        return DAYS[then.tm_wday]
    day = f"{then.tm_mday} {MONTHS[then.tm_mon - 1]}"
    return day if then.tm_year == today.tm_year else f"{day} {then.tm_year}"


class DatedItemDelegate(QStyledItemDelegate):
    """Draws the title elided on the left and the date in grey on the right; the editor edits the title only."""

    def paint(self, painter, option, index) -> None:
        date = index.data(DATE_ROLE) or ""
        width = option.fontMetrics.horizontalAdvance(date) + 10 if date else 0
        opt = option.__class__(option)
        self.initStyleOption(opt, index)
        title, opt.text = opt.text, ""
        style = opt.widget.style() if opt.widget else QStyle()
        style.drawControl(QStyle.ControlElement.CE_ItemViewItem, opt, painter, opt.widget)
        selected = bool(opt.state & QStyle.StateFlag.State_Selected)
        text_rect = opt.rect.adjusted(4, 0, -4, 0)
        painter.save()
        painter.setPen(opt.palette.highlightedText().color() if selected else opt.palette.text().color())
        elided = opt.fontMetrics.elidedText(title, Qt.TextElideMode.ElideRight, text_rect.width() - width)
        painter.drawText(text_rect, Qt.AlignmentFlag.AlignVCenter | Qt.AlignmentFlag.AlignLeft, elided)
        if date:
            painter.setPen(opt.palette.highlightedText().color() if selected else opt.palette.placeholderText().color())
            painter.drawText(text_rect, Qt.AlignmentFlag.AlignVCenter | Qt.AlignmentFlag.AlignRight, date)
        painter.restore()


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
        self.list.setItemDelegate(DatedItemDelegate(self.list))
        self.search = QLineEdit()
        self.search.setPlaceholderText("Search chats (Ctrl+F)")
        self.search.setAccessibleName("Search conversations")
        self.search.setClearButtonEnabled(True)
        self.search.setToolTip("Esc clears the search")
        self.no_matches = QLabel()
        self.no_matches.setWordWrap(True)
        self.no_matches.setAlignment(Qt.AlignmentFlag.AlignCenter)
        theme.tint(self.no_matches, "muted")
        self.no_matches.hide()
        self._open_id: int | None = None  # the chat on screen: kept while a search hides it, selected again after
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
        layout.addWidget(self.search)
        layout.addWidget(self.no_matches)
        layout.addWidget(self.list, 1)
        layout.addLayout(buttons)
        delete_action = QAction(self)
        delete_action.setShortcut(QKeySequence.StandardKey.Delete)
        delete_action.setShortcutContext(Qt.ShortcutContext.WidgetShortcut)
        delete_action.triggered.connect(self.confirm_delete)
        self.list.addAction(delete_action)
        self.search.installEventFilter(self)  # Esc clears it

        self.new_button.clicked.connect(self.new_conversation)
        self.rename_button.clicked.connect(self.rename_current)
        self.delete_button.clicked.connect(self.confirm_delete)
        self.list.currentItemChanged.connect(self._current_changed)
        self.list.itemChanged.connect(self._renamed)
        self.search.textChanged.connect(lambda _: self.refresh())
        self.refresh()

    @property
    def current_id(self) -> int | None:
        item = self.list.currentItem()
        return None if item is None else item.data(ID_ROLE)

    def refresh(self, select_id: int | None = None) -> None:
        """Reload from the store, keeping (or moving to) the selection: the chat on screen, even when a search hid it
        for a while."""
        if select_id is not None:
            self._open_id = select_id
        keep = self._open_id if self._open_id is not None else self.current_id
        self.list.blockSignals(True)
        self.list.clear()
        now = time.time()
        query = self.search.text().strip()
        rows = self.store.search(query)
        self.no_matches.setText(f"No chats match “{query}”. Esc clears the search." if query else "")
        self.no_matches.setVisible(bool(query) and not rows)
        for row in rows:
            item = QListWidgetItem(row.title)
            item.setData(ID_ROLE, row.id)
            item.setData(DATE_ROLE, when(row.updated, now))
            item.setToolTip(time.strftime("%Y-%m-%d %H:%M", time.localtime(row.updated)))
            item.setFlags(item.flags() | Qt.ItemFlag.ItemIsEditable)
            self.list.addItem(item)
            if row.id == keep:
                self.list.setCurrentItem(item)
        self.list.blockSignals(False)
        has = self.current_id is not None
        for button in (self.rename_button, self.delete_button, self.export_button):
            button.setEnabled(has)

    def eventFilter(self, obj, event) -> bool:
        if (obj is self.search and event.type() == QEvent.Type.KeyPress and event.key() == Qt.Key.Key_Escape
                and self.search.text()):
            self.search.clear()
            return True
        return super().eventFilter(obj, event)

    def select(self, conversation_id: int) -> None:
        self._open_id = conversation_id
        self.refresh(conversation_id)
        self.selected.emit(conversation_id)

    def find(self) -> None:
        """Ctrl+F: into the search box, its text selected."""
        self.search.setFocus()
        self.search.selectAll()

    def new_conversation(self) -> int:
        self.search.clear()  # a new chat matches no search: it must show
        conversation_id = self.store.create()
        self.select(conversation_id)
        return conversation_id

    def delete(self, conversation_id: int) -> None:
        self.store.delete(conversation_id)
        if self._open_id == conversation_id:
            self._open_id = None
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
            self._open_id = current.data(ID_ROLE)
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
