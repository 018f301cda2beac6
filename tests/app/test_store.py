from app.store import ConversationStore


def test_conversation_survives_reopen(tmp_path):
    path = tmp_path / "c.sqlite3"
    store = ConversationStore(path)
    cid = store.create("First")
    store.add_message(cid, "user", "Hello")
    store.add_message(cid, "assistant", "Hi **there**", {"tokens_per_s": 12.5})
    store.rename(cid, "Greeting")
    store.close()

    reopened = ConversationStore(path)
    rows = reopened.conversations()
    assert [r.title for r in rows] == ["Greeting"]
    messages = reopened.messages(rows[0].id)
    assert [(m.role, m.content) for m in messages] == [("user", "Hello"), ("assistant", "Hi **there**")]
    assert messages[1].meta == {"tokens_per_s": 12.5}


def test_delete_after_and_delete(tmp_path):
    store = ConversationStore(tmp_path / "c.sqlite3")
    cid = store.create()
    first = store.add_message(cid, "user", "one")
    store.add_message(cid, "assistant", "two")
    third = store.add_message(cid, "user", "three")
    store.set_memory_start(cid, third)
    store.delete_after(cid, first)
    assert [m.content for m in store.messages(cid)] == ["one"]
    assert store.conversation(cid).memory_start_id is None  # the marked message is gone
    other = store.create("other")
    store.delete(cid)
    assert [r.id for r in store.conversations()] == [other]
    assert store.messages(cid) == []


def test_default_path_is_in_the_data_dir(isolated_user_files):
    store = ConversationStore()
    assert store.path.parent == isolated_user_files
    store.close()
