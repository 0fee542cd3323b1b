"""Every way Slurm ends a job, on a real single-node cluster, in the two shapes a batch script
runs a program in: ``srun python train.py`` and ``exec python train.py``.

Each case submits the same program with lifeguard and without it (raw MLflow) side by side.
lifeguard's result is asserted; raw MLflow's is recorded and printed in the table at the end of
the session (``conftest.pytest_terminal_summary``), never asserted: it is the baseline.

The bare shape (``python train.py`` as a child of the batch shell) is not one of the two: under
proctrack/linuxproc scancel signals every process of the job, so it behaves like ``exec``; under
proctrack/cgroup the child is SIGKILLed microseconds after the shell dies
(docs/slurm-and-containers.md).
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from lifeguard.demo import wait_gone
from lifeguard.preemption import TAG_WARNING

from .conftest import NOT_ASKED, SHAPES, TIMEOUT, Job, Slurm, Submitter, asked, record

if not asked():
    # One line for the whole module (a skip per test prints a line per test), nothing started.
    pytest.skip(NOT_ASKED, allow_module_level=True)

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


def finish(
    sub: Submitter,
    job: Job,
    run_id: str,
    pid: int,
    *,
    settle: float = 0.0,
    timeout: float = TIMEOUT,
) -> Ran:
    """Wait for the job and its process to be over, then read the run. ``settle``: how long a
    guardian outside the job may take to write the status once the process is gone."""
    state = job.wait_state(timeout=timeout)
    assert wait_gone(pid, TIMEOUT), f"{job.name}: pid {pid} alive after the job ended {state}"
    job.extra.setdefault("gone", time.time())
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
    """The same job with lifeguard and without it. Heartbeats every second: a sweep ends the
    run of an owner dead on this host once it has seen it unchanged for two of them (10 s at
    least), not two minutes as with the default 60 s."""
    guarded = sub.submit(f"{case}-{shape}", shape, "--heartbeat", "1", *train_args, sbatch=sbatch)
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


def sweep(sub: Submitter, run_ids: list[str]) -> subprocess.CompletedProcess[str]:
    """`lifeguard sweep` on this node, again and again until ``run_ids`` are ended: a run is
    ended once the sweep has seen it unchanged for long enough (its owner dead on this host:
    two of its heartbeats, 10 s at least), never at the first look."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=sub.uri)
    deadline = time.monotonic() + TIMEOUT
    while True:
        done = subprocess.run(
            [sys.executable, "-m", "lifeguard", "sweep", "--tracking-uri", sub.uri,
             "--journal-dir", str(sub.tmp_path / "sweep-journal")],
            capture_output=True, text=True, timeout=TIMEOUT, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        if all(client.get_run(r).info.status != "RUNNING" for r in run_ids):
            return done
        assert time.monotonic() < deadline, f"runs never ended: {done.stdout}"


def nothing_inside_can_act(sub: Submitter, ran: Ran, case: str, shape: str) -> Ran:
    """Under proctrack/cgroup: the run is left RUNNING (nothing of the job survived to speak);
    recorded as measured, then `lifeguard sweep` ends it, at its last sign of life."""
    assert ran.status == "RUNNING", ran.summary()
    sweep(sub, [ran.run_id])
    after = finish(sub, ran.job, ran.run_id, ran.pid)
    record(case, shape, "lifeguard", ran.summary() + " -> sweep: " + after.summary())
    return after


# -- the cases ------------------------------------------------------------------------------


def test_scancel(submitter: Submitter, slurm: Slurm) -> None:
    """scancel: SIGCONT and SIGTERM to every process of the job, SIGKILL after KillWait."""
    # The bare shape too: under proctrack/linuxproc scancel signals every process of the job,
    # the batch shell's child included (under proctrack/cgroup it is SIGKILLed:
    # docs/slurm-and-containers.md).
    jobs = {shape: submit_pair(submitter, "scancel", shape) for shape in (*SHAPES, "bare")}
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
        if shape == "bare" and slurm.proctrack != "linuxproc":
            # The batch shell dies of the SIGTERM and its child is SIGKILLed at once (docs/).
            ran = nothing_inside_can_act(submitter, ran, "scancel", shape)
            assert ran.status == "KILLED", ran.summary()
            check_end_time(ran, cancelled)
            continue
        assert ran.status == "KILLED", ran.summary() + "\n" + guarded.tail()
        assert ran.tags.get("lifeguard.signal") == "SIGTERM", ran.tags
        check_end_time(ran, cancelled)


def test_scancel_signal_kill_is_a_cancel(submitter: Submitter, slurm: Slurm) -> None:
    """`scancel --signal=KILL JOB` (the whole job, no step, no --batch) is not a SIGKILL: Slurm
    treats it as a cancel, SIGTERM first, and the run ends KILLED by SIGTERM in-process."""
    case = "scancel --signal=KILL JOB"
    jobs = {shape: submit_pair(submitter, case, shape) for shape in SHAPES}
    started = {job.id: ready(job) for pair in jobs.values() for job in pair}
    cancelled = time.time()
    for pair in jobs.values():
        for job in pair:
            slurm.run("scancel", "--signal=KILL", job.id)
    for shape, (guarded, raw) in jobs.items():
        ran = finish(submitter, guarded, *started[guarded.id])
        base = finish(submitter, raw, *started[raw.id])
        record(case, shape, "lifeguard", ran.summary())
        record(case, shape, "raw", base.summary())
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


# -- a time limit runs while the other tests do ---------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def time_limit_jobs(
    request: pytest.FixtureRequest,
) -> tuple[Submitter | None, dict[str, tuple[Job, Job]]]:
    """Slurm's smallest time limit is a minute, checked every 30 s or so: the jobs are submitted
    when the module starts, in the non-preemptable partition, and judged by the last test."""
    if "test_time_limit" not in {item.name for item in request.session.items}:
        return None, {}
    tmp = request.getfixturevalue("tmp_path_factory").mktemp("time-limit")
    slurm: Slurm = request.getfixturevalue("slurm")
    template = request.getfixturevalue("template_db")
    import shutil

    shutil.copy(template, tmp / "mlflow.db")
    sub = Submitter(slurm, tmp, f"sqlite:///{tmp / 'mlflow.db'}")
    request.addfinalizer(sub.cancel_all)
    options = ("--time=1", "--partition=high")
    return sub, {shape: submit_pair(sub, "time limit", shape, sbatch=options) for shape in SHAPES}


