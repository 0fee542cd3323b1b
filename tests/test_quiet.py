"""Nothing to do costs nothing, and nowhere to journal is handled quietly and truthfully
(issue 23).

A program that imports mlflow and starts no run (a data-prep step, a shared entry point) gets no
client, no store file and no output from lifeguard. A process whose user has no home, or a
read-only one, journals in a private place of its own on the host, creates nothing elsewhere,
and says nothing unless a status is really lost for now: then one line, that says what happens.
"""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from lifeguard.demo import run_child
from tests.conftest import CHILD_TIMEOUT, Store, child_env
from tests.servers import MlflowServer

pytestmark = pytest.mark.slow

INSTALL = "import lifeguard; lifeguard.install()\n"
WAIT_FOR_SIGTERM = (
    "import json, time\n"
    "print('LIFEGUARD-READY ' + json.dumps({'pid': __import__('os').getpid()}), flush=True)\n"
    "time.sleep(60)\n"
)


def bare_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LIFEGUARD_", "MLFLOW_"))}
    env.update(PYTHONWARNINGS="ignore", **extra)
    return env


@pytest.mark.parametrize("shape", ["returns", "python -W error", "a tracking uri never used"])
def test_importing_mlflow_without_a_run_leaves_no_file_and_no_output(
    tmp_path: Path, shape: str
) -> None:
    """``install(); import mlflow`` in an empty directory: no ``mlflow.db`` (MLflow's default
    store, created and migrated by the first client), nothing on stderr, the same exit as
    without lifeguard."""
    results = {}
    for on in (False, True):
        cwd = tmp_path / f"work-{on}"
        cwd.mkdir()
        never = tmp_path / f"never-{on}.db"
        env = bare_env(LIFEGUARD_JOURNAL_DIR=str(tmp_path / "journal"))
        if shape == "a tracking uri never used":
            env["MLFLOW_TRACKING_URI"] = f"sqlite:///{never}"
        flags = ["-W", "error"] if shape == "python -W error" else []
        results[on] = subprocess.run(
            [sys.executable, *flags, "-c", (INSTALL if on else "") + "import mlflow\n"],
            cwd=cwd,
            env={**env, **({"PYTHONWARNINGS": "error"} if flags else {})},
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT,
        )
        assert list(cwd.iterdir()) == [], results[on].stderr
        assert not never.exists()
    assert results[True].returncode == results[False].returncode == 0, results[True].stderr
    assert results[True].stderr == results[False].stderr


def test_a_start_run_that_mlflow_itself_fails_adds_nothing(tmp_path: Path) -> None:
    """``python -W error``: MLflow itself cannot open a sqlite store (SQLAlchemy's deprecation
    warning, an error under ``-W error``), and ``start_run`` raises before any run exists. The
    program's traceback is MLflow's; lifeguard has no run to end, so it builds no client and
    prints nothing (it added a second, 40-line traceback from a client built for a search)."""
    results = {}
    for on in (False, True):
        cwd = tmp_path / f"work-{on}"
        cwd.mkdir()
        env = bare_env(
            LIFEGUARD_JOURNAL_DIR=str(tmp_path / "journal"),
            MLFLOW_TRACKING_URI=f"sqlite:///{cwd / 'mlflow.db'}",
        )
        env["PYTHONWARNINGS"] = "error"
        results[on] = subprocess.run(
            [sys.executable, "-W", "error", "-c", (INSTALL if on else "") + RUN_AND_PRINT],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT,
        )
    without, with_ = results[False], results[True]
    # The premise: MLflow's own failure, without lifeguard too (a later SQLAlchemy may warn no
    # more; this test then proves nothing and says so).
    assert without.returncode == 1 and "Warning" in without.stderr, without.stderr
    assert with_.returncode == without.returncode
    assert _without_lines_of_this_file(with_.stderr) == _without_lines_of_this_file(without.stderr)
    assert "lifeguard" not in with_.stderr
    assert not (tmp_path / "journal").exists()


RUN_AND_PRINT = "import mlflow\nrun = mlflow.start_run()\nprint(run.info.run_id)\n"


def _without_lines_of_this_file(stderr: str) -> str:
    """A traceback without the ``-c`` program's own lines: its first line differs by the
    install line in front of it."""
    return "\n".join(line for line in stderr.splitlines() if '"<string>", line' not in line)


def test_a_sigterm_with_no_run_leaves_no_file_and_no_output(tmp_path: Path) -> None:
    cwd = tmp_path / "work"
    cwd.mkdir()
    result = run_child(
        [sys.executable, "-c", INSTALL + "import mlflow\n" + WAIT_FOR_SIGTERM],
        env=bare_env(LIFEGUARD_JOURNAL_DIR=str(tmp_path / "journal")),
        send=(signal.SIGTERM,),
        timeout=CHILD_TIMEOUT,
        cwd=str(cwd),
    )
    assert result.returncode == -signal.SIGTERM
    assert result.stderr == ""
    assert list(cwd.iterdir()) == []
    assert not (tmp_path / "journal").exists()


