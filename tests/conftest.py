"""Shared fixtures: a real sqlite MLflow store per test, and a runner for the child programs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lifeguard.demo import ChildResult, run_child
from lifeguard.demo import wait_gone as demo_wait_gone
from lifeguard.localserver import MlflowServer

CHILDREN = Path(__file__).parent / "children"
REPO = Path(__file__).parent.parent

# One child import of mlflow costs ~1.5 s of CPU; on a loaded 2-core machine a child can take
# many times that. This bounds each wait, not the expected duration.
CHILD_TIMEOUT = 90.0


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


def child_env(store: Store, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LIFEGUARD_", "MLFLOW_"))}
    env.update(
        MLFLOW_TRACKING_URI=store.uri,
        LIFEGUARD_JOURNAL_DIR=str(store.path.parent / "journal"),
        PYTHONWARNINGS="ignore",
    )
    env.update(extra)
    return env


def sweep(store: Store) -> None:
    """``lifeguard sweep`` as a user runs it after the fact: it replays the journal."""
    done = subprocess.run(
        [sys.executable, "-m", "lifeguard", "sweep", "--tracking-uri", store.uri],
        env=child_env(store),
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT,
    )
    assert done.returncode == 0, done.stdout + done.stderr


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


@pytest.fixture(autouse=True)
def _private_journal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Never touch the developer's real ~/.cache/lifeguard from a test.
    monkeypatch.setenv("LIFEGUARD_JOURNAL_DIR", str(tmp_path / "journal"))


class Scenario:
    """Runs tests/children/program.py and collects what a test asserts on."""

    def __init__(self, store: Store, tmp_path: Path) -> None:
        self.store = store
        self.record = tmp_path / "finalizer-calls.txt"

    def run(
        self,
        *args: str,
        send: tuple[int, ...] = (),
        env: dict[str, str] | None = None,
        launcher: tuple[str, ...] = (),
        **kwargs: object,
    ) -> ChildResult:
        """``launcher`` goes before the program, e.g. ``("-m", "lifeguard", "run", "--",
        sys.executable)`` to run it under the supervisor."""
        program = [str(CHILDREN / "program.py"), "--record", str(self.record), *args]
        cmd = [sys.executable, *launcher, *program] if launcher else [sys.executable, *program]
        return run_child(
            cmd,
            env=env or child_env(self.store),
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
def scenario(store: Store, tmp_path: Path) -> Scenario:
    return Scenario(store, tmp_path)
