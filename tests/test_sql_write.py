"""Ending a run on a SQL store in one transaction (``lifeguard.backends.mlflow.sql``).

Real sqlite stores; the lock is a real second connection's. Each test fails on the client path
it replaced (four sessions, two commits, a read then a write, MLflow's 20 s busy timeout).
"""

from __future__ import annotations

import sqlite3
import textwrap
import threading
import time
from pathlib import Path

import pytest
from mlflow.exceptions import MlflowException

from lifeguard.backends.mlflow import runs, sql
from lifeguard.journal import Entry
from tests.conftest import REPO, Store, child_env, shows_lifeguard, without_and_with

TAGS = {"lifeguard.outcome": "signal", "lifeguard.reason": "SIGTERM", "lifeguard.signal": "SIGTERM"}


def entry_for(store: Store, run_id: str, tags: dict[str, str] | None = None) -> Entry:
    return Entry(
        run_id, store.uri, "KILLED", 1_700_000_000_123, dict(TAGS if tags is None else tags)
    )


def new_run(store: Store) -> str:
    experiment = store.client.create_experiment(f"e{time.monotonic_ns()}")
    return str(store.client.create_run(experiment).info.run_id)


def commits(store: Store) -> list[int]:
    """A list that grows by one at every commit on the store's engine (the client's cached one)."""
    from sqlalchemy import event

    engine = store.client._tracking_client.store.engine
    seen: list[int] = []
    event.listen(engine, "commit", lambda conn: seen.append(1))
    return seen


def test_the_status_end_time_and_tags_land_in_one_commit(store: Store) -> None:
    run_id = new_run(store)
    store.client.set_tag(run_id, "lifeguard.reason", "an older reason")  # updated, not doubled
    seen = commits(store)
    assert sql.end(store.client, entry_for(store, run_id), seconds=5.0) is True
    assert len(seen) == 1
    run = store.run(run_id)
    assert (run.info.status, run.info.end_time) == ("KILLED", 1_700_000_000_123)
    assert {k: v for k, v in run.data.tags.items() if k.startswith("lifeguard.")} == TAGS


def test_a_run_somebody_ended_is_left_as_it_is(store: Store) -> None:
    run_id = new_run(store)
    store.client.set_terminated(run_id, "FINISHED", end_time=42)
    assert sql.end(store.client, entry_for(store, run_id), seconds=5.0) is False
    run = store.run(run_id)
    assert (run.info.status, run.info.end_time) == ("FINISHED", 42)
    assert not any(k.startswith("lifeguard.") for k in run.data.tags)


def test_a_deleted_run_is_left_alone_and_a_missing_one_raises(store: Store) -> None:
    run_id = new_run(store)
    store.client.delete_run(run_id)
    assert sql.end(store.client, entry_for(store, run_id), seconds=5.0) is False
    with pytest.raises(MlflowException, match="not found"):
        sql.end(store.client, entry_for(store, "0" * 32), seconds=5.0)
    assert store.run(run_id).info.status == "RUNNING"


def test_a_tag_over_mlflows_limit_is_cut_as_mlflow_cuts_it(store: Store) -> None:
    from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

    run_id = new_run(store)
    long = {"lifeguard.reason": "x" * (MAX_TAG_VAL_LENGTH + 10)}
    assert sql.end(store.client, entry_for(store, run_id, long), seconds=5.0) is True
    assert store.run(run_id).data.tags["lifeguard.reason"] == "x" * MAX_TAG_VAL_LENGTH


