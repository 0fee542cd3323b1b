"""Nothing waits for the next run (issue 25): a status a dying program could only journal is
written seconds after its death by the replayer it leaves behind, with no later install() or
sweep; and the metrics it queued get the time the deadline has left.

Real processes throughout: the programs are tests/children/last_gasp.py (a verl-style
``Tracking``, stopped inside a slow sqlite write) against a real sqlite store or a real
``mlflow server`` on 127.0.0.1; the replayer is the real detached process they leave.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from lifeguard.backends.mlflow.plan import FLUSH_CHUNK, FLUSH_STALL
from lifeguard.demo import ChildResult, run_child, wait_gone
from lifeguard.journal import Entry, Journal
from lifeguard.owner import Owner, process_start_time, start_ticks
from tests.conftest import (
    CHILD_TIMEOUT,
    CHILDREN,
    Scenario,
    Store,
    child_env,
    lifeguard_cli,
    trials,
)
from tests.servers import FaultProxy, MlflowServer

pytestmark = pytest.mark.slow

CHILD = CHILDREN / "last_gasp.py"
SUBREAPER = CHILDREN / "subreaper.py"


def journal_dir(store: Store) -> Path:
    return store.path.parent / "journal"


def entries(store: Store) -> list[str]:
    directory = journal_dir(store)
    return sorted(p.stem for p in directory.glob("*.json")) if directory.exists() else []


def program(
    store: Store, mode: str, *args: str, install: dict[str, object] | None = None, **env: str
) -> tuple[list[str], dict[str, str]]:
    return [sys.executable, str(CHILD), mode, *args], child_env(
        store, TEST_INSTALL=json.dumps(install or {}), **env
    )


def parent_of(pid: str) -> int:
    """The parent pid of ``/proc/<pid>``, from its stat line (after the command's parenthesis,
    which may hold spaces)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


def replayers_of(pid: int) -> list[int]:
    """The last-gasp replayers process ``pid`` left (alive now); not the children a replayer
    forks for a round of writes, which have its command line."""
    found: dict[int, int] = {}  # pid -> parent
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            argv = Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0")
            parent = parent_of(name)
        except (OSError, ValueError, IndexError):
            continue
        mine = b"lifeguard.guardian.replay" in argv and b"--writer" in argv
        if mine and argv[argv.index(b"--writer") + 1] == str(pid).encode():
            found[int(name)] = parent
    return [replayer for replayer, parent in found.items() if parent not in found]


def the_replayer(pid: int, timeout: float = 30.0) -> int:
    """The one replayer process ``pid`` left, expected alive still (its store locked or down).
    Polled: the program may die before the shell it spawned has exec'd the replayer, whose
    command line shows only then."""
    give_up = time.monotonic() + timeout
    while not (found := replayers_of(pid)) and time.monotonic() < give_up:
        time.sleep(0.05)  # polling /proc for an exec, bounded
    assert len(found) == 1, f"replayers of {pid}: {found}"
    return found[0]


def kill_replayer(replayer: int) -> None:
    """SIGKILL a replayer and the child it may have forked for a round of writes. The child
    outlives a SIGKILL of its parent and finishes its round (the entry claimed, the status
    written): a test that means "no replay is writing any more" kills both. Stopped first, so
    that no new round starts between the look at its children and the kill."""
    os.kill(replayer, signal.SIGSTOP)
    children = []
    for name in os.listdir("/proc"):
        try:
            if parent_of(name) == replayer:
                children.append(int(name))
        except (OSError, ValueError, IndexError):
            continue
    for pid in [*children, replayer]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in [*children, replayer]:
        assert wait_gone(pid, 30.0), pid


def wait_ended(client: MlflowClient, run_id: str, timeout: float) -> tuple[str, float]:
    """(the run's status once it is no longer RUNNING, or RUNNING at the timeout; when)."""
    give_up = time.monotonic() + timeout
    while True:
        status = client.get_run(run_id).info.status
        if status != "RUNNING" or time.monotonic() >= give_up:
            return status, time.time()
        time.sleep(0.02)  # polling the store, bounded: no replayer of ours to wait on


