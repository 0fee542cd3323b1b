"""Every way Slurm ends a job, on a real single-node cluster, in the two shapes a batch script
runs a program in: ``srun python train.py`` and ``exec python train.py``.

Each case submits the same program with lifeguard and without it (raw MLflow) side by side.
lifeguard's result is asserted; raw MLflow's is recorded and printed in the table at the end of
the session (``conftest.pytest_terminal_summary``), never asserted: it is the baseline.

The bare shape (``python train.py`` as a child of the batch shell) is not one of the two: under
proctrack/linuxproc scancel signals every process of the job, so it behaves like ``exec``; under
proctrack/cgroup the child is SIGKILLed microseconds after the shell dies (README, Slurm).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest

from lifeguard.demo import wait_gone

from .conftest import SHAPES, TIMEOUT, Job, Slurm, Submitter, record

pytestmark = pytest.mark.slow


@dataclass
class Ran:
    """One job's run after the job is over."""

    job: Job
    run_id: str
    pid: int
    status: str
    end_time: float | None  # epoch seconds
    tags: dict[str, str]
    slurm_state: str

    def summary(self) -> str:
        why = self.tags.get("lifeguard.reason")
        return f"{self.status}" + (f" ({why})" if why else "") + f" [job {self.slurm_state}]"


def ready(job: Job) -> tuple[str, int]:
    _, run_id, pid, _attempt = job.wait_line("ready")
    return run_id, int(pid)


def finish(sub: Submitter, job: Job, run_id: str, pid: int, *, settle: float = 0.0) -> Ran:
    """Wait for the job and its process to be over, then read the run. ``settle``: how long a
    guardian outside the job may take to write the status once the process is gone."""
    state = job.wait_state()
    assert wait_gone(pid, TIMEOUT), f"{job.name}: pid {pid} alive after the job ended {state}"
    job.extra["gone"] = time.time()
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=sub.uri)
    deadline = time.monotonic() + settle
    while True:
        run = client.get_run(run_id)
        if run.info.status != "RUNNING" or time.monotonic() >= deadline:
            break
        time.sleep(0.2)  # polling the store for a guardian's write, bounded by settle
    end = run.info.end_time / 1000 if run.info.end_time else None
    return Ran(job, run_id, pid, run.info.status, end, dict(run.data.tags), state)


def submit_pair(
    sub: Submitter, case: str, shape: str, *train_args: str, sbatch: tuple[str, ...] = ()
) -> tuple[Job, Job]:
    """The same job with lifeguard and without it."""
    guarded = sub.submit(f"{case}-{shape}", shape, *train_args, sbatch=sbatch)
    raw = sub.submit(f"{case}-{shape}-raw", shape, *train_args, raw=True, sbatch=sbatch)
    return guarded, raw


def check_end_time(ran: Ran, after: float, slack: float = 1.5) -> None:
    """The end time is when the process really ended: not before ``after`` (the event), not
    after the moment the test saw the process gone."""
    assert ran.end_time is not None, f"{ran.job.name}: no end time"
    gone = float(ran.job.extra["gone"])  # type: ignore[arg-type]
    assert after - slack <= ran.end_time <= gone + slack, (
        f"{ran.job.name}: end time {ran.end_time:.3f} outside [{after:.3f}, {gone:.3f}]"
    )


# -- the cases ------------------------------------------------------------------------------


def test_scancel(submitter: Submitter, slurm: Slurm) -> None:
    """scancel: SIGCONT and SIGTERM to every process of the job, SIGKILL after KillWait."""
    jobs = {shape: submit_pair(submitter, "scancel", shape) for shape in SHAPES}
    started = {job.id: ready(job) for pair in jobs.values() for job in pair}
    cancelled = time.time()
    for pair in jobs.values():
        for job in pair:
            slurm.run("scancel", job.id)
    for shape, (guarded, raw) in jobs.items():
        ran = finish(submitter, guarded, *started[guarded.id])
        base = finish(submitter, raw, *started[raw.id])
        record("scancel", shape, "lifeguard", ran.summary())
        record("scancel", shape, "raw", base.summary())
        assert ran.status == "KILLED", ran.summary() + "\n" + guarded.tail()
        assert ran.tags.get("lifeguard.signal") == "SIGTERM", ran.tags
        check_end_time(ran, cancelled)


def test_normal_exit(submitter: Submitter, slurm: Slurm) -> None:
    jobs = {shape: submit_pair(submitter, "exit 0", shape, "--steps", "3") for shape in SHAPES}
    for shape, (guarded, raw) in jobs.items():
        ran = finish(submitter, guarded, *ready(guarded))
        base = finish(submitter, raw, *ready(raw))
        record("exit 0", shape, "lifeguard", ran.summary())
        record("exit 0", shape, "raw", base.summary())
        assert ran.status == "FINISHED", ran.summary() + "\n" + guarded.tail()
        assert ran.slurm_state == "COMPLETED"


def test_exit_3(submitter: Submitter, slurm: Slurm) -> None:
    args = ("--steps", "3", "--exit", "3")
    jobs = {shape: submit_pair(submitter, "exit 3", shape, *args) for shape in SHAPES}
    for shape, (guarded, raw) in jobs.items():
        ran = finish(submitter, guarded, *ready(guarded))
        base = finish(submitter, raw, *ready(raw))
        record("exit 3", shape, "lifeguard", ran.summary())
        record("exit 3", shape, "raw", base.summary())
        assert ran.status == "FAILED", ran.summary() + "\n" + guarded.tail()
        assert ran.tags.get("lifeguard.exit_code") == "3", ran.tags
        assert ran.slurm_state == "FAILED"