def preempt(slurm: Slurm, tmp: Path, victims: list[Job]) -> None:
    """A job in the higher-tier partition that needs every CPU the preemptable jobs hold: Slurm
    preempts them all (requeued with --requeue, cancelled otherwise). Returns once it has run,
    so that the preemption is over (the victims' CPUs released).

    It asks for every CPU that the high partition's own jobs (test_time_limit's, submitted at
    the session's start) leave. One of those may end between the count and the scheduling: the
    preemptor then fits beside the victims, preempts nothing, and runs; another, sized anew,
    follows (seen: a victim still RUNNING 90 s later)."""
    total = int(slurm.run("sinfo", "-h", "-N", "-o", "%c").split()[0])
    script = tmp / "preemptor.sh"
    script.write_text("#!/bin/bash\ntrue\n")
    for attempt in range(3):
        held = slurm.run("squeue", "-h", "-t", "R", "-p", "high", "-o", "%C").split()
        cpus = total - sum(int(n) for n in held)
        log = tmp / f"preemptor-{attempt}.log"
        out = slurm.run(
            "sbatch", "--parsable", "--partition=high", f"--cpus-per-task={cpus}",
            "--job-name=preemptor", f"--output={log}", str(script),
        )  # fmt: skip
        preemptor = Job(slurm, out.strip().split(";")[0], "preemptor", log, log, time.time())
        preemptor.wait_state({"COMPLETED"})
        left = [job.name for job in victims if slurm.job_state(job.id).get("JobState") == "RUNNING"]
        if not left:
            return
    raise AssertionError(f"not preempted by three preemptors: {left}")


def warn(slurm: Slurm, job: Job, shape: str) -> None:
    """A preemption warning now: scancel --signal=USR1 reaches srun's tasks only, --batch the
    batch shell only (the exec'd python)."""
    if shape == "srun":
        slurm.run("scancel", "--signal=USR1", job.id)
    else:
        slurm.run("scancel", "--batch", "--signal=USR1", job.id)


def wait_tag(sub: Submitter, run_id: str, key: str, timeout: float = 30.0) -> dict[str, str]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=sub.uri)
    deadline = time.monotonic() + timeout
    while True:
        tags = dict(client.get_run(run_id).data.tags)
        if key in tags or time.monotonic() > deadline:
            return tags
        time.sleep(0.2)  # the tag is written from a background thread