def signalled_at(result: ChildResult) -> float:
    line = next(x for x in result.stdout.splitlines() if x.startswith("SIGNAL "))
    return float(line.split()[1])


# -- a slow sqlite write: the death releases the lock, the replayer writes at once -----------


@pytest.mark.parametrize("second_signal", [False, True], ids=["sigterm", "second-sigterm"])
def test_a_status_stuck_behind_the_program_s_own_write_lands_seconds_after_the_death(
    store: Store, second_signal: bool
) -> None:
    """The issue's reproduction: SIGTERM while the program is inside a slow sqlite write (it
    holds the write lock). The status write fails on that lock and is journaled, and the
    process dies of SIGTERM. Before, the run stayed RUNNING until the next install() or sweep;
    now it is KILLED, with the signal's time, seconds after the death, and nothing else runs."""
    mode = "slow-write-twice" if second_signal else "slow-write"
    cmd, env = program(store, mode, install={"deadline": 5.0})
    result = run_child(
        cmd,
        env=env,
        timeout=CHILD_TIMEOUT,
        on_line={"FINALIZING": signal.SIGTERM} if second_signal else None,
    )
    died = time.time()
    assert result.returncode == -signal.SIGTERM, result.stderr
    [run_id] = result.ready["run_ids"]  # type: ignore[misc]
    status, landed = wait_ended(store.client, run_id, timeout=30.0)
    assert status == "KILLED", result.stderr
    # Seconds after the death, not the next install() or sweep; a loaded machine's replayer
    # start (python and mlflow's imports) takes a few of them.
    assert landed - died < 10.0, landed - died
    run = store.run(run_id)
    signalled = signalled_at(result) * 1000
    assert signalled - 1 <= run.info.end_time <= signalled + 500  # the signal's, not the replay's
    assert run.data.tags["lifeguard.signal"] == "SIGTERM"
    assert "UNREACHED" not in result.stdout
    for pid in replayers_of(int(result.ready["pid"])):  # type: ignore[call-overload]
        assert wait_gone(pid, 30.0)
    assert entries(store) == []


# -- nothing extra when nothing is journaled ---------------------------------------------------


def adopted(result: ChildResult) -> dict[str, object]:
    line = next(x for x in result.stdout.splitlines() if x.startswith("SUBREAPER "))
    report: dict[str, object] = json.loads(line[len("SUBREAPER ") :])
    return report


@pytest.mark.parametrize(
    ("mode", "send", "replayers"),
    [
        ("wait", (), 0),  # a clean return
        ("wait", (signal.SIGTERM,), 0),  # a signal whose write succeeded
        ("slow-write", (), 1),  # the control: a status only journaled leaves one replayer
    ],
    ids=["clean-exit", "sigterm-written", "sigterm-journaled"],
)
def test_a_replayer_is_left_only_when_a_status_is_only_journaled(
    store: Store, mode: str, send: tuple[int, ...], replayers: int
) -> None:
    """Every process the program leaves behind is adopted by a subreaper and counted: none
    when every status was written; exactly one, the replayer, when one was only journaled."""
    cmd, env = program(store, mode, install={"deadline": 5.0})
    result = run_child(
        [sys.executable, str(SUBREAPER), *cmd],
        env=env,
        send=send,
        to_ready_pid=True,
        timeout=CHILD_TIMEOUT,
    )
    report = adopted(result)
    expected_status = -signal.SIGTERM if send or mode != "wait" else 0
    assert report["status"] == expected_status, result.stderr
    left = report["adopted"]
    assert isinstance(left, list)
    assert len(left) == replayers, left
    assert all("lifeguard.guardian.replay" in cmdline for cmdline in left if cmdline), left
    [run_id] = result.ready["run_ids"]  # type: ignore[misc]
    assert store.status(run_id) == ("KILLED" if expected_status else "FINISHED")
    assert entries(store) == []


