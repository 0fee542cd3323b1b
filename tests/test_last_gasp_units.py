"""The pieces of the last gasp, in-process: what a process knows it left, the journal's claims,
the bound's validation, how the flush merges a backlog into requests, and what install()'s
replay leaves to a process that still runs."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from lifeguard import lastgasp
from lifeguard.journal import BUSY, ENDED, GONE, HELD, Entry, Journal


def entry(run_id: str, pid: int | None = None) -> Entry:
    return Entry(run_id, "sqlite:////tmp/x.db", "KILLED", 1, {}, pid=pid)


@pytest.fixture(autouse=True)
def _clean_bookkeeping() -> None:
    lastgasp._kept.clear()
    lastgasp._left.clear()


def test_a_process_knows_exactly_which_entries_it_left(tmp_path: Path) -> None:
    journal = Journal(str(tmp_path / "j"))
    written, left = entry("a" * 32), entry("b" * 32)
    journal.write(written)
    journal.write(left)
    journal.remove(written)  # its status reached the store
    assert lastgasp.unwritten() == {str(tmp_path / "j"): ["b" * 32]}
    os.unlink(tmp_path / "j" / ("b" * 32 + ".json"))  # taken by someone else meanwhile
    assert lastgasp.unwritten() == {}


def test_nothing_left_means_nothing_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[object] = []
    monkeypatch.setattr(lastgasp, "start_replayer", lambda *a, **k: started.append(a))
    lastgasp.leave_replayer()  # never journaled anything
    journal = Journal(str(tmp_path / "j"))
    e = entry("c" * 32)
    journal.write(e)
    journal.remove(e)
    lastgasp.leave_replayer()  # journaled, and written
    assert started == []
    journal.write(entry("d" * 32))
    monkeypatch.setenv(lastgasp.BOUND_ENV, "0")
    lastgasp.leave_replayer()  # turned off
    assert started == []
    monkeypatch.delenv(lastgasp.BOUND_ENV)
    lastgasp.leave_replayer()
    lastgasp.leave_replayer()  # once per process
    assert len(started) == 1


def test_a_forked_child_does_not_leave_its_parent_s_entries(tmp_path: Path) -> None:
    journal = Journal(str(tmp_path / "j"))
    journal.write(entry("e" * 32))
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write_fd, repr(lastgasp.unwritten()).encode())
        os._exit(0)
    os.close(write_fd)
    seen = os.read(read_fd, 4096).decode()
    os.waitpid(pid, 0)
    os.close(read_fd)
    assert seen == "{}"
    assert lastgasp.unwritten() == {str(tmp_path / "j"): ["e" * 32]}


def test_a_claim_is_exclusive_and_sees_the_entry_as_it_is_now(tmp_path: Path) -> None:
    journal = Journal(str(tmp_path / "j"))
    listed = entry("f" * 32, pid=1)
    journal.write(listed)
    journal.write(entry("f" * 32, pid=2))  # journaled again since it was listed
    with journal.claim(listed) as mine:
        assert mine.state == HELD and mine.entry is not None and mine.entry.pid == 2
        with journal.claim(listed, wait=0.1) as other:
            assert other.state == BUSY and other.entry is None
        journal.remove(mine.entry)
    with journal.claim(listed) as after:
        assert after.state == GONE


def test_a_claim_waits_for_the_holder_and_then_finds_the_entry_written(tmp_path: Path) -> None:
    journal = Journal(str(tmp_path / "j"))
    e = entry("0" * 32)
    journal.write(e)
    fd = os.open(journal.directory + "/" + "0" * 32 + ".json", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another replay, writing it

    def written_by_the_holder() -> None:
        os.unlink(journal.directory + "/" + "0" * 32 + ".json")
        os.close(fd)

    timer = threading.Timer(0.3, written_by_the_holder)
    timer.start()
    try:
        with journal.claim(e, wait=30.0) as claim:
            assert claim.state == GONE
    finally:
        timer.join()


def test_a_claim_is_released_when_its_holder_dies(tmp_path: Path) -> None:
    journal = Journal(str(tmp_path / "j"))
    e = entry("1" * 32)
    path = journal.write(e)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); "
         "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()", path],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with journal.claim(e) as claim:
            assert claim.state == BUSY
        holder.kill()
        holder.wait(30)
        with journal.claim(e) as claim:
            assert claim.state == HELD
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(30)


@pytest.mark.parametrize("value", ["-1", "soon", "3601", "nan"])
def test_install_refuses_a_bad_replay_bound(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    from lifeguard.options import Options

    monkeypatch.setenv("LIFEGUARD_REPLAY_BOUND", value)
    with pytest.raises(ValueError, match="LIFEGUARD_REPLAY_BOUND"):
        Options.from_kwargs({})


def test_the_backlog_is_merged_per_run_without_a_key_twice() -> None:
    """The flush's requests: one run each, at most FLUSH_CHUNK values, a param or tag key
    never twice in one request (MLflow refuses that), in the queue's order."""
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.utils.async_logging.run_batch import RunBatch

    from lifeguard.backends.mlflow.plan import FLUSH_CHUNK, _chunks

    def metric(i: int) -> RunBatch:
        return RunBatch("r1", metrics=[Metric("m", float(i), 0, i)])

    batches = [metric(i) for i in range(FLUSH_CHUNK + 5)]
    batches += [RunBatch("r2", params=[Param("p", "1")]), RunBatch("r2", params=[Param("p", "1")])]
    batches += [RunBatch("r2", tags=[RunTag("t", "x")]), metric(0)]
    chunks = _chunks(batches)
    assert [(c.run_id, c.values) for c in chunks] == [
        ("r1", FLUSH_CHUNK), ("r1", 5), ("r2", 1), ("r2", 2), ("r1", 1),
    ]  # fmt: skip
    assert sum(len(c.batches) for c in chunks) == len(batches)


