"""Conversations kept in an SQLite file, written message by message so a crash loses at most one reply."""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import paths

FILE_NAME = "conversations.sqlite3"
SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    memory_start_id INTEGER          -- first message still in the model's context; NULL: all of them
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,  -- never reused: a regenerated reply is a new message
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    created REAL NOT NULL,
    meta TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
CREATE TABLE IF NOT EXISTS presets (  -- a system prompt with sampling, saved by name, chosen per chat
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    system_prompt TEXT NOT NULL,
    sampling TEXT NOT NULL DEFAULT '{}'  -- SamplingParams fields as JSON (those not given: the settings')
);
"""
# SCHEMA is version 0; every file, a new one included, is brought to SCHEMA_VERSION by MIGRATIONS in order.
# Each is (columns added: (table, column, declaration), ...), then the SQL that fills them in for old rows (or "").
# A table of its own (presets) is in SCHEMA, made where missing at every open.
SCHEMA_VERSION = 3
MIGRATIONS = {
    1: ((("messages", "parent_id", "INTEGER REFERENCES messages(id) ON DELETE CASCADE"),  # NULL: a first message
         ("messages", "chosen", "INTEGER NOT NULL DEFAULT 0"),  # the highest among siblings is on screen
         ("conversations", "system_prompt", "TEXT")),  # NULL: the default one in the settings
        # Before branches a chat was one line of messages in id order: each follows the one before it.
        "UPDATE messages SET chosen = id, parent_id = (SELECT MAX(p.id) FROM messages p "
        "WHERE p.conversation_id = messages.conversation_id AND p.id < messages.id)"),
    2: ((("conversations", "preset_id", "INTEGER REFERENCES presets(id) ON DELETE SET NULL"),  # NULL: none
         ("conversations", "overflow_policy", "TEXT")),  # context_policy's name; NULL: the settings' choice
        ""),
    # JSON: the chat's reply format and tools (reply_options.ReplyOptions.to_dict); NULL: free text, no tools
    3: ((("conversations", "reply_options", "TEXT"),), ""),
}
_CONVERSATION_COLUMNS = "id, title, updated, memory_start_id, system_prompt, preset_id, overflow_policy, reply_options"
# Files SQLite keeps beside the database; they belong to it and move with it.
_SIDE_FILES = ("-wal", "-shm", "-journal")


@dataclass(frozen=True)
class ConversationRow:
    id: int
    title: str
    updated: float
    memory_start_id: int | None = None
    system_prompt: str | None = None  # None: the preset's, else the default system prompt in the settings
    preset_id: int | None = None
    overflow_policy: str | None = None  # when the context is full (context_policy); None: as the settings say
    reply_options: dict = field(default_factory=dict)  # JSON replies and tools (app/reply_options.py); {}: none


def _conversation(row: tuple) -> ConversationRow:
    return ConversationRow(*row[:-1], _options(row[-1]))


def _options(text: str | None) -> dict:
    """A chat's stored reply options; {} for none, or for a value edited into something else than a JSON object."""
    try:
        options = json.loads(text) if text else {}
    except (ValueError, RecursionError):
        return {}
    return options if isinstance(options, dict) else {}


@dataclass(frozen=True)
class Preset:
    id: int
    name: str
    system_prompt: str
    sampling: dict  # SamplingParams fields it sets


@dataclass(frozen=True)
class Message:
    id: int
    role: str  # "user" | "assistant" | "system"
    content: str
    meta: dict = field(default_factory=dict)  # tokens/s, finish reason, model, sampling, ... of an assistant reply
    created: float = 0.0  # seconds since the epoch (0: not known, as for a message not stored yet)
    parent_id: int | None = None  # the message it follows (None: the first of its chat)
    siblings: tuple[int, ...] = ()  # its versions (it included), oldest first: regenerated replies, edits


class _UnreadableHistory(Exception):
    """The history file is not a database Stowage can read: corrupt, cut short, another file, a folder."""


def _table_columns(db: sqlite3.Connection) -> dict[str, set[str]]:
    tables = [name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    return {t: {row[1] for row in db.execute(f"PRAGMA table_info('{t}')")} for t in tables}


def _expected_columns() -> dict[str, set[str]]:
    db = sqlite3.connect(":memory:")
    db.executescript(SCHEMA)
    columns = _table_columns(db)
    db.close()
    return {t: cols for t, cols in columns.items() if not t.startswith("sqlite_")}


_COLUMNS = _expected_columns()  # read from SCHEMA itself, so the check cannot drift from it


def _columns_at(version: int) -> dict[str, set[str]]:
    """The columns a file at schema `version` has: SCHEMA's and those MIGRATIONS added up to it."""
    columns = {table: set(names) for table, names in _COLUMNS.items()}
    for v in range(1, min(version, SCHEMA_VERSION) + 1):
        for table, column, _ in MIGRATIONS[v][0]:
            columns[table].add(column)
    return columns


def _migrate(db: sqlite3.Connection) -> None:
    """Bring `db` (SCHEMA at its user_version) to SCHEMA_VERSION in one transaction; raises on a read-only file."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    db.execute("BEGIN IMMEDIATE")
    try:
        for v in range(version + 1, SCHEMA_VERSION + 1):
            columns, fill = MIGRATIONS[v]
            for table, column, declaration in columns:
                db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {declaration}")
            if fill:
                db.execute(fill)
        # Written even when nothing changes: a read-only file is found out now, not at the first message sent.
        db.execute(f"PRAGMA user_version = {max(int(version), SCHEMA_VERSION)}")
        db.commit()
    except BaseException:
        db.rollback()
        raise


def _check(db: sqlite3.Connection) -> None:
    """Raise _UnreadableHistory unless `db` passes quick_check and its tables have SCHEMA's columns; reads only."""
    try:
        result = db.execute("PRAGMA quick_check").fetchall()
        if result != [("ok",)]:
            raise _UnreadableHistory(f"it fails SQLite's integrity check: {str(result[0][0]).splitlines()[-1]}")
        found = _table_columns(db)
        version = db.execute("PRAGMA user_version").fetchone()[0]
    except sqlite3.DatabaseError as e:
        name = getattr(e, "sqlite_errorname", "")
        if name.startswith("SQLITE_CORRUPT") or name == "SQLITE_NOTADB":
            raise _UnreadableHistory(f"{e}") from e
        raise
    for table, columns in _columns_at(version).items():
        if table in found and not columns <= found[table]:
            missing = ", ".join(sorted(columns - found[table]))
            raise _UnreadableHistory(f"it is not a Stowage history (table {table} lacks {missing})")


def _open_read_only(path: Path, query: str = "mode=ro") -> sqlite3.Connection:
    return sqlite3.connect(f"{path.resolve().as_uri()}?{query}", uri=True)


def _connect(path: Path) -> sqlite3.Connection:
    """The history file, checked and writable; _UnreadableHistory, sqlite3.Error or OSError if not."""
    if path.is_dir():
        raise _UnreadableHistory("it is a folder, not a file")
    if path.exists():
        # Checked read-only first: closing a read-write connection to a broken file would fold its -wal
        # into it and delete the -wal, and the file moved aside must be what was on disk.
        probe = _open_read_only(path)
        try:
            _check(probe)
        finally:
            probe.close()
    db = sqlite3.connect(path)
    try:
        db.execute("PRAGMA foreign_keys = ON")
        db.executescript(SCHEMA)
        # WAL: a kill mid-write leaves the last committed state, and readers never block the writer.
        db.execute("PRAGMA journal_mode = WAL")
        # NORMAL in WAL mode survives a crash or kill of the app (only a power loss can drop the last
        # commit) and skips an fsync per message that froze the GUI for tens of milliseconds.
        db.execute("PRAGMA synchronous = NORMAL")
        db.commit()
        _migrate(db)
    except BaseException:
        db.close()
        raise
    return db


def _copy_into_memory(path: Path) -> sqlite3.Connection | None:
    """The history at `path` copied into memory, or None when it cannot be read."""
    # A read-only folder refuses even a read-only open of a WAL file (no -shm can be made there);
    # immutable then reads the file as it is on disk, without the -wal.
    for query in ("mode=ro", "immutable=1"):
        db = sqlite3.connect(":memory:")
        try:
            source = _open_read_only(path, query)
            try:
                _check(source)
                source.backup(db)
                return db
            finally:
                source.close()
        except (sqlite3.Error, _UnreadableHistory, OSError):
            db.close()
    return None


def _in_memory(path: Path | None) -> tuple[sqlite3.Connection, bool]:
    """A history in memory with SCHEMA, holding a copy of the file's when it can be read; (db, copied)."""
    db = _copy_into_memory(path) if path is not None and path.is_file() else None
    copied = db is not None
    db = db or sqlite3.connect(":memory:")
    db.execute("PRAGMA foreign_keys = ON")
    db.executescript(SCHEMA)
    db.commit()
    _migrate(db)
    return db, copied


def _move_aside(path: Path) -> Path:
    """Rename `path` (and its -wal/-shm) to conversations.sqlite3.broken-YYYYmmdd-HHMMSS; never deletes it."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = path.with_name(f"{path.name}.broken-{stamp}")
    n = 1
    while any(target.with_name(target.name + s).exists() for s in ("", *_SIDE_FILES)):
        n += 1
        target = path.with_name(f"{path.name}.broken-{stamp}-{n}")
    path.rename(target)
    for suffix in _SIDE_FILES:
        side = path.with_name(path.name + suffix)
        if side.exists():
            side.rename(target.with_name(target.name + suffix))
    return target


class ConversationStore:
    """Conversations and their messages; every write is committed at once.

    `warning` is None when the history file opened normally. Otherwise it is one or two sentences for the
    user (the GUI shows it in a dialog at start): the file could not be read and was moved aside (kept, never
    deleted) and a new one started; or the file or folder cannot be written, so this session's history is
    kept in memory only and is lost at exit. The store works in every case; nothing here raises at start.
    """

    def __init__(self, path: str | Path | None = None):
        self.warning: str | None = None
        self.path: Path | None = Path(path) if path is not None else None  # None: the data folder cannot be made
        self._db = self._open()

    def _open(self) -> sqlite3.Connection:
        try:
            if self.path is None:
                self.path = paths.data_dir() / FILE_NAME
            self.path.parent.mkdir(parents=True, exist_ok=True)
            return self._open_or_replace(self.path)
        except (sqlite3.Error, OSError, _UnreadableHistory) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            where = self.path if self.path is not None else getattr(e, "filename", None) or "the data folder"
            db, copied = _in_memory(self.path)
            kept = "Past conversations are shown, but" if copied else "This session starts with no history, and"
            self.warning = " ".join(filter(None, [self.warning, (
                f"Conversations will not be saved: {where} cannot be written ({reason}). {kept} what you do in "
                "this session is lost when Stowage closes. Make it writable (or free disk space) and restart "
                "Stowage."
            )]))
            return db

    def _open_or_replace(self, path: Path) -> sqlite3.Connection:
        try:
            return _connect(path)
        except _UnreadableHistory as e:
            reason = e
        try:
            moved = _move_aside(path)
        except OSError as e:
            self.warning = (
                f"The conversation history at {path} could not be read ({reason}), and it could not be moved "
                f"aside ({e.strerror or e}). This session keeps its conversations in memory only; they are lost "
                "when Stowage closes."
            )
            return _in_memory(None)[0]
        self.warning = (
            f"The conversation history at {path} could not be read ({reason}); it was moved to {moved} and a "
            "new one was started."
        )
        return _connect(path)

    def close(self) -> None:
        self._db.close()

    # conversations
    def conversations(self) -> list[ConversationRow]:
        """All conversations, most recently updated first."""
        rows = self._db.execute(
            f"SELECT {_CONVERSATION_COLUMNS} FROM conversations ORDER BY updated DESC, id DESC"
        )
        return [_conversation(row) for row in rows]

    def search(self, text: str) -> list[ConversationRow]:
        """Conversations whose title or any message holds `text` (ASCII case ignored), most recent first."""
        if not text:
            return self.conversations()
        pattern = "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        rows = self._db.execute(
            f"SELECT {_CONVERSATION_COLUMNS} FROM conversations c WHERE title LIKE ?1 ESCAPE '\\' OR "
            "EXISTS (SELECT 1 FROM messages m WHERE m.conversation_id = c.id AND m.content LIKE ?1 ESCAPE '\\') "
            "ORDER BY updated DESC, id DESC",
            (pattern,),
        )
        return [_conversation(row) for row in rows]

    def conversation(self, conversation_id: int) -> ConversationRow:
        row = self._db.execute(
            f"SELECT {_CONVERSATION_COLUMNS} FROM conversations WHERE id = ?", (conversation_id,)
        ).fetchone()
        if row is None:
            raise KeyError(f"no conversation {conversation_id}")
        return _conversation(row)

    def create(self, title: str = "New chat") -> int:
        now = time.time()
        with self._db:
            cur = self._db.execute(
                "INSERT INTO conversations (title, created, updated) VALUES (?, ?, ?)", (title, now, now)
            )
        return cur.lastrowid

    def rename(self, conversation_id: int, title: str) -> None:
        with self._db:
            self._db.execute("UPDATE conversations SET title = ? WHERE id = ?", (title, conversation_id))

    def delete(self, conversation_id: int) -> None:
        with self._db:
            self._db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    def set_memory_start(self, conversation_id: int, message_id: int | None) -> None:
        with self._db:
            self._db.execute(
                "UPDATE conversations SET memory_start_id = ? WHERE id = ?", (message_id, conversation_id)
            )

    def set_system_prompt(self, conversation_id: int, text: str | None) -> None:
        """This chat's own system prompt (None: follow the default in the settings)."""
        with self._db:
            self._db.execute("UPDATE conversations SET system_prompt = ? WHERE id = ?", (text, conversation_id))

    def set_preset(self, conversation_id: int, preset_id: int | None) -> None:
        with self._db:
            self._db.execute("UPDATE conversations SET preset_id = ? WHERE id = ?", (preset_id, conversation_id))

    def set_overflow_policy(self, conversation_id: int, policy: str | None) -> None:
        """What this chat does when its context is full (None: as the settings say)."""
        with self._db:
            self._db.execute("UPDATE conversations SET overflow_policy = ? WHERE id = ?", (policy, conversation_id))

    def set_reply_options(self, conversation_id: int, options: dict) -> None:
        """This chat's reply format and tools (app/reply_options.py; {}: free text, no tools)."""
        with self._db:
            self._db.execute("UPDATE conversations SET reply_options = ? WHERE id = ?",
                             (json.dumps(options) if options else None, conversation_id))

    # presets
    def presets(self) -> list[Preset]:
        rows = self._db.execute("SELECT id, name, system_prompt, sampling FROM presets ORDER BY name COLLATE NOCASE")
        return [Preset(id, name, prompt, json.loads(sampling)) for id, name, prompt, sampling in rows]

    def preset(self, preset_id: int) -> Preset | None:
        return next((p for p in self.presets() if p.id == preset_id), None)

    def save_preset(self, name: str, system_prompt: str, sampling: dict) -> int:
        """Save under `name`, replacing a preset of that name (the chats that chose it keep it); its id."""
        with self._db:
            self._db.execute(
                "INSERT INTO presets (name, system_prompt, sampling) VALUES (?, ?, ?) ON CONFLICT(name) DO UPDATE SET "
                "system_prompt = excluded.system_prompt, sampling = excluded.sampling",
                (name, system_prompt, json.dumps(sampling)))
        return self._db.execute("SELECT id FROM presets WHERE name = ?", (name,)).fetchone()[0]

    def delete_preset(self, preset_id: int) -> None:
        """The chats that chose it go back to the settings' system prompt and sampling."""
        with self._db:
            self._db.execute("UPDATE conversations SET preset_id = NULL WHERE preset_id = ?", (preset_id,))
            self._db.execute("DELETE FROM presets WHERE id = ?", (preset_id,))

    # messages: a tree (regenerated replies and edits are siblings); a chat shows one branch of it
    def messages(self, conversation_id: int) -> list[Message]:
        """The branch on screen, oldest first: from the first message down, each time the most recently chosen child."""
        children: dict[int | None, list[tuple]] = {}
        for row in self._db.execute(
            "SELECT id, parent_id, role, content, meta, created, chosen FROM messages WHERE conversation_id = ? "
            "ORDER BY id", (conversation_id,),
        ):
            children.setdefault(row[1], []).append(row)
        branch, parent = [], None
        while parent in children:
            versions = children[parent]
            id, _, role, content, meta, created, _ = max(versions, key=lambda r: (r[6], r[0]))
            branch.append(Message(id, role, content, json.loads(meta), created, parent, tuple(r[0] for r in versions)))
            parent = id
        return branch

    def add_message(self, conversation_id: int, role: str, content: str, meta: dict | None = None,
                    parent_id: int | None = None) -> int:
        """A message after `parent_id` (None: after the last one on screen), put on screen."""
        if parent_id is None:
            branch = self.messages(conversation_id)
            parent_id = branch[-1].id if branch else None
        return self._insert(conversation_id, parent_id, role, content, meta)

    def add_alternative(self, message_id: int, content: str, meta: dict | None = None) -> int:
        """Another version of a message (the same place and role), put on screen in its stead."""
        conversation_id, parent_id, role = self._db.execute(
            "SELECT conversation_id, parent_id, role FROM messages WHERE id = ?", (message_id,)).fetchone()
        return self._insert(conversation_id, parent_id, role, content, meta)

    def choose(self, message_id: int) -> None:
        """Put this version of a message on screen, with the branch below it that was last shown."""
        with self._db:
            self._db.execute("UPDATE messages SET chosen = ? WHERE id = ?", (self._next_rank(message_id), message_id))

    def _next_rank(self, message_id: int | None = None, conversation_id: int | None = None) -> int:
        return self._db.execute(
            "SELECT COALESCE(MAX(chosen), 0) + 1 FROM messages WHERE conversation_id = "
            "COALESCE(?, (SELECT conversation_id FROM messages WHERE id = ?))", (conversation_id, message_id),
        ).fetchone()[0]

    def _insert(self, conversation_id: int, parent_id: int | None, role: str, content: str, meta: dict | None) -> int:
        now = time.time()
        with self._db:
            cur = self._db.execute(
                "INSERT INTO messages (conversation_id, parent_id, role, content, created, meta, chosen) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (conversation_id, parent_id, role, content, now, json.dumps(meta or {}),
                 self._next_rank(conversation_id=conversation_id)),
            )
            self._db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, conversation_id))
        return cur.lastrowid

    def update_message(self, message_id: int, content: str, meta: dict | None = None) -> None:
        with self._db:
            if meta is None:
                self._db.execute("UPDATE messages SET content = ? WHERE id = ?", (content, message_id))
            else:
                self._db.execute(
                    "UPDATE messages SET content = ?, meta = ? WHERE id = ?", (content, json.dumps(meta), message_id)
                )

    def delete_message(self, message_id: int) -> None:
        """Delete one message. The messages after it follow the one before it instead; but a message with other
        versions (a regenerated reply, an edit) takes the branch below it along, and another version shows."""
        row = self._db.execute("SELECT conversation_id, parent_id FROM messages WHERE id = ?", (message_id,)).fetchone()
        if row is None:
            return
        conversation_id, parent_id = row
        num_versions = self._db.execute(
            "SELECT COUNT(*) FROM messages WHERE conversation_id = ? AND parent_id IS ?", (conversation_id, parent_id),
        ).fetchone()[0]
        with self._db:
            if num_versions == 1:
                self._db.execute("UPDATE messages SET parent_id = ? WHERE parent_id = ?", (parent_id, message_id))
            child = self._db.execute("SELECT MIN(id) FROM messages WHERE parent_id IS ? AND conversation_id = ? "
                                     "AND id != ?", (parent_id, conversation_id, message_id)).fetchone()[0]
            # the model's memory started at this message: it starts at the one that takes its place
            self._db.execute("UPDATE conversations SET memory_start_id = ? WHERE id = ? AND memory_start_id = ?",
                             (child, conversation_id, message_id))
            self._db.execute("DELETE FROM messages WHERE id = ?", (message_id,))
            self._db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (time.time(), conversation_id))
