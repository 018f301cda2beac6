"""A history file that is corrupt, cut short, a folder or unwritable never stops the store from opening."""

from __future__ import annotations

import os
import pickle
import pwd
import select
import shutil
import signal
import sqlite3
import tempfile
import time
import traceback
from pathlib import Path

import pytest

from stowage.app.store import ConversationStore


def write_history(path: Path, num_messages: int = 400) -> None:
    """A real history with enough messages that the file spans many pages."""
    store = ConversationStore(path)
    assert store.warning is None
    cid = store.create("Kept")
    for i in range(num_messages):
        store.add_message(cid, "user" if i % 2 == 0 else "assistant", f"message {i} " + "lorem ipsum " * 40)
    store.close()
    assert not path.with_name(path.name + "-wal").exists()  # closed cleanly: everything is in the main file


def moved_files(folder: Path, name: str = "c.sqlite3") -> list[Path]:
    """The moved-aside databases in `folder` (their -wal and -shm not counted)."""
    return sorted(p for p in folder.glob(f"{name}.broken-*") if not p.name.endswith(("-wal", "-shm")))


def assert_fresh_and_usable(store: ConversationStore) -> None:
    assert store.conversations() == []
    cid = store.create("After")
    store.add_message(cid, "user", "still works")
    assert [m.content for m in store.messages(cid)] == ["still works"]


def assert_moved_aside(store: ConversationStore, original: bytes) -> Path:
    """The broken file was renamed, byte for byte, the warning names both places, and a fresh file was started."""
    [moved] = moved_files(store.path.parent, store.path.name)
    assert moved.read_bytes() == original
    assert str(store.path) in store.warning and str(moved) in store.warning
    assert "moved to" in store.warning and "new one was started" in store.warning
    assert_fresh_and_usable(store)
    store.close()
    reopened = ConversationStore(store.path)  # the new file is a real, healthy history
    assert reopened.warning is None and [r.title for r in reopened.conversations()] == ["After"]
    reopened.close()
    return moved


def test_random_bytes_are_moved_aside(tmp_path):
    path = tmp_path / "c.sqlite3"
    original = os.urandom(64 * 1024)
    path.write_bytes(original)
    store = ConversationStore(path)
    assert "file is not a database" in store.warning
    assert_moved_aside(store, original)


