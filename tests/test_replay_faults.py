"""install()'s replay (``python -m lifeguard.guardian.replay``, detached) against what stores and
journals really hold, each case a real replayer process on a real store:

* a reason tag quoting a file name that is not UTF-8 (lone surrogates) is written, escaped,
  in the program itself and from the journal, and never stops the entries after it;
* a run read that fails once, or answers without the run's status, writes nothing: whether a
  live process resumed the run is unknown, and the entry waits for the next replay;
* a sqlite store whose file is not there gets no new, empty database: the entry waits;
* the replayer holds none of the program's inherited pipes: a launcher waiting for their end
  of file is not kept waiting on a replay.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from lifeguard.journal import Entry, Journal
from lifeguard.owner import Owner
from tests.conftest import CHILD_TIMEOUT, Store, _base_env, child_env
from tests.servers import MlflowServer
from tests.test_journal_identity import adopt
from tests.test_sweep_trust import Recorder

# A file name from os.listdir that is not UTF-8: Python holds its bad byte as a lone surrogate.
NOT_UTF8 = os.fsdecode(b"/data/shard-\xff.bin")
ESCAPED = "/data/shard-\\udcff.bin"


@pytest.fixture
def server(mlflow_server: MlflowServer) -> MlflowServer:
    """The session's server (conftest.mlflow_server): these tests read only their own runs."""
    return mlflow_server


def gone_writer() -> Owner:
    """A writer that no longer runs: this process's pid, as a process that had it before."""
    here = Owner.current()
    assert here.start_ticks is not None
    return Owner(here.host, here.pid, here.start_time - 1000, here.boot_id, here.pid_ns,
                 here.start_ticks - 1)  # fmt: skip


def replay(journal: Path) -> subprocess.CompletedProcess[str]:
    """install()'s replay, as install() starts it, on ``journal``."""
    env = {**_base_env(), "LIFEGUARD_JOURNAL_DIR": str(journal)}
    return subprocess.run(
        [sys.executable, "-m", "lifeguard.guardian.replay"],
        env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT,
    )  # fmt: skip


