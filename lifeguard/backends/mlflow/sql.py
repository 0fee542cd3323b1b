"""Ending a run on a SQL tracking store in one transaction: the check, the tags and the status.

Through MLflow's client, one ending is four sessions and two commits: a read of the status,
``log_batch`` (which opens a second session inside its first) and ``update_run_info`` (which then
loads the run's tags, params and metrics lazily only to build a return value nobody reads). On
sqlite every commit is several fsyncs, and it all sits between a SIGTERM and the exit. Here it is
one session with one commit, and the status update is also the check: ``... WHERE status =
'RUNNING'`` cannot end a run that somebody else ended a moment earlier, as a read followed by a
write could.

Only MLflow's own table models are used (its ``dbmodels``); should they move, ``end`` says so by
returning None before it writes anything, and the caller takes the public path.
"""

from __future__ import annotations

import contextlib

from lifeguard._log import logger

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import Any

    from mlflow.tracking import MlflowClient

    from lifeguard.journal import Entry

__all__ = ["end"]

RUNNING = "RUNNING"
ACTIVE = "active"
# sqlite waits this long for another writer before it gives up (MLflow sets 20 s per session).
# Never less than this, so that a normal commit of a busy store is waited for; never more than
# the time left, so that the write fails, and is journaled, before the deadline abandons it.
MIN_BUSY_MS = 100


def end(client: MlflowClient, entry: Entry, *, seconds: float | None) -> bool | None:
    """End the run of ``entry`` if it is still RUNNING: True if this ended it, False if it was
    no longer RUNNING or was deleted (nothing written), None if the store is not one of MLflow's
    SQL stores (nothing written; use the public calls). Store errors propagate, as MLflow's
    would. ``seconds``: how long a sqlite store may wait on another writer's lock (None:
    MLflow's own wait)."""
    store = getattr(getattr(client, "_tracking_client", None), "store", None)
    sessions = getattr(store, "ManagedSessionMaker", None)
    if sessions is None:
        return None
    try:
        from mlflow.store.tracking.dbmodels.models import SqlRun, SqlTag

        tables = _Tables(SqlRun.__table__, SqlTag.__table__)
    except (ImportError, AttributeError, KeyError) as exc:
        logger().debug("MLflow's SQL models moved (%s); using the client", exc)
        return None
    try:
        writing = sessions(read_only=False)
    except TypeError:  # an MLflow before read replicas: every session may write
        writing = sessions()
    with _quiet_mlflow_session_errors(), writing as session:
        sqlite = _sqlite_connection(session) if getattr(store, "db_type", "") == "sqlite" else None
        if sqlite is None or seconds is None:
            return _end(session, store, tables, entry)
        # For this session only: the connection goes back to the pool with the wait it had.
        before = int(sqlite.execute("PRAGMA busy_timeout").fetchone()[0])
        sqlite.execute(f"PRAGMA busy_timeout = {max(MIN_BUSY_MS, int(seconds * 1000))}")
        try:
            ended = _end(session, store, tables, entry)
            session.commit()  # here, under the shorter wait: the commit is where one waits
            return ended
        finally:
            sqlite.execute(f"PRAGMA busy_timeout = {before}")


class _Tables:
    """MLflow's ``runs`` and ``tags`` tables, with the columns this module writes checked."""

    def __init__(self, runs: Any, tags: Any) -> None:
        runs.c.run_uuid, runs.c.status, runs.c.end_time, runs.c.lifecycle_stage  # noqa: B018
        tags.c.run_uuid, tags.c.key, tags.c.value  # noqa: B018
        self.runs, self.tags = runs, tags


def _end(session: Any, store: Any, tables: _Tables, entry: Entry) -> bool:
    """The statements of ``end``, in the session (committed by the caller)."""
    from sqlalchemy import and_, insert, select, update

    runs, tags = tables.runs, tables.tags
    ended = session.execute(
        update(runs)
        .where(
            and_(
                runs.c.run_uuid == entry.run_id,
                runs.c.status == RUNNING,
                runs.c.lifecycle_stage == ACTIVE,
            )
        )
        .values(status=entry.status, end_time=entry.end_time)
    ).rowcount
    if not ended:
        # Not RUNNING any more, or deleted (nothing to end: MLflow refuses any write to a
        # deleted run, and a journal entry for it could never be written), or not there:
        # MLflow's own read raises for that, as its calls would.
        run = store._get_run(run_uuid=entry.run_id, session=session)
        if run.status == RUNNING:
            logger().debug("run %s was deleted; left as it is", entry.run_id)
        return False
    values = _tag_values(entry.tags)
    existing = set(
        session.execute(
            select(tags.c.key).where(
                and_(tags.c.run_uuid == entry.run_id, tags.c.key.in_(list(values)))
            )
        ).scalars()
    )
    for key in existing:
        session.execute(
            update(tags)
            .where(and_(tags.c.run_uuid == entry.run_id, tags.c.key == key))
            .values(value=values[key])
        )
    new = [
        {"run_uuid": entry.run_id, "key": key, "value": value}
        for key, value in values.items()
        if key not in existing
    ]
    if new:
        session.execute(insert(tags), new)
    return True


def _sqlite_connection(session: Any) -> Any:
    """The session's own sqlite3 connection (SQLAlchemy 2's attribute names), or None."""
    try:
        return session.connection().connection.dbapi_connection
    except AttributeError:
        return None


def write_blocked(uri: str) -> bool:
    """Whether a write to the sqlite store at ``uri`` (absolute) would have to wait for a lock
    someone holds now: a reader's (a cursor left half-read) or a writer's. Asked without
    waiting, on a connection of its own that takes the lock and gives it back at once. False
    for other stores, a file that is not there, or any other error (nothing to release)."""
    import sqlite3
    from urllib.parse import quote

    if not uri.startswith("sqlite:////"):
        return False
    path = uri[len("sqlite:///") :].partition("?")[0]
    try:
        probe = sqlite3.connect(
            f"file:{quote(path)}?mode=rw", uri=True, timeout=0, isolation_level=None
        )
    except sqlite3.Error:
        return False
    try:
        probe.execute("BEGIN EXCLUSIVE")
        probe.execute("ROLLBACK")
        return False
    except sqlite3.OperationalError as exc:
        return "locked" in str(exc) or "busy" in str(exc)
    finally:
        probe.close()


def _tag_values(tags: dict[str, str]) -> dict[str, str]:
    """The tags as MLflow would store them: a value over its limit is cut, as MLflow cuts it."""
    try:
        from mlflow.utils.validation import MAX_TAG_VAL_LENGTH as limit
    except ImportError:
        limit = 5000  # the smallest limit any MLflow release had
    return {key: value[:limit] for key, value in tags.items()}


class _ThisThread:
    """A logging filter that drops the records of one thread."""

    def __init__(self) -> None:
        import threading

        self.ident = threading.get_ident()

    def filter(self, record: object) -> bool:
        return getattr(record, "thread", None) != self.ident


@contextlib.contextmanager
def _quiet_mlflow_session_errors() -> Iterator[None]:
    """MLflow's session logs a failed statement (a locked store) with its whole traceback, on
    the program's stderr, before it raises. The caller reports the failure in one line and
    journals the entry; the traceback would be output the program never made. Only this
    thread's records are dropped: the program's own sessions still log as they always did."""
    import logging

    log = logging.getLogger("mlflow.store.db.utils")
    only_ours = _ThisThread()
    log.addFilter(only_ours)
    try:
        yield
    finally:
        log.removeFilter(only_ours)