def test_a_run_the_program_ended_itself_needs_nothing_at_exit(store: Store, tmp_path: Path) -> None:
    """``with mlflow.start_run():`` ends the run in the block: lifeguard has nothing to do at
    exit, and the program's output is the same as without it."""
    code = (
        "import mlflow\n"
        "with mlflow.start_run() as run:\n"
        "    mlflow.log_metric('m', 1.0)\n"
        "print(run.info.run_id)\n"
    )
    results = {
        on: subprocess.run(
            [sys.executable, "-c", (INSTALL if on else "") + code],
            env=child_env(store),
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT,
        )
        for on in (False, True)
    }
    assert results[True].returncode == 0, results[True].stderr
    assert results[True].stderr == results[False].stderr
    run = store.run(results[True].stdout.strip())
    assert run.info.status == "FINISHED"
    assert "lifeguard.reason" not in run.data.tags  # MLflow ended it; lifeguard never wrote


# -- MLflow's own output at exit ------------------------------------------------------------

LINKED = """
import os, signal, sys, time
{install}
import mlflow
run = mlflow.start_run(run_name="train")
print("RUN", run.info.run_id, flush=True)
print("training", flush=True)
{ending}
"""

LINK_ENDINGS = {
    "returns": "",
    "sys.exit(3)": "sys.exit(3)",
    "an exception": "raise RuntimeError('loss is NaN')",
    "SIGTERM": "os.kill(os.getpid(), signal.SIGTERM); time.sleep(60)",
}


@pytest.mark.parametrize("ending", list(LINK_ENDINGS))
def test_mlflows_own_links_at_exit_are_printed_as_without_lifeguard(
    mlflow_server: MlflowServer, tmp_path: Path, ending: str
) -> None:
    """A run on a tracking server: at exit, MLflow's own hook prints "🏃 View run train at:
    URL" and "🧪 View experiment at: URL" on stdout, after the program's output; launchers'
    and CI logs keep the link to the run. lifeguard ends the run instead of that hook, and the
    same lines come out, in the same place; none where MLflow prints none (a SIGTERM: its hook
    never runs). Seen: the lines were gone."""
    results = {}
    for on in (False, True):
        code = LINKED.replace("{install}", INSTALL.strip() if on else "")
        results[on] = subprocess.run(
            [sys.executable, "-c", code.replace("{ending}", LINK_ENDINGS[ending])],
            env=bare_env(
                MLFLOW_TRACKING_URI=mlflow_server.uri,
                LIFEGUARD_JOURNAL_DIR=str(tmp_path / "journal"),
            ),
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT,
        )
    without, with_ = results[False], results[True]
    assert with_.returncode == without.returncode, with_.stderr
    if ending != "SIGTERM":  # the premise: MLflow prints them
        assert "🏃 View run train at: " in without.stdout, without.stdout
    assert _same_run(with_.stdout) == _same_run(without.stdout), with_.stderr
    assert with_.stderr == without.stderr


def _same_run(stdout: str) -> str:
    """The output with the run's id (and so its URL) made the same for any run."""
    run_id = stdout.split("RUN ", 1)[1].split()[0]
    return stdout.replace(run_id, "ID")


# -- no home, or a read-only one -------------------------------------------------------------

PROGRAM = (
    INSTALL
    + "import json, time, mlflow\n"
    + "run = mlflow.start_run()\n"
    + "print('LIFEGUARD-READY ' + json.dumps({'run_id': run.info.run_id}), flush=True)\n"
    + "time.sleep(60)\n"
)


def no_home_env(store: Store, home: Path, tmp: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in child_env(store).items()
        if k not in ("LIFEGUARD_JOURNAL_DIR", "XDG_CACHE_HOME", "XDG_RUNTIME_DIR")
    }
    env.update(HOME=str(home), TMPDIR=str(tmp), **extra)
    return env


def test_a_user_without_a_home_journals_in_a_private_place_of_its_own(
    store: Store, tmp_path: Path
) -> None:
    """HOME names a directory that does not exist (a container's user): nothing is created
    there; the journal goes to a 0700 directory of the user's under the temporary directory;
    the store write succeeds, so nothing is said."""
    home = tmp_path / "nonexistent"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    result = run_child(
        [sys.executable, "-c", PROGRAM],
        env=no_home_env(store, home, tmp),
        send=(signal.SIGTERM,),
        timeout=CHILD_TIMEOUT,
    )
    assert result.returncode == -signal.SIGTERM
    assert result.stderr == ""
    assert store.status(str(result.ready["run_id"])) == "KILLED"
    assert not home.exists()
    private = tmp / f"lifeguard-{os.getuid()}"
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    assert list((private / "journal").iterdir()) == []  # written ahead, removed once ended


