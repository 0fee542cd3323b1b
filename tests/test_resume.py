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
from tests.conftest import CHILD_TIMEOUT, Store, child_env, lifeguard_cli

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
    done = lifeguard_cli("sweep", "--tracking-uri", store.uri, "--json", env=child_env(store))
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


# Resumes RESUME_RUN_ID on the store RESUME_URI after a run of its own on the default store,
# waits until the heartbeat has adopted it (its owner tags name this process: polled, bounded),
# then says ready.
RESUME_ELSEWHERE = """
import json, os, sys, time
# mlflow first: the run is resumed the moment lifeguard is installed (and its replay started).
import mlflow
from mlflow.tracking import MlflowClient
import lifeguard
lifeguard.install(**json.loads(os.environ.get("TEST_INSTALL", "{}")))
from lifeguard import demo
if os.environ.get("FIRST_RUN"):
    with mlflow.start_run():
        pass
mlflow.set_tracking_uri(os.environ["RESUME_URI"])
run_id = os.environ.get("RESUME_RUN_ID")
if not run_id:  # made after the first run (by a scheduler, say), to be resumed here
    run_id = MlflowClient(os.environ["RESUME_URI"]).create_run("0").info.run_id
run = mlflow.start_run(run_id=run_id)
client = MlflowClient(os.environ["RESUME_URI"])
give_up = time.monotonic() + 60


def adopted():
    # The owner tags are ours, and the run is RUNNING: a journaled ending of the process before
    # that landed between the resume and those tags (a replay on a loaded machine) is undone
    # just after them (heartbeat._resume_again).
    found = client.get_run(run.info.run_id)
    mine = found.data.tags.get("lifeguard.owner.pid") == str(os.getpid())
    return mine and found.info.status == "RUNNING"


while not adopted():
    assert time.monotonic() < give_up, "never adopted"
    time.sleep(0.05)
demo.announce(run_ids=[run.info.run_id], watchdog=lifeguard.watchdog_pid(),
              replay=lifeguard.journaldir.replay_pid)
if os.environ.get("ENDING") == "exit0":
    sys.stdin.readline()
    sys.exit(0)
time.sleep(3600)
"""


def run_elsewhere(store: Store, other: Store, run_id: str, sig: int | None, **env: str):
    return run_child(
        [sys.executable, "-c", RESUME_ELSEWHERE],
        env=child_env(store, RESUME_URI=other.uri, RESUME_RUN_ID=run_id, **env),
        send=(sig,) if sig else (),
        timeout=CHILD_TIMEOUT,
    )


@pytest.mark.parametrize(
    ("sig", "watchdog"),
    [(signal.SIGTERM, False), (signal.SIGKILL, True)],
    ids=["sigterm-in-process", "sigkill-watchdog"],
)
def test_a_run_resumed_on_another_store_ends_there(
    tmp_path, template_db, store: Store, sig: int, watchdog: bool
) -> None:
    """A run of its own on the default store first, then the resumed run on another: before,
    the resumed run was tied to the first run's store (journaled there, "not found"), and the
    watchdog never heard of the second store."""
    from tests.conftest import wait_gone
    from tests.test_stores import store_at

    other = store_at(template_db, tmp_path / "other" / "mlflow.db")
    result = run_elsewhere(
        store, other, "", sig, FIRST_RUN="1", TEST_INSTALL=json.dumps({"watchdog": watchdog})
    )
    [run_id] = result.ready["run_ids"]  # type: ignore[misc]
    assert result.returncode == -sig, result.stderr
    if watchdog:
        wait_gone(int(result.ready["watchdog"]))  # type: ignore[call-overload]
    assert other.status(run_id) == "KILLED", result.stderr
    assert "not found" not in result.stderr, result.stderr


@pytest.mark.parametrize("heartbeat", ["default", "off"])
def test_a_requeued_job_s_replay_leaves_the_run_it_resumed_alone(
    store: Store, heartbeat: str
) -> None:
    """Job 1 journaled KILLED and died before writing it; job 2 (the requeue) resumes the run.
    Job 2's own install() replays the journal in the background: before, the replay ended the
    live resumed run KILLED, and "never overwrite" then kept that over job 2's FINISHED. With
    heartbeats off (helper-15) the run was never adopted, and so it still went."""
    from lifeguard.journal import Entry, Journal
    from tests.conftest import wait_gone

    run_id = orphan_run(store)
    # Job 1's journal entry, as its finalizer wrote it before it was cut off; its writer, the
    # orphan's process, is gone.
    orphan = store.run(run_id)
    dead_pid = int(orphan.data.tags[TAG_PID])
    # Cut off as its run began: job 1's ending is dated before job 2 starts, as a requeue's is.
    ended_at = orphan.info.start_time
    entry = Entry(run_id, store.uri, "KILLED", ended_at, {"lifeguard.signal": "SIGTERM"})
    entry.pid = dead_pid
    Journal(str(store.path.parent / "journal")).write(entry)
    during: list[str] = []

    def after_the_replay(ready: dict[str, object]) -> None:
        wait_gone(int(ready["replay"]))  # type: ignore[call-overload]
        during.append(store.status(run_id))  # the replay is over; the job still trains

    result = run_child(
        [sys.executable, "-c", RESUME_ELSEWHERE],
        env=child_env(
            store,
            RESUME_URI=store.uri,
            RESUME_RUN_ID=run_id,
            ENDING="exit0",
            TEST_INSTALL=json.dumps({"heartbeat": 0} if heartbeat == "off" else {}),
        ),
        after_ready=after_the_replay,
        timeout=CHILD_TIMEOUT,
    )
    assert during == ["RUNNING"], result.stderr
    assert result.returncode == 0, result.stderr
    assert store.status(run_id) == "FINISHED"
    assert list((store.path.parent / "journal").glob("*.json")) == []


