"""Ending a run on an MLflow sqlite store with the standard library's ``sqlite3``, without mlflow.

The replayers (``lifeguard.guardian.replay``: the last gasp's, and install()'s) write journaled
statuses: the last gasp's the moment its program is gone. Through mlflow, that first costs an
import of mlflow and SQLAlchemy: 1.5 s of CPU on a quiet machine, 7 s measured on a loaded 2-core
one, all of it after the death (or beside a program starting up, for install()'s). The
ending itself is what ``lifeguard.backends.mlflow.sql`` writes through MLflow's own table models,
one transaction: ``UPDATE runs SET status, end_time WHERE run_uuid = ? AND status = 'RUNNING'
AND lifecycle_stage = 'active'`` (the check and the write at once: an ended run is never
overwritten), then the reason tags, one commit. MLflow's ``update_run_info`` writes those two
columns and nothing else for a status.

MLflow's schema for these two tables has not changed since MLflow 1.x; still, it is checked at
the first use (every column written or read, in ``PRAGMA table_info``), and anything else makes
:func:`unsupported` say why: the replayer then takes the mlflow path. Tag values are cut to the
length the ``tags.value`` column declares, as MLflow cuts them to its limit.

Whether the run was adopted since (``owner.adopted_since``) is decided inside the same
transaction as the write, under sqlite's write lock: a requeued job that resumes the run cannot
slip in between the check and the write.
"""

from __future__ import annotations

import os
import re
import sqlite3

from lifeguard.journal import ALREADY_ENDED, ENDED, SUPERSEDED, after_failed_write, run_missing

TYPE_CHECKING = False
if TYPE_CHECKING:
    from lifeguard.journal import Entry, Journal

__all__ = ["SqliteStore", "unsupported"]

RUNNING = "RUNNING"
ACTIVE = "active"
PREFIX = "sqlite:///"
# The columns read or written here; a store without any of them is not one this module knows.
RUN_COLUMNS = frozenset({"run_uuid", "status", "end_time", "lifecycle_stage"})
TAG_COLUMNS = frozenset({"key", "value", "run_uuid"})
# The first SQLite with INSERT ... ON CONFLICT DO UPDATE; an older one takes the mlflow path.
UPSERT_SINCE = (3, 24, 0)
# The smallest tag-value limit any MLflow release had, should the column not declare one.
DEFAULT_TAG_LIMIT = 5000


def path_of(uri: str) -> str | None:
    """The database file of an absolute ``sqlite:////path`` URI without options, else None."""
    if not uri.startswith(PREFIX + "/") or "?" in uri:
        return None
    return uri[len(PREFIX) :]


def unsupported(uri: str) -> str | None:
    """Why this module cannot end runs at ``uri``, or None if it can (an absolute sqlite path;
    its tables are checked at the first write). A path with no file (yet: an unmounted volume)
    is this module's too: its write fails and the entry stays journaled, where MLflow's client
    would create and migrate an empty store there."""
    path = path_of(uri)
    if path is None:
        return "not an absolute sqlite://// path without options"
    if os.path.exists(path) and not os.path.isfile(path):
        return f"{path} is not a regular file"
    return None


class _NoSuchRun(Exception):
    """The store answered, and has no such run."""


class SchemaError(Exception):
    """The database is not an MLflow store this module knows: take the mlflow path."""