# -- a server down at the death ---------------------------------------------------------------


@pytest.mark.timeout(300)
def test_a_server_back_a_minute_later_gets_the_status_within_seconds(
    store: Store, tmp_path: Path
) -> None:
    """The server dies before the SIGTERM and comes back 60 s later (20 s in a contributor's
    `tox`: conftest.trials), on the same port and store. No install() and no sweep run
    meanwhile: the replayer the program left writes the status within seconds of the server's
    return, with the signal's time as end time."""
    outage = float(trials(60, 20))
    first = MlflowServer(tmp_path / "server").start()
    second: MlflowServer | None = None
    try:
        cmd, env = program(store, "wait", install={"deadline": 3.0}, MLFLOW_TRACKING_URI=first.uri)
        sent: list[float] = []
        result = run_child(
            cmd,
            env=env,
            send=(signal.SIGTERM,),
            timeout=CHILD_TIMEOUT,
            after_ready=lambda ready: (first.stop(), sent.append(time.time())),
        )
        assert result.returncode == -signal.SIGTERM, result.stderr
        [run_id] = result.ready["run_ids"]  # type: ignore[misc]
        replayer = the_replayer(int(result.ready["pid"]))  # type: ignore[call-overload]
        assert entries(store) == [run_id]
        # The outage: a minute, as the issue has it. The replayer keeps trying meanwhile.
        assert not wait_gone(replayer, timeout=outage - (time.time() - sent[0]))
        second = MlflowServer(first.root, port=first.port).start()
        back = time.time()
        status, landed = wait_ended(MlflowClient(tracking_uri=second.uri), run_id, 60.0)
        assert status == "KILLED"
        # The replayer's next try after the server is back: its backoff, plus a loaded machine.
        assert landed - back < 30.0, landed - back
        run = MlflowClient(tracking_uri=second.uri).get_run(run_id)
        assert sent[0] * 1000 - 1 <= run.info.end_time <= sent[0] * 1000 + 2000
        assert wait_gone(replayer, 30.0)
        assert entries(store) == []
    finally:
        first.stop()
        if second is not None:
            second.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    srv = MlflowServer(tmp_path_factory.mktemp("server")).start()
    yield srv
    srv.stop()


@pytest.fixture
def proxy(server: MlflowServer) -> Iterator[FaultProxy]:
    p = FaultProxy(server.port)
    yield p
    p.close()


def sweep(uri: str, journal: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lifeguard", "sweep", "--tracking-uri", uri,
         "--journal-dir", str(journal), "--timeout", "5"],
        capture_output=True, text=True, timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")},
    )  # fmt: skip


def die_with_server_down(
    store: Store, proxy: FaultProxy, *, bound: str, stderr_file: Path | None = None
) -> tuple[str, int, float, str]:
    """A program against the proxy, which fails every request from before its SIGTERM on.
    Returns (run id, the replayer's pid, the signal's time, the program's stderr)."""
    cmd, env = program(
        store, "wait", install={"deadline": 3.0},
        MLFLOW_TRACKING_URI=proxy.uri, LIFEGUARD_REPLAY_BOUND=bound,
    )  # fmt: skip
    proxy.mode = "pass"
    ready_line = "LIFEGUARD-READY "
    if stderr_file is None:
        sent: list[float] = []

        def server_down(ready: dict[str, object]) -> None:
            proxy.mode = "error500"
            sent.append(time.time())

        result = run_child(
            cmd, env=env, send=(signal.SIGTERM,), timeout=CHILD_TIMEOUT, after_ready=server_down
        )
        assert result.returncode == -signal.SIGTERM, result.stderr
        [run_id] = result.ready["run_ids"]  # type: ignore[misc]
        pid, stderr = int(result.ready["pid"]), result.stderr  # type: ignore[call-overload]
    else:
        # The program's stderr is a file (a Slurm output file, nohup.out): the replayer keeps it.
        with open(stderr_file, "w") as err:
            proc = subprocess.Popen(
                cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                text=True, start_new_session=True,
            )  # fmt: skip
        assert proc.stdout is not None and proc.stdin is not None
        line = proc.stdout.readline()
        assert line.startswith(ready_line), line
        ready = json.loads(line[len(ready_line) :])
        proxy.mode = "error500"
        sent = [time.time()]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(CHILD_TIMEOUT) == -signal.SIGTERM
        [run_id], pid, stderr = ready["run_ids"], ready["pid"], stderr_file.read_text()
    replayer = the_replayer(pid)
    return run_id, replayer, sent[0], stderr