def test_preemption_warning(submitter: Submitter, slurm: Slurm) -> None:
    """--signal=USR1@N (here sent at once by scancel): the callback runs, the run is tagged and
    goes on RUNNING; the scancel that follows ends it KILLED."""
    args = ("--preemption",)
    jobs = {shape: submit_pair(submitter, "USR1 then scancel", shape, *args) for shape in SHAPES}
    started = {job.id: ready(job) for pair in jobs.values() for job in pair}
    for shape, pair in jobs.items():
        for job in pair:
            warn(slurm, job, shape)
    for pair in jobs.values():
        for job in pair:
            job.wait_line("preempted")
    for guarded, _raw in jobs.values():
        run_id = started[guarded.id][0]
        tags = wait_tag(submitter, run_id, "lifeguard.preemption_warning")
        assert tags.get("lifeguard.preemption_warning", "").startswith("SIGUSR1 at "), tags
        assert slurm.job_state(guarded.id)["JobState"] == "RUNNING"
        from mlflow.tracking import MlflowClient

        assert MlflowClient(tracking_uri=submitter.uri).get_run(run_id).info.status == "RUNNING"
    cancelled = time.time()
    for pair in jobs.values():
        for job in pair:
            slurm.run("scancel", job.id)
    for shape, (guarded, raw) in jobs.items():
        ran = finish(submitter, guarded, *started[guarded.id])
        base = finish(submitter, raw, *started[raw.id])
        record("USR1 then scancel", shape, "lifeguard", ran.summary())
        record("USR1 then scancel", shape, "raw", base.summary())
        assert ran.status == "KILLED", ran.summary() + "\n" + guarded.tail()
        check_end_time(ran, cancelled)


def test_preemption_warning_before_start_run(submitter: Submitter, slurm: Slurm) -> None:
    """The warning comes while the program is still loading, before it has a run: the run it
    starts afterwards is tagged at start_run."""
    args = ("--preemption", "--early-warning")
    case = "USR1 before start_run"
    jobs = {shape: submit_pair(submitter, case, shape, *args) for shape in SHAPES}
    for shape, pair in jobs.items():
        for job in pair:
            job.wait_line("waiting")
            warn(slurm, job, shape)
    started = {job.id: ready(job) for pair in jobs.values() for job in pair}
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=submitter.uri)
    for shape, (guarded, raw) in jobs.items():
        tags = client.get_run(started[guarded.id][0]).data.tags
        raw_tags = client.get_run(started[raw.id][0]).data.tags
        record(case, shape, "lifeguard", "tagged" if TAG_WARNING in tags else "not tagged")
        record(case, shape, "raw", "tagged" if TAG_WARNING in raw_tags else "not tagged")
        assert tags.get(TAG_WARNING, "").startswith("SIGUSR1 at "), tags
        slurm.run("scancel", guarded.id)
        slurm.run("scancel", raw.id)
    for guarded, _raw in jobs.values():
        ran = finish(submitter, guarded, *started[guarded.id])
        assert ran.status == "KILLED", ran.summary() + "\n" + guarded.tail()


def test_preempted(submitter: Submitter, slurm: Slurm, tmp_path: Path) -> None:
    """Preemption by a higher-tier partition's job (PreemptMode=REQUEUE, the jobs do not allow
    a requeue: cancelled): the same double SIGTERM as a time limit in srun jobs."""
    jobs = {shape: submit_pair(submitter, "preempted", shape) for shape in SHAPES}
    started = {job.id: ready(job) for pair in jobs.values() for job in pair}
    preempted = time.time()
    preempt(slurm, tmp_path, [job for pair in jobs.values() for job in pair])
    for shape, (guarded, raw) in jobs.items():
        ran = finish(submitter, guarded, *started[guarded.id])
        base = finish(submitter, raw, *started[raw.id])
        record("preempted", shape, "lifeguard", ran.summary())
        record("preempted", shape, "raw", base.summary())
        assert ran.status == "KILLED", ran.summary() + "\n" + guarded.tail()
        assert ran.tags.get("lifeguard.signal") == "SIGTERM", ran.tags
        check_end_time(ran, preempted)


