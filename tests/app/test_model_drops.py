"""A model dropped anywhere on the window opens, whichever text box is under the cursor: never pasted as its path."""

import shutil

from PySide6.QtCore import QMimeData, QPointF, Qt, QUrl
from PySide6.QtGui import QDragEnterEvent, QDragMoveEvent, QDropEvent
from PySide6.QtWidgets import QApplication


def _drag_and_drop(window, widget, path) -> bool:
    """Drag `path` over the middle of `widget` and drop it, as the platform delivers a drag: to the window's QWindow,
    which hands each event to the widget under the cursor. Returns whether the drop was accepted."""
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(path))])
    mime.setText(QUrl.fromLocalFile(str(path)).toString())  # what file managers put beside the URL list
    point = widget.mapTo(window, widget.rect().center())
    under = window.childAt(point)
    assert under is widget or widget.isAncestorOf(under)  # the drag really is over this text box
    handle = window.windowHandle()
    for kind in (QDragEnterEvent, QDragMoveEvent):
        event = kind(point, Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier)
        QApplication.sendEvent(handle, event)
        assert event.isAccepted()  # the cursor says a drop is welcome here
    drop = QDropEvent(QPointF(point), Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton,
                      Qt.KeyboardModifier.NoModifier)
    QApplication.sendEvent(handle, drop)
    return drop.isAccepted()


def test_a_model_dropped_on_a_text_box_opens_and_is_not_pasted(app_driver, tiny_model_dir, tmp_path, qtbot):
    # Caught: the message box (and the search box, the system prompt editor) took the drop itself and held
    # "file:///…" as text; the window never saw it, so the model was not opened (review finding 8).
    window = app_driver.open(tiny_model_dir)
    app_driver.wait_planned(window)
    chat = window.chat
    chat.system_prompt.start_edit()  # its editor shows
    chat.input.setPlainText("my draft")
    boxes = {"message": (chat.input, chat.input.toPlainText),
             "search": (window.conversations.search, window.conversations.search.text),
             "system prompt": (chat.system_prompt.editor, chat.system_prompt.editor.toPlainText)}
    for i, (name, (box, text)) in enumerate(boxes.items()):
        before = text()
        folder = tmp_path / f"dropped-on-{i}"
        shutil.copytree(tiny_model_dir, folder)
        assert _drag_and_drop(window, box, folder), name
        assert text() == before, name  # nothing pasted
        qtbot.waitUntil(lambda: window.settings_panel.forecast is not None
                        and str(window.settings_panel.forecast.info.model_dir) == str(folder),
                        timeout=app_driver.timeout_ms)
        assert window.settings_panel.model_combo.currentText() == folder.name

    # Anything else dropped there is the box's, as before: a text file's path is pasted.
    notes = tmp_path / "notes.txt"
    notes.write_text("not a model")
    assert _drag_and_drop(window, chat.input, notes)
    assert "notes.txt" in chat.input.toPlainText() and window.model_dir == str(folder)