@pytest.mark.parametrize("stderr_kind", ["pipe", "file"])
def test_a_server_down_past_the_bound_leaves_the_entry_and_says_so_in_one_line(
    store: Store, server: MlflowServer, proxy: FaultProxy, tmp_path: Path, stderr_kind: str
) -> None:
    """The replayer gives up at its bound (LIFEGUARD_REPLAY_BOUND, 4 s here): the entry stays
    for the sweep, and one line says so: on the program's stderr when that is a file, in the
    journal's replayer.log when it was a pipe (held open, it would keep the reader waiting)."""
    err = tmp_path / "stderr.txt" if stderr_kind == "file" else None
    run_id, replayer, sent, before = die_with_server_down(store, proxy, bound="4", stderr_file=err)
    assert wait_gone(replayer, 60.0)
    assert entries(store) == [run_id]
    log = journal_dir(store) / "replayer.log"
    if err is None:
        said = log.read_text().splitlines()
        assert stat_mode(log) == 0o600
    else:
        assert not log.exists()
        said = err.read_text()[len(before) :].splitlines()
    assert len(said) == 1, said
    assert "1 run status(es) journaled by pid" in said[0]
    assert "within the replayer's bound of 4 s" in said[0]
    assert "lifeguard sweep" in said[0] and str(journal_dir(store)) in said[0]
    client = MlflowClient(tracking_uri=server.uri)
    assert client.get_run(run_id).info.status == "RUNNING"
    proxy.mode = "pass"
    swept = sweep(proxy.uri, journal_dir(store))
    assert swept.returncode == 0, swept.stderr
    run = client.get_run(run_id)
    assert run.info.status == "KILLED"
    assert sent * 1000 - 1 <= run.info.end_time <= sent * 1000 + 2000
    assert entries(store) == []


def test_a_killed_replayer_leaves_its_entry_to_the_sweep(
    store: Store, server: MlflowServer, proxy: FaultProxy
) -> None:
    """SIGKILL the replayer while it retries: its claim dies with it, and the sweep writes the
    entry with the true end time."""
    run_id, replayer, sent, _ = die_with_server_down(store, proxy, bound="120")
    kill_replayer(replayer)
    assert entries(store) == [run_id]
    proxy.mode = "pass"
    swept = sweep(proxy.uri, journal_dir(store))
    assert swept.returncode == 0, swept.stderr
    run = MlflowClient(tracking_uri=server.uri).get_run(run_id)
    assert run.info.status == "KILLED"
    assert sent * 1000 - 1 <= run.info.end_time <= sent * 1000 + 2000


