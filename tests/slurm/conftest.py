"""A real single-node Slurm cluster (tests/slurm/cluster.sh) and helpers to run jobs on it.

The cluster changes the machine (it may apt-get install Slurm and munge, and it starts three
daemons), so it is started only when asked: ``LIFEGUARD_SLURM=1``, or ``CI=true``. Otherwise
every test here is skipped, with one line that says how to ask, and nothing is installed or
started, as root too. Asked, it is started once per session, after collection (so that its
start, apt-get included, counts against no test's timeout), and stopped at the end; if it cannot
run (no root, no packages), the tests fail: asked, a skip would pass for a run.

The cluster never meets another Slurm on the machine (cluster.sh: its own ports, munged,
config, state and job ids), and every client call of these tests goes to it: ``SLURM_CONF`` is
its slurm.conf, whatever the environment said, and no inherited ``SLURM_*``/``SBATCH_*``/...
variable (those of a job of a real cluster) reaches sbatch, scancel or scontrol.

Jobs are submitted with sbatch and synchronised on the lines ``train.py`` writes to a file;
every wait has a timeout. Each test submits its jobs together (every shape, with lifeguard and
without), so that one test's jobs run side by side; the tests themselves run one at a time,
because a preemption takes every preemptable job on the node.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

HERE = Path(__file__).parent
CLUSTER = HERE / "cluster.sh"
TRAIN = HERE / "train.py"
SLURM_DIR = Path(os.environ.get("LIFEGUARD_SLURM_DIR", "/tmp/lifeguard-slurm"))
# Every wait is bounded; jobs import mlflow (seconds of CPU) on a loaded 2-core machine.
TIMEOUT = 90.0
SHAPES = ("srun", "exec")
# Slurm's JobState values after which nothing of the job runs any more.
TERMINAL = {
    "BOOT_FAIL",
    "CANCELLED",
    "COMPLETED",
    "DEADLINE",
    "FAILED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "TIMEOUT",
}


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def asked() -> bool:
    """Only when asked may these tests install packages and start daemons."""
    return _in_ci() or os.environ.get("LIFEGUARD_SLURM", "").lower() in ("1", "true", "yes")


NOT_ASKED = (
    "not asked: the Slurm tests install Slurm and munge (apt-get) and start a test cluster; "
    "set LIFEGUARD_SLURM=1 to run them (CI=true does too)"
)
# Variables Slurm's clients read that could point them at another cluster or change what they
# submit (a job of a real cluster exports SLURM_JOB_ID, SLURM_CONF, SBATCH_*, ...).
CLIENT_VARIABLES = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "SQUEUE_", "SINFO_", "SCANCEL_",
                    "SCONTROL_")  # fmt: skip


def client_env() -> dict[str, str]:
    """Our environment for a Slurm client: this cluster's slurm.conf, nothing inherited."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(CLIENT_VARIABLES)}
    env["SLURM_CONF"] = str(SLURM_DIR / "slurm.conf")
    return env


def _here(item: pytest.Item) -> bool:
    return HERE in item.path.parents


# What the start in pytest_collection_finish found: None (not started), or why it failed.
_CLUSTER: dict[str, object] = {"started": False, "error": None}


