"""Deaths no in-process hook can see, ended by the guardian: the watchdog sidecar."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lifeguard import demo
from lifeguard.demo import proc_stat
from tests.conftest import (
    CHILD_TIMEOUT,
    SEEN_APART_MS,
    Scenario,
    Store,
    _base_env,
    child_env,
    wait_gone,
)
from tests.servers import FaultProxy, MlflowServer

pytestmark = pytest.mark.slow

# path -> (status the guardian must write, exit status as subprocess reports it)
DEATHS = {
    "SIGKILL": ("KILLED", -signal.SIGKILL),
    "self-SIGKILL": ("KILLED", -signal.SIGKILL),
    "os._exit(0)": ("FINISHED", 0),
    "os._exit(5)": ("FAILED", 5),
    "segfault": ("FAILED", -signal.SIGSEGV),
    "blocked in C": ("KILLED", -signal.SIGTERM),
}
# Ended in-process after all: a helper thread finalizes for the stuck main thread.
IN_PROCESS = {"blocked in C"}


def test_deaths_cover_the_demo() -> None:
    assert set(DEATHS) == set(demo.DEATHS)


@pytest.mark.parametrize("path", list(DEATHS))
def test_watchdog_ends_the_run(scenario: Scenario, store: Store, path: str) -> None:
    status, returncode = DEATHS[path]
    sig = demo.DEATHS[path][1]
    result = scenario.run("--path", path, "--watchdog", send=() if sig is None else (sig,))
    died = int(time.time() * 1000)
    assert result.returncode == returncode, result.stderr
    wait_gone(result.ready["watchdog"])

    [run_id] = result.ready["run_ids"]
    run = store.run(run_id)
    assert run.info.status == status
    # The end time is the moment of death, not when the watchdog got round to writing it (an
    # import of mlflow and a write later: seconds). The watchdog and this test see the death
    # each on its own; on a loaded machine the watchdog may be scheduled a moment after the
    # test took ``died`` (seen once in a run of the suite beside CI's), hence the slack.
    assert run.info.end_time is not None
    assert run.info.start_time <= run.info.end_time <= died + SEEN_APART_MS
    if path in IN_PROCESS:
        assert run.data.tags["lifeguard.ended_by"] == "process"
        assert scenario.calls() == [(result.ready["pid"], status)]
    else:
        assert run.data.tags["lifeguard.ended_by"] == "watchdog"
        assert scenario.calls() == []  # no in-process finalizer could run


def test_watchdog_stands_down_when_the_program_finalized(scenario: Scenario, store: Store) -> None:
    result = scenario.run("--path", "SIGTERM", "--watchdog", send=(signal.SIGTERM,))
    assert result.returncode == -signal.SIGTERM
    wait_gone(result.ready["watchdog"])
    [run_id] = result.ready["run_ids"]
    run = store.run(run_id)
    assert run.info.status == "KILLED"
    assert run.data.tags["lifeguard.ended_by"] == "process"
    assert scenario.calls() == [(result.ready["pid"], "KILLED")]


def test_a_store_locked_at_the_death_is_waited_for_within_the_deadline(
    scenario: Scenario, store: Store
) -> None:
    """Someone else holds the sqlite store's write lock when the program is SIGKILLed (another
    job's writes, a `sqlite3` shell): the watchdog cannot even open the store at first. It tries
    again until its deadline (10 s) rather than give up: the lock, held 8 s here (past the
    watchdog's import of mlflow and sqlite's 5 s busy timeout), is gone by then, and the run
    reads KILLED. It used to die of the OperationalError, the run RUNNING."""
    import sqlite3
    import threading

    holding = threading.Event()
    release = threading.Event()

    def hold_the_lock() -> None:
        conn = sqlite3.connect(store.path, timeout=30, isolation_level=None)
        conn.execute("BEGIN EXCLUSIVE")
        holding.set()
        release.wait(60)
        conn.execute("ROLLBACK")
        conn.close()

    def lock_then_kill(ready: dict[str, object]) -> None:
        threading.Thread(target=hold_the_lock, daemon=True).start()
        assert holding.wait(30)
        # The fault: a lock held for a while after the death, then let go.
        threading.Timer(8.0, release.set).start()

    try:
        result = scenario.run(
            "--path", "SIGKILL", "--watchdog", send=(signal.SIGKILL,), after_ready=lock_then_kill
        )
        died = int(time.time() * 1000)
        assert result.returncode == -signal.SIGKILL, result.stderr
        wait_gone(result.ready["watchdog"])
    finally:
        release.set()
    [run_id] = result.ready["run_ids"]
    run = store.run(run_id)
    assert run.info.status == "KILLED"
    assert run.info.end_time is not None and run.info.end_time <= died + SEEN_APART_MS
    assert run.data.tags["lifeguard.ended_by"] == "watchdog"


WATCHED = """
import json, os, time
import lifeguard
lifeguard.install(watchdog=True, deadline=15)
import mlflow
run = mlflow.start_run()
ready = {"run_id": run.info.run_id, "pid": os.getpid(), "watchdog": lifeguard.watchdog_pid()}
print("LIFEGUARD-READY " + json.dumps(ready), flush=True)
time.sleep(600)
"""


def _watched(env: dict[str, str]) -> subprocess.Popen[bytes]:
    """WATCHED started with its output read through pipes, as ``capture_output=True`` does."""
    return subprocess.Popen(
        [sys.executable, "-c", WATCHED],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


def _ready(proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    assert proc.stdout is not None and proc.stderr is not None
    line = proc.stdout.readline().decode()
    assert line.startswith("LIFEGUARD-READY "), line + proc.stderr.read().decode()
    ready: dict[str, Any] = json.loads(line.split(" ", 1)[1])
    return ready


def test_the_watchdog_lets_go_of_the_programs_stderr_at_its_death(
    mlflow_server: MlflowServer, tmp_path: Path
) -> None:
    """Output read through a pipe (``| tee``, ``subprocess.run(capture_output=True)``): the
    reader's end of file comes when the program dies, as without lifeguard, not once the
    watchdog is done ending its runs. Here the server swallows every request from the death on,
    so the watchdog works for its whole deadline (15 s); the end of file must come while it
    still works. Seen: 10 s after a SIGKILL, when the watchdog exited. What it has to say (it
    cannot search the server) goes to the journal directory's log."""
    proxy = FaultProxy(mlflow_server.port)
    journal = tmp_path / "journal"
    env = dict(_base_env(), MLFLOW_TRACKING_URI=proxy.uri, LIFEGUARD_JOURNAL_DIR=str(journal))
    proc = _watched(env)
    watchdog = None
    try:
        ready = _ready(proc)
        watchdog = ready["watchdog"]
        proxy.mode = "blackhole"
        os.kill(ready["pid"], signal.SIGKILL)
        assert proc.wait(CHILD_TIMEOUT) == -signal.SIGKILL
        said = _read_to_the_end(proc.stderr.fileno())
        still = proc_stat(watchdog)
        assert still is not None and still[0] not in "ZX", "stderr ended only with the watchdog"
        assert said == b""
    finally:
        proc.kill()
        proc.wait()
        if watchdog is not None:
            wait_gone(watchdog, CHILD_TIMEOUT)
        proxy.close()
    log = (journal / "replayer.log").read_text()
    assert "cannot search" in log and str(ready["pid"]) in log, log