def test_the_sweep_waits_for_an_entry_a_replayer_is_writing_and_never_writes_it_too(
    store: Store, server: MlflowServer, proxy: FaultProxy
) -> None:
    """Two replays of one entry at once: the dying program's replayer holds the entry's claim
    while it writes; a sweep that comes meanwhile waits for that attempt, and does not write
    the entry beside it. Here the test holds the claim itself, as a replayer would, for as long
    as it likes: the sweep leaves the entry alone (it cannot tell), and the run RUNNING; once
    the claim is released, the sweep writes it."""
    import fcntl

    run_id, replayer, _, _ = die_with_server_down(store, proxy, bound="120")
    kill_replayer(replayer)  # its own claim, if any, goes with it
    proxy.mode = "pass"
    entry_path = journal_dir(store) / f"{run_id}.json"
    fd = os.open(entry_path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        held = sweep(proxy.uri, journal_dir(store))
        # Left to the replay that holds it, as to a writer still finalizing: not a failure.
        assert held.returncode == 0, held.stdout + held.stderr
        assert "left to their writers" in held.stderr, held.stderr
        assert MlflowClient(tracking_uri=server.uri).get_run(run_id).info.status == "RUNNING"
        assert entries(store) == [run_id]
    finally:
        os.close(fd)
    swept = sweep(proxy.uri, journal_dir(store))
    assert swept.returncode == 0, swept.stderr
    assert MlflowClient(tracking_uri=server.uri).get_run(run_id).info.status == "KILLED"


# -- only its own writer's entries --------------------------------------------------------------


def plant(store: Store, run_id: str, pid: int, started: float | None = None) -> None:
    """An entry journaled by process ``pid`` of this host and namespace, with its full identity
    (as every writer records it): started at ``started``, by default that pid's start time now
    (the live process itself; an older time is another process that had the pid before)."""
    here = Owner.current()
    start = process_start_time(pid) if started is None else started
    assert start is not None, f"no process {pid}"
    ticks = start_ticks(pid)
    assert ticks is not None, f"no process {pid}"
    if started is not None:  # another process that had the pid before: an earlier start
        ticks -= 1
    writer = Owner(here.host, pid, start, here.boot_id, here.pid_ns, ticks)
    journal = Journal(str(journal_dir(store)))
    journal.write(Entry(run_id, store.uri, "KILLED", 1_700_000_000_000, {}, writer=writer))


def test_the_replayer_writes_only_what_its_writer_left(store: Store) -> None:
    """Beside the dying program's entry, the journal holds two it must not write: one of a
    process still alive and finalizing (another program's), and a stale one journaled long ago
    by the same pid as the writer (a reused pid). The replayer writes its writer's entry only;
    the others keep their runs RUNNING and their entries for install() and the sweep, which
    check their writers."""
    alive_run = store.client.create_run("0").info.run_id
    reused_run = store.client.create_run("0").info.run_id
    alive = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)  # fmt: skip
    try:
        cmd, env = program(store, "slow-write", install={"deadline": 5.0})

        def plant_both(ready: dict[str, object]) -> None:
            # After install(): its own replay of dead writers' entries (the reused pid's is
            # one: its writer, told apart by its start time, is gone) is not this test's.
            plant(store, alive_run, alive.pid)
            plant(store, reused_run, int(ready["pid"]), 1.0)  # type: ignore[call-overload]

        result = run_child(cmd, env=env, timeout=CHILD_TIMEOUT, after_ready=plant_both)
        assert result.returncode == -signal.SIGTERM, result.stderr
        [run_id] = result.ready["run_ids"]  # type: ignore[misc]
        # The status first: its replayer wrote it, so it shows in /proc until it is done.
        assert wait_ended(store.client, run_id, 30.0)[0] == "KILLED"
        for pid in replayers_of(int(result.ready["pid"])):  # type: ignore[call-overload]
            assert wait_gone(pid, 30.0)
        assert store.status(alive_run) == "RUNNING"
        assert store.status(reused_run) == "RUNNING"
        assert entries(store) == sorted([alive_run, reused_run])
    finally:
        assert alive.stdin is not None
        alive.stdin.close()
        alive.wait(30)


