"""Evidence of life beats identity: the sweep never ends a live run, whatever its owner tags say,
whatever the wall clock or /proc shows (a real `mlflow server`, real programs, real sweeps).

* A step of the wall clock (the sweeper's time and the boot time /proc/stat derives from it,
  40 days either way) does not make a live owner on this host look gone.
* Under ``hidepid=2`` another user's sweep cannot see the owner's process: unknown, not gone.
* Owner tags rewritten on a live run (pid, start ticks): the run's changing heartbeat keeps it.
* A run resumed by a plain-MLflow program after its lifeguard owner ended it is not that owner's.
* ``--stale-after`` shorter than a run's heartbeat: the run's own interval decides, and one line
  says so.

The clock step and hidepid need root (mount namespaces); they skip with one line elsewhere, and
fail under CI=true, where they must run.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from lifeguard import demo
from lifeguard.journal import Entry, Journal
from lifeguard.owner import TAG_PID, TAG_START, Owner
from tests.conftest import CHILD_TIMEOUT, CHILDREN, _base_env, lifeguard_cli
from tests.servers import MlflowServer

TAG_TICKS = "lifeguard.owner.start_ticks"
OWNER_PROGRAM = CHILDREN / "owner_program.py"
SWEEPER = CHILDREN / "sweeper.py"
DAY = 86400
NOBODY = 65534
# Bound on any wait for sweeps to do something, on a loaded machine.
POLL = 300.0


def must_run_here(why: str) -> None:
    """Skip with one line; under CI=true, where these must run, fail instead."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{why} (CI=true: this test must run)")
    pytest.skip(why)


