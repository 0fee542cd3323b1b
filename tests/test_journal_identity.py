"""A journal entry knows who wrote it: host, boot, PID namespace, pid and start time.

* An entry written by PID 1 of a container (whose store was down at its SIGTERM) is replayed
  from the host and from another container, with its true end time, unless its run was adopted
  since; its writer's pid 1 is not "my pid 1". It used to read as "writer alive" wherever a pid
  1 exists (everywhere), was never replayed, and the sweep said the server "did not accept" it
  without having sent a request.
* Every count the sweep prints is a request it made (or none, said as such).
* Entries of the first format (a bare pid) are still read and replayed.
* ``lifeguard.ended_by`` names whoever wrote the status: ``replay``, ``sweep``, ``watchdog``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from lifeguard.journal import Entry, Journal
from lifeguard.owner import Owner, process_start_time, start_ticks
from tests.conftest import (
    CHILD_TIMEOUT,
    CHILDREN,
    Scenario,
    Store,
    child_env,
    lifeguard_cli,
    wait_gone,
)
from tests.namespaces import NS, require_unshare
from tests.servers import MlflowServer
from tests.test_containers import NS_INIT, InNamespace
from tests.test_sweep_trust import Recorder

PROGRAM = str(CHILDREN / "program.py")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    srv = MlflowServer(tmp_path_factory.mktemp("server")).start()
    yield srv
    srv.stop()


def sweep_args(uri: str, journal: Path) -> list[str]:
    return ["sweep", "--tracking-uri", uri, "--json", "--timeout", "10",
            "--journal-dir", str(journal)]  # fmt: skip


def sweep_cmd(uri: str, journal: Path) -> list[str]:
    return [sys.executable, "-m", "lifeguard", *sweep_args(uri, journal)]


def writes(recorder: Recorder, endpoint: str) -> int:
    return sum(1 for method, path, _, _ in recorder.requests if path.endswith(endpoint))


def entries(journal: Path) -> dict[str, dict[str, object]]:
    return {p.stem: json.loads(p.read_text()) for p in journal.glob("*.json")}


def adopt(client: MlflowClient, run_id: str, owner: Owner) -> None:
    """What a requeued job's heartbeat does when it resumes a run: its owner tags, a beat."""
    for key, value in {**owner.tags(), "lifeguard.heartbeat": str(int(time.time() * 1000))}.items():
        client.set_tag(run_id, key, value)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("where", ["host", "another container"])