def test_truncated_history_is_moved_aside(tmp_path):
    path = tmp_path / "c.sqlite3"
    write_history(path)
    original = path.read_bytes()[: path.stat().st_size // 2]
    path.write_bytes(original)
    store = ConversationStore(path)
    assert store.warning is not None
    assert_moved_aside(store, original)


def test_a_bad_page_in_the_middle_is_found_and_moved_aside(tmp_path):
    path = tmp_path / "c.sqlite3"
    write_history(path)
    data = bytearray(path.read_bytes())
    page = 4096
    middle = len(data) // 2 // page * page
    data[middle : middle + page] = b"\xff" * page  # 0xff is no b-tree page type
    original = bytes(data)
    path.write_bytes(original)
    store = ConversationStore(path)
    assert store.warning is not None
    assert_moved_aside(store, original)


def test_a_bad_schema_page_is_moved_aside(tmp_path):
    path = tmp_path / "c.sqlite3"
    write_history(path)
    data = bytearray(path.read_bytes())
    data[100:4096] = b"\x07" * (4096 - 100)  # page 1 past the file header: sqlite_master itself
    original = bytes(data)
    path.write_bytes(original)
    store = ConversationStore(path)
    assert "malformed" in store.warning
    assert_moved_aside(store, original)


def test_a_folder_at_the_path_is_moved_aside(tmp_path):
    path = tmp_path / "c.sqlite3"
    path.mkdir()
    (path / "inside.txt").write_text("keep me")
    store = ConversationStore(path)
    assert "it is a folder" in store.warning
    [moved] = moved_files(tmp_path)
    assert (moved / "inside.txt").read_text() == "keep me"
    assert_fresh_and_usable(store)
    store.close()


def test_another_programs_database_is_moved_aside(tmp_path):
    path = tmp_path / "c.sqlite3"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE messages (id INTEGER PRIMARY KEY, body TEXT)")  # same table name, other columns
    db.commit()
    db.close()
    original = path.read_bytes()
    store = ConversationStore(path)
    assert "not a Stowage history" in store.warning and "messages" in store.warning
    assert_moved_aside(store, original)


def test_wal_and_shm_move_with_the_broken_file(tmp_path):
    path = tmp_path / "c.sqlite3"
    path.write_bytes(b"not sqlite" * 1000)
    path.with_name("c.sqlite3-wal").write_bytes(b"wal bytes")
    path.with_name("c.sqlite3-shm").write_bytes(b"shm bytes")
    store = ConversationStore(path)
    [moved] = moved_files(tmp_path)
    assert moved.with_name(moved.name + "-wal").read_bytes() == b"wal bytes"
    assert moved.with_name(moved.name + "-shm").exists()  # an index SQLite rebuilds from the -wal; bytes may change
    assert_fresh_and_usable(store)
    store.close()


def test_the_last_messages_in_the_wal_are_kept_with_the_broken_file(tmp_path):
    # A kill leaves recent messages in the -wal only; the checks must not fold it into the broken file or drop it.
    live = tmp_path / "live" / "c.sqlite3"
    write_history(live)
    store = ConversationStore(live)
    cid = store.create("Recent")
    store.add_message(cid, "user", "only in the wal")
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    for suffix in ("", "-wal", "-shm"):
        shutil.copy(f"{live}{suffix}", crashed / f"c.sqlite3{suffix}")  # the files as a kill leaves them
    store.close()
    path = crashed / "c.sqlite3"
    data = bytearray(path.read_bytes())
    middle = len(data) // 2 // 4096 * 4096
    data[middle : middle + 4096] = b"\xff" * 4096
    path.write_bytes(bytes(data))
    wal = path.with_name("c.sqlite3-wal").read_bytes()
    assert len(wal) > 0

    store = ConversationStore(path)
    [moved] = moved_files(crashed)
    assert moved.read_bytes() == bytes(data)
    assert moved.with_name(moved.name + "-wal").read_bytes() == wal
    assert_fresh_and_usable(store)
    store.close()


def test_a_second_broken_file_does_not_overwrite_the_first(tmp_path):
    path = tmp_path / "c.sqlite3"
    for content in (b"first broken file" * 100, b"second broken file" * 100):
        path.write_bytes(content)
        ConversationStore(path).close()
    assert sorted(p.read_bytes()[:6] for p in moved_files(tmp_path)) == [b"first ", b"second"]


def test_empty_file_is_a_new_history_without_warning(tmp_path):
    path = tmp_path / "c.sqlite3"
    path.write_bytes(b"")
    store = ConversationStore(path)
    assert store.warning is None and moved_files(tmp_path) == []
    assert_fresh_and_usable(store)


# Unwritable files and folders. chmod does not stop root, so as root the scenario runs in a forked child
# that has dropped to the `nobody` user; that is the real permission check, not a simulation.


@pytest.fixture
def locked_folder(tmp_path):
    """A folder the scenario's user owns; as root it sits in /tmp (pytest's folder is closed to others)."""
    if os.geteuid() != 0:
        folder = tmp_path / "data"
        folder.mkdir()
        yield folder
        for p in (folder, *folder.rglob("*")):
            if not p.is_symlink():
                p.chmod(0o700)
        return
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("running as root without a 'nobody' user to drop to, and chmod does not stop root")
    folder = Path(tempfile.mkdtemp(prefix="stowage-store-"))
    os.chown(folder, nobody.pw_uid, nobody.pw_gid)
    yield folder
    shutil.rmtree(folder)


def as_folder_owner(folder: Path, scenario, *args):
    """scenario(*args) with the permissions of the folder's owner: here, or as root in a child that drops to it."""
    if os.geteuid() != 0:
        return scenario(*args)
    owner = folder.stat()
    for p in folder.rglob("*"):
        os.chown(p, owner.st_uid, owner.st_gid)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        try:
            os.close(read_end)
            try:
                os.setgroups([])
                os.setgid(owner.st_gid)
                os.setuid(owner.st_uid)
            except PermissionError as e:
                result = ("skip", f"cannot drop root privileges here ({e})")
            else:
                try:
                    result = ("ok", scenario(*args))
                except BaseException:
                    result = ("error", traceback.format_exc())
            os.write(write_end, pickle.dumps(result))
        finally:
            os._exit(0)
    os.close(write_end)
    data, deadline = b"", time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([read_end], [], [], 1.0)
            if ready:
                chunk = os.read(read_end, 1 << 16)
                if not chunk:
                    break
                data += chunk
        else:
            os.kill(pid, signal.SIGKILL)
            pytest.fail("the unprivileged child did not finish in 60 s")
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)
    status, value = pickle.loads(data)
    if status == "skip":
        pytest.skip(value)
    if status == "error":
        pytest.fail(f"in the unprivileged child:\n{value}")
    return value


def open_and_use(path: str) -> dict:
    """Open the store, read what it shows, add a conversation, and report (plain data: it may cross a pipe)."""
    store = ConversationStore(path)
    shown = [r.title for r in store.conversations()]
    cid = store.create("This session")
    store.add_message(cid, "user", "kept in memory")
    assert [m.content for m in store.messages(cid)] == ["kept in memory"]
    store.close()
    return {"warning": store.warning, "shown": shown}


def test_read_only_folder_without_history_runs_in_memory(locked_folder):
    locked_folder.chmod(0o500)
    path = locked_folder / "c.sqlite3"
    seen = as_folder_owner(locked_folder, open_and_use, str(path))
    assert "will not be saved" in seen["warning"] and str(path) in seen["warning"]
    assert "starts with no history" in seen["warning"]
    assert seen["shown"] == []
    assert not path.exists()


