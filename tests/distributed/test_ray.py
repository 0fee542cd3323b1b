"""A real local Ray (num_cpus=2) with a verl-style actor that owns the run and installs
lifeguard with the watchdog in __init__ (examples/ray_actor.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lifeguard.demo import ChildResult, run_child
from tests.conftest import Store, child_env, wait_gone

pytest.importorskip("ray")
pytestmark = pytest.mark.slow

DRIVER = str(Path(__file__).parent / "ray_driver.py")


def drive(store: Store, scenario: str, home: Path) -> ChildResult:
    # Ray keeps an authentication token in ~/.ray: the driver gets a home of its own.
    env = child_env(store, HOME=str(home))
    result = run_child([sys.executable, DRIVER, scenario], env=env, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    wait_gone(int(result.ready["watchdog"]))  # type: ignore[call-overload]
    return result


def test_exit_actor_is_finished(store: Store, tmp_path: Path) -> None:
    result = drive(store, "exit_actor", tmp_path)
    run = store.run(result.ready["run_id"])  # type: ignore[arg-type]
    assert run.info.status == "FINISHED"
    assert run.data.tags["lifeguard.ended_by"] == "process"


def test_sigterm_to_the_actor_is_killed_and_rays_handler_runs(store: Store, tmp_path: Path) -> None:
    result = drive(store, "sigterm", tmp_path)
    # lifeguard chained the handler Ray installed in its worker before our install()...
    chained = str(result.ready["chained"])
    assert chained.startswith("ray._private.worker.") and chained.endswith(".sigterm_handler")
    run = store.run(result.ready["run_id"])  # type: ignore[arg-type]
    assert run.info.status == "KILLED"
    assert run.data.tags["lifeguard.signal"] == "SIGTERM"
    # ...and finalized in-process when that handler raised SystemExit to end the worker.
    assert run.data.tags["lifeguard.ended_by"] == "process"


@pytest.mark.parametrize("scenario", ["kill", "shutdown"])
def test_ray_kill_and_driver_shutdown_are_killed(
    store: Store, scenario: str, tmp_path: Path
) -> None:
    """``ray.kill`` SIGKILLs the worker: no Python code runs in it, the watchdog ends the run.
    ``ray.shutdown()`` tears workers down with a SIGTERM that a SIGKILL may follow at once:
    lifeguard in the worker ends the run when it gets there first, else the watchdog does.
    KILLED either way."""
    result = drive(store, scenario, tmp_path)
    run = store.run(result.ready["run_id"])  # type: ignore[arg-type]
    assert run.info.status == "KILLED"
    writers = {"watchdog"} if scenario == "kill" else {"watchdog", "process"}
    assert run.data.tags["lifeguard.ended_by"] in writers
    assert run.info.end_time is not None


def test_a_raising_method_does_not_end_the_run(store: Store, tmp_path: Path) -> None:
    result = drive(store, "method_raises", tmp_path)
    after = json.loads(
        next(line for line in result.stdout.splitlines() if line.startswith("AFTER-RAISE "))[12:]
    )
    assert after == {"status": "RUNNING", "step": 6}  # the actor lived on and trained again
    assert store.status(result.ready["run_id"]) == "FINISHED"  # type: ignore[arg-type]