def test_a_sqlite_without_upsert_sends_the_replay_down_the_mlflow_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tag write is an upsert (SQLite 3.24, 2018); an older SQLite (CentOS 7 ships 3.7)
    would fail every write and keep the statuses journaled for good: the store says it is not
    one sqlitestore can write, and the replayers take the mlflow path (SQLAlchemy's writes)."""
    import sqlite3

    from lifeguard.guardian import sqlitestore

    path = tmp_path / "mlflow.db"
    sqlite3.connect(str(path)).close()
    store = sqlitestore.SqliteStore(f"sqlite:///{path}")
    monkeypatch.setattr(sqlite3, "sqlite_version_info", (3, 22, 0))
    monkeypatch.setattr(sqlite3, "sqlite_version", "3.22.0")
    with pytest.raises(sqlitestore.SchemaError, match=r"SQLite 3\.22\.0 has no upsert"):
        store.check()


@pytest.mark.parametrize("anew", [True, False], ids=["journaled-anew", "as-listed"])
def test_install_s_replay_leaves_what_a_running_process_journaled_since_the_listing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, anew: bool
) -> None:
    """install()'s replay lists a dead writer's entry; by the time it holds the claim, a process
    that still runs (a resumed attempt) may have journaled that run again. That entry is the
    running process's to write: the replay leaves it. As listed, it is written."""
    from lifeguard.guardian import replay
    from lifeguard.owner import Owner, process_start_time

    monkeypatch.setenv("LIFEGUARD_JOURNAL_DIR", str(tmp_path / "j"))
    monkeypatch.setattr(replay.time, "sleep", lambda seconds: None)  # no resume to wait for
    me = Owner.current()
    # Our pid, with another start time: the process that had this pid before us, gone.
    assert me.start_ticks is not None
    dead = Owner(me.host, me.pid, me.start_time - 1000, me.boot_id, me.pid_ns, me.start_ticks - 1)
    running = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                               stdin=subprocess.PIPE)  # fmt: skip
    try:
        start = process_start_time(running.pid)
        assert start is not None
        alive = Owner.of_pid(running.pid)
        assert alive is not None
        assert dead.is_alive() is False and alive.is_alive() is True
        run_id = "2" * 32
        journal = Journal()
        journal.write(Entry(run_id, "sqlite:////nowhere/x.db", "KILLED", 1, {}, writer=dead))
        listed = Journal.entries

        def listed_then_journaled_anew(self: Journal) -> Iterator[Entry]:
            for e in listed(self):
                if anew:  # after the listing, before the claim
                    journal.write(
                        Entry(run_id, "sqlite:////nowhere/x.db", "FAILED", 2, {}, writer=alive)
                    )
                yield e

        written: list[Entry] = []

        def write(self: object, entry: Entry, journal: Journal, give_up: float) -> tuple[str, str]:
            written.append(entry)
            journal.remove(entry)
            return ENDED, ""

        monkeypatch.setattr(Journal, "entries", listed_then_journaled_anew)
        monkeypatch.setattr(replay._Stores, "apply", write)
        assert replay.at_install() == 0
        if anew:
            assert written == []
            (left,) = list(listed(journal))
            assert left.status == "FAILED" and left.writer is not None
            assert left.writer.same_process(alive)
        else:
            assert [(e.run_id, e.status, e.tags.get("lifeguard.ended_by")) for e in written] == [
                (run_id, "KILLED", "replay")
            ]
            assert list(listed(journal)) == []
    finally:
        running.kill()
        running.wait(30)
