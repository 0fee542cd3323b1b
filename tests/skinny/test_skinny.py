"""lifeguard on `mlflow-skinny` (tox -e skinny): what a training node that logs to a remote server
installs. Skinny has no `mlflow server` and no SQL store, so the server runs from a full install
in another environment (LIFEGUARD_TEST_SERVER_PYTHON, which tox sets), and every run here lives
there. Each test first proves that this environment really is skinny, so that none can pass on a
full install."""

from __future__ import annotations

import importlib
import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest

from tests.conftest import Scenario, child_env, wait_gone
from tests.servers import MlflowServer

SERVER_PYTHON = os.environ.get("LIFEGUARD_TEST_SERVER_PYTHON", "")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not SERVER_PYTHON,
        reason="run by `tox -e skinny`, which sets LIFEGUARD_TEST_SERVER_PYTHON to the python of "
        "a full mlflow install for the server",
    ),
]

# What mlflow-skinny leaves out, and a full install has: the SQL store and the server.
ABSENT = (
    "sqlalchemy",
    "alembic",
    "mlflow.store.db.utils",
    "mlflow.store.tracking.sqlalchemy_store",
    "mlflow.server",
)

DEADLINE = 3.0
# Bounds the wait from the signal to the exit beyond the deadline: interpreter start-up and
# teardown on a loaded 2-core machine. Raw MLflow against a dead server retries for minutes.
EXIT_SLACK = 15.0


def assert_skinny() -> None:
    assert metadata.version("mlflow-skinny")
    with pytest.raises(metadata.PackageNotFoundError):
        metadata.distribution("mlflow")
    for name in ABSENT:
        with pytest.raises(ImportError):
            importlib.import_module(name)


@pytest.fixture(autouse=True)
def _skinny() -> None:
    assert_skinny()


class ServerStore:
    """The `store` the shared fixtures expect, on a server: the runs are read through the REST
    client, the only store skinny has. ``path`` only places the journal (in tmp_path)."""

    def __init__(self, uri: str, tmp_path: Path) -> None:
        from mlflow.tracking import MlflowClient

        self.uri = uri
        self.path = tmp_path / "server-store"
        self.client = MlflowClient(tracking_uri=uri)

    def run(self, run_id: str):  # type: ignore[no-untyped-def]
        return self.client.get_run(run_id)

    def status(self, run_id: str) -> str:
        return str(self.run(run_id).info.status)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    srv = MlflowServer(tmp_path_factory.mktemp("server"), python=SERVER_PYTHON).start()
    yield srv
    srv.stop()


@pytest.fixture
def store(server: MlflowServer, tmp_path: Path) -> ServerStore:
    return ServerStore(server.uri, tmp_path)


def journal_dir(store: ServerStore) -> Path:
    return store.path.parent / "journal"


def test_the_client_is_skinny_and_the_server_is_not() -> None:
    """The premise, said once more on its own: a full install here would make every test below
    prove nothing about skinny."""
    assert_skinny()
    full = subprocess.run(
        [SERVER_PYTHON, "-c", "import sqlalchemy, mlflow.server, mlflow.store.db.utils"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert full.returncode == 0, full.stderr


# path -> (MLflow status, exit status as subprocess reports it)
IN_PROCESS = {
    "SIGTERM": ("KILLED", -signal.SIGTERM),
    "sys.exit(3)": ("FAILED", 3),
    "exception": ("FAILED", 1),
}


@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("path", list(IN_PROCESS))
def test_in_process(scenario: Scenario, store: ServerStore, path: str, order: str) -> None:
    status, returncode = IN_PROCESS[path]
    before = int(time.time() * 1000)
    sig = signal.SIGTERM if path == "SIGTERM" else None
    result = scenario.run("--path", path, "--order", order, send=() if sig is None else (sig,))
    after = int(time.time() * 1000)

    assert result.returncode == returncode, result.stderr
    [run_id] = result.ready["run_ids"]
    run = store.run(run_id)
    assert run.info.status == status
    assert run.info.end_time is not None
    assert before <= run.info.start_time <= run.info.end_time <= after
    assert scenario.calls() == [(result.ready["pid"], status)]
    tags = run.data.tags
    assert tags["lifeguard.ended_by"] == "process"
    assert tags["lifeguard.owner.pid"] == str(result.ready["pid"])
    if sig is not None:
        assert tags["lifeguard.signal"] == "SIGTERM"
    if path == "exception":
        assert tags["lifeguard.exception"] == "RuntimeError"


def test_watchdog_after_sigkill(scenario: Scenario, store: ServerStore) -> None:
    """The watchdog imports the program's mlflow, skinny here, to write KILLED."""
    result = scenario.run("--path", "SIGKILL", "--watchdog", send=(signal.SIGKILL,))
    died = int(time.time() * 1000)
    assert result.returncode == -signal.SIGKILL, result.stderr
    wait_gone(result.ready["watchdog"])
    [run_id] = result.ready["run_ids"]
    run = store.run(run_id)
    assert run.info.status == "KILLED"
    assert run.info.end_time is not None and run.info.start_time <= run.info.end_time <= died
    assert run.data.tags["lifeguard.ended_by"] == "watchdog"
    assert scenario.calls() == []  # no in-process finalizer could run


@pytest.mark.timeout(300)  # a server's start and stop, twice, on a loaded machine
def test_dead_server(scenario: Scenario, store: ServerStore, tmp_path: Path) -> None:
    """The server dies before the SIGTERM: the program exits within its deadline with its true
    exit status, the status is journaled, and it lands with its true end time once the server is
    back."""
    first = MlflowServer(tmp_path / "dead-server", python=SERVER_PYTHON).start()
    second: MlflowServer | None = None
    signalled: list[float] = []

    def kill_server(ready: dict[str, object]) -> None:
        first.stop()
        signalled.append(time.monotonic())  # run_child sends SIGTERM right after this returns

    try:
        env = child_env(store, MLFLOW_TRACKING_URI=first.uri, LIFEGUARD_DEADLINE=str(DEADLINE))
        result = scenario.run("--path", "SIGTERM", send=(signal.SIGTERM,), env=env,
                              after_ready=kill_server)  # fmt: skip
        exited = time.monotonic()
        assert result.returncode == -signal.SIGTERM, result.stderr
        assert exited - signalled[0] < DEADLINE + EXIT_SLACK
        assert "could not end run" in result.stderr

        [run_id] = result.ready["run_ids"]
        journal = journal_dir(store)
        entry_path = journal / f"{run_id}.json"
        assert stat.S_IMODE(entry_path.stat().st_mode) == 0o600
        entry = json.loads(entry_path.read_text())
        assert entry["status"] == "KILLED"
        assert entry["tracking_uri"] == first.uri

        # The same store comes back on the same port; the sweep (skinny's) replays the journal.
        second = MlflowServer(first.root, port=first.port, python=SERVER_PYTHON).start()
        swept = subprocess.run(
            [sys.executable, "-m", "lifeguard", "sweep", "--tracking-uri", first.uri,
             "--journal-dir", str(journal), "--timeout", "5"],
            capture_output=True, text=True, timeout=120,
            env={k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")},
        )  # fmt: skip
        assert swept.returncode == 0, swept.stdout + swept.stderr
        run = ServerStore(second.uri, tmp_path).run(run_id)
        assert run.info.status == "KILLED"
        assert run.info.end_time == entry["end_time"]  # the true end time, not the sweep's
        assert run.data.tags["lifeguard.signal"] == "SIGTERM"
        assert not entry_path.exists()
    finally:
        first.stop()
        if second is not None:
            second.stop()
