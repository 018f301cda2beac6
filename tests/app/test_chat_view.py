from PySide6.QtGui import QTextFormat

from stowage.app.chat_view import ChatView
from stowage.app.store import Message


def test_markdown_is_rendered_with_code_in_monospace(qtbot):
    view = ChatView()
    qtbot.addWidget(view)
    view.resize(600, 400)
    view.show()
    widget = view.add_message(Message(1, "assistant", "Some **bold** text.\n\n```python\nprint('hi')\n```\n"))
    document = widget.body.document()
    assert "bold" in document.toPlainText() and "**" not in document.toPlainText()
    code = [b for b in _blocks(document) if b.text() == "print('hi')"][0]
    assert code.blockFormat().hasProperty(QTextFormat.Property.BlockCodeFence)
    assert "monospace" in (code.charFormat().fontFamilies() or [])
    assert widget.body.height() >= document.size().height()  # as tall as its text: no inner scrolling


def test_streaming_reply_is_throttled_and_marker_placed(qtbot):
    view = ChatView()
    qtbot.addWidget(view)
    view.show()
    first = view.add_message(Message(1, "user", "old question"))
    second = view.add_message(Message(2, "user", "new question"))
    view.begin_reply()
    renders = []
    view.reply_rendered.connect(renders.append)
    for piece in ["Hel", "lo", " wor", "ld"]:
        view.append_reply(piece)
    assert renders == []  # nothing drawn per token
    qtbot.waitUntil(lambda: bool(renders), timeout=1000)
    assert renders == ["Hello world"]  # one redraw for the four pieces
    view.end_reply(Message(3, "assistant", "Hello world", {"tokens_per_s": 9.5}))
    assert view.widgets[-1].message.id == 3 and "9.5 tokens/s" in view.widgets[-1].note.text()
    view.mark_memory_start(2)
    column = view._column
    assert column.indexOf(view.memory_marker) == column.indexOf(second) - 1
    assert column.indexOf(first) < column.indexOf(view.memory_marker)


def _blocks(document):
    block = document.begin()
    while block.isValid():
        yield block
        block = block.next()


def test_single_line_breaks_are_kept_on_screen(qtbot):
    view = ChatView()
    qtbot.addWidget(view)
    view.resize(600, 400)
    view.show()
    poem = "Roses are red,\nviolets are blue;\n\n```\ncode  stays\nas is\n```\n- a list\n- still a list"
    widget = view.add_message(Message(1, "user", poem))
    lines = widget.body.document().toPlainText().replace("\u2028", "\n").splitlines()
    assert "Roses are red," in lines and "violets are blue;" in lines  # two lines, not one run-on line
    assert "code  stays" in lines and "as is" in lines  # fenced code untouched (no added break spaces)
    assert [b.textList() is not None for b in _blocks(widget.body.document()) if "list" in b.text()] == [True, True]
    assert widget.text == poem  # Copy gives what was written


def test_edit_says_the_version_there_now_is_kept(qtbot):
    view = ChatView()
    qtbot.addWidget(view)
    view.show()
    for i, role in enumerate(["user", "assistant", "user", "assistant"], start=1):
        view.add_message(Message(i, role, f"message {i}", siblings=(i,)))
    first, third = view.widgets[0], view.widgets[2]
    qtbot.waitUntil(first.isVisible)  # widgets added to a shown layout appear at the next event loop pass
    first.edit_button.click()
    assert first.edit_note.isVisible() and "version 2" in first.edit_note.text()
    assert "kept with the 3 messages after it" in first.edit_note.text()
    first.cancel_button.click()
    assert not first.edit_note.isVisible()
    third.edit_button.click()
    assert "kept with the reply after it" in third.edit_note.text()


def test_arrows_show_which_version_and_ask_for_the_next(qtbot):
    view = ChatView()
    qtbot.addWidget(view)
    view.show()
    single = view.add_message(Message(1, "user", "Q", siblings=(1,)))
    second = view.add_message(Message(3, "assistant", "A2", parent_id=1, siblings=(2, 3)))
    qtbot.waitUntil(second.isVisible)
    assert not single.version.isVisible() and second.version.isVisible()
    assert second.version.text() == "2/2" and second.previous_button.isEnabled() and not second.next_button.isEnabled()
    with qtbot.waitSignal(view.alternative_chosen) as chosen:
        second.previous_button.click()
    assert chosen.args == [2]
    view.set_alternatives_enabled(False)  # while a reply streams
    assert not second.previous_button.isEnabled()


