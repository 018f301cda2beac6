import json

from app.conversation_list import ConversationList
from app.store import ConversationStore


def test_new_rename_delete_export(qtbot, tmp_path):
    store = ConversationStore(tmp_path / "c.sqlite3")
    widget = ConversationList(store)
    qtbot.addWidget(widget)
    with qtbot.waitSignal(widget.selected) as blocker:
        first = widget.new_conversation()
    assert blocker.args == [first] and widget.current_id == first
    store.add_message(first, "user", "Hi")
    store.add_message(first, "assistant", "Hello! `code`")
    second = widget.new_conversation()
    assert widget.list.count() == 2 and widget.current_id == second

    # Rename in place, as the list's editor does when the user types a title and presses Enter.
    widget.list.currentItem().setText("  Planning  ")
    assert store.conversation(second).title == "Planning"

    widget.export(first, tmp_path / "chat.md")
    widget.export(first, tmp_path / "chat.json")
    assert "## Assistant\n\nHello! `code`" in (tmp_path / "chat.md").read_text()
    assert json.loads((tmp_path / "chat.json").read_text())["messages"][0] == {"role": "user", "content": "Hi"}

    with qtbot.waitSignal(widget.selected) as blocker:
        widget.delete(second)
    assert blocker.args == [first]
    assert [r.id for r in store.conversations()] == [first]
    store.close()