def test_read_only_folder_shows_the_history_but_saves_nothing(locked_folder):
    path = locked_folder / "c.sqlite3"
    write_history(path, num_messages=4)
    before = path.read_bytes()
    locked_folder.chmod(0o500)
    seen = as_folder_owner(locked_folder, open_and_use, str(path))
    assert "will not be saved" in seen["warning"] and "Past conversations are shown" in seen["warning"]
    assert seen["shown"] == ["Kept"]
    assert path.read_bytes() == before and moved_files(locked_folder) == []


def test_read_only_file_shows_the_history_but_saves_nothing(locked_folder):
    path = locked_folder / "c.sqlite3"
    write_history(path, num_messages=4)
    before = path.read_bytes()
    path.chmod(0o400)
    seen = as_folder_owner(locked_folder, open_and_use, str(path))
    assert "will not be saved" in seen["warning"] and "readonly" in seen["warning"]
    assert seen["shown"] == ["Kept"]
    assert path.read_bytes() == before


def test_corrupt_file_in_a_read_only_folder_is_left_in_place(locked_folder):
    path = locked_folder / "c.sqlite3"
    path.write_bytes(b"garbage" * 1000)
    locked_folder.chmod(0o500)
    seen = as_folder_owner(locked_folder, open_and_use, str(path))
    assert "could not be read" in seen["warning"] and "could not be moved aside" in seen["warning"]
    assert "memory only" in seen["warning"]
    assert path.read_bytes() == b"garbage" * 1000


def test_data_folder_that_cannot_be_created_runs_in_memory(locked_folder, monkeypatch):
    locked_folder.chmod(0o500)
    monkeypatch.setenv("STOWAGE_DATA_DIR", str(locked_folder / "stowage"))

    def default_store() -> dict:
        store = ConversationStore()
        store.create("in memory")
        return {"warning": store.warning, "path": store.path}

    seen = as_folder_owner(locked_folder, default_store)
    assert "will not be saved" in seen["warning"] and str(locked_folder / "stowage") in seen["warning"]
    assert seen["path"] is None


# The schema before branches and per-chat system prompts (user_version 0), as Stowage wrote it.
OLD_SCHEMA = """
CREATE TABLE conversations (id INTEGER PRIMARY KEY, title TEXT NOT NULL, created REAL NOT NULL,
                            updated REAL NOT NULL, memory_start_id INTEGER);
CREATE TABLE messages (id INTEGER PRIMARY KEY AUTOINCREMENT,
                       conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
                       role TEXT NOT NULL, content TEXT NOT NULL, created REAL NOT NULL, meta TEXT NOT NULL DEFAULT '{}');
CREATE INDEX messages_by_conversation ON messages(conversation_id, id);
INSERT INTO conversations VALUES (1, 'Old chat', 1.0, 2.0, 3), (2, 'Other', 1.0, 1.0, NULL);
INSERT INTO messages (conversation_id, role, content, created) VALUES
    (1, 'user', 'hi', 1.0), (2, 'user', 'elsewhere', 1.0), (1, 'assistant', 'hello', 1.5), (1, 'user', 'more', 2.0);
"""


def test_a_history_in_the_old_schema_opens_with_its_chats(tmp_path):
    path = tmp_path / "c.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(OLD_SCHEMA)
    db.execute("PRAGMA journal_mode = WAL")
    db.close()
    store = ConversationStore(path)
    assert store.warning is None
    assert [(r.title, r.memory_start_id, r.system_prompt) for r in store.conversations()] == [
        ("Old chat", 3, None), ("Other", None, None)]
    old = store.messages(1)
    assert [(m.id, m.role, m.content, m.parent_id) for m in old] == [
        (1, "user", "hi", None), (3, "assistant", "hello", 1), (4, "user", "more", 3)]
    assert [m.content for m in store.messages(2)] == ["elsewhere"]
    store.add_message(1, "assistant", "and a new reply")
    store.close()
    reopened = ConversationStore(path)  # migrated once: the second open finds the new schema
    assert [m.content for m in reopened.messages(1)][-1] == "and a new reply"
    reopened.close()


def read_old_chat(path: str) -> dict:
    store = ConversationStore(path)
    shown = [m.content for m in store.messages(1)]
    store.close()
    return {"warning": store.warning, "shown": shown}


def test_a_read_only_history_in_the_old_schema_is_shown(locked_folder):
    path = locked_folder / "c.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(OLD_SCHEMA)
    db.close()
    before = path.read_bytes()
    path.chmod(0o400)
    seen = as_folder_owner(locked_folder, read_old_chat, str(path))
    assert "will not be saved" in seen["warning"] and "Past conversations are shown" in seen["warning"]
    assert seen["shown"] == ["hi", "hello", "more"]  # migrated in memory; the file is left as it was
    assert path.read_bytes() == before
