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

    from mlflow.tracking import MlflowClient

    from lifeguard.guardian.journal import Entry

__all__ = ["end"]

RUNNING = "RUNNING"
ACTIVE = "active"
# sqlite waits this long for another writer before it gives up (MLflow sets 20 s per session).
# Never less than this, so that a normal commit of a busy store is waited for; never more than
# the time left, so that the write fails, and is journaled, before the deadline abandons it.
MIN_BUSY_MS = 100


def end(client: MlflowClient, entry: Entry, *, seconds: float | None) -> bool | None:
    """End the run of ``entry`` if it is still RUNNING: True if this ended it, False if it was
    no longer RUNNING (nothing written), None if the store is not one of MLflow's SQL stores
    (nothing written; use the public calls). Store errors propagate, as MLflow's would.
    ``seconds``: how long a sqlite store may wait on another writer's lock (None: MLflow's)."""
    store = getattr(getattr(client, "_tracking_client", None), "store", None)
    sessions = getattr(store, "ManagedSessionMaker", None)
    if sessions is None:
        return None
    try:
        from mlflow.store.tracking.dbmodels.models import SqlRun, SqlTag
        from sqlalchemy import and_, insert, select, text, update

        runs, tags = SqlRun.__table__, SqlTag.__table__
        runs.c.run_uuid, runs.c.status, runs.c.end_time, runs.c.lifecycle_stage  # noqa: B018
        tags.c.run_uuid, tags.c.key, tags.c.value  # noqa: B018
    except (ImportError, AttributeError, KeyError) as exc:
        logger().debug("lifeguard: MLflow's SQL models moved (%s); using the client", exc)
        return None
    values = _tag_values(entry.tags)
    try:
        writing = sessions(read_only=False)
    except TypeError:  # an MLflow before read replicas: every session may write
        writing = sessions()
    with _quiet_mlflow_session_errors(), writing as session:
        if seconds is not None and getattr(store, "db_type", None) == "sqlite":
            # For this session only: MLflow sets its own at the start of every session.
            busy = max(MIN_BUSY_MS, int(seconds * 1000))
            session.execute(text(f"PRAGMA busy_timeout = {busy};"))
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
            # Not RUNNING any more, or not there, or deleted: MLflow's own read says which,
            # and raises as its calls would for a missing or deleted run.
            run = store._get_run(run_uuid=entry.run_id, session=session)  # type: ignore[union-attr]
            if run.status == RUNNING:
                store._check_run_is_active(run)  # type: ignore[union-attr]
            return False
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