def pytest_collection_finish(session: pytest.Session) -> None:
    if not asked() or session.config.option.collectonly:
        return
    if not any(_here(item) for item in session.items):
        return
    if sys.platform != "linux":
        _CLUSTER["error"] = "Linux only"
        return
    env = client_env()

    def ready() -> bool:
        if not (SLURM_DIR / "slurm.conf").exists() or shutil.which("sinfo") is None:
            return False
        done = subprocess.run(
            [str(CLUSTER), "status"], env=env, capture_output=True, timeout=60, check=False
        )
        return done.returncode == 0

    if ready():
        return  # started by an earlier session (or by hand): left running, as found
    if os.geteuid() != 0:
        _CLUSTER["error"] = "not root, and no cluster running (run tests/slurm/cluster.sh as root)"
        return
    SLURM_DIR.mkdir(parents=True, exist_ok=True)
    with open(SLURM_DIR.parent / "lifeguard-slurm.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # xdist workers or two sessions: one start
        if ready():
            return
        done = subprocess.run(
            [str(CLUSTER), "start"], env=env, capture_output=True, text=True,
            timeout=900, check=False,
        )  # fmt: skip
    if done.returncode != 0:
        _CLUSTER["error"] = f"cluster.sh start exited {done.returncode}: {done.stderr.strip()}"
        return
    _CLUSTER["started"] = True


def _stop_cluster() -> None:
    if _CLUSTER["started"]:
        subprocess.run([str(CLUSTER), "stop"], env=client_env(), timeout=120, check=False)
        _CLUSTER["started"] = False


@pytest.fixture(scope="session", autouse=True)
def _cluster_stopped_at_the_end() -> Iterator[None]:
    """Stops the cluster this session started as the session's fixtures end: before the check
    that the session left no process running (tests/conftest.py, set up earlier, so torn down
    later), which would otherwise find its daemons."""
    yield
    _stop_cluster()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not asked() and exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        # test_slurm.py skipped itself, as asked: a success (tox -e slurm says OK), not "no tests".
        session.exitstatus = pytest.ExitCode.OK
    _stop_cluster()  # no test ran (none selected): the fixture above never did


@dataclass
class Slurm:
    conf: Path
    env: dict[str, str]
    kill_wait: float
    proctrack: str

    def run(self, *cmd: str, check: bool = True) -> str:
        done = subprocess.run(
            cmd, env=self.env, capture_output=True, text=True, timeout=30, check=False
        )
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} -> {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def job_state(self, job_id: str) -> dict[str, str]:
        out = self.run("scontrol", "-o", "show", "job", job_id, check=False)
        return dict(re.findall(r"(\w+)=(\S*)", out))


@pytest.fixture(scope="session")
def slurm() -> Slurm:
    if _CLUSTER["error"]:
        # Asked, and the cluster cannot run: a failure, never a skip that passes for a run.
        pytest.fail(f"Slurm test cluster unavailable: {_CLUSTER['error']}", pytrace=False)
    conf = SLURM_DIR / "slurm.conf"
    text = conf.read_text()
    match = re.search(r"^KillWait=(\d+)", text, re.M)
    kill_wait = float(match.group(1)) if match else 30.0
    match = re.search(r"^ProctrackType=proctrack/(\w+)", text, re.M)
    return Slurm(conf, client_env(), kill_wait, match.group(1) if match else "unknown")


@dataclass
class Job:
    slurm: Slurm
    id: str
    name: str
    out: Path
    log: Path
    submitted: float
    extra: dict[str, object] = field(default_factory=dict)

    def lines(self) -> list[str]:
        try:
            return self.out.read_text().splitlines()
        except FileNotFoundError:
            return []

    def wait_line(self, prefix: str, timeout: float = TIMEOUT, count: int = 1) -> list[str]:
        """The ``count``-th line starting with ``prefix``, split; fails after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            found = [line.split() for line in self.lines() if line.startswith(prefix)]
            if len(found) >= count:
                return found[count - 1]
            state = self.slurm.job_state(self.id).get("JobState", "")
            if state in TERMINAL and len(found) < count:
                # One last read: the line may have landed just before the end.
                found = [line.split() for line in self.lines() if line.startswith(prefix)]
                if len(found) >= count:
                    return found[count - 1]
                raise AssertionError(
                    f"job {self.name} ({self.id}) ended {state} before {prefix!r}:\n{self.tail()}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"no {prefix!r} from job {self.name} ({self.id}) in {timeout}s "
                    f"(state {state}):\n{self.tail()}"
                )
            time.sleep(0.05)  # polling a file the job writes

    def wait_state(self, states: set[str] | None = None, timeout: float = TIMEOUT) -> str:
        """Wait until the job is in one of ``states`` (default: any terminal one)."""
        wanted = states or TERMINAL
        deadline = time.monotonic() + timeout
        while True:
            state = self.slurm.job_state(self.id).get("JobState", "")
            if state in wanted:
                return state
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"job {self.name} ({self.id}) still {state} after {timeout}s:\n{self.tail()}"
                )
            time.sleep(0.1)

    def tail(self) -> str:
        try:
            return self.log.read_text()[-3000:]
        except FileNotFoundError:
            return "(no job output)"


def batch_script(shape: str, argv: list[str], sbatch: list[str]) -> str:
    command = " ".join(_quote(a) for a in argv)
    launch = {"srun": f"srun {command}", "exec": f"exec {command}", "bare": command}[shape]
    directives = "".join(f"#SBATCH {option}\n" for option in sbatch)
    return f"#!/bin/bash\n{directives}{launch}\n"


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


@dataclass
class Submitter:
    slurm: Slurm
    tmp_path: Path
    uri: str
    jobs: list[Job] = field(default_factory=list)

    def submit(
        self,
        name: str,
        shape: str,
        *train_args: str,
        raw: bool = False,
        sbatch: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> Job:
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)  # a job name and a directory
        workdir = self.tmp_path / name
        workdir.mkdir(parents=True, exist_ok=True)
        out = workdir / "milestones.txt"
        log = workdir / "job.log"
        argv = [sys.executable, str(TRAIN), "--out", str(out), *train_args]
        if raw:
            argv.append("--raw")
        script = workdir / "job.sh"
        script.write_text(
            batch_script(
                shape, argv, [f"--job-name={name}", f"--output={log}", "--cpus-per-task=1", *sbatch]
            )
        )
        job_env = {
            k: v for k, v in self.slurm.env.items() if not k.startswith(("LIFEGUARD_", "MLFLOW_"))
        }
        job_env.update(
            MLFLOW_TRACKING_URI=self.uri,
            LIFEGUARD_JOURNAL_DIR=str(workdir / "journal"),
            PYTHONWARNINGS="ignore",
            PYTHONUNBUFFERED="1",
        )
        job_env.update(env or {})
        submitted = time.time()
        done = subprocess.run(
            ["sbatch", "--parsable", f"--chdir={workdir}", str(script)],
            env=job_env, capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        job = Job(self.slurm, done.stdout.strip().split(";")[0], name, out, log, submitted)
        self.jobs.append(job)
        return job

    def cancel_all(self) -> None:
        for job in self.jobs:
            self.slurm.run("scancel", "--quiet", job.id, check=False)


@pytest.fixture
def submitter(slurm: Slurm, tmp_path: Path, template_db: Path) -> Iterator[Submitter]:
    path = tmp_path / "mlflow.db"
    shutil.copy(template_db, path)
    sub = Submitter(slurm, tmp_path, f"sqlite:///{path}")
    yield sub
    sub.cancel_all()  # a test that failed half-way leaves nothing running


# -- the table printed at the end: lifeguard beside raw MLflow, for every case and shape --------

RESULTS: dict[tuple[str, str], dict[str, str]] = {}


def record(case: str, shape: str, who: str, result: str) -> None:
    RESULTS.setdefault((case, shape), {})[who] = result


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not RESULTS:
        return
    tr = terminalreporter
    tr.section("Slurm endings: lifeguard beside raw MLflow (observed)")
    width = max(len(case) for case, _ in RESULTS) + 2
    tr.write_line(f"{'case':<{width}}{'shape':<7}{'raw MLflow':<32}lifeguard")
    for (case, shape), row in RESULTS.items():
        tr.write_line(
            f"{case:<{width}}{shape:<7}{row.get('raw', '-'):<32}{row.get('lifeguard', '-')}"
        )