@pytest.mark.timeout(300)
def test_a_reason_that_is_not_utf8_is_written_in_the_program(store: Store) -> None:
    """The program's own finalizer writes it: FAILED, the bad byte escaped, nothing journaled."""
    program = (
        "import os, lifeguard; lifeguard.install(); import mlflow; "
        "run = mlflow.start_run(); print(run.info.run_id, flush=True); "
        "raise RuntimeError('corrupt shard ' + os.fsdecode(b'/data/shard-\\xff.bin'))"
    )
    done = subprocess.run(
        [sys.executable, "-c", program],
        env=child_env(store), capture_output=True, text=True, timeout=CHILD_TIMEOUT,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    run = store.run(done.stdout.split()[0])
    assert run.info.status == "FAILED", done.stderr
    assert ESCAPED in run.data.tags["lifeguard.reason"]
    assert not list((store.path.parent / "journal").glob("*.json"))


@pytest.mark.timeout(300)
def test_an_entry_that_is_not_utf8_is_replayed_and_the_others_too(
    tmp_path: Path, template_db: Path
) -> None:
    """An entry journaled with a lone surrogate in its reason (by an earlier lifeguard), sorted
    first, and another store's entry after it: both are written."""
    import shutil

    stores = []
    for name in ("a", "b"):
        shutil.copy(template_db, tmp_path / f"{name}.db")
        stores.append(Store(tmp_path / f"{name}.db"))
    runs = sorted((s.client.create_run("0").info.run_id, s) for s in stores)
    journal = Journal(str(tmp_path / "journal"))
    (first, first_store), (second, second_store) = runs
    reasons = {first: f"RuntimeError: corrupt shard {NOT_UTF8}", second: "killed by SIGTERM"}
    for run_id, s in runs:
        tags = {"lifeguard.reason": reasons[run_id]}
        journal.write(Entry(run_id, s.uri, "FAILED", 1_000, tags, writer=gone_writer()))
    done = replay(tmp_path / "journal")
    assert done.returncode == 0, done.stderr
    assert first_store.status(first) == "FAILED" and second_store.status(second) == "FAILED"
    reason = first_store.run(first).data.tags["lifeguard.reason"]
    assert reason == f"RuntimeError: corrupt shard {ESCAPED}"
    assert not list((tmp_path / "journal").glob("*.json"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("spoil", ["503", "no-status"])
def test_a_run_read_that_fails_writes_nothing_and_the_entry_waits(
    server: MlflowServer, tmp_path: Path, spoil: str
) -> None:
    """The run was resumed since by a live process (this one: its owner tags, a fresh beat).
    The replay's read of it fails (a 503 at each of the REST path's tries): it must not write
    the dead writer's KILLED over the live run; the entry waits, and the next replay, which
    reads it, drops it as history."""
    from lifeguard.guardian import rest

    client = MlflowClient(tracking_uri=server.uri)
    run_id = client.create_run("0").info.run_id
    adopt(client, run_id, Owner.current())
    recorder = Recorder(server.port)
    try:
        journal = tmp_path / "journal"
        entry = Entry(run_id, recorder.uri, "KILLED", 1_000, {}, writer=gone_writer())
        Journal(str(journal)).write(entry)
        recorder.spoil = spoil
        recorder.spoil_reads = rest.ATTEMPTS if spoil == "503" else 1
        done = replay(journal)
        assert recorder.spoil_reads == 0, "the replay never read the run"
        assert done.returncode == 1, done.stderr  # one entry left pending
        assert client.get_run(run_id).info.status == "RUNNING"
        assert [p.stem for p in journal.glob("*.json")] == [run_id]
        writes = [path for method, path, _, _ in recorder.requests if method == "POST"]
        assert writes == []

        done = replay(journal)  # the next install()'s: the read answers
        assert done.returncode == 0, done.stderr
        assert client.get_run(run_id).info.status == "RUNNING"
        assert not list(journal.glob("*.json"))  # superseded: the live process owns the run
    finally:
        recorder.httpd.shutdown()


@pytest.mark.timeout(300)
def test_a_sqlite_store_that_is_not_there_is_not_created(tmp_path: Path) -> None:
    """The store's volume is not mounted (yet): the entry waits for it; no empty store appears
    at its path (MLflow's client would create and migrate one)."""
    missing = tmp_path / "volume" / "mlflow.db"
    missing.parent.mkdir()
    journal = tmp_path / "journal"
    entry = Entry("3" * 32, f"sqlite:///{missing}", "KILLED", 1_000, {}, writer=gone_writer())
    Journal(str(journal)).write(entry)
    done = replay(journal)
    assert done.returncode == 1, done.stderr
    assert not missing.exists()
    assert [p.stem for p in journal.glob("*.json")] == ["3" * 32]
    assert json.loads(next(journal.glob("*.json")).read_text())["status"] == "KILLED"


@pytest.mark.timeout(300)
def test_the_replayer_holds_none_of_the_program_s_pipes(store: Store) -> None:
    """A launcher passes the program a pipe and waits for its end of file, as CI runners and
    `subprocess.run(capture_output=True)` do. The replay install() left behind meets a store
    locked by another writer: the launcher's end of file comes while the replay still waits
    on the lock (it then writes the status), not when it is over."""
    import sqlite3

    run_id = store.client.create_run("0").info.run_id
    journal = store.path.parent / "journal"
    Journal(str(journal)).write(Entry(run_id, store.uri, "KILLED", 1_000, {}, writer=gone_writer()))
    other = sqlite3.connect(str(store.path), isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another writer holds the lock: the replay waits on it
    read_end, write_end = os.pipe()
    replayer = subprocess.Popen(
        [sys.executable, "-m", "lifeguard.guardian.replay"],
        env=child_env(store), pass_fds=[write_end], stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    os.close(write_end)
    try:
        # Nobody holds the pipe any more. A replayer that kept it would give up on the lock
        # first (30 s) and exit: only then would this read return, and the run stay RUNNING.
        assert os.read(read_end, 1) == b""
    finally:
        os.close(read_end)
        other.execute("ROLLBACK")
        other.close()
    _, err = replayer.communicate(timeout=CHILD_TIMEOUT)
    assert replayer.returncode == 0, err
    assert store.status(run_id) == "KILLED"
    assert not list(journal.glob("*.json"))