LATE_ENDING = """
import os, sys, time
import lifeguard
# No heartbeat thread: this program adopts its resumed run itself (heartbeat.beat(), what the
# thread does within a second of a resume), so that the late ending lands exactly in between.
lifeguard.install(heartbeat=0)
import mlflow
from mlflow.tracking import MlflowClient
from lifeguard import demo
from lifeguard.backends.mlflow.heartbeat import heartbeat
client = MlflowClient()
run_id = mlflow.start_run(run_id=os.environ["RESUME_RUN_ID"]).info.run_id  # resumed: RUNNING
ended_at = os.environ.get("ENDED_AT") or str(int(time.time() * 1000))
# What a replay (or a watchdog, a sweep) writes for the process that ran it before, landing
# between this resume and its adoption: a loaded machine's replay did, and the run stayed KILLED.
client.set_terminated(run_id, "KILLED", end_time=int(ended_at))
heartbeat.beat()
info = client.get_run(run_id).info
demo.announce(status=info.status, end_time=info.end_time)
sys.exit(0)
"""


@pytest.mark.parametrize("ended", ["before-this-process", "during-this-process"])
def test_a_resumed_run_ended_late_by_the_process_before_is_running_again(
    store: Store, ended: str
) -> None:
    """The ending of the process that ran the run before, written after this process resumed
    it and before it adopted it (its owner tags), is older news than the resume: the adoption
    sets RUNNING again, as MLflow's resume would have had the write come first, and this process
    ends the run with its own truth. An ending dated after this process started is not that
    (the program or a user ended the run since) and stays."""
    run_id = orphan_run(store)
    ended_at = int(time.time() * 1000) - 1000  # the process before died: before this one began
    extra = {"ENDED_AT": str(ended_at)} if ended == "before-this-process" else {}
    result = run_child(
        [sys.executable, "-c", LATE_ENDING],
        env=child_env(store, RESUME_RUN_ID=run_id, **extra),
        timeout=CHILD_TIMEOUT,
    )
    assert result.returncode == 0, result.stderr
    if ended == "before-this-process":
        assert result.ready["status"] == "RUNNING", result.stderr
        assert result.ready["end_time"] == ended_at  # kept, as MLflow's own resume keeps it
        assert store.status(run_id) == "FINISHED"
    else:
        assert result.ready["status"] == "KILLED", result.stderr
        assert store.status(run_id) == "KILLED"


JOB_ONE = """
import json, os, sys, time
import lifeguard
lifeguard.install(watchdog=True, heartbeat=0)
import mlflow
from lifeguard.journal import Entry, Journal
run = mlflow.start_run()
# Its finalization journaled the run's ending, then was cut short (a SIGKILL at the end of the
# grace period): the watchdog has the entry to write.
entry = Entry(run.info.run_id, mlflow.get_tracking_uri(), "KILLED", int(time.time() * 1000),
              {"lifeguard.signal": "SIGTERM"})
entry.pid = os.getpid()
Journal().keep(entry)
print(json.dumps({"run_id": run.info.run_id, "watchdog": lifeguard.watchdog_pid()}), flush=True)
sys.stdin.readline()
"""


def test_a_watchdog_leaves_alone_a_run_resumed_since_its_program_journaled_it(
    store: Store,
) -> None:
    """Job 1 journaled its run's ending and was SIGKILLed; job 2, the requeue, had resumed the
    run by the time job 1's watchdog got to the entry (it may wait its turn for minutes). The
    watchdog drops the entry instead of ending a live run KILLED, which job 2's own ending could
    then not correct ("never overwrite")."""
    from tests.conftest import wait_gone

    job_one = subprocess.Popen(
        [sys.executable, "-c", JOB_ONE], env=child_env(store), text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert job_one.stdout is not None
        first = json.loads(job_one.stdout.readline())
        run_id, watchdog = first["run_id"], int(first["watchdog"])
        during: list[str] = []

        def kill_job_one(ready: dict[str, object]) -> None:
            # Job 2 has adopted the run (its owner tags name it): now job 1 dies.
            job_one.kill()
            job_one.wait(CHILD_TIMEOUT)
            wait_gone(watchdog)
            during.append(store.status(run_id))

        result = run_child(
            [sys.executable, "-c", RESUME_ELSEWHERE],
            env=child_env(store, RESUME_URI=store.uri, RESUME_RUN_ID=run_id, ENDING="exit0"),
            after_ready=kill_job_one,
            timeout=CHILD_TIMEOUT,
        )
    finally:
        if job_one.poll() is None:
            job_one.kill()
            job_one.wait()
    assert during == ["RUNNING"], result.stderr
    assert result.returncode == 0, result.stderr
    assert store.status(run_id) == "FINISHED"
    assert list((store.path.parent / "journal").glob("*.json")) == []