def _read_to_the_end(fd: int) -> bytes:
    """Everything left in the pipe ``fd``, up to its end of file (bounded: CHILD_TIMEOUT)."""
    data = bytearray()
    give_up = time.monotonic() + CHILD_TIMEOUT
    while True:
        left = give_up - time.monotonic()
        assert left > 0, f"no end of file on the program's stderr: {bytes(data)!r}"
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 65536)
            if not chunk:
                return bytes(data)
            data.extend(chunk)


# A program whose watchdog is SIGKILLed (the OOM killer, a person's `pkill`) and gone.
WATCHDOG_KILLED = """
import ctypes, os, select, signal, sys, time
# A tool piped into `head` takes SIGPIPE's default action back, so that a closed pipe ends it
# quietly: a write to a pipe nobody reads then kills it.
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
import lifeguard
lifeguard.install(watchdog=True)
import mlflow
watchdog = os.pidfd_open(lifeguard.watchdog_pid())
os.kill(lifeguard.watchdog_pid(), signal.SIGKILL)
assert select.select([watchdog], [], [], 60)[0], "the watchdog outlived its SIGKILL"
"""

KILLS_ITS_WATCHDOG = (
    WATCHDOG_KILLED
    + """
run = mlflow.start_run()
mlflow.log_metric("loss", 0.5)
print(run.info.run_id, flush=True)
sys.exit(0)  # at exit, "done" goes to the dead watchdog
"""
)


def test_a_killed_watchdog_never_kills_the_program_by_sigpipe(store: Store) -> None:
    """The watchdog SIGKILLed (the OOM killer, a person's ``pkill``): the program's next lines to
    it ("done" at exit) go to a pipe nobody reads. With SIGPIPE at its default
    action, each such write killed the program by SIGPIPE (exit -13), where without lifeguard it
    exits 0. Now it exits as it would, and ends its run itself."""
    done = subprocess.run(
        [sys.executable, "-c", KILLS_ITS_WATCHDOG],
        env=child_env(store),
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT,
    )
    assert done.returncode == 0, done.stderr
    run = store.run(done.stdout.strip())
    assert run.info.status == "FINISHED"
    assert run.data.tags["lifeguard.ended_by"] == "process"