def test_editing_an_earlier_message_brings_its_editor_into_view(qtbot):
    from PySide6.QtCore import QPoint

    view = ChatView()
    qtbot.addWidget(view)
    view.resize(500, 400)
    view.show()
    for i in range(30):
        view.add_message(Message(i + 1, "user" if i % 2 == 0 else "assistant", f"message {i}\n\nwith a second line"))
    bar = view.verticalScrollBar()
    qtbot.waitUntil(lambda: bar.maximum() > 0 and bar.value() == bar.maximum())  # at the newest, as after a reply
    first = view.widgets[0]
    first.start_edit()

    def editor_in_view() -> bool:
        top = first.editor.mapTo(view.viewport(), QPoint(0, 0)).y()
        return 0 <= top and top + first.editor.height() <= view.viewport().height()

    qtbot.waitUntil(editor_in_view, timeout=2000)
    qtbot.wait(100)  # and it stays there: the view no longer follows the bottom
    assert editor_in_view()


CODE = "Here:\n\n```python\ndef area(r):\n    return 3.14 * r * r\n```\n\n| Name | Size |\n|:-----|-----:|\n| a | 1 |\n"


def test_code_is_highlighted_with_a_copy_button_and_table_headers_align_with_their_columns(qtbot):
    from PySide6.QtCore import Qt
    from PySide6.QtGui import QGuiApplication, QTextCursor, QTextTable

    view = ChatView()
    qtbot.addWidget(view)
    view.resize(600, 500)
    view.show()
    body = view.add_message(Message(1, "assistant", CODE)).body
    document = body.document()
    start = document.find("def area").position() - len("def area")
    cursor = QTextCursor(document)
    cursor.setPosition(start + 1)  # inside "def"
    keyword = cursor.charFormat().foreground().color()
    cursor.setPosition(start + 5)  # inside "area"
    name = cursor.charFormat().foreground().color()
    assert keyword.name() != name.name()  # a keyword and a name in different colours
    assert [b.language for b in body.code_blocks] == ["python"]
    button = body.copy_buttons[0]
    qtbot.waitUntil(button.isVisible, timeout=2000)  # the new message is shown at the next turn of the event loop
    qtbot.mouseClick(button, Qt.MouseButton.LeftButton)
    assert QGuiApplication.clipboard().text() == "def area(r):\n    return 3.14 * r * r"

    (table,) = [f for f in document.rootFrame().childFrames() if isinstance(f, QTextTable)]
    align = lambda row, col: table.cellAt(row, col).firstCursorPosition().blockFormat().alignment()  # noqa: E731
    assert align(0, 1) == align(1, 1) and align(1, 1) & Qt.AlignmentFlag.AlignRight
    assert align(0, 0) == align(1, 0)
    header = table.cellAt(0, 0)  # on one line with the others (Qt's Markdown opened it with an empty one after code)
    assert document.toPlainText()[header.firstPosition():header.lastPosition()] == "Name"


def test_messages_take_the_palettes_colours_in_dark_and_light(qtbot):
    from PySide6.QtGui import QColor

    from stowage.app import theme

    def looks(widget):
        image = widget.grab().toImage()
        counts = {}
        for y in range(4, image.height() - 4, 2):
            for x in range(4, image.width() - 4, 2):
                rgb = image.pixel(x, y)
                counts[rgb] = counts.get(rgb, 0) + 1
        background = QColor(max(counts, key=counts.get)).name()
        text = widget.body.palette().color(widget.body.foregroundRole()).name()
        return background, text

    view = ChatView()
    qtbot.addWidget(view)
    view.resize(500, 300)
    view.show()
    widget = view.add_message(Message(1, "assistant", "Some words to read, in a long enough line."))
    try:
        theme.apply("dark")
        qtbot.wait(20)
        background, text = looks(widget)
        assert theme.is_dark() and QColor(background).lightnessF() < 0.3
        assert theme.contrast(text, background) >= 4.5
        theme.apply("light")
        qtbot.wait(20)
        background, text = looks(widget)
        assert QColor(background).lightnessF() > 0.8 and theme.contrast(text, background) >= 4.5
    finally:
        theme.apply("system")
