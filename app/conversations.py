"""Conversations on disk: SQLite (stdlib ``sqlite3``) in WAL mode under the user data folder.

Every write commits at once (autocommit), so a crash or a kill loses at most the last second
of the reply being streamed: a user message is stored when it is sent, an assistant message
when its reply starts (empty, ``streaming``), then with its text so far about once a second
while it streams, and again when it finishes or is stopped. A reply still marked
``streaming`` when the store is opened again was cut off; it is marked ``interrupted``.

It also keeps the folders the user added to the model picker (``model_folders``).
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL,
    system_prompt TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,  -- ids are never reused after a regenerate
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL CHECK (role IN ('user', 'assistant')),
    content TEXT NOT NULL,
    status TEXT NOT NULL DEFAULT 'done',
    meta TEXT NOT NULL DEFAULT '{}',
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
CREATE TABLE IF NOT EXISTS model_folders (
    path TEXT PRIMARY KEY,
    added REAL NOT NULL
);
"""

#: ``done`` (finished normally), ``streaming`` (being written), ``stopped`` (by the user),
#: ``error`` (the engine failed; content is the partial reply), ``interrupted`` (app died).
STATUSES = ("done", "streaming", "stopped", "error", "interrupted")


@dataclass(frozen=True, slots=True)
class Conversation:
    id: int
    title: str
    system_prompt: str
    updated: float


@dataclass(frozen=True, slots=True)
class Message:
    id: int
    conversation_id: int
    role: str
    content: str
    status: str = "done"
    meta: dict[str, Any] = field(default_factory=dict)


class ChatStore:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._db = sqlite3.connect(path, isolation_level=None)  # autocommit
        self._db.execute("PRAGMA journal_mode=WAL")
        # In WAL mode NORMAL syncs at checkpoints, not at every commit: a commit survives the
        # app crashing or being killed (only a power cut can take the last ones), and the
        # UI thread, which writes a streaming reply every second, never waits on an fsync.
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(SCHEMA)
        self._db.execute("UPDATE messages SET status = 'interrupted' WHERE status = 'streaming'")

    def close(self) -> None:
        self._db.close()

    # -- conversations -----------------------------------------------------------------------
    def create_conversation(self, title: str = "New chat", system_prompt: str = "") -> int:
        now = time.time()
        cur = self._db.execute(
            "INSERT INTO conversations (title, system_prompt, created, updated) "
            "VALUES (?, ?, ?, ?)",
            (title, system_prompt, now, now),
        )
        return int(cur.lastrowid or 0)

    def untouched_conversation(self) -> int | None:
        """The newest conversation as "New chat" left it (no message, no title or system
        prompt of the user's), if any: what "New chat" opens again rather than adding
        another."""
        row = self._db.execute(
            "SELECT c.id FROM conversations c WHERE c.title = 'New chat' "
            "AND c.system_prompt = '' AND NOT EXISTS "
            "(SELECT 1 FROM messages m WHERE m.conversation_id = c.id) "
            "ORDER BY c.updated DESC, c.id DESC LIMIT 1"
        ).fetchone()
        return None if row is None else int(row[0])

    def conversations(self) -> list[Conversation]:
        rows = self._db.execute(
            "SELECT id, title, system_prompt, updated FROM conversations "
            "ORDER BY updated DESC, id DESC"
        ).fetchall()
        return [Conversation(*row) for row in rows]

    def conversation(self, conversation_id: int) -> Conversation:
        row = self._db.execute(
            "SELECT id, title, system_prompt, updated FROM conversations WHERE id = ?",
            (conversation_id,),
        ).fetchone()
        if row is None:
            raise KeyError(f"no conversation {conversation_id}")
        return Conversation(*row)

    def rename(self, conversation_id: int, title: str) -> None:
        self._db.execute(
            "UPDATE conversations SET title = ? WHERE id = ?", (title, conversation_id)
        )

    def set_system_prompt(self, conversation_id: int, system_prompt: str) -> None:
        self._db.execute(
            "UPDATE conversations SET system_prompt = ? WHERE id = ?",
            (system_prompt, conversation_id),
        )

    def delete_conversation(self, conversation_id: int) -> None:
        self._db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    # -- messages ----------------------------------------------------------------------------
    def messages(self, conversation_id: int) -> list[Message]:
        rows = self._db.execute(
            "SELECT id, conversation_id, role, content, status, meta FROM messages "
            "WHERE conversation_id = ? ORDER BY id",
            (conversation_id,),
        ).fetchall()
        return [Message(row[0], row[1], row[2], row[3], row[4], json.loads(row[5])) for row in rows]

    def add_message(
        self,
        conversation_id: int,
        role: str,
        content: str,
        status: str = "done",
        meta: dict[str, Any] | None = None,
    ) -> int:
        now = time.time()
        cur = self._db.execute(
            "INSERT INTO messages (conversation_id, role, content, status, meta, created) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (conversation_id, role, content, status, json.dumps(meta or {}), now),
        )
        self._touch(conversation_id, now)
        return int(cur.lastrowid or 0)

    def update_message(
        self,
        message_id: int,
        *,
        content: str | None = None,
        status: str | None = None,
        meta: dict[str, Any] | None = None,
    ) -> None:
        sets, values = [], []
        for column, value in (("content", content), ("status", status)):
            if value is not None:
                sets.append(f"{column} = ?")
                values.append(value)
        if meta is not None:
            sets.append("meta = ?")
            values.append(json.dumps(meta))
        if sets:
            self._db.execute(
                f"UPDATE messages SET {', '.join(sets)} WHERE id = ?", (*values, message_id)
            )

    def delete_messages_from(self, message_id: int) -> None:
        """Delete a message and everything after it in its conversation (regenerate, edit)."""
        row = self._db.execute(
            "SELECT conversation_id FROM messages WHERE id = ?", (message_id,)
        ).fetchone()
        if row is not None:
            self._db.execute(
                "DELETE FROM messages WHERE conversation_id = ? AND id >= ?", (row[0], message_id)
            )

    # -- folders the model picker scans ------------------------------------------------------
    def model_folders(self) -> list[str]:
        """The folders the user added, oldest first."""
        rows = self._db.execute("SELECT path FROM model_folders ORDER BY added, path").fetchall()
        return [str(row[0]) for row in rows]

    def add_model_folder(self, path: str) -> None:
        self._db.execute(
            "INSERT OR IGNORE INTO model_folders (path, added) VALUES (?, ?)", (path, time.time())
        )

    def remove_model_folder(self, path: str) -> None:
        self._db.execute("DELETE FROM model_folders WHERE path = ?", (path,))

    def _touch(self, conversation_id: int, now: float) -> None:
        self._db.execute(
            "UPDATE conversations SET updated = ? WHERE id = ?", (now, conversation_id)
        )