def test_an_entry_written_by_pid_1_of_a_container_is_replayed_elsewhere(
    server: MlflowServer, store: Store, tmp_path: Path, where: str
) -> None:
    unshare = require_unshare()
    client = MlflowClient(tracking_uri=server.uri)
    recorder = Recorder(server.port)
    journal = tmp_path / "volume" / "journal"  # a volume both containers and the host see
    try:
        env = child_env(store, MLFLOW_TRACKING_URI=recorder.uri, LIFEGUARD_JOURNAL_DIR=str(journal))
        cmd = [sys.executable, PROGRAM, "--path", "SIGTERM", "--runs", "nested"]
        trainer = InNamespace(unshare, cmd, env)  # the program is PID 1 of its namespace
        try:
            ready = trainer.ready()
            assert ready["pid"] == 1
            recorder.mode = "deny"  # the server refuses everything: the statuses are journaled
            signalled = int(time.time() * 1000)
            os.kill(trainer.init, signal.SIGTERM)  # `docker stop`
            assert trainer.wait() == 128 + signal.SIGTERM, trainer.stderr()
        finally:
            trainer.kill()
        run_ids: list[str] = ready["run_ids"]  # type: ignore[assignment]
        written = entries(journal)
        assert sorted(written) == sorted(run_ids), trainer.stderr()
        ended_at = {run_id: int(data["end_time"]) for run_id, data in written.items()}  # type: ignore[call-overload]
        assert all(signalled - 1000 <= t <= signalled + 5000 for t in ended_at.values())

        # A requeued job resumed one of them meanwhile: a live process (this test) owns it.
        recorder.mode = "forward"
        resumed, dead = run_ids
        adopt(client, resumed, Owner.current())
        recorder.requests.clear()

        if where == "host":
            done = subprocess.run(
                sweep_cmd(recorder.uri, journal), capture_output=True, text=True, timeout=300
            )
        else:
            # Under a patient init: the sweep is pid 2 there, pid 1 is another process again.
            cmd = [sys.executable, NS_INIT, "--", *sweep_cmd(recorder.uri, journal)]
            ns = InNamespace(unshare, cmd, dict(os.environ))
            try:
                ns.go()
                ns.close_stdin()
                returncode = ns.wait()
                done = subprocess.CompletedProcess(cmd, returncode, ns.output(), ns.stderr())
            finally:
                ns.kill()
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        counts = report["journal"]
        assert counts["ended"] == 1 and counts["superseded"] == 1, counts
        # Every count is a request made, and nothing else: one status written, no failure.
        assert counts["journaled"] == counts["not sent"] == counts["waiting"] == 0, counts
        assert writes(recorder, "runs/update") == counts["ended"]
        assert "did not accept" not in done.stderr
        assert entries(journal) == {}

        run = client.get_run(dead)
        assert run.info.status == "KILLED"
        assert run.info.end_time == ended_at[dead]  # the moment of the SIGTERM, not the replay
        assert run.data.tags["lifeguard.signal"] == "SIGTERM"
        # Written by the sweep's replay of the journal: "replay", the journal's truth, never
        # "sweep", which marks an orphan ended on a guess (scripts/stress.py counts those lost).
        assert run.data.tags["lifeguard.ended_by"] == "replay"
        assert client.get_run(resumed).info.status == "RUNNING"  # its live owner ends it
        for data in written.values():
            writer = data.get("writer")
            assert isinstance(writer, dict), data
            # PID 1 of its own namespace on this very host and boot.
            assert writer["pid"] == 1 and writer["host"] == Owner.current().host
            assert writer["pid_ns"] != Owner.current().pid_ns
            assert writer["boot_id"] == Owner.current().boot_id
    finally:
        recorder.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_sweeps_counts_are_the_requests_it_made(server: MlflowServer, tmp_path: Path) -> None:
    """An entry whose writer still runs here is left to it (no request, said so, exit 0); one
    the server refuses is "did not accept 1" after exactly one refused write; one after that
    for the same server is not sent, and said so."""
    client = MlflowClient(tracking_uri=server.uri)
    recorder = Recorder(server.port)
    journal = tmp_path / "journal"
    sleeper = subprocess.Popen(["sleep", "600"])
    try:
        alive = Owner.of_pid(sleeper.pid)
        assert alive is not None
        run_ids = [client.create_run("0").info.run_id for _ in range(3)]
        journal.mkdir(mode=0o700)
        for run_id in run_ids:
            # Written as JSON, field by field: the format is the contract between versions.
            path = journal / f"{run_id}.json"
            path.write_text(json.dumps({
                "version": 1, "run_id": run_id, "tracking_uri": recorder.uri,
                "status": "KILLED", "end_time": 1_000, "journaled_at": 1_000,
                "tags": {"lifeguard.ended_by": "process", "lifeguard.reason": "killed by SIGTERM"},
                "pid": alive.pid,
                "writer": {"host": alive.host, "pid": alive.pid, "start_time": alive.start_time,
                           "boot_id": alive.boot_id, "pid_ns": alive.pid_ns,
                           "start_ticks": alive.start_ticks},
            }))  # fmt: skip
            path.chmod(0o600)
        done = lifeguard_cli(*sweep_args(recorder.uri, journal), timeout=300)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["journal"]["waiting"] == 3
        assert recorder.requests == [] or all(
            not any(r in path for r in run_ids) for _, path, _, _ in recorder.requests
        )
        assert "did not accept" not in done.stderr
        assert "3 journaled status(es) left to their writers" in done.stderr

        sleeper.kill()
        sleeper.wait(60)
        recorder.mode = "deny-writes"
        recorder.requests.clear()
        done = lifeguard_cli(*sweep_args(recorder.uri, journal), timeout=300)
        assert done.returncode == 1, done.stderr
        counts = json.loads(done.stdout)["journal"]
        assert (counts["journaled"], counts["not sent"]) == (1, 2), counts
        assert writes(recorder, "runs/update") + writes(recorder, "runs/log-batch") == 1
        assert "did not accept 1 journaled status(es) (2 more not sent" in done.stderr
        assert all(client.get_run(r).info.status == "RUNNING" for r in run_ids)
    finally:
        sleeper.kill()
        recorder.close()


# -- the first format, and hostile writer fields -------------------------------------------------


def test_an_entry_of_the_first_format_is_read_with_no_writer(tmp_path: Path) -> None:
    """Entries written before the writer's identity existed: a bare pid. Read, and replayed
    unless adopted (its pid names another process in every other namespace: not checkable)."""
    data = {"version": 1, "run_id": "a" * 32, "tracking_uri": "http://h", "status": "KILLED",
            "end_time": 5, "tags": {}, "journaled_at": 5, "pid": 1}  # fmt: skip
    path = tmp_path / ("a" * 32 + ".json")
    path.write_text(json.dumps(data))
    path.chmod(0o600)
    tmp_path.chmod(0o700)
    [entry] = Journal(str(tmp_path)).entries()
    assert (entry.pid, entry.writer, entry.end_time) == (1, None, 5)
    assert entry.writer_alive() is None  # pid 1 is alive here, and says nothing about it