class SqliteStore:
    """One sqlite store. ``busy`` is how long a write waits on another writer's lock."""

    def __init__(self, uri: str) -> None:
        path = path_of(uri)
        if path is None:
            raise ValueError(f"not an absolute sqlite path: {uri}")
        self.tracking_uri = uri
        self.path = path
        self.busy = 5.0
        self._tag_limit: int | None = None

    def _connect(self) -> sqlite3.Connection:
        # mode=rw: never create a database where the store was (a mistyped or deleted path).
        from urllib.parse import quote

        return sqlite3.connect(
            f"file:{quote(self.path)}?mode=rw",
            uri=True,
            timeout=self.busy,
            isolation_level=None,  # transactions are begun and committed here, explicitly
        )

    def check(self) -> None:
        """Raise :class:`SchemaError` unless the tables have the columns used here."""
        db = self._connect()
        try:
            self._tag_limit = _check(db)
        finally:
            db.close()

    def apply(self, entry: Entry, *, journal: Journal | None) -> str:
        """Write ``entry`` unless the run is no longer RUNNING (ALREADY_ENDED) or was adopted
        since by another live process (SUPERSEDED: the entry is history). The entry is removed
        from the journal once the store has it, kept (JOURNALED) if the store cannot be written
        now (locked past ``busy``, unreadable), kept as MISSING if the store has no such run
        (the entry's own problem, not the store's)."""
        try:
            result = self._apply(entry)
        except _NoSuchRun:
            return run_missing(journal, entry, self.tracking_uri, "no such run in its runs table")
        except (sqlite3.Error, OSError) as exc:
            return after_failed_write(journal, entry, self.tracking_uri, f"sqlite3: {exc}")
        if journal is not None:
            journal.remove(entry)
        return result

    def _apply(self, entry: Entry) -> str:
        from lifeguard.names import TAG_HEARTBEAT
        from lifeguard.owner import OWNER_TAGS, adopted_since

        db = self._connect()
        try:
            if self._tag_limit is None:
                self._tag_limit = _check(db)
            db.execute("BEGIN IMMEDIATE")  # the write lock first: the check and the write are one
            try:
                row = db.execute(
                    "SELECT status, lifecycle_stage FROM runs WHERE run_uuid = ?", (entry.run_id,)
                ).fetchone()
                if row is None:
                    raise _NoSuchRun(entry.run_id)
                status, stage = row
                if status != RUNNING or stage != ACTIVE:
                    db.execute("ROLLBACK")
                    return ALREADY_ENDED
                keys = (*OWNER_TAGS, TAG_HEARTBEAT)
                marks = ", ".join("?" * len(keys))
                tags = dict(
                    db.execute(
                        f"SELECT key, value FROM tags WHERE run_uuid = ? AND key IN ({marks})",
                        (entry.run_id, *keys),
                    ).fetchall()
                )
                if adopted_since(status, tags, entry.pid, entry.end_time, entry.writer):
                    db.execute("ROLLBACK")
                    return SUPERSEDED
                db.execute(
                    "UPDATE runs SET status = ?, end_time = ? WHERE run_uuid = ? "
                    "AND status = ? AND lifecycle_stage = ?",
                    (entry.status, entry.end_time, entry.run_id, RUNNING, ACTIVE),
                )
                limit = self._tag_limit
                db.executemany(
                    "INSERT INTO tags (key, value, run_uuid) VALUES (?, ?, ?) "
                    "ON CONFLICT (key, run_uuid) DO UPDATE SET value = excluded.value",
                    [(k, v[:limit], entry.run_id) for k, v in entry.tags.items()],
                )
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
            return ENDED
        finally:
            db.close()


def _check(db: sqlite3.Connection) -> int:
    """The tag-value limit, after checking both tables have the columns used here (and that this
    SQLite has the upsert the tag write uses: 3.24, 2018; CentOS 7 ships 3.7)."""
    if sqlite3.sqlite_version_info < UPSERT_SINCE:
        raise SchemaError(f"SQLite {sqlite3.sqlite_version} has no upsert (3.24 or later)")
    runs = {row[1] for row in db.execute("PRAGMA table_info(runs)")}
    tag_rows = list(db.execute("PRAGMA table_info(tags)"))
    tags = {row[1] for row in tag_rows}
    if not runs >= RUN_COLUMNS or not tags >= TAG_COLUMNS:
        raise SchemaError("no MLflow runs and tags tables with the expected columns")
    for row in tag_rows:
        if row[1] == "value":
            match = re.fullmatch(r"\s*VARCHAR\s*\(\s*(\d+)\s*\)\s*", str(row[2]), re.IGNORECASE)
            if match:
                return int(match.group(1))
    return DEFAULT_TAG_LIMIT
