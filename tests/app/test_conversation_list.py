import json

from stowage.app.conversation_list import ID_ROLE, ConversationList
from stowage.app.store import ConversationStore


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
    assert "## Assistant\n\n*" in (tmp_path / "chat.md").read_text()  # when it was written, then the text
    assert "*\n\nHello! `code`" in (tmp_path / "chat.md").read_text()
    first_message = json.loads((tmp_path / "chat.json").read_text())["messages"][0]
    assert (first_message["role"], first_message["content"]) == ("user", "Hi") and first_message["created"]

    with qtbot.waitSignal(widget.selected) as blocker:
        widget.delete(second)
    assert blocker.args == [first]
    assert [r.id for r in store.conversations()] == [first]
    store.close()


def test_search_box_filters_the_list_and_items_show_their_date(qtbot, tmp_path):
    import time

    from PySide6.QtCore import QDateTime

    from stowage.app.conversation_list import DATE_ROLE, when

    store = ConversationStore(tmp_path / "c.sqlite3")
    plans = store.create("Weekend plans")
    store.add_message(plans, "user", "a hike near the lake")
    other = store.create("Taxes")
    widget = ConversationList(store)
    qtbot.addWidget(widget)
    assert widget.list.count() == 2
    qtbot.keyClicks(widget.search, "LAKE")
    assert [widget.list.item(i).data(ID_ROLE) for i in range(widget.list.count())] == [plans]
    widget.search.clear()
    assert widget.list.count() == 2
    today = widget.list.item(0).data(DATE_ROLE)
    assert today == QDateTime.fromSecsSinceEpoch(int(store.conversation(other).updated)).toString("HH:mm")
    long_ago = time.mktime((2020, 3, 14, 12, 0, 0, 0, 0, -1))
    assert when(long_ago, now=time.time()) == "14 Mar 2020"
    store.close()


def test_export_writes_the_branch_on_screen(qtbot, tmp_path):
    store = ConversationStore(tmp_path / "c.sqlite3")
    widget = ConversationList(store)
    qtbot.addWidget(widget)
    cid = widget.new_conversation()
    question = store.add_message(cid, "user", "Q")
    kept = store.add_message(cid, "assistant", "the reply on screen")
    store.add_message(cid, "assistant", "a regenerated reply", parent_id=question)
    store.choose(kept)
    widget.export(cid, tmp_path / "chat.md")
    text = (tmp_path / "chat.md").read_text()
    assert "the reply on screen" in text and "regenerated" not in text and "version 1 of 2" in text
    store.close()


def test_search_says_no_matches_esc_clears_it_and_the_open_chat_stays_selected(qtbot, tmp_path):
    from PySide6.QtCore import Qt

    store = ConversationStore(tmp_path / "c.sqlite3")
    plans = store.create("Weekend plans")
    taxes = store.create("Taxes")
    widget = ConversationList(store)
    qtbot.addWidget(widget)
    widget.show()
    widget.select(plans)
    chosen = []
    widget.selected.connect(chosen.append)
    qtbot.keyClicks(widget.search, "nothing like this")
    assert widget.list.count() == 0
    assert widget.no_matches.isVisible() and "No chats match" in widget.no_matches.text()
    qtbot.keyClick(widget.search, Qt.Key.Key_Escape)
    assert widget.search.text() == "" and not widget.no_matches.isVisible()
    assert widget.list.count() == 2 and widget.current_id == plans  # the chat on screen, selected again
    qtbot.keyClicks(widget.search, "tax")  # the open chat is hidden by the search, then shown again
    assert [widget.list.item(i).data(ID_ROLE) for i in range(widget.list.count())] == [taxes]
    widget.search.clear()
    assert widget.current_id == plans and chosen == []  # nothing else was opened meanwhile
    store.close()