@pytest.mark.timeout(60)
def test_a_writer_holding_the_lock_is_waited_for_only_the_time_given(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """MLflow's sessions wait 20 s on a locked sqlite store, longer than the whole deadline:
    the finalizer would be abandoned mid-write. Given 0.5 s, the write gives up, so the caller
    can journal the entry in time; once the lock is gone the same write goes through."""
    run_id = new_run(store)
    holder = sqlite3.connect(store.path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another writer's lock, as another job's commit holds it
    try:
        start = time.monotonic()
        with pytest.raises(MlflowException, match="locked"):
            sql.end(store.client, entry_for(store, run_id), seconds=0.5)
        waited = time.monotonic() - start
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert 0.4 <= waited < 10.0  # well short of MLflow's 20 s, whatever the machine's load
    # MLflow's session logs the failure with its traceback; the caller reports it in one line.
    assert not [r for r in caplog.records if r.name.startswith("mlflow")], caplog.text
    assert store.status(run_id) == "RUNNING"
    assert sql.end(store.client, entry_for(store, run_id), seconds=0.5) is True
    assert store.status(run_id) == "KILLED"


def test_the_lock_wait_leaves_mlflows_own_busy_timeout_to_the_program(store: Store) -> None:
    """The shorter wait is for lifeguard's session only: the program's next session on the same
    pooled connection waits MLflow's 20 s again (MLflow sets it at every session's start)."""
    from sqlalchemy import text

    run_id = new_run(store)
    assert sql.end(store.client, entry_for(store, run_id), seconds=0.5) is True
    sessions = store.client._tracking_client.store.ManagedSessionMaker
    with sessions() as session:
        assert session.execute(text("PRAGMA busy_timeout")).scalar() == 20000


def test_apply_journals_an_entry_whose_store_stays_locked(store: Store, tmp_path) -> None:
    """Through ``runs.apply``, as the finalizer calls it: the write that could not get the lock
    is kept in the journal (nothing lost), and the replay writes it once the lock is gone."""
    from lifeguard import finalizers
    from lifeguard.journal import Journal

    run_id = new_run(store)
    journal = Journal(tmp_path / "journal")
    holder = sqlite3.connect(store.path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    results: list[str] = []

    def finalizer() -> None:  # a finalizer's thread, with 1.5 s left of its deadline
        finalizers._deadlines[threading.get_ident()] = time.monotonic() + 1.5
        try:
            results.append(
                runs.apply(
                    store.client, entry_for(store, run_id), journal=journal, write_ahead=False
                )
            )
        finally:
            finalizers._deadlines.pop(threading.get_ident(), None)

    try:
        thread = threading.Thread(target=finalizer)
        thread.start()
        thread.join(30)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert results == [runs.JOURNALED]
    assert [e.run_id for e in journal.entries()] == [run_id]
    assert runs.replay_journal(journal)[runs.ENDED] == 1
    assert store.status(run_id) == "KILLED"


def test_the_pooled_connection_keeps_the_wait_it_had(store: Store) -> None:
    """``PRAGMA busy_timeout`` belongs to the connection, not the session: the pooled
    connection goes back with the wait any MLflow session leaves on it (MLflow sets it at each
    session's start), not lifeguard's 0.2 s (attack, session 20), for anything else on the same
    engine."""
    from sqlalchemy import text

    engine = store.client._tracking_client.store.engine
    run_id = new_run(store)
    engine.dispose()  # one connection in the pool from here on: the one sql.end uses
    store.client.get_run(run_id)  # an MLflow session, on that connection
    with engine.connect() as conn:
        as_mlflow_leaves_it = conn.execute(text("PRAGMA busy_timeout")).scalar()
    assert sql.end(store.client, entry_for(store, run_id), seconds=0.2) is True
    with engine.connect() as conn:
        assert conn.execute(text("PRAGMA busy_timeout")).scalar() == as_mlflow_leaves_it


# A user deletes the run in the UI while it trains.
DELETED_PROGRAM = """
import sys, mlflow
if sys.argv[1] == "on":
    import lifeguard
    lifeguard.install()
run = mlflow.start_run()
mlflow.MlflowClient().delete_run(run.info.run_id)
"""


def test_a_run_deleted_while_running_changes_neither_stderr_nor_the_journal(
    store: Store, tmp_path: Path
) -> None:
    """Without lifeguard MLflow's exit hook fails silently on a deleted run. With it, the
    write raised, the entry was journaled for good (every later sweep exited 1 on it) and a
    warning reached the program's stderr (attack, session 20). A deleted run is left alone."""
    program = tmp_path / "deleted_program.py"
    program.write_text(textwrap.dedent(DELETED_PROGRAM))
    journal = tmp_path / "journal"
    env = child_env(store, PYTHONPATH=str(REPO), LIFEGUARD_JOURNAL_DIR=str(journal))
    done = without_and_with(program, env)
    assert done["off"].returncode == done["on"].returncode == 0, done["on"].stderr
    assert not shows_lifeguard(done["on"].stderr), done["on"].stderr
    assert not list(journal.glob("*.json"))