@pytest.mark.timeout(300)
def test_planted_files_neither_stop_nor_fool_the_replayer(store: Store) -> None:
    """A FIFO and a group-readable file planted in the journal under run-id names: the replayer,
    which reads only its writer's entries, by name, neither blocks on the FIFO nor replays
    either, and writes its writer's status. The next reader of the whole journal (the sweep
    here) refuses both, naming each, and replays neither."""
    other = store.client.create_run("0").info.run_id
    directory = journal_dir(store)

    def plant_hostile(ready: dict[str, object]) -> None:
        directory.mkdir(mode=0o700, exist_ok=True)
        os.mkfifo(directory / ("f" * 32 + ".json"), 0o600)
        loose = directory / f"{other}.json"
        loose.write_text(Entry(other, store.uri, "KILLED", 1, {}, pid=1).to_json())
        loose.chmod(0o644)

    cmd, env = program(store, "slow-write", install={"deadline": 5.0})
    result = run_child(cmd, env=env, timeout=CHILD_TIMEOUT, after_ready=plant_hostile)
    assert result.returncode == -signal.SIGTERM, result.stderr
    [run_id] = result.ready["run_ids"]  # type: ignore[misc]
    # The status first: its replayer wrote it, so it shows in /proc until it is done.
    assert wait_ended(store.client, run_id, 30.0)[0] == "KILLED"
    for pid in replayers_of(int(result.ready["pid"])):  # type: ignore[call-overload]
        assert wait_gone(pid, 30.0)
    assert store.status(other) == "RUNNING"
    assert not (directory / "replayer.log").exists()  # nothing to say: it read neither
    swept = lifeguard_cli("sweep", "--tracking-uri", store.uri, env=child_env(store))
    assert "refusing journal file" in swept.stderr, swept.stderr
    assert "FIFO" in swept.stderr and "0644" in swept.stderr
    assert store.status(other) == "RUNNING"


def stat_mode(path: Path) -> int:
    import stat

    return stat.S_IMODE(path.stat().st_mode)


# -- the async flush gets the time that is left --------------------------------------------------


WARNING = re.compile(r"did not flush in time; (\d+) queued metric, param and tag values not sent")


def queued_then_sigterm(
    store: Store, count: int, install: dict[str, object] | None = None
) -> tuple[ChildResult, float, float, str]:
    """A program that queued ``count`` metrics with synchronous=False gets SIGTERM at once.
    Returns (its result, seconds from the signal to its exit, the signal's time, run id)."""
    cmd, child_env_ = program(store, "async", str(count), install=install)
    sent: list[float] = []
    result = run_child(
        cmd, env=child_env_, send=(signal.SIGTERM,), timeout=CHILD_TIMEOUT,
        after_ready=lambda ready: sent.append(time.monotonic()),
    )  # fmt: skip
    exited = time.monotonic() - sent[0]
    [run_id] = result.ready["run_ids"]  # type: ignore[misc]
    return result, exited, sent[0], run_id


def stored(client: MlflowClient, run_id: str) -> int:
    return len(client.get_metric_history(run_id, "async_loss"))


def test_a_thousand_queued_metrics_all_land_before_the_sigterm_death(store: Store) -> None:
    """1,000 metrics queued with synchronous=False, then SIGTERM at the default deadline: all
    1,000 are stored, the run is KILLED and the process dies of SIGTERM. (Before: the flush got
    a tenth of the deadline, 1 s, and 272 of 1,000 were stored.)"""
    result, exited, _, run_id = queued_then_sigterm(store, 1000)
    assert result.returncode == -signal.SIGTERM, result.stderr
    assert store.status(run_id) == "KILLED"
    assert stored(store.client, run_id) == 1000, (exited, result.stderr)
    assert exited < 10.0  # the default deadline
    assert "did not flush" not in result.stderr