def test_a_planted_fallback_directory_is_not_used(store: Store, tmp_path: Path) -> None:
    """The temporary directory is everyone's: a ``lifeguard-UID`` there that is not the user's
    own private directory is refused, not written into."""
    home = tmp_path / "nonexistent"
    tmp = tmp_path / "tmp"
    planted = tmp / f"lifeguard-{os.getuid()}"
    planted.mkdir(parents=True)
    planted.chmod(0o777)
    result = run_child(
        [sys.executable, "-c", PROGRAM],
        env=no_home_env(store, home, tmp),
        send=(signal.SIGTERM,),
        timeout=CHILD_TIMEOUT,
    )
    assert result.returncode == -signal.SIGTERM
    assert result.stderr == ""  # the store write succeeded: nothing lost, nothing said
    assert store.status(str(result.ready["run_id"])) == "KILLED"
    assert list(planted.iterdir()) == []
    assert not home.exists()


def _unshare_works() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, timeout=30)
    return probe.returncode == 0


def test_a_read_only_home_is_not_written_and_nothing_is_said(store: Store, tmp_path: Path) -> None:
    """A home mounted read-only: the journal goes elsewhere, and the store write succeeds, so
    nothing is said (it used to print "cannot journal run" for every run)."""
    if not _unshare_works():
        if os.environ.get("CI"):
            pytest.fail("a read-only bind mount needs root and unshare --mount")
        pytest.skip("a read-only bind mount needs root and unshare --mount")
    home = tmp_path / "home"
    home.mkdir()
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    # A mount namespace of the child's own: the read-only bind mount goes with it.
    script = (
        f'mount --bind "{home}" "{home}" && mount -o remount,bind,ro "{home}" '
        f'&& exec "{sys.executable}" -c "$0"'
    )
    result = run_child(
        ["unshare", "--mount", "sh", "-c", script, PROGRAM],
        env=no_home_env(store, home, tmp),
        send=(signal.SIGTERM,),
        timeout=CHILD_TIMEOUT,
    )
    assert result.returncode == -signal.SIGTERM, result.stderr
    assert result.stderr == ""
    assert store.status(str(result.ready["run_id"])) == "KILLED"
    assert list(home.iterdir()) == []


def test_a_status_that_cannot_be_kept_is_one_line_that_says_what_happens(
    store: Store, tmp_path: Path
) -> None:
    """Nowhere to journal (the journal's path runs through a file by the time the program
    ends: install() refuses one that does so already) and a store that cannot be written
    (another process holds sqlite's write lock past the deadline): one line per run, saying the
    run stays RUNNING until ``lifeguard sweep`` ends it; no traceback; the exit is the signal's,
    as without lifeguard."""
    not_a_dir = tmp_path / "a-file"
    not_a_dir.mkdir()
    env = child_env(store, LIFEGUARD_JOURNAL_DIR=str(not_a_dir / "journal"), LIFEGUARD_DEADLINE="2")
    holder: list[sqlite3.Connection] = []

    def lock_the_store(ready: dict[str, object]) -> None:
        shutil.rmtree(not_a_dir)
        not_a_dir.write_text("")
        connection = sqlite3.connect(store.path, timeout=30, isolation_level=None)
        connection.execute("BEGIN EXCLUSIVE")
        holder.append(connection)

    try:
        result = run_child(
            [sys.executable, "-c", PROGRAM],
            env=env,
            send=(signal.SIGTERM,),
            timeout=CHILD_TIMEOUT,
            after_ready=lock_the_store,
        )
    finally:
        for connection in holder:
            connection.rollback()
            connection.close()
    assert result.returncode == -signal.SIGTERM
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"lifeguard: could not end run {result.ready['run_id']} as KILLED")
    assert "could not be journaled" in lines[0]
    assert "stays RUNNING until `lifeguard sweep` ends it" in lines[0]
    assert store.status(str(result.ready["run_id"])) == "RUNNING"


# The variables by which MLflow's telemetry tells a CI machine or a running test (and stays off).
_CI_MARKERS = ("CI", "GITHUB_ACTIONS", "GITLAB_CI", "JENKINS_URL", "BUILDKITE", "TF_BUILD")


def test_collecting_the_suite_writes_nothing_in_the_home(tmp_path: Path) -> None:
    """`tox` changes nothing outside .tox. pytest's collection imports mlflow (test modules do,
    at their top) before any test runs, when MLflow's telemetry does not know it is under pytest:
    it wrote ~/.config/mlflow/telemetry.json in the contributor's home. Collected here as on a
    contributor's machine: not in CI, and in a home of its own."""
    home = tmp_path / "home"
    home.mkdir()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MLFLOW_", "PYTEST_", "DO_NOT_TRACK")) and k not in _CI_MARKERS
    }
    env["HOME"] = str(home)
    repo = Path(__file__).parent.parent
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "tests/test_containers.py"],
        cwd=repo, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(str(p.relative_to(home)) for p in home.rglob("*")) == []
