from stowage.app.store import SCHEMA_VERSION, ConversationStore


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


# A history at schema version 1 (branches and per-chat system prompts, before presets), as Stowage wrote it.
VERSION_1 = """
CREATE TABLE conversations (id INTEGER PRIMARY KEY, title TEXT NOT NULL, created REAL NOT NULL,
                            updated REAL NOT NULL, memory_start_id INTEGER, system_prompt TEXT);
CREATE TABLE messages (id INTEGER PRIMARY KEY AUTOINCREMENT,
                       conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
                       role TEXT NOT NULL, content TEXT NOT NULL, created REAL NOT NULL, meta TEXT NOT NULL DEFAULT '{}',
                       parent_id INTEGER REFERENCES messages(id) ON DELETE CASCADE, chosen INTEGER NOT NULL DEFAULT 0);
CREATE INDEX messages_by_conversation ON messages(conversation_id, id);
INSERT INTO conversations VALUES (1, 'Kept chat', 1.0, 2.0, NULL, 'Be brief.');
INSERT INTO messages (conversation_id, role, content, created, parent_id, chosen) VALUES
    (1, 'user', 'hi', 1.0, NULL, 1), (1, 'assistant', 'hello', 1.5, 1, 2);
PRAGMA user_version = 1;
"""


def test_presets_come_with_a_migration_that_keeps_the_chats(tmp_path):
    import sqlite3

    path = tmp_path / "c.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(VERSION_1)
    db.close()
    store = ConversationStore(path)
    assert store.warning is None
    (row,) = store.conversations()
    assert (row.title, row.system_prompt, row.preset_id, row.overflow_policy) == ("Kept chat", "Be brief.", None, None)
    assert [m.content for m in store.messages(1)] == ["hi", "hello"]
    coder = store.save_preset("Coder", "You write Python.", {"temperature": 0.2, "top_k": 20})
    store.set_preset(1, coder)
    store.set_overflow_policy(1, "drop_oldest")
    assert store.save_preset("Coder", "You write Rust.", {"temperature": 0.3}) == coder  # saved again: replaced
    store.close()
    again = ConversationStore(path)
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    (row,) = again.conversations()
    assert (row.preset_id, row.overflow_policy) == (coder, "drop_oldest")
    assert again.preset(coder).system_prompt == "You write Rust." and again.preset(coder).sampling == {"temperature": 0.3}
    again.delete_preset(coder)
    assert again.presets() == [] and again.conversation(1).preset_id is None
    again.close()


def test_deleting_one_message_keeps_the_ones_after_it(tmp_path):
    store = ConversationStore(tmp_path / "c.sqlite3")
    cid = store.create()
    q1 = store.add_message(cid, "user", "q1")
    a1 = store.add_message(cid, "assistant", "a1")
    q2 = store.add_message(cid, "user", "q2")
    a2 = store.add_message(cid, "assistant", "a2")
    store.set_memory_start(cid, a1)
    store.delete_message(a1)
    assert [m.id for m in store.messages(cid)] == [q1, q2, a2]
    assert store.conversation(cid).memory_start_id == q2  # the memory line moves to the message in its place
    store.delete_message(q1)  # the first one: the next becomes the first
    assert [m.content for m in store.messages(cid)] == ["q2", "a2"]
    retry = store.add_alternative(a2, "a2, again")
    store.add_message(cid, "user", "q3")  # below the second version
    store.delete_message(retry)  # a version goes with its branch; the other version shows
    assert [m.content for m in store.messages(cid)] == ["q2", "a2"]
    store.close()


def test_reply_options_come_with_version_3_and_are_kept_per_chat(tmp_path):
    import sqlite3

    path = tmp_path / "c.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(VERSION_1)
    db.close()
    store = ConversationStore(path)
    assert store.conversation(1).reply_options == {}  # an old chat: free text, no tools
    options = {"response_format": {"type": "json_object"}, "tools": [{"type": "function", "function": {"name": "f"}}]}
    store.set_reply_options(1, options)
    other = store.create()
    store.close()
    again = ConversationStore(path)
    assert again.conversation(1).reply_options == options and again.conversation(other).reply_options == {}
    again.set_reply_options(1, {})
    assert again.conversation(1).reply_options == {}
    # a value edited by hand into something else: no options, not an error (before: JSONDecodeError)
    for edited in ("not json", "[1, 2]", "[" * 10_000):
        again._db.execute("UPDATE conversations SET reply_options = ? WHERE id = 1", (edited,))
        assert again.conversation(1).reply_options == {} and len(again.conversations()) == 2
    again.close()