@pytest.mark.parametrize(
    "writer",
    [
        "not a dict",
        {"host": 3, "pid": 1, "start_time": 1.0},
        {"host": "h", "pid": True, "start_time": 1.0},
        {"host": "h", "pid": 1, "start_time": "soon"},
        {"host": "h", "pid": 1, "start_time": 1.0, "pid_ns": 7},
        {"host": "h", "pid": 2, "start_time": 1.0},  # disagrees with "pid": 1
    ],
)
def test_a_damaged_writer_is_no_writer(tmp_path: Path, writer: object) -> None:
    data = {"version": 1, "run_id": "b" * 32, "tracking_uri": "http://h", "status": "KILLED",
            "end_time": 5, "tags": {}, "pid": 1, "writer": writer}  # fmt: skip
    path = tmp_path / ("b" * 32 + ".json")
    path.write_text(json.dumps(data))
    path.chmod(0o600)
    tmp_path.chmod(0o700)
    [entry] = Journal(str(tmp_path)).entries()
    assert entry.writer is None and entry.pid == 1


def test_a_new_entry_carries_its_writers_identity(tmp_path: Path) -> None:
    path = Journal(str(tmp_path)).write(Entry("c" * 32, "http://h", "FAILED", 7, {}))
    data = json.loads(Path(path).read_text())
    me = Owner.current()
    assert data["pid"] == os.getpid()  # still there, for readers of the first format
    assert data["writer"] == me.fields()
    [entry] = Journal(str(tmp_path)).entries()
    assert entry.writer is not None and entry.writer.same_process(me)
    assert entry.writer_alive() is False  # the replaying process's own entries are its own


@pytest.mark.slow
def test_a_writer_in_a_namespace_nested_here_is_checked(tmp_path: Path) -> None:
    """A container started from here is in sight: its processes are listed here too, each with
    its pid in every namespace. A live writer there holds its entry back; a dead one (its
    namespace still alive) does not; a namespace with nothing left in sight says nothing."""
    unshare = require_unshare()
    ns = subprocess.Popen(
        [unshare, *NS, "sh", "-c", "sleep 600 & echo $!; wait"],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert ns.stdout is not None
        inner = int(ns.stdout.readline())  # the sleeper's pid inside: 2
        from tests.namespaces import host_pid, namespace_init

        init = namespace_init(ns.pid)
        sleeper = host_pid(init, inner)
        here = Owner.current()
        pid_ns = str(os.stat(f"/proc/{init}/ns/pid").st_ino)
        start = process_start_time(sleeper)
        assert start is not None
        ticks = start_ticks(sleeper)
        assert ticks is not None
        live = Owner(here.host, inner, start, here.boot_id, pid_ns, ticks)
        assert live.is_alive() is True
        earlier = Owner(here.host, inner, start - 50, here.boot_id, pid_ns, ticks - 1)
        assert earlier.is_alive() is False
        assert Owner(here.host, 77, start, here.boot_id, pid_ns, ticks).is_alive() is False
        entry = Entry("d" * 32, "http://h", "KILLED", 1, {}, writer=live)
        assert entry.writer_alive() is True
    finally:
        os.killpg(ns.pid, signal.SIGKILL)
        ns.wait(60)
    wait_gone(init)
    # The namespace is gone: nothing in sight to say (None), or its inode number already
    # belongs to a new namespace (the kernel reuses them at once; other tests make them), in
    # which no such process runs: dead, and rightly, since two live namespaces never share one.
    assert live.is_alive() is not True


# -- ended_by names the writer ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_replay_says_it_wrote_the_status(scenario: Scenario, store: Store) -> None:
    """The program journaled its ending (ended_by=process) and could not write it; the replay
    that did (install()'s) says so. On a sqlite store it imports no mlflow to do it: it runs
    beside a program that is starting up."""
    journal = store.path.parent / "journal"
    run_id = store.client.create_run("0").info.run_id
    Journal(str(journal)).write(
        Entry(
            run_id, store.uri, "KILLED", 1_000, {"lifeguard.ended_by": "process"}, pid=999_999_999
        )
    )
    env = child_env(store)
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "lifeguard.guardian.replay"],
        env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    imported = [line.rpartition("|")[2].strip() for line in done.stderr.splitlines()]
    assert "lifeguard.guardian.sqlitestore" in imported, done.stderr
    assert not [m for m in imported if m.split(".")[0] in ("mlflow", "sqlalchemy")], done.stderr
    run = store.run(run_id)
    assert run.info.status == "KILLED" and run.info.end_time == 1_000
    assert run.data.tags["lifeguard.ended_by"] == "replay"


