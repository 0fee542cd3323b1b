"""A run resumed with ``mlflow.start_run(run_id=...)`` (after a crash, a preemption, a Slurm
requeue) is the resuming process's: its owner tags move to it, a sweep leaves it alone while it
lives, and it ends with the truth however that process ends."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from lifeguard.demo import run_child
from lifeguard.owner import TAG_PID
from tests.conftest import CHILD_TIMEOUT, Store, child_env

pytestmark = pytest.mark.slow

RESUME = """
import os, sys, time
import lifeguard
lifeguard.install()
import mlflow
from lifeguard import demo
run = mlflow.start_run(run_id=os.environ["RESUME_RUN_ID"])
mlflow.log_metric("loss", 0.1)
demo.announce(run_ids=[run.info.run_id], pid=os.getpid())
sys.stdin.readline()  # the test closes our stdin once it has looked
if os.environ["ENDING"] == "exit3":
    sys.exit(3)
time.sleep(3600)
"""


def orphan_run(store: Store) -> str:
    """A run left RUNNING by a process that died without a word (SIGKILL, no guardian)."""
    code = textwrap.dedent(
        """
        import os, signal, lifeguard
        lifeguard.install()
        import mlflow
        run = mlflow.start_run()
        print(run.info.run_id, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=child_env(store),
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    run_id = done.stdout.split()[0]
    assert store.status(run_id) == "RUNNING"
    return run_id


def sweep(store: Store) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-m", "lifeguard", "sweep", "--tracking-uri", store.uri, "--json"],
        env=child_env(store),
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT,
    )
    assert done.returncode in (0, 1), done.stderr
    return json.loads(done.stdout) if done.stdout.strip() else {}


def wait_for_owner(store: Store, run_id: str, pid: int) -> None:
    """Bounded wait for the resuming process's heartbeat thread to adopt the run."""
    deadline = time.monotonic() + CHILD_TIMEOUT
    while store.run(run_id).data.tags.get(TAG_PID) != str(pid):
        assert time.monotonic() < deadline, "the resumed run was never adopted"
        time.sleep(0.1)


@pytest.mark.parametrize(
    ("ending", "status", "returncode"),
    [("SIGTERM", "KILLED", -signal.SIGTERM), ("exit3", "FAILED", 3)],
)
def test_a_resumed_run_is_adopted_spared_by_the_sweep_and_ended_with_the_truth(
    store: Store, ending: str, status: str, returncode: int
) -> None:
    run_id = orphan_run(store)

    def adopted_then_swept(ready: dict[str, object]) -> None:
        wait_for_owner(store, run_id, int(ready["pid"]))  # type: ignore[call-overload]
        sweep(store)  # same host, live owner: the run must survive it
        assert store.status(run_id) == "RUNNING"

    result = run_child(
        [sys.executable, "-c", textwrap.dedent(RESUME)],
        env=child_env(store, RESUME_RUN_ID=run_id, ENDING=ending),
        timeout=CHILD_TIMEOUT,
        send=(signal.SIGTERM,) if ending == "SIGTERM" else (),
        after_ready=adopted_then_swept,
    )
    assert result.returncode == returncode, result.stderr
    assert store.status(run_id) == status, result.stderr


def test_a_run_only_resumed_and_returned_from_ends_with_this_process_reason(store: Store) -> None:
    """install() before ``import mlflow``, then only a resume (a Slurm requeue's next attempt)
    and a plain return: no new run ever moves lifeguard's atexit hook before MLflow's, whose
    hook would end the run FINISHED first and leave the previous attempt's reason on it."""
    first = textwrap.dedent(
        """
        import os, signal, lifeguard
        lifeguard.install()
        import mlflow
        run = mlflow.start_run()
        print(run.info.run_id, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", first],
        env=child_env(store),
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT,
    )
    assert done.returncode == -signal.SIGTERM, done.stderr
    run_id = done.stdout.split()[0]
    assert store.run(run_id).data.tags["lifeguard.reason"] == "killed by SIGTERM"
    second = textwrap.dedent(
        """
        import os, lifeguard
        lifeguard.install()
        import mlflow
        mlflow.start_run(run_id=os.environ["RESUME_RUN_ID"])
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", second],
        env=child_env(store, RESUME_RUN_ID=run_id),
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT,
    )
    assert done.returncode == 0, done.stderr
    run = store.run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["lifeguard.reason"] == "exit code 0", run.data.tags
    assert run.data.tags["lifeguard.outcome"] == "exit"