def watchdog_case(
    submitter: Submitter, slurm: Slurm, case: str, args: tuple[str, ...], kill: str
) -> None:
    """Jobs whose program dies by SIGKILL; the watchdog, outside the job's process tree, ends
    the run. Under proctrack/cgroup it is in the job's cgroup and dies with it: the run stays
    RUNNING (recorded), and `lifeguard sweep` ends it."""
    jobs = {shape: submit_pair(submitter, case, shape, *args) for shape in SHAPES}
    started = {job.id: ready(job) for pair in jobs.values() for job in pair}
    event = time.time()
    for shape, pair in jobs.items():
        for job in pair:
            if kill == "scancel":
                slurm.run("scancel", job.id)
            elif shape == "srun":
                slurm.run("scancel", "--signal=KILL", f"{job.id}.0")
            else:
                slurm.run("scancel", "--batch", "--signal=KILL", job.id)
    if kill == "scancel":
        event += slurm.kill_wait  # the SIGKILL came KillWait after the SIGTERM
    # A watchdog that is there writes within a second or two; under cgroup none is left.
    settle = 30.0 if slurm.proctrack != "cgroup" else 5.0
    ran = {}
    for shape, (guarded, raw) in jobs.items():
        ran[shape] = finish(submitter, guarded, *started[guarded.id], settle=settle)
        base = finish(submitter, raw, *started[raw.id])
        record(case, shape, "lifeguard", ran[shape].summary())
        record(case, shape, "raw", base.summary())
    if slurm.proctrack == "cgroup":
        for shape in SHAPES:
            assert ran[shape].status == "RUNNING", ran[shape].summary()
        sweep(submitter, [ran[shape].run_id for shape in SHAPES])
        for shape in SHAPES:
            before = ran[shape]
            ran[shape] = finish(submitter, before.job, before.run_id, before.pid)
            record(case, shape, "lifeguard", f"{before.summary()} -> sweep: {ran[shape].summary()}")
    for shape, (guarded, _raw) in jobs.items():
        assert ran[shape].status == "KILLED", ran[shape].summary() + "\n" + guarded.tail()
        check_end_time(ran[shape], event)


def test_sigkill_with_watchdog(submitter: Submitter, slurm: Slurm) -> None:
    """A real SIGKILL: `scancel --signal=KILL JOB` acts like a cancel (SIGTERM first); the KILL
    itself reaches srun's tasks as JOB.0 and the exec'd python with --batch."""
    watchdog_case(submitter, slurm, "SIGKILL + watchdog", ("--watchdog",), kill="KILL")


def test_sigterm_ignored_killwait_watchdog(submitter: Submitter, slurm: Slurm) -> None:
    """The program ignores SIGTERM (its own SIG_IGN after install): slurmd SIGKILLs it KillWait
    later, and the run ends with the time of that SIGKILL."""
    args = ("--watchdog", "--ignore-term")
    watchdog_case(submitter, slurm, "SIGTERM ignored, KillWait (watchdog)", args, kill="scancel")


def test_sigterm_ignored_killwait_sweep(submitter: Submitter, slurm: Slurm) -> None:
    """The same without a watchdog: nothing of the job is left to speak, and `lifeguard sweep`
    (on the node, owner dead on this host) ends the run KILLED at its last sign of life."""
    args = ("--ignore-term",)
    case = "SIGTERM ignored, KillWait"
    jobs = {shape: submit_pair(submitter, case, shape, *args) for shape in SHAPES}
    started = {job.id: ready(job) for pair in jobs.values() for job in pair}
    cancelled = time.time()
    for pair in jobs.values():
        for job in pair:
            slurm.run("scancel", job.id)
    results = {}
    for shape, (guarded, raw) in jobs.items():
        before = finish(submitter, guarded, *started[guarded.id])
        assert before.status == "RUNNING", before.summary()
        results[shape] = finish(submitter, raw, *started[raw.id])
    swept = sweep(submitter, [started[guarded.id][0] for guarded, _ in jobs.values()])
    for shape, (guarded, _raw) in jobs.items():
        ran = finish(submitter, guarded, *started[guarded.id])
        record(case + " (sweep)", shape, "lifeguard", ran.summary())
        record(case + " (sweep)", shape, "raw", results[shape].summary())
        assert ran.status == "KILLED", ran.summary() + "\n" + swept.stdout + swept.stderr
        check_end_time(ran, cancelled + slurm.kill_wait)