def _flocked_by(pid: int, path: Path) -> bool:
    """Whether ``pid`` holds an flock on ``path`` (/proc/locks: the journal's claim on an entry)."""
    inode = path.stat().st_ino
    with open("/proc/locks") as f:
        for line in f:
            fields = line.split()
            if fields[1] == "FLOCK" and fields[4] == str(pid) and fields[5].endswith(f":{inode}"):
                return True
    return False


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_install_s_replay_waits_out_a_store_locked_for_seconds(store: Store) -> None:
    """A sqlite store locked for longer than a last gasp's attempt (5 s: another writer, a slow
    disk): nobody waits on install()'s replay, so it waits as MLflow's own client would, and
    writes the status once the lock is released."""
    import sqlite3

    journal = store.path.parent / "journal"
    run_id = store.client.create_run("0").info.run_id
    Journal(str(journal)).write(
        Entry(run_id, store.uri, "KILLED", 1_000, {"lifeguard.ended_by": "process"}, pid=1 << 30)
    )
    entry_file = next(journal.glob(f"{run_id}*.json"))
    other = sqlite3.connect(str(store.path), isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another writer holds the lock
    replay = subprocess.Popen(
        [sys.executable, "-m", "lifeguard.guardian.replay"],
        env=child_env(store), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + CHILD_TIMEOUT
        # The replay claims the entry, then meets the lock: from then on it is waiting on it.
        while not _flocked_by(replay.pid, entry_file):
            assert replay.poll() is None, replay.communicate()
            assert time.monotonic() < deadline, "the replay never claimed the entry"
            time.sleep(0.05)  # polling a condition with a deadline
        time.sleep(7)  # the lock, held 7 s more: the scenario itself (more than 5 s)
        assert replay.poll() is None, replay.communicate()
    finally:
        other.execute("ROLLBACK")
        other.close()
    _, err = replay.communicate(timeout=CHILD_TIMEOUT)
    assert replay.returncode == 0, err
    run = store.run(run_id)
    assert run.info.status == "KILLED" and run.info.end_time == 1_000
    assert not list(journal.glob("*.json"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_watchdog_that_writes_the_programs_journaled_status_says_so(
    scenario: Scenario, store: Store
) -> None:
    """SIGTERM, then a SIGKILL while the finalizers run (a launcher's grace period ran out):
    the program had journaled its ending (killed by SIGTERM, at the SIGTERM); its watchdog
    writes it, and the run says the watchdog wrote it."""
    sent = int(time.time() * 1000)
    result = scenario.run(
        "--path", "SIGTERM", "--watchdog", "--blocking-finalizer",
        send=(signal.SIGTERM,), on_line={"FINALIZING": signal.SIGKILL},
    )  # fmt: skip
    assert result.returncode == -signal.SIGKILL, result.stderr
    wait_gone(result.ready["watchdog"])  # type: ignore[arg-type]
    [run_id] = result.ready["run_ids"]  # type: ignore[misc]
    run = store.run(run_id)
    assert run.info.status == "KILLED"
    assert run.data.tags["lifeguard.signal"] == "SIGTERM"  # the program's own truth
    assert run.info.end_time >= sent - 1000
    assert run.data.tags["lifeguard.ended_by"] == "watchdog"


def test_a_reused_pid_is_not_the_writer(tmp_path: Path) -> None:
    """The writer's pid now belongs to another process (this one, started later): the writer
    is gone, and its entry is replayed."""
    here = Owner.current()
    parent = Owner.of_pid(os.getppid())
    assert parent is not None and parent.start_ticks is not None
    earlier = Owner(here.host, os.getppid(), 1_000.0, here.boot_id, here.pid_ns,
                    parent.start_ticks - 1)  # fmt: skip
    assert Entry("f" * 32, "http://h", "KILLED", 1, {}, writer=earlier).writer_alive() is False
    parent_start = parent.start_time
    assert Entry("f" * 32, "http://h", "KILLED", 1, {}, writer=parent).writer_alive() is True
    elsewhere = Owner("another-host", os.getppid(), parent_start, here.boot_id, here.pid_ns)
    assert Entry("f" * 32, "http://h", "KILLED", 1, {}, writer=elsewhere).writer_alive() is None
