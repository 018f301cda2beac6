from stowage.app.store import ConversationStore


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


def test_delete(tmp_path):
    store = ConversationStore(tmp_path / "c.sqlite3")
    cid = store.create()
    store.add_message(cid, "user", "one")
    other = store.create("other")
    store.delete(cid)
    assert [r.id for r in store.conversations()] == [other]
    assert store.messages(cid) == []


def test_alternatives_are_siblings_and_the_chosen_branch_is_shown(tmp_path):
    path = tmp_path / "c.sqlite3"
    store = ConversationStore(path)
    cid = store.create()
    question = store.add_message(cid, "user", "Q")
    first = store.add_message(cid, "assistant", "A1")
    follow_up = store.add_message(cid, "user", "Q2")
    second = store.add_message(cid, "assistant", "A2", parent_id=question)  # a regenerated reply
    shown = store.messages(cid)
    assert [m.content for m in shown] == ["Q", "A2"] and shown[1].siblings == (first, second)
    store.choose(first)  # back to the first reply, and the branch below it as it was left
    assert [m.content for m in store.messages(cid)] == ["Q", "A1", "Q2"]
    edited = store.add_alternative(question, "Q, edited")
    shown = store.messages(cid)
    assert [(m.id, m.content) for m in shown] == [(edited, "Q, edited")] and shown[0].siblings == (question, edited)
    store.close()
    reopened = ConversationStore(path)
    reopened.choose(question)
    assert [m.id for m in reopened.messages(cid)] == [question, first, follow_up]
    reopened.close()


def test_default_path_is_in_the_data_dir(isolated_user_files):
    store = ConversationStore()
    assert store.path.parent == isolated_user_files
    store.close()


def last_message(path, conversation_id):
    """The last message as another process opening the file would see it."""
    store = ConversationStore(path)
    try:
        return store.messages(conversation_id)[-1]
    finally:
        store.close()


def test_streamed_reply_is_saved_as_it_grows(tmp_path):
    path = tmp_path / "c.sqlite3"
    store = ConversationStore(path)
    assert store.warning is None
    cid = store.create()
    store.add_message(cid, "user", "Count to three")
    reply = store.add_message(cid, "assistant", "")
    for partial in ("One", "One, two", "One, two, three"):
        store.update_message(reply, partial)
        # Another connection sees each step: a kill mid-reply keeps what was streamed so far.
        assert last_message(path, cid).content == partial
    store.update_message(reply, "One, two, three.", {"finish_reason": "stop"})
    store.close()
    last = last_message(path, cid)
    assert (last.id, last.content, last.meta) == (reply, "One, two, three.", {"finish_reason": "stop"})


def test_search_finds_titles_and_message_text(tmp_path):
    store = ConversationStore(tmp_path / "c.sqlite3")
    trip = store.create("Trip to Lisbon")
    code = store.create("Python help")
    store.add_message(code, "user", "Why does my LISBON_TZ constant break?")
    other = store.create("Groceries")
    store.add_message(other, "user", "milk, 100% cocoa")
    assert {r.id for r in store.search("lisbon")} == {trip, code}  # the title, and a message (any case)
    assert [r.id for r in store.search("100%")] == [other]  # % and _ are literal, not wildcards
    assert store.search("0_c") == [] and store.search("nowhere") == []
    assert [r.id for r in store.search("")] == [r.id for r in store.conversations()]
    store.close()