def test_requeue_resumes_the_run(submitter: Submitter, slurm: Slurm, tmp_path: Path) -> None:
    """--requeue: preempted, started again by Slurm, the program resumes the same run by the id
    it stored; the last attempt ends it with the truth, and owns it."""
    args = ("--resume-file", "run_id.txt", "--finish-on-attempt", "1")
    case = "preempted, requeued, exit 0"
    jobs = {
        shape: submit_pair(submitter, case, shape, *args, sbatch=("--requeue",)) for shape in SHAPES
    }
    first = {job.id: ready(job) for pair in jobs.values() for job in pair}
    # Slurm makes a requeued job wait about two minutes (its BeginTime), which this test cuts
    # short; it may do so only once the preemption is over. Cut short at once, one requeued
    # job ended FAILED with no line from its second attempt (CI), as if started while the
    # preemptor still waited for the CPUs and preempted again mid-launch. So: the preemptor has
    # run (preempt returns then), and every first attempt's process is gone.
    preempt(slurm, tmp_path, [job for pair in jobs.values() for job in pair])
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=submitter.uri)
    for pair in jobs.values():
        for job in pair:
            job.wait_state({"PENDING"})
    for job_id, (_run_id, pid) in first.items():
        assert wait_gone(pid, TIMEOUT), f"job {job_id}: first attempt's pid {pid} still alive"
    # Two seconds on: slurmd revoked the first attempt's job credential when it killed it, to
    # the second, and refuses a launch whose credential is from that same second ("Killing
    # non-startable batch job: Job credential revoked", then FAILED: seen in CI, 0.2 s after
    # the requeue).
    soon = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() + 2))  # not "now": 22.05
    for pair in jobs.values():
        for job in pair:
            slurm.run("scontrol", "update", f"JobId={job.id}", f"StartTime={soon}")
    for shape, (guarded, raw) in jobs.items():
        results = {}
        for who, job in (("lifeguard", guarded), ("raw", raw)):
            run_id, pid = first[job.id]
            _, again, new_pid, attempt = job.wait_line("ready", count=2, timeout=150)
            assert again == run_id and attempt == "1" and int(new_pid) != pid
            ran = finish(submitter, job, run_id, int(new_pid))
            results[who] = ran
            record(case, shape, who, ran.summary())
        ran = results["lifeguard"]
        assert ran.status == "FINISHED", ran.summary() + "\n" + guarded.tail()
        assert ran.tags.get("lifeguard.reason") == "exit code 0", ran.tags  # not attempt 0's
        assert ran.slurm_state == "COMPLETED"
        # Ownership moved to the last attempt's process.
        assert ran.tags.get("lifeguard.owner.pid") == str(ran.pid), ran.tags
        params = client.get_run(ran.run_id).data.params
        assert set(params) == {"attempt_0_pid", "attempt_1_pid"}, params


def test_scancel_mlflow_server(slurm: Slurm, tmp_path: Path) -> None:
    """scancel against a local `mlflow server` (HTTP store) instead of sqlite."""
    from lifeguard.localserver import MlflowServer

    server = MlflowServer(tmp_path / "server").start()
    try:
        sub = Submitter(slurm, tmp_path / "jobs", server.uri)
        try:
            case = "scancel (mlflow server)"
            jobs = {shape: submit_pair(sub, case, shape) for shape in SHAPES}
            started = {job.id: ready(job) for pair in jobs.values() for job in pair}
            cancelled = time.time()
            for pair in jobs.values():
                for job in pair:
                    slurm.run("scancel", job.id)
            for shape, (guarded, raw) in jobs.items():
                ran = finish(sub, guarded, *started[guarded.id])
                base = finish(sub, raw, *started[raw.id])
                record(case, shape, "lifeguard", ran.summary())
                record(case, shape, "raw", base.summary())
                assert ran.status == "KILLED", ran.summary() + "\n" + guarded.tail()
                check_end_time(ran, cancelled)
        finally:
            sub.cancel_all()
    finally:
        server.stop()


def test_time_limit(
    time_limit_jobs: tuple[Submitter | None, dict[str, tuple[Job, Job]]], slurm: Slurm
) -> None:
    """--time=1: at the limit slurmd sends each srun task two SIGTERMs a few ms apart (one
    stop), then SIGKILL after KillWait. Submitted when the module started (fixture above)."""
    sub, jobs = time_limit_jobs
    assert sub is not None
    for shape, (guarded, raw) in jobs.items():
        run_id, pid = ready(guarded)
        raw_id, raw_pid = ready(raw)
        ran = finish(sub, guarded, run_id, pid, timeout=150)
        base = finish(sub, raw, raw_id, raw_pid, timeout=150)
        record("time limit", shape, "lifeguard", ran.summary())
        record("time limit", shape, "raw", base.summary())
        assert ran.slurm_state == "TIMEOUT"
        assert ran.status == "KILLED", ran.summary() + "\n" + guarded.tail()
        assert ran.tags.get("lifeguard.signal") == "SIGTERM", ran.tags
