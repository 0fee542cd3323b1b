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
