"""Containers and shared hosts: the guardians, the journal and the sweep in PID namespaces of
their own (``unshare --pid --fork --mount-proc``), with the host's hostname.

* Two namespaces, trainers with the same pid started in the same instant: a watchdog (or
  ``lifeguard run``) ends only its own trainer's run; the neighbour's live run stays RUNNING
  and later ends with its own status.
* A trainer that is PID 1 of its namespace, with ``install(watchdog=True)``, SIGKILLed: its
  run is KILLED (PID 1 stays behind as the watchdog; guardian/init.py).
* A whole namespace killed at once: the sweep ends its run at the last heartbeat and touches no
  live run of another namespace.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from lifeguard import demo
from lifeguard.owner import Owner
from tests.conftest import CHILD_TIMEOUT, CHILDREN, Store, child_env, shows_lifeguard, wait_gone
from tests.namespaces import NS, host_pid, namespace_init, require_unshare
from tests.servers import MlflowServer
from tests.test_sweep_trust import STALE, Sweeps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROGRAM = str(CHILDREN / "program.py")
NS_INIT = str(CHILDREN / "ns_init.py")


class InNamespace:
    """A command in a PID namespace of its own, driven like run_child: its ready line (and
    each later line) read with a timeout, its stderr kept; ``init`` is the host pid of the
    namespace's init."""

    def __init__(self, unshare: str, cmd: Sequence[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [unshare, *NS, *cmd],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr_text: list[str] = []
        threading.Thread(target=self._read_stdout, daemon=True).start()
        self._stderr_reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._stderr_reader.start()
        self.init = self._init()

    def _init(self) -> int:
        deadline = time.monotonic() + CHILD_TIMEOUT
        while True:  # unshare forks the init right away; bounded all the same
            try:
                return namespace_init(self.proc.pid)
            except (OSError, IndexError):
                assert time.monotonic() < deadline, "unshare started no namespace"
                assert self.proc.poll() is None, self.stderr()
                time.sleep(0.01)

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        self.stderr_text.append(self.proc.stderr.read())

    def wait_for_go(self) -> None:
        """Until the init (tests/children/ns_init.py) waits for its "go" line; its line is
        consumed, so that what the command prints is all that is left."""
        line = self.lines.get(timeout=CHILD_TIMEOUT)
        assert line == "ns-init waiting for go\n", f"{line!r}: {self.stderr()}"

    def go(self) -> None:
        self.wait_for_go()
        self.send("go\n")

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text)
        self.proc.stdin.flush()

    def close_stdin(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()

    def ready(self) -> dict[str, object]:
        deadline = time.monotonic() + CHILD_TIMEOUT
        while True:
            line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, f"no ready line: {self.stderr()}"
            if line.startswith(demo.READY):
                info: dict[str, object] = json.loads(line[len(demo.READY) :])
                return info

    def output(self) -> str:
        """Everything printed after the ready line (or all of it, without one), once the
        command has ended."""
        lines = []
        while (line := self.lines.get(timeout=CHILD_TIMEOUT)) is not None:
            lines.append(line)
        return "".join(lines)

    def host_pid(self, pid: object) -> int:
        assert isinstance(pid, int)
        return host_pid(self.init, pid)

    def wait(self) -> int:
        return self.proc.wait(CHILD_TIMEOUT)

    def stderr(self) -> str:
        if self.proc.poll() is None:
            return "(still running)"
        self._stderr_reader.join(CHILD_TIMEOUT)  # EOF once every process holding it is gone
        return "".join(self.stderr_text)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(CHILD_TIMEOUT)


@pytest.fixture
def unshare() -> str:
    return require_unshare()


@pytest.fixture
def namespaces() -> Iterator[list[InNamespace]]:
    started: list[InNamespace] = []
    yield started
    for ns in started:
        ns.kill()


def owner_of(client: MlflowClient, run_id: str) -> Owner:
    owner = Owner.from_tags(dict(client.get_run(run_id).data.tags))
    assert owner is not None
    return owner


# -- 1. a guardian never ends a neighbour's run --------------------------------------------------


@pytest.mark.parametrize("guardian", ["watchdog", "supervisor"])
def test_a_guardian_ends_its_own_trainers_run_and_never_a_neighbours(
    unshare: str, store: Store, tmp_path: Path, namespaces: list[InNamespace], guardian: str
) -> None:
    """Two containers sharing the host's hostname and one tracking store, each with a trainer
    that is pid 2 (watchdog) or pid 3 (under `lifeguard run`, pid 2) of its own PID namespace,
    started in the same instant. A's trainer is SIGKILLed: A's guardian ends A's run KILLED;
    B's live run stays RUNNING, and ends FINISHED when B's trainer returns. The guardians used
    to match runs by host, pid and start second only, and ended B's run too (4 in 4); B's own
    write was then refused by "never overwrite", and B's run stayed wrong for good."""
    program = [sys.executable, PROGRAM, "--path", "SIGTERM", "--order", "after"]
    if guardian == "watchdog":
        cmd = [*program, "--watchdog"]
    else:
        cmd = [sys.executable, "-m", "lifeguard", "run", "--", *program]
    env = child_env(store)
    for _ in range(2):
        namespaces.append(InNamespace(unshare, [sys.executable, NS_INIT, "--", *cmd], env))
    a, b = namespaces
    for ns in (a, b):
        ns.wait_for_go()
    for ns in (a, b):
        ns.send("go\n")  # both trainers start now
    ready_a, ready_b = a.ready(), b.ready()
    [run_a], [run_b] = ready_a["run_ids"], ready_b["run_ids"]  # type: ignore[misc]
    client = store.client
    owner_a, owner_b = owner_of(client, run_a), owner_of(client, run_b)
    # The collision the guardians must tell apart: one hostname and boot, the same pid and
    # start second; only the PID namespace differs.
    assert (owner_a.host, owner_a.boot_id, owner_a.pid) == (
        owner_b.host,
        owner_b.boot_id,
        owner_b.pid,
    )
    assert ready_a["pid"] == ready_b["pid"] == owner_a.pid
    assert abs(owner_a.start_time - owner_b.start_time) <= 1.0, "not started in the same second"
    assert owner_a.pid_ns != owner_b.pid_ns

    trainer_a = a.host_pid(ready_a["pid"])
    guardian_a = a.host_pid(ready_a["watchdog"]) if guardian == "watchdog" else None
    died = int(time.time() * 1000)
    os.kill(trainer_a, signal.SIGKILL)
    assert a.wait() == 128 + signal.SIGKILL, a.stderr()  # ns_init waits for the guardian too
    if guardian_a is not None:
        wait_gone(guardian_a)  # the watchdog has done its work
    run = client.get_run(run_a)
    assert run.info.status == "KILLED", a.stderr()
    assert run.data.tags["lifeguard.ended_by"] == guardian
    assert run.info.start_time <= run.info.end_time <= int(time.time() * 1000)
    assert run.info.end_time >= died - 1000
    assert client.get_run(run_b).info.status == "RUNNING", "a guardian ended its neighbour's run"

    b.close_stdin()  # B's trainer returns from main: its own, true ending
    assert b.wait() == 0, b.stderr()
    run = client.get_run(run_b)
    assert run.info.status == "FINISHED"
    # A clean return from main is known inside: the program ends its own run, under `lifeguard
    # run` too (the supervisor then has nothing to do, and imports nothing).
    assert run.data.tags["lifeguard.ended_by"] == "process"


# -- 3. PID 1 -------------------------------------------------------------------------------------

# The time docs/containers.md promises from a PID-1 trainer's SIGKILL to its run KILLED, on a
# sqlite store (the guardian imports mlflow: ~1.5 s of CPU) on a loaded 2-core machine.
PID1_KILLED_WITHIN = 20.0


@pytest.mark.parametrize("order", ["before", "after"])
def test_a_pid1_trainer_with_a_watchdog_is_ended_after_a_sigkill(
    unshare: str, store: Store, namespaces: list[InNamespace], order: str
) -> None:
    """`python train.py` as a container's entrypoint (PID 1) with install(watchdog=True). A
    sidecar would be killed by the kernel with PID 1; the run stayed RUNNING. Now PID 1 stays
    behind as the watchdog and the trainer goes on as its child: SIGKILLed (the OOM killer),
    its run reads KILLED, ended by the watchdog, at the moment of death; the namespace's exit
    status is the trainer's, 128 + 9 as PID 1 reports a death by signal."""
    cmd = [sys.executable, PROGRAM, "--path", "SIGKILL", "--watchdog", "--order", order]
    ns = InNamespace(unshare, cmd, child_env(store))
    namespaces.append(ns)
    ready = ns.ready()
    [run_id] = ready["run_ids"]  # type: ignore[misc]
    trainer = ns.host_pid(ready["pid"])
    died = time.monotonic()
    died_ms = int(time.time() * 1000)
    os.kill(trainer, signal.SIGKILL)
    returncode = ns.wait()
    took = time.monotonic() - died
    run = store.run(run_id)
    assert run.info.status == "KILLED", ns.stderr()
    assert returncode == 128 + signal.SIGKILL, ns.stderr()
    assert run.data.tags["lifeguard.ended_by"] == "watchdog"
    assert run.data.tags["lifeguard.signal"] == "SIGKILL"
    assert died_ms - 1000 <= run.info.end_time <= died_ms + 1000
    assert took < PID1_KILLED_WITHIN, f"{took:.1f}s from the SIGKILL to KILLED"
    assert ns.stderr() == "", ns.stderr()  # the guardian said nothing: nothing went wrong
    # How: PID 1 stayed behind as the watchdog; the trainer ran as its child.
    assert ready["watchdog"] == 1 and ready["pid"] != 1, ready


def test_a_pid1_entrypoint_that_execs_its_trainer_keeps_its_watchdog(
    unshare: str, store: Store, namespaces: list[InNamespace]
) -> None:
    """The entrypoint installs lifeguard with its watchdog (PID 1 stays behind as the guardian)
    and then execs the trainer, which installs it again. The trainer, SIGKILLed, has its run
    ended KILLED by PID 1, and the namespace exits 128 + 9: the guardian kept guarding across
    the exec. (Its channel used to close with the exec; the trainer's own install() then
    started a sidecar, which died with PID 1, and the run stayed RUNNING.)"""
    entrypoint = str(CHILDREN / "exec_entrypoint.py")
    cmd = [sys.executable, entrypoint, PROGRAM, "--path", "SIGKILL", "--watchdog"]
    ns = InNamespace(unshare, cmd, child_env(store))
    namespaces.append(ns)
    ready = ns.ready()
    [run_id] = ready["run_ids"]  # type: ignore[misc]
    assert ready["pid"] != 1, ready  # the trainer runs as PID 1's child, exec'd in place
    trainer = ns.host_pid(ready["pid"])
    died_ms = int(time.time() * 1000)
    os.kill(trainer, signal.SIGKILL)
    assert ns.wait() == 128 + signal.SIGKILL, ns.stderr()
    run = store.run(run_id)
    assert run.info.status == "KILLED", ns.stderr()
    assert run.data.tags["lifeguard.ended_by"] == "watchdog"
    assert died_ms - 1000 <= run.info.end_time <= died_ms + 1000
    # One guardian, PID 1: the trainer's install() started no sidecar of its own.
    assert ready["watchdog"] == 1, ready


@pytest.mark.parametrize(
    ("path", "status", "code"),
    [
        ("SIGTERM", "KILLED", 128 + signal.SIGTERM),
        ("sys.exit(3)", "FAILED", 3),
        ("return", "FINISHED", 0),
    ],
)
def test_a_pid1_trainer_under_its_watchdog_ends_as_it_would_as_pid1(
    unshare: str, store: Store, namespaces: list[InNamespace], path: str, status: str, code: int
) -> None:
    """What the program and the container's runtime see stays as with the program as PID 1:
    the exit status (143 for SIGTERM sent to PID 1, as `docker stop` does: PID 1 cannot die of
    a signal, and the trainer as PID 1 already exited 143 after lifeguard's finalization), its
    stdout, and the run's status, written by the program itself."""
    cmd = [sys.executable, PROGRAM, "--path", path, "--watchdog", "--order", "after"]
    ns = InNamespace(unshare, cmd, child_env(store))
    namespaces.append(ns)
    ready = ns.ready()
    [run_id] = ready["run_ids"]  # type: ignore[misc]
    if path == "SIGTERM":
        os.kill(ns.init, signal.SIGTERM)  # to PID 1, as `docker stop` and the kubelet do
    assert ns.wait() == code, ns.stderr()
    run = store.run(run_id)
    assert run.info.status == status
    assert run.data.tags["lifeguard.ended_by"] == "process"
    assert not shows_lifeguard(ns.stderr()), ns.stderr()


# -- 4. a whole container killed at once --------------------------------------------------------


@pytest.fixture
def server(tmp_path: Path) -> Iterator[MlflowServer]:
    srv = MlflowServer(tmp_path / "server").start()
    yield srv
    srv.stop()


@pytest.mark.timeout(900)
def test_a_whole_namespace_killed_at_once_is_swept_by_its_heartbeat(
    unshare: str,
    server: MlflowServer,
    store: Store,
    tmp_path: Path,
    namespaces: list[InNamespace],
) -> None:
    """The end of a Kubernetes grace period, or `memory.oom.group`: every process of the
    container is SIGKILLed at once, its watchdog too, so nothing in it is left to say anything.
    `lifeguard sweep` (a CronJob, here from the host, with a `--stale-after` of ten heartbeats)
    ends the run KILLED at its last sign of life (heartbeat or metric); the trainer of another
    namespace, same hostname and same pid, keeps its live run through every sweep, and ends it
    itself."""
    cmd = [sys.executable, PROGRAM, "--path", "SIGTERM", "--order", "after", "--watchdog"]
    env = child_env(store, MLFLOW_TRACKING_URI=server.uri, LIFEGUARD_HEARTBEAT="1")
    for _ in range(2):
        namespaces.append(InNamespace(unshare, [sys.executable, NS_INIT, "--", *cmd], env))
    a, b = namespaces
    for ns in (a, b):
        ns.wait_for_go()
    for ns in (a, b):
        ns.send("go\n")
    ready_a, ready_b = a.ready(), b.ready()
    [run_a], [run_b] = ready_a["run_ids"], ready_b["run_ids"]  # type: ignore[misc]
    client = MlflowClient(tracking_uri=server.uri)
    assert owner_of(client, run_a).pid == owner_of(client, run_b).pid

    sweeps = Sweeps(server.uri, tmp_path / "journal")
    sweeps.once()  # the first sighting of both
    os.kill(a.init, signal.SIGKILL)  # the kernel takes every process of A's namespace with it
    a.wait()
    killed = time.monotonic()
    before = client.get_run(run_a)
    # The run's last sign of life: its latest heartbeat, or a metric logged after it. The first
    # beat rides along with the run's creation, the program logs a metric next, and SIGKILL may
    # come before the second beat.
    last_sign = max(
        int(before.data.tags["lifeguard.heartbeat"]),
        before.info.start_time,
        *(m.timestamp for m in client.get_metric_history(run_a, "loss")),
    )
    deadline = killed + 600
    while client.get_run(run_a).info.status == "RUNNING":
        assert time.monotonic() < deadline, "A's run was never swept"
        reasons = sweeps.once()
        assert client.get_run(run_b).info.status == "RUNNING", reasons[run_b]
        assert "lost" not in reasons[run_b]
    run = client.get_run(run_a)
    assert run.info.status == "KILLED"
    assert run.info.end_time == last_sign  # the last sign of life, not the sweep's time
    assert run.data.tags["lifeguard.ended_by"] == "sweep"
    assert "another PID namespace" in run.data.tags["lifeguard.reason"]
    # Ended by the first sweep that started --stale-after past the last one that saw a beat.
    after = [entry for entry in sweeps.log if entry[0] >= killed]
    assert after and sweeps.log[-1][0] <= after[0][1] + STALE + sweeps_apart(sweeps)

    b.close_stdin()
    assert b.wait() == 0, b.stderr()
    run = client.get_run(run_b)
    assert run.info.status == "FINISHED" and run.data.tags["lifeguard.ended_by"] == "process"


def sweeps_apart(sweeps: Sweeps) -> float:
    """The longest a sweep took: the slack between "stale" and "the next sweep started"."""
    return max(end - start for start, end, _ in sweeps.log)


REFUSED = """
import os, sys, threading
stop = threading.Event()
threading.Thread(target=stop.wait, daemon=True).start()  # a thread of the program's own
import lifeguard
lifeguard.install(watchdog=True)
from lifeguard import demo
demo.announce(pid=os.getpid(), watchdog=lifeguard.watchdog_pid())
sys.stdin.readline()
sys.exit(4)
"""


def test_pid1_refuses_to_fork_a_program_with_threads_in_one_line(
    unshare: str, store: Store, namespaces: list[InNamespace]
) -> None:
    """A fork keeps only the calling thread: with a thread of the program's already running,
    PID 1 does not fork. One line says so and names `lifeguard run`; the program carries on
    as PID 1, unharmed, with its in-process hooks, and exits as it would."""
    ns = InNamespace(unshare, [sys.executable, "-c", REFUSED], child_env(store))
    namespaces.append(ns)
    ready = ns.ready()
    assert ready == {"pid": 1, "watchdog": None}
    ns.close_stdin()
    assert ns.wait() == 4
    [line] = [line for line in ns.stderr().splitlines() if line.strip()]
    assert "`lifeguard run`" in line and "2 Python threads" in line and "PID 1" in line


def test_pid1_drops_a_signal_the_program_does_not_catch_as_the_kernel_would(
    unshare: str, store: Store, namespaces: list[InNamespace]
) -> None:
    """SIGUSR1 at its default action: the kernel drops it for a PID-1 program, so the PID-1
    watchdog does not pass it on either (it would have killed the program)."""
    cmd = [sys.executable, PROGRAM, "--path", "SIGTERM", "--watchdog", "--order", "after"]
    ns = InNamespace(unshare, cmd, child_env(store))
    namespaces.append(ns)
    ready = ns.ready()
    [run_id] = ready["run_ids"]  # type: ignore[misc]
    trainer = ns.host_pid(ready["pid"])
    os.kill(ns.init, signal.SIGUSR1)
    os.kill(ns.init, signal.SIGWINCH)  # and one it ignores
    ns.close_stdin()  # then main returns
    assert ns.wait() == 0, ns.stderr()
    assert store.status(run_id) == "FINISHED"
    assert trainer != ns.init