@pytest.mark.parametrize("deadline", [10.0, 2.0], ids=["default-deadline", "2s-deadline"])
def test_ten_thousand_queued_metrics_send_what_fits_and_count_the_rest(
    store: Store, deadline: float
) -> None:
    """10,000 queued: the flush sends for as long as the deadline leaves (less what the status
    write keeps), the run is KILLED before the deadline, and what did not fit is counted in the
    warning: exactly the values not sent (the request in flight at the cut, FLUSH_CHUNK values
    at most, may land or not). Whether they fit depends on the machine's speed: at 2 s they did
    not under load and did on a quiet machine. Either way nothing is lost silently (the warning
    itself is tested where nothing can be sent: a dead server, and a store that hangs)."""
    install = {} if deadline == 10.0 else {"deadline": deadline}
    result, exited, _, run_id = queued_then_sigterm(store, 10_000, install=install)
    assert result.returncode == -signal.SIGTERM, result.stderr
    assert store.status(run_id) == "KILLED"
    # The finalizers are done by the deadline; the death follows them (a loaded machine's
    # process teardown, a few hundred ms at most).
    assert exited < deadline + 5.0, exited
    sent = stored(store.client, run_id)
    match = WARNING.search(result.stderr)
    if match is None:
        assert sent == 10_000, result.stderr  # everything fit in the time
    else:
        unsent = int(match.group(1))
        assert 10_000 - FLUSH_CHUNK <= sent + unsent <= 10_000, (sent, unsent)
        assert sent > 0
    assert entries(store) == []


@pytest.mark.timeout(300)
def test_a_dead_server_s_backlog_is_given_up_within_a_second(store: Store, tmp_path: Path) -> None:
    """A backlog queued for a server that is dead when SIGTERM comes: the flush sends nothing,
    is given up within 1 s of no progress, and the process exits in under 2 s, its status
    journaled (and left to its replayer)."""
    srv = MlflowServer(tmp_path / "server").start()
    try:
        cmd, env = program(store, "async", "3000", MLFLOW_TRACKING_URI=srv.uri)
        sent: list[float] = []

        def kill_server(ready: dict[str, object]) -> None:
            srv.stop()
            sent.append(time.monotonic())

        result = run_child(
            cmd, env=env, send=(signal.SIGTERM,), timeout=CHILD_TIMEOUT, after_ready=kill_server
        )
        exited = time.monotonic() - sent[0]
        assert result.returncode == -signal.SIGTERM, result.stderr
        # Given up at the stall, not at the 10 s deadline (a loaded machine adds seconds).
        assert exited < FLUSH_STALL + 5.0, (exited, result.stderr)
        assert WARNING.search(result.stderr), result.stderr
        [run_id] = result.ready["run_ids"]  # type: ignore[misc]
        assert entries(store) == [run_id]
        os.kill(the_replayer(int(result.ready["pid"])), signal.SIGKILL)  # type: ignore[call-overload]
    finally:
        srv.stop()


# -- the other place a process ends: the atexit finalization -----------------------------------


def test_an_exit_with_the_store_locked_by_another_writer_leaves_a_replayer(
    scenario: Scenario, store: Store
) -> None:
    """``sys.exit(3)`` while another process holds the sqlite store's write lock (another job's
    long commit): the status write gives up at the deadline and the status is journaled; the
    process exits 3, as ever. The replayer it leaves writes FAILED, with the exit's time, once
    the other writer lets go, with no later install() or sweep."""
    import sqlite3

    holder = sqlite3.connect(store.path, isolation_level=None, timeout=60)
    locked: list[float] = []

    def lock(ready: dict[str, object]) -> None:
        holder.execute("BEGIN IMMEDIATE")
        locked.append(time.time())

    try:
        env = child_env(store, LIFEGUARD_DEADLINE="2")
        result = scenario.run("--path", "sys.exit(3)", "--wait-stdin", env=env, after_ready=lock)
        assert result.returncode == 3, result.stderr
        [run_id] = result.ready["run_ids"]  # type: ignore[misc]
        replayer = the_replayer(int(result.ready["pid"]))  # type: ignore[call-overload]
        assert store.status(run_id) == "RUNNING"
        assert entries(store) == [run_id]
    finally:
        if holder.in_transaction:
            holder.execute("ROLLBACK")
        holder.close()
    assert wait_gone(replayer, 30.0)
    run = store.run(run_id)
    assert run.info.status == "FAILED"
    assert locked[0] * 1000 - 1 <= run.info.end_time
    assert run.data.tags["lifeguard.exit_code"] == "3"
    assert entries(store) == []
