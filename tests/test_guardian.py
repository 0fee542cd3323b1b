"""Deaths no in-process hook can see, ended by the guardian: the watchdog sidecar."""

from __future__ import annotations

import signal
import time

import pytest

from lifeguard import demo
from tests.conftest import Scenario, Store, wait_gone

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
    # The end time is the moment of death, not when the watchdog got round to writing it.
    assert run.info.end_time is not None and run.info.start_time <= run.info.end_time <= died
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
    assert run.info.end_time is not None and run.info.end_time <= died
    assert run.data.tags["lifeguard.ended_by"] == "watchdog"