CRASHES_AFTER_ITS_WATCHDOG = (
    WATCHDOG_KILLED
    + """
if sys.argv[1] == "after a line":
    mlflow.start_run()  # its store goes to the dead watchdog
ctypes.string_at(0)
"""
)


@pytest.mark.parametrize("when", ["before any line", "after a line"])
def test_a_crash_after_the_watchdog_was_killed_is_still_the_crash(store: Store, when: str) -> None:
    """faulthandler writes a crash to the watchdog's pipe. Written to a pipe nobody reads any
    more, that raised SIGPIPE in the crashing thread: with SIGPIPE at its default action the
    program died of SIGPIPE (exit 141 from a shell), not of SIGSEGV as without lifeguard, with
    or without a line sent to the dead watchdog first (helper-15). The program holds a read end
    of that pipe now: no write to it can raise SIGPIPE."""
    done = subprocess.run(
        [sys.executable, "-c", CRASHES_AFTER_ITS_WATCHDOG, when],
        env=child_env(store),
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT,
    )
    assert done.returncode == -signal.SIGSEGV, done.stderr


UNINSTALLS = """
import json, os, sys
import lifeguard, mlflow
lifeguard.install(watchdog=True)
first = lifeguard.watchdog_pid()
run = mlflow.start_run()
lifeguard.uninstall()
pids = [first]
for _ in range(3):
    lifeguard.install(watchdog=True)
    pids.append(lifeguard.watchdog_pid())
    lifeguard.uninstall()
ready = {"run_id": run.info.run_id, "watchdogs": pids, "after": lifeguard.watchdog_pid()}
print(json.dumps(ready), flush=True)
sys.stdin.readline()  # the test has seen every watchdog gone
os._exit(4)
"""


def test_uninstall_stands_the_watchdog_down(store: Store) -> None:
    """The watchdog install() started outlived uninstall(): it took the program's later
    os._exit(4), which it was no longer told of, for a death, and wrote KILLED "died without
    running its exit hooks" over a run lifeguard no longer guarded; each install() and
    uninstall() left one more. Now each one exits at uninstall(), while the program lives, and
    writes nothing."""
    proc = subprocess.Popen(
        [sys.executable, "-c", UNINSTALLS],
        env=child_env(store),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdin is not None and proc.stdout is not None
        line = proc.stdout.readline()
        assert line, proc.communicate(timeout=CHILD_TIMEOUT)[1]
        ready = json.loads(line)
        assert ready["after"] is None
        assert len(set(ready["watchdogs"])) == 4 and all(ready["watchdogs"])
        for pid in ready["watchdogs"]:
            wait_gone(pid, CHILD_TIMEOUT)
        assert proc.poll() is None  # gone while the program lives
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.wait(CHILD_TIMEOUT) == 4
    finally:
        proc.kill()
        proc.communicate()
    run = store.run(ready["run_id"])
    assert run.info.status == "RUNNING"
    assert "lifeguard.ended_by" not in run.data.tags


def test_a_stopped_watchdog_holds_no_reader_of_the_programs_stderr(
    store: Store, tmp_path: Path
) -> None:
    """helper-15: a watchdog stopped (SIGSTOP, a debugger) before the program died never got
    to let go of the program's stderr, and ``subprocess.run(capture_output=True)`` waited for
    its end of file until the watchdog was sent SIGCONT (15 minutes, in the helper's harness).
    The watchdog lets go of a pipe at its start now; once going again, it ends the run."""
    proc = _watched(child_env(store))
    watchdog = None
    try:
        ready = _ready(proc)
        watchdog = ready["watchdog"]
        os.kill(watchdog, signal.SIGSTOP)
        os.kill(ready["pid"], signal.SIGKILL)
        assert proc.wait(CHILD_TIMEOUT) == -signal.SIGKILL
        assert _read_to_the_end(proc.stderr.fileno()) == b""
        still = proc_stat(watchdog)
        assert still is not None and still[0] == "T", "the end of file came only with the watchdog"
    finally:
        proc.kill()
        proc.wait()
        if watchdog is not None:
            os.kill(watchdog, signal.SIGCONT)
            wait_gone(watchdog, CHILD_TIMEOUT)
    run = store.run(ready["run_id"])
    assert run.info.status == "KILLED"
    assert run.data.tags["lifeguard.ended_by"] == "watchdog"
