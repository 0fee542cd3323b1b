"""Shared fixtures: a real sqlite MLflow store per test, and a runner for the child programs."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lifeguard.demo import ChildResult, drive, proc_stat, run_child
from lifeguard.demo import wait_gone as demo_wait_gone
from lifeguard.forkserver import ForkServer
from lifeguard.localserver import MlflowServer

CHILDREN = Path(__file__).parent / "children"
REPO = Path(__file__).parent.parent

# One child import of mlflow costs ~1.5 s of CPU; on a loaded 2-core machine a child can take
# many times that. This bounds each wait, not the expected duration.
CHILD_TIMEOUT = 90.0
# How far apart two processes may see the same death on a loaded machine (ms): a watchdog that
# stamps the end time as it wakes may be scheduled a moment after the test that reaped the child.
SEEN_APART_MS = 500
# The randomized and repeated tests (the stress run, the import beside a replay, asyncio's
# Ctrl-C) run their full count of trials where LIFEGUARD_TEST_FULL=1 (CI: .ci/run sets it) and
# fewer in a contributor's `tox`, each trial a real one: their point is the rare race, which the
# full count is for, and they are most of the suite's time.
FULL_TRIALS = os.environ.get("LIFEGUARD_TEST_FULL") == "1"


def trials(full: int, quick: int) -> int:
    return full if FULL_TRIALS else quick


def shows_lifeguard(text: str) -> bool:
    """Whether ``text`` (a child's output) shows anything of lifeguard's: a line of its, its
    name, a frame of its code. The checkout's own path is taken out first: cloned as
    ``.../lifeguard``, as a newcomer's clone is, it is in every frame of the test env's packages
    (``.tox/tests/lib/.../mlflow/...``), and three tests failed a newcomer's `tox` on that
    alone. A frame of the package itself (``<checkout>/lifeguard/...``) still shows."""
    for root in {str(REPO), str(REPO.resolve())}:
        text = text.replace(root + os.sep, "<checkout>" + os.sep)
    return "lifeguard" in text


# MLflow's telemetry is off while a test runs (it reads PYTEST_CURRENT_TEST), but not while pytest
# collects: the first `import mlflow` of a test module wrote ~/.config/mlflow/telemetry.json in
# the contributor's real home, a change outside .tox. Off for this process, before any import of
# mlflow; the children's environments drop every MLFLOW_ variable (_base_env) and keep theirs.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

# `tox` leaves no process running and writes nothing outside .tox and the temporary directory
# (docs/tests.md). Each pytest process (each xdist worker) marks the environment that its tests'
# processes inherit, and points HOME at an empty directory of its own; at the end of its
# session, a process that still carries its mark, or anything written in that HOME, fails the
# session's last test (_leaves_nothing_behind). A process started with an environment made from
# scratch carries no mark, and is not seen.
SESSION_MARK = "PYTEST_LIFEGUARD_SESSION"
os.environ[SESSION_MARK] = f"{os.getpid()}-{time.time_ns()}"
SESSION_HOME = Path(tempfile.mkdtemp(prefix="lifeguard-tests-home-"))
os.environ["HOME"] = str(SESSION_HOME)
for _var in ("XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME"):
    os.environ.pop(_var, None)  # each defaults to a directory under HOME
# From a session's end to a process it started having ended: a replayer or a guardian whose
# program a test's teardown has just killed may still be writing its last status.
LEFTOVER_GRACE = 30.0

# The environment pytest started with, before any test's monkeypatch: the warm interpreter's.
_STARTING_ENVIRON = dict(os.environ)


# optionalhook: an env without pytest-xdist (slurm's) loads this file too.
@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto`` (tox): one worker more than the cores this process may run on. A fifth of
    the suite's test time is spent waiting with nothing on a core (a server that comes back a
    minute later, heartbeats, a sweep's stale-after, a store locked for seconds): with a worker
    per core the cores were 81 % busy and pytest took 604 s, with one more 97 % and 487 s
    (``scripts/suite_cpu.py``, the whole suite, one quiet 2-core machine, one after the other).
    The tests were written for a loaded machine, which this is. PYTEST_XDIST_AUTO_NUM_WORKERS,
    when set, decides as xdist documents."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS") or config.option.numprocesses != "auto":
        return None
    return len(os.sched_getaffinity(0)) + 1


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The few tests that take minutes (marked ``long``) go first, the rest keep their order.
    Under `pytest -n auto --dist worksteal` (tox) the workers then share the short tests out
    around them; a long test left to the end would run alone while the other worker idles."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


@pytest.fixture(scope="session")
def template_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty, fully migrated MLflow sqlite store. Migrating takes seconds, so it is done once
    per worker and copied into each test's tmp_path."""
    import logging

    from mlflow.tracking import MlflowClient

    logging.getLogger("mlflow").setLevel(logging.WARNING)
    path = tmp_path_factory.mktemp("template") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """One real `mlflow server` per pytest worker, shared by every test that needs a live server
    and looks only at runs it made itself (a start costs seconds of CPU: two interpreters import
    mlflow). Tests that stop or restart their server, or need an empty one, start their own."""
    srv = MlflowServer(tmp_path_factory.mktemp("server")).start()
    yield srv
    srv.stop()


class Store:
    """A real sqlite MLflow store in the test's tmp_path."""

    def __init__(self, path: Path) -> None:
        from mlflow.tracking import MlflowClient

        self.path = path
        self.uri = f"sqlite:///{path}"
        self.client = MlflowClient(tracking_uri=self.uri)

    def run(self, run_id: str):
        return self.client.get_run(run_id)

    def status(self, run_id: str) -> str:
        return str(self.run(run_id).info.status)


@pytest.fixture
def store(tmp_path: Path, template_db: Path) -> Store:
    path = tmp_path / "mlflow.db"
    shutil.copy(template_db, path)
    return Store(path)


def _base_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """What every child program's environment has in common: child_env() without a store."""
    environ = dict(os.environ) if environ is None else environ
    # MLflow's own variables stay with this process: the tracking URI the tests set, and the
    # telemetry session id (_MLFLOW_TELEMETRY_SESSION_ID) MLflow puts in os.environ once used.
    prefixes = ("LIFEGUARD_", "MLFLOW_", "_MLFLOW_")
    env = {k: v for k, v in environ.items() if not k.startswith(prefixes)}
    env["PYTHONWARNINGS"] = "ignore"
    return env


def child_env(store: Store, **extra: str) -> dict[str, str]:
    env = _base_env()
    env.update(
        MLFLOW_TRACKING_URI=store.uri,
        LIFEGUARD_JOURNAL_DIR=str(store.path.parent / "journal"),
    )
    env.update(extra)
    return env


def sweep(store: Store) -> None:
    """``lifeguard sweep`` as a user runs it after the fact: it replays the journal."""
    done = lifeguard_cli("sweep", "--tracking-uri", store.uri, env=child_env(store))
    assert done.returncode == 0, done.stdout + done.stderr


def lifeguard_cli(
    *args: str,
    env: dict[str, str] | None = None,
    timeout: float = CHILD_TIMEOUT,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """``python -m lifeguard ARGS`` run to its end, its output captured: forked from the warm
    interpreter (tests/zygote.py) where ``env`` allows it, else started cold. A sweep is a
    short program that imports mlflow and asks a store: cold, ~4 s of CPU, most of it the
    import; the tests run ~80 of them. ``env`` defaults to a child's (:func:`_base_env`). A
    test of the CLI's own start (a bad option, what a bad URI prints) runs it cold itself."""
    env = _base_env() if env is None else env
    cmd = [sys.executable, "-m", "lifeguard", *args]
    if WARM.takes(env):
        done = WARM.run(cmd, env, timeout=timeout, cwd=cwd and str(cwd), expect_ready=False)
        return subprocess.CompletedProcess(cmd, done.returncode, done.stdout, done.stderr)
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def without_and_with(
    program: Path, env: dict[str, str]
) -> dict[str, subprocess.CompletedProcess[str]]:
    """Run ``program`` twice to the end: with ``off`` (no lifeguard) and ``on`` as its argument,
    for a program that installs lifeguard only when told; the outputs are then compared."""
    return {
        mode: subprocess.run(
            [sys.executable, str(program), mode],
            env=env,
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT,
            check=False,
        )
        for mode in ("off", "on")
    }


def wait_gone(pid: int, timeout: float = 60.0) -> None:
    """Wait for a process we are not the parent of (a watchdog, a reparented fork child)."""
    assert demo_wait_gone(pid, timeout), f"process {pid} still alive after {timeout}s"


def wait_blocked(pid: int, where: str, timeout: float = 60.0) -> None:
    """Wait until ``pid``'s main thread sleeps in a kernel function whose name holds ``where``
    ("pipe_read": a read of stdin, ``anon_pipe_read`` on recent kernels). A signal whose Python
    handler must run soon is sent then: one that lands between the handler check CPython makes
    before a blocking call and the call's system call is handled only once the call returns,
    with or without lifeguard (a read of stdin: when the test closes it)."""
    deadline = time.monotonic() + timeout
    seen = "nothing"
    while True:
        stat = proc_stat(pid)
        state = "gone" if stat is None else stat[0]
        try:
            with open(f"/proc/{pid}/wchan") as f:
                seen = f"state {state}, in {f.read()!r}"
        except OSError:
            state = "gone"
        assert state not in ("gone", "Z", "X"), f"{pid} ended before it blocked in {where!r}"
        if state == "S" and where in seen:
            return
        assert time.monotonic() < deadline, f"{pid} not blocked in {where!r} ({seen})"
        time.sleep(0.005)


@pytest.fixture(autouse=True)
def _private_journal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Never touch the developer's real ~/.cache/lifeguard from a test.
    monkeypatch.setenv("LIFEGUARD_JOURNAL_DIR", str(tmp_path / "journal"))


# What a forked child may have that its warm interpreter had not: variables read only once the
# program runs (by lifeguard, by MLflow's fluent API, by the child programs themselves). Any other
# difference (PYTHONPATH, HOME, an MLFLOW_ setting read as mlflow is imported) needs a cold start.
_READ_LATE = ("LIFEGUARD_", "TEST_", "RESUME_", "PYTEST_")
# ...but MLflow reads whether this one is set at all as it is imported (its telemetry).
_READ_AT_IMPORT = frozenset({"PYTEST_CURRENT_TEST"})
_READ_LATE_NAMES = frozenset(
    {"MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_TOKEN", "MLFLOW_RUN_ID", "MLFLOW_RUN_ID_EXPECTED"}
)


class WarmInterpreter:
    """One fork server per pytest worker (tests/zygote.py), started on first use: the child
    programs that need no cold start are forked from it, each saving the ~4 s of CPU that
    ``import mlflow`` and a store's first query cost (most of each such test's time). Set
    LIFEGUARD_TEST_COLD=1 to exec every child instead."""

    def __init__(self) -> None:
        self.server: ForkServer | None = None
        self.env = _base_env(_STARTING_ENVIRON)
        # Every child starts with PYTEST_CURRENT_TEST in its environment (child_env copies it
        # from a running test), and MLflow reads its presence as it is imported (its telemetry
        # stays off under pytest, and in CI). The warm interpreter imports mlflow as they do.
        self.env["PYTEST_CURRENT_TEST"] = "tests/zygote.py (the warm interpreter)"
        self.cold = os.environ.get("LIFEGUARD_TEST_COLD") == "1"

    def takes(self, env: dict[str, str]) -> bool:
        if self.cold:
            return False
        for key in self.env.keys() | env.keys():
            if self.env.get(key) == env.get(key):
                continue
            if not (key.startswith(_READ_LATE) or key in _READ_LATE_NAMES):
                return False
            if key in _READ_AT_IMPORT and (key in self.env) != (key in env):
                return False
        return True

    def run(self, cmd: list[str], env: dict[str, str], **kwargs: object) -> ChildResult:
        """:func:`run_child` for ``[sys.executable, PROGRAM, *ARGS]`` (or ``[sys.executable,
        "-m", MODULE, *ARGS]``), forked."""
        import time

        assert cmd[0] == sys.executable and (cmd[1].endswith(".py") or cmd[1] == "-m"), cmd
        if self.server is None:
            zygote = str(Path(__file__).parent / "zygote.py")
            self.server = ForkServer([sys.executable, zygote], self.env)
        started = time.monotonic()
        timeout = float(kwargs.get("timeout", CHILD_TIMEOUT))  # type: ignore[arg-type]
        # The working directory a Popen would give it: ours now, not the server's at its start.
        cwd = kwargs.pop("cwd", None) or os.getcwd()
        kwargs.pop("die_with_parent", None)  # it dies with the server, which dies with us
        child = self.server.spawn(cmd[1:], env, timeout, cwd=cwd)  # type: ignore[arg-type]
        return drive(child, cmd, started, **kwargs)  # type: ignore[arg-type]

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None


# One per pytest worker, its fork server started on first use: shared by the tests' programs
# (the ``warm`` fixture) and their sweeps (:func:`lifeguard_cli`), closed as the session ends.
WARM = WarmInterpreter()


def pytest_sessionfinish() -> None:
    WARM.close()
    shutil.rmtree(SESSION_HOME, ignore_errors=True)


def processes_of_this_session() -> dict[int, str]:
    """pid -> command line of every live process whose environment carries this pytest
    process's mark (/proc/PID/environ: the environment it was started with), but itself."""
    mark = f"{SESSION_MARK}={os.environ[SESSION_MARK]}".encode()
    found: dict[int, str] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                marked = mark in f.read().split(b"\0")
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile
            continue
        if marked and cmdline:  # a zombie has no command line: ended, not yet reaped
            found[int(name)] = cmdline
    return found


@pytest.fixture(scope="session", autouse=True)
def _leaves_nothing_behind() -> Iterator[None]:
    """Set up before, and torn down after, every other fixture of the session (the servers,
    the warm interpreter): what is left then was left by a test."""
    yield
    WARM.close()
    deadline = time.monotonic() + LEFTOVER_GRACE
    left = processes_of_this_session()
    while left and time.monotonic() < deadline:  # each may be ending: bounded, then named
        time.sleep(0.2)
        left = processes_of_this_session()
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    written = sorted(str(p.relative_to(SESSION_HOME)) for p in SESSION_HOME.rglob("*"))
    problems = []
    if left:
        problems.append(
            f"{len(left)} process(es) of this session still ran {LEFTOVER_GRACE:g} s after its "
            "end (killed now): " + "; ".join(f"{pid}: {cmd}" for pid, cmd in left.items())
        )
    if written:
        problems.append(f"written in HOME ({SESSION_HOME}) by the tests: {', '.join(written)}")
    assert not problems, "\n".join(problems)


@pytest.fixture(scope="session")
def warm() -> WarmInterpreter:
    return WARM


class Scenario:
    """Runs tests/children/program.py and collects what a test asserts on."""

    def __init__(self, store: Store, tmp_path: Path, warm: WarmInterpreter) -> None:
        self.store = store
        self.record = tmp_path / "finalizer-calls.txt"
        self.warm = warm

    def run(
        self,
        *args: str,
        send: tuple[int, ...] = (),
        env: dict[str, str] | None = None,
        launcher: tuple[str, ...] = (),
        **kwargs: object,
    ) -> ChildResult:
        """``launcher`` goes before the program, e.g. ``("-m", "lifeguard", "run", "--",
        sys.executable)`` to run it under the supervisor. The program is forked from the warm
        interpreter unless it must start cold: under a launcher, with mlflow imported after
        install() (the import order is what such a test is about: the warm one has imported
        it), or with an environment the warm interpreter did not start with."""
        program = [str(CHILDREN / "program.py"), "--record", str(self.record), *args]
        cmd = [sys.executable, *launcher, *program] if launcher else [sys.executable, *program]
        env = env or child_env(self.store)
        if (
            not launcher
            and "after" not in args
            and "--order=after" not in args
            # A top level that raises SystemExit itself is judged by its last instruction
            # (ending._raised_anew), which under the zygote is the zygote's frame's.
            and "--bare-exit" not in args
            and kwargs.get("new_session", True)
            and kwargs.get("die_with_parent", True)
            and self.warm.takes(env)
        ):
            return self.warm.run(cmd, env, send=send, timeout=CHILD_TIMEOUT, **kwargs)
        return run_child(
            cmd,
            env=env,
            send=send,
            timeout=CHILD_TIMEOUT,
            **kwargs,  # type: ignore[arg-type]
        )

    def calls(self) -> list[tuple[int, str]]:
        """(pid, status) for every time the recording finalizer ran."""
        if not self.record.exists():
            return []
        lines = self.record.read_text().split()
        return [(int(pid), status) for pid, status in zip(lines[::2], lines[1::2], strict=True)]


@pytest.fixture
def scenario(store: Store, tmp_path: Path, warm: WarmInterpreter) -> Scenario:
    return Scenario(store, tmp_path, warm)
