"""Conversations kept in an SQLite file, written message by message so a crash loses at most one reply."""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import paths

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
"""


@dataclass(frozen=True)
class ConversationRow:
    id: int
    title: str
    updated: float
    memory_start_id: int | None = None


@dataclass(frozen=True)
class Message:
    id: int
    role: str  # "user" | "assistant" | "system"
    content: str
    meta: dict = field(default_factory=dict)  # tokens/s, finish reason, ... of an assistant reply


class ConversationStore:
    """Conversations and their messages; every write is committed at once."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path is not None else paths.data_dir() / "conversations.sqlite3"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path)
        self._db.execute("PRAGMA foreign_keys = ON")
        # WAL: a kill mid-write leaves the last committed state, and readers never block the writer.
        self._db.execute("PRAGMA journal_mode = WAL")
        # NORMAL in WAL mode survives a crash or kill of the app (only a power loss can drop the last
        # commit) and skips an fsync per message that froze the GUI for tens of milliseconds.
        self._db.execute("PRAGMA synchronous = NORMAL")
        self._db.executescript(SCHEMA)
        self._db.commit()

    def close(self) -> None:
        self._db.close()

    # conversations
    def conversations(self) -> list[ConversationRow]:
        """All conversations, most recently updated first."""
        rows = self._db.execute(
            "SELECT id, title, updated, memory_start_id FROM conversations ORDER BY updated DESC, id DESC"
        )
        return [ConversationRow(*row) for row in rows]

    def conversation(self, conversation_id: int) -> ConversationRow:
        row = self._db.execute(
            "SELECT id, title, updated, memory_start_id FROM conversations WHERE id = ?", (conversation_id,)
        ).fetchone()
        if row is None:
            raise KeyError(f"no conversation {conversation_id}")
        return ConversationRow(*row)

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

    # messages
    def messages(self, conversation_id: int) -> list[Message]:
        rows = self._db.execute(
            "SELECT id, role, content, meta FROM messages WHERE conversation_id = ? ORDER BY id",
            (conversation_id,),
        )
        return [Message(id, role, content, json.loads(meta)) for id, role, content, meta in rows]

    def add_message(self, conversation_id: int, role: str, content: str, meta: dict | None = None) -> int:
        now = time.time()
        with self._db:
            cur = self._db.execute(
                "INSERT INTO messages (conversation_id, role, content, created, meta) VALUES (?, ?, ?, ?, ?)",
                (conversation_id, role, content, now, json.dumps(meta or {})),
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

    def delete_after(self, conversation_id: int, message_id: int) -> None:
        """Delete every message after `message_id` (for regenerate and edit-and-resend)."""
        with self._db:
            self._db.execute(
                "DELETE FROM messages WHERE conversation_id = ? AND id > ?", (conversation_id, message_id)
            )
            self._db.execute(
                "UPDATE conversations SET memory_start_id = NULL WHERE id = ? AND memory_start_id > ?",
                (conversation_id, message_id),
            )