def require_root_namespaces() -> str:
    """unshare(1), after checking that this process may make a private mount namespace and
    mount in it (root)."""
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        must_run_here("needs root and unshare(1) for a private mount namespace")
    assert unshare is not None
    probe = subprocess.run(
        [unshare, "--mount", "--propagation", "private", "mount", "-t", "tmpfs", "t", "/mnt"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    if probe.returncode != 0:
        must_run_here(f"cannot mount in a private mount namespace here: {probe.stderr.strip()}")
    return unshare


class Program:
    """owner_program.py, held at its stdin."""

    def __init__(self, uri: str, *args: str, prefix: Sequence[str] = (), **env: str) -> None:
        # A journal of its own (made 0700 by lifeguard), never the one in the tests' HOME.
        journal = os.path.join(tempfile.mkdtemp(prefix="lifeguard-owner-"), "journal")
        environ = {
            **_base_env(), "MLFLOW_TRACKING_URI": uri, "LIFEGUARD_JOURNAL_DIR": journal, **env
        }  # fmt: skip
        environ.setdefault("LIFEGUARD_HEARTBEAT", "1")
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, str(OWNER_PROGRAM), *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=environ, start_new_session=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith(demo.READY), self.stderr()
        ready = json.loads(line[len(demo.READY) :])
        self.run_ids: list[str] = ready["run_ids"]
        self.run_id = self.run_ids[0]
        self.pid: int = ready["pid"]  # in its own PID namespace, if it has one

    def stderr(self) -> str:
        self.proc.kill()
        self.proc.wait(CHILD_TIMEOUT)
        assert self.proc.stderr is not None
        return self.proc.stderr.read()

    def finish(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        return self.proc.wait(CHILD_TIMEOUT)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):  # the whole session is gone already
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(CHILD_TIMEOUT)


def sweep_json(done: subprocess.CompletedProcess[str]) -> dict[str, dict[str, str]]:
    """run id -> decision, from one `lifeguard sweep --json`."""
    assert done.returncode in (0, 1), done.stderr
    return {d["run_id"]: d for d in json.loads(done.stdout)["decisions"]}


def sweep(uri: str, journal: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return lifeguard_cli(
        "sweep", "--tracking-uri", uri, "--json", "--timeout", "10", "--journal-dir",
        str(journal), *args, timeout=300,
    )  # fmt: skip


def stepped_sweep(
    unshare: str, uri: str, journal: Path, step: float, *args: str
) -> subprocess.CompletedProcess[str]:
    """A sweep on a host whose wall clock was stepped by ``step`` seconds since boot: its
    time.time() and the boot time in /proc/stat (which the kernel derives from the wall clock)
    both moved; the clocks since boot did not."""
    stat = journal.parent / f"stat{step:+.0f}"
    lines = []
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("btime "):
                line = f"btime {int(line.split()[1]) + int(step)}\n"
            lines.append(line)
    stat.write_text("".join(lines))
    script = 'mount --bind "$0" /proc/stat && exec "$@"'
    cmd = [unshare, "--mount", "--propagation", "private", "sh", "-c", script, str(stat),
           sys.executable, str(SWEEPER), "sweep", "--tracking-uri", uri, "--json",
           "--timeout", "10", "--journal-dir", str(journal), *args]  # fmt: skip
    env = {**_base_env(), "SWEEPER_STEP_SECONDS": str(step)}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


@contextlib.contextmanager
def home_of_nobody() -> Iterator[Path]:
    """A directory of the unprivileged user's own (its HOME; its journal below it): the
    sweep trusts only a journal directory that is the user's."""
    home = Path(tempfile.mkdtemp(prefix="lifeguard-nobody-"))
    os.chown(home, NOBODY, NOBODY)
    home.chmod(0o700)
    try:
        yield home
    finally:
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def nobody_home() -> Iterator[Path]:
    with home_of_nobody() as home:
        yield home


def hidden_sweep(
    unshare: str, uri: str, home: Path, *args: str
) -> subprocess.CompletedProcess[str]:
    """A sweep by another user (nobody) on a host whose /proc is mounted ``hidepid=2``: it sees
    no process but its own."""
    script = (
        "mount -t proc -o hidepid=2 proc /proc && "
        f'exec setpriv --reuid {NOBODY} --regid {NOBODY} --clear-groups -- "$@"'
    )
    cmd = [unshare, "--mount", "--propagation", "private", "sh", "-c", script, "sh",
           sys.executable, "-m", "lifeguard", "sweep", "--tracking-uri", uri, "--json",
           "--timeout", "10", "--journal-dir", str(home / "journal"), *args]  # fmt: skip
    env = {**_base_env(), "HOME": str(home), "MLFLOW_DISABLE_TELEMETRY": "true"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def require_hidepid(unshare: str, home: Path) -> None:
    """That the unprivileged user can run this interpreter, and sees only its own processes
    under the new /proc."""
    script = (
        "mount -t proc -o hidepid=2 proc /proc && "
        f'exec setpriv --reuid {NOBODY} --regid {NOBODY} --clear-groups -- "$@"'
    )
    probe = subprocess.run(
        [unshare, "--mount", "--propagation", "private", "sh", "-c", script, "sh",
         sys.executable, "-c", "import os, lifeguard, mlflow; print(os.path.exists('/proc/1'))"],
        env={**_base_env(), "HOME": str(home)}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if probe.returncode != 0 or probe.stdout.strip() != "False":
        must_run_here(f"cannot sweep as another user under hidepid=2 here: {probe.stderr[-300:]}")
    with open("/proc/self/mountinfo") as f:  # the host's own /proc is untouched
        assert "hidepid" not in next(line for line in f if " /proc " in line)


def status(client: MlflowClient, run_id: str) -> str:
    return str(client.get_run(run_id).info.status)


# -- 1. a wall-clock step ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_wall_clock_step_does_not_make_a_live_owner_look_gone(
    mlflow_server: MlflowServer, tmp_path: Path
) -> None:
    """40 days forward, 40 days back, and an NTP correction of 5 s: the live program on this
    host is alive to every sweep, and so is the writer of a journal entry still in its hands."""
    unshare = require_root_namespaces()
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    program = Program(mlflow_server.uri)
    journal = tmp_path / "journal"
    try:
        # A status the live program journaled and has not written yet (it is finalizing, say):
        # its writer is alive, so no replay may write it for it.
        pending = client.create_run("0").info.run_id
        writer = Owner.of_pid(program.proc.pid)
        assert writer is not None
        Journal(str(journal)).write(
            Entry(pending, mlflow_server.uri, "KILLED", 1_000, {}, writer=writer)
        )
        for step in (40 * DAY, -40 * DAY, 5):
            done = stepped_sweep(unshare, mlflow_server.uri, journal, step)
            decision = sweep_json(done)[program.run_id]
            assert decision["verdict"] == "alive", (step, decision)
            assert "is alive on this host" in decision["reason"], (step, decision)
            assert json.loads(done.stdout)["journal"].get("waiting") == 1, done.stdout
            assert status(client, program.run_id) == status(client, pending) == "RUNNING"
    finally:
        assert program.finish() == 0
    assert status(client, program.run_id) == "FINISHED"


# -- 2. hidepid -------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_owner_hidden_by_hidepid_is_unknown_never_gone(
    mlflow_server: MlflowServer, nobody_home: Path
) -> None:
    """Another user's sweep under hidepid=2 cannot see the live owner: it judges the run by its
    heartbeat, which keeps it alive; once the owner is killed, by the same heartbeat's silence."""
    unshare = require_root_namespaces()
    require_hidepid(unshare, nobody_home)
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    program = Program(mlflow_server.uri)
    looks = 0
    started = time.monotonic()
    try:
        # Past the 10 s after which an owner proven gone could end its run. The heartbeat is
        # all that keeps it: --stale-after 10s, ten of its beats, so that a beat late on a
        # loaded machine is not a silence.
        while looks < 3 or time.monotonic() - started < 12:
            decision = sweep_json(hidden_sweep(unshare, mlflow_server.uri, nobody_home,
                                               "--stale-after", "10s"))[program.run_id]  # fmt: skip
            looks += 1
            assert decision["verdict"] in ("alive", "watch"), decision
            assert "gone" not in decision["reason"], decision
            assert status(client, program.run_id) == "RUNNING"
    finally:
        program.kill()
    deadline = time.monotonic() + POLL
    while status(client, program.run_id) == "RUNNING":
        assert time.monotonic() < deadline, "the dead owner's run was never ended"
        hidden_sweep(unshare, mlflow_server.uri, nobody_home, "--stale-after", "10s")
    # Gone is provable under hidepid (kill(pid, 0): no such process), hidden is not.
    reason = client.get_run(program.run_id).data.tags["lifeguard.reason"]
    assert "unchanged" in reason, reason


# -- 3. wrong owner tags ----------------------------------------------------------------------


def dead_pid() -> int:
    """The pid of a process of this host that has ended."""
    gone = subprocess.Popen(["true"])
    gone.wait(CHILD_TIMEOUT)
    return gone.pid


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("forged", [TAG_PID, TAG_TICKS, TAG_START])
def test_owner_tags_rewritten_on_a_live_run_do_not_end_it(
    mlflow_server: MlflowServer, tmp_path: Path, forged: str
) -> None:
    """A script rewrites the owner pid (to a process that is gone), the start ticks or the start
    time of a live run: the run keeps changing (its heartbeat), so it is alive. Once its
    program is killed, the wrong tags still end it no sooner than its silence allows."""
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    program = Program(mlflow_server.uri)
    value = {TAG_PID: str(dead_pid()), TAG_TICKS: "1", TAG_START: "1000000000.00"}[forged]
    client.set_tag(program.run_id, forged, value)
    journal = tmp_path / "journal"
    started = time.monotonic()
    verdicts: list[dict[str, str]] = []
    try:
        # Ten seconds of patience: a 1 s heartbeat on a loaded 2-core machine can be late by a
        # few seconds; the tags forged here must not shorten that below PROOF_FLOOR.
        while len(verdicts) < 3 or time.monotonic() - started < 12:
            decision = sweep_json(sweep(mlflow_server.uri, journal, "--stale-after", "10s"))[
                program.run_id
            ]
            verdicts.append(decision)
            # Between two beats a look may find the run unchanged ("watch"); never more.
            assert decision["verdict"] in ("alive", "watch"), decision
            assert status(client, program.run_id) == "RUNNING"
    finally:
        program.kill()
    # Seen alive after the first look (which always is): by its beats, whatever the forged tag says.
    assert [d for d in verdicts[1:] if d["verdict"] == "alive"], verdicts
    killed = time.monotonic()
    deadline = killed + POLL
    while status(client, program.run_id) == "RUNNING":
        assert time.monotonic() < deadline, "the dead owner's run was never ended"
        sweep(mlflow_server.uri, journal, "--stale-after", "10s")
    assert client.get_run(program.run_id).data.tags["lifeguard.ended_by"] == "sweep"


# -- 4. a resume by plain MLflow --------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_resumed_by_a_plain_mlflow_program_is_left_to_it(
    mlflow_server: MlflowServer, tmp_path: Path
) -> None:
    """train.py (lifeguard) ends its run FINISHED; evaluate.py (plain MLflow) resumes it and
    logs. The owner tags still name train.py, which is gone: the run is evaluate.py's now, and
    the sweep leaves it alone; evaluate.py ends it FINISHED, with no word of a sweep."""
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    train = Program(mlflow_server.uri)
    assert train.finish() == 0
    assert status(client, train.run_id) == "FINISHED"
    evaluate = Program(mlflow_server.uri, "--plain", "--resume", train.run_id, "--metric")
    journal = tmp_path / "journal"
    started = time.monotonic()
    looks = 0
    try:
        while looks < 3 or time.monotonic() - started < 12:
            decision = sweep_json(sweep(mlflow_server.uri, journal, "--stale-after", "3s"))[
                train.run_id
            ]
            looks += 1
            assert decision["verdict"] == "skip", decision
            assert "without lifeguard" in decision["reason"], decision
            assert status(client, train.run_id) == "RUNNING"
    finally:
        assert evaluate.finish() == 0
    run = client.get_run(train.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags.get("lifeguard.ended_by") != "sweep"
    assert "swept" not in run.data.tags.get("lifeguard.reason", "")


# -- 5. --stale-after shorter than the heartbeat ----------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_stale_after_shorter_than_the_heartbeat_waits_for_the_runs_own_beats(
    mlflow_server: MlflowServer, tmp_path: Path
) -> None:
    """A run on another node beats every 60 s; `--stale-after 1s`, twice, seconds apart, does
    not end it, and says in one line why it holds back."""
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        must_run_here("needs root and unshare(1) for a UTS namespace (a node of its own)")
    assert unshare is not None
    # Another node: its own hostname (and PID namespace), so nothing here can see its process.
    node = [unshare, "--uts", "--pid", "--fork", "--mount-proc", "--kill-child", "sh", "-c",
            'hostname other-node && exec "$@"', "sh"]  # fmt: skip
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    program = Program(mlflow_server.uri, prefix=node, LIFEGUARD_HEARTBEAT="60")
    tags = client.get_run(program.run_id).data.tags
    assert tags["lifeguard.owner.host"] == "other-node"
    assert tags["lifeguard.heartbeat.interval"] == "60"
    journal = tmp_path / "journal"
    try:
        first = sweep(mlflow_server.uri, journal, "--stale-after", "1s")
        started = time.monotonic()
        while True:  # a second sweep at least 3 s after the first: both within one beat
            again = sweep(mlflow_server.uri, journal, "--stale-after", "1s")
            if time.monotonic() - started >= 3:
                break
        for done in (first, again):
            assert sweep_json(done)[program.run_id]["verdict"] != "end"
        assert status(client, program.run_id) == "RUNNING"
        notes = [line for line in again.stderr.splitlines() if "not --stale-after" in line]
        assert len(notes) == 1, again.stderr
        assert "3 of its own heartbeat intervals" in notes[0], notes
    finally:
        program.kill()


# -- a heartbeat that does not stall ----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_watchdog_beats_while_the_program_holds_the_gil(mlflow_server: MlflowServer) -> None:
    """The main thread holds the GIL in one long C call: the heartbeat thread cannot run, and a
    sweep would see the run fall silent. Its watchdog beats for it meanwhile."""
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    program = Program(mlflow_server.uri, "--watchdog", "--hold-gil", "20")
    assert program.proc.stdout is not None
    try:
        holding = program.proc.stdout.readline()
        assert holding.startswith("HOLDING "), program.stderr()
        held_at = int(holding.split()[1])
        # Polled on the server (no sleeping program to wait for): the tag moves while held.
        deadline = time.monotonic() + 60
        while True:
            beat = int(client.get_run(program.run_id).data.tags["lifeguard.heartbeat"])
            if beat > held_at:
                break
            assert time.monotonic() < deadline, "no beat while the program held the GIL"
            time.sleep(0.2)  # a poll of the server's state, not a synchronisation
        released = program.proc.stdout.readline()
        assert released.startswith("RELEASED "), program.stderr()
        # Well before the release: a beat of the program's own thread, once it runs again, is
        # stamped about when the GIL is let go (maybe just before the release's own stamp).
        assert held_at < beat < int(released.split()[1]) - 5000
    finally:
        program.kill()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_watchdog_never_beats_for_a_run_past_its_end(mlflow_server: MlflowServer) -> None:
    """SIGTERM, and the program's own finalizer then takes 4 s before the runs are ended: its
    heartbeat stopped at the signal, but the watchdog must not take that silence for a stall
    and beat for it (1.5 intervals on). A beat then would say the run lived past the end time
    it is given, the time of the signal."""
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    program = Program(mlflow_server.uri, "--watchdog", "--slow-ending", "4")
    try:
        first = client.get_run(program.run_id).data.tags["lifeguard.heartbeat"]
        # A beat of the heartbeat thread's, which is told to the watchdog with the run's id.
        deadline = time.monotonic() + 60
        while client.get_run(program.run_id).data.tags["lifeguard.heartbeat"] == first:
            assert time.monotonic() < deadline, "no beat of the program's own"
            time.sleep(0.2)  # a poll of the server's state, not a synchronisation
        program.proc.send_signal(signal.SIGTERM)
        assert program.proc.wait(CHILD_TIMEOUT) == -signal.SIGTERM, program.stderr()
        run = client.get_run(program.run_id)
        assert run.info.status == "KILLED"
        assert int(run.data.tags["lifeguard.heartbeat"]) <= run.info.end_time
    finally:
        program.kill()


# -- the sweep as a service -------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sweep_every_ends_a_lost_run_and_stops_cleanly(
    mlflow_server: MlflowServer, tmp_path: Path
) -> None:
    """`lifeguard sweep --every 1s`: one process, one JSON document per sweep; a program killed
    with no guardian has its run ended while a live one's never is; SIGTERM between sweeps
    stops it with exit status 0."""
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    live, lost = Program(mlflow_server.uri), Program(mlflow_server.uri)
    lost.kill()
    service = subprocess.Popen(
        [sys.executable, "-m", "lifeguard", "sweep", "--tracking-uri", mlflow_server.uri,
         "--every", "1s", "--stale-after", "3s", "--json", "--journal-dir",
         str(tmp_path / "journal")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_base_env(),
    )  # fmt: skip
    assert service.stdout is not None
    try:
        sweeps = 0
        deadline = time.monotonic() + POLL
        while True:
            line = service.stdout.readline()  # one sweep's report
            assert line, service.stderr.read() if service.stderr else ""
            decisions = {d["run_id"]: d for d in json.loads(line)["decisions"]}
            sweeps += 1
            assert decisions[live.run_id]["verdict"] == "alive", decisions[live.run_id]
            if status(client, lost.run_id) == "KILLED":
                break
            assert time.monotonic() < deadline, decisions.get(lost.run_id)
        assert sweeps >= 2  # the first look never ends a run
        assert status(client, live.run_id) == "RUNNING"
        service.send_signal(signal.SIGTERM)
        assert service.wait(CHILD_TIMEOUT) in (0, -signal.SIGTERM)
    finally:
        if service.poll() is None:
            service.kill()
            service.wait(CHILD_TIMEOUT)
        assert live.finish() == 0
    assert status(client, live.run_id) == "FINISHED"
    assert client.get_run(lost.run_id).data.tags["lifeguard.ended_by"] == "sweep"


# -- a sweep in a time namespace ---------------------------------------------------------------


def in_a_time_namespace(code: str) -> str:
    """``code``'s output, run by a sweeper's Python in a time namespace whose boot time is a day
    ahead (``unshare --time --boottime 86400``)."""
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        must_run_here("needs root and unshare(1) for a time namespace")
    assert unshare is not None
    done = subprocess.run(
        [unshare, "--time", "--boottime", "86400", sys.executable, "-c", code],
        capture_output=True, text=True, timeout=CHILD_TIMEOUT, check=False,
    )  # fmt: skip
    if done.returncode != 0 and "unshare" in done.stderr:
        must_run_here(f"cannot make a time namespace here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_sweep_in_a_time_namespace_sees_a_live_owner_alive() -> None:
    """The kernel shows start ticks shifted by the reader's boot-time offset: read from a time
    namespace, every live owner started "at another tick", proven gone (helper-14's attack
    ended a live run that way within seconds)."""
    from lifeguard.owner import Owner

    with subprocess.Popen(["cat"], stdin=subprocess.PIPE) as live:
        owner = Owner.of_pid(live.pid)
        assert owner is not None and owner.start_ticks is not None
        code = (
            "from lifeguard.owner import Owner, pid_liveness\n"
            f"print(pid_liveness({live.pid}, {owner.start_ticks}),"
            f" Owner.of_pid({live.pid}).start_ticks)"
        )
        assert in_a_time_namespace(code).split() == ["True", str(owner.start_ticks)]
        live.stdin.close()  # type: ignore[union-attr]


def test_a_sweep_in_a_time_namespace_ages_nothing(tmp_path: Path) -> None:
    """A run first seen by a sweep outside, seen again by one in a time namespace a day ahead:
    unchanged for the seconds between them, not for a day (CLOCK_BOOTTIME differs by the
    offset; the wall clock is the one both share)."""
    from lifeguard.sweep import RunFacts, Sightings

    directory = tmp_path / "state"
    directory.mkdir(mode=0o700)
    facts = RunFacts("r" * 32, "0", 1_000, {"lifeguard.heartbeat": "5"})
    first = Sightings(str(directory), "http://server").load()
    first.finished_reading()
    assert first.quiet_for(facts) == 0.0
    first.save(["0"])
    code = (
        "from lifeguard.sweep import RunFacts, Sightings\n"
        f"s = Sightings({str(directory)!r}, 'http://server').load()\n"
        "s.finished_reading()\n"
        f"print(s.quiet_for(RunFacts({'r' * 32!r}, '0', 1_000, {{'lifeguard.heartbeat': '5'}})))"
    )
    quiet = float(in_a_time_namespace(code))
    assert 0.0 <= quiet < 3600, quiet
