"""Against a real `mlflow server` on 127.0.0.1 that dies, hangs or fails: the program still exits
within its deadline with its true exit status, and the status lands later with its true end
time, from the journal."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import Scenario, Store, child_env
from tests.servers import FaultProxy, MlflowServer

pytestmark = pytest.mark.slow

SECRET = "s3cret-token-do-not-write"


@pytest.fixture
def server(mlflow_server: MlflowServer) -> MlflowServer:
    """The session's server (conftest.mlflow_server): this module's tests read only their runs."""
    return mlflow_server


@pytest.fixture
def proxy(server: MlflowServer) -> Iterator[FaultProxy]:
    p = FaultProxy(server.port)
    yield p
    p.close()


def journal_dir(store: Store) -> Path:
    return store.path.parent / "journal"


def server_env(store: Store, uri: str) -> dict[str, str]:
    # A short deadline keeps the test quick; the runner's timeout bounds the exit.
    return child_env(
        store, MLFLOW_TRACKING_URI=uri, MLFLOW_TRACKING_TOKEN=SECRET, LIFEGUARD_DEADLINE="3"
    )


def sweep(uri: str, journal: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lifeguard", "sweep", "--tracking-uri", uri,
         "--journal-dir", str(journal), "--timeout", "5"],
        capture_output=True, text=True, timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")},
    )  # fmt: skip


def assert_journaled(journal: Path, run_id: str) -> dict[str, object]:
    """One private file per run, in a private directory, with no secret in it."""
    assert stat.S_IMODE(journal.stat().st_mode) == 0o700
    entry = journal / f"{run_id}.json"
    assert stat.S_IMODE(entry.stat().st_mode) == 0o600
    text = entry.read_text()
    assert SECRET not in text and "alice" not in text and "pa55" not in text
    data: dict[str, object] = json.loads(text)
    return data


@pytest.mark.parametrize("fault", ["blackhole", "error500"])
def test_hung_or_failing_server(
    scenario: Scenario, store: Store, server: MlflowServer, proxy: FaultProxy, fault: str
) -> None:
    # Credentials in the URI must not reach the journal either.
    env = server_env(store, proxy.uri.replace("http://", "http://alice:pa55@"))
    result = scenario.run(
        "--path", "SIGTERM", send=(signal.SIGTERM,), env=env,
        after_ready=lambda ready: setattr(proxy, "mode", fault),
    )  # fmt: skip
    assert result.returncode == -signal.SIGTERM, result.stderr
    [run_id] = result.ready["run_ids"]
    entry = assert_journaled(journal_dir(store), run_id)
    assert entry["status"] == "KILLED"
    assert entry["tracking_uri"] == proxy.uri
    assert "could not end run" in result.stderr

    client = MlflowClient(tracking_uri=server.uri)
    assert client.get_run(run_id).info.status == "RUNNING"
    proxy.mode = "pass"
    swept = sweep(proxy.uri, journal_dir(store))
    assert swept.returncode == 0, swept.stderr
    run = client.get_run(run_id)
    assert run.info.status == "KILLED"
    assert run.info.end_time == entry["end_time"]  # the true end time, not the sweep's
    assert run.data.tags["lifeguard.signal"] == "SIGTERM"
    assert not (journal_dir(store) / f"{run_id}.json").exists()


@pytest.mark.timeout(300)  # a server's start and stop, twice, on a loaded machine
def test_killed_server_then_back(scenario: Scenario, store: Store, tmp_path: Path) -> None:
    first = MlflowServer(tmp_path / "server").start()
    second: MlflowServer | None = None
    try:
        env = server_env(store, first.uri)
        # No last-gasp replayer (tests/test_last_gasp.py has it): the entry waits for the sweep
        # and the next install(), whose paths this test is about.
        env["LIFEGUARD_REPLAY_BOUND"] = "0"
        result = scenario.run("--path", "sys.exit(3)", "--wait-stdin", env=env,
                              after_ready=lambda ready: first.stop())  # fmt: skip
        assert result.returncode == 3, result.stderr
        [run_id] = result.ready["run_ids"]
        entry = assert_journaled(journal_dir(store), run_id)
        assert entry["status"] == "FAILED"

        down = sweep(first.uri, journal_dir(store))
        assert down.returncode == 1
        assert f"cannot read runs from {first.uri}" in down.stderr
        assert (journal_dir(store) / f"{run_id}.json").exists()  # nothing lost

        # The same store comes back on the same port; the next program's install() replays.
        second = MlflowServer(first.root, port=first.port).start()
        replay = scenario.run("--path", "return", "--wait-replay", env=env)
        assert replay.returncode == 0, replay.stderr
        run = MlflowClient(tracking_uri=second.uri).get_run(run_id)
        assert run.info.status == "FAILED"
        assert run.info.end_time == entry["end_time"]
        assert run.data.tags["lifeguard.exit_code"] == "3"
        assert not (journal_dir(store) / f"{run_id}.json").exists()
    finally:
        first.stop()
        if second is not None:
            second.stop()


def test_two_hundred_runs_in_twenty_threads_all_end_killed(
    server: MlflowServer, store: Store, tmp_path: Path
) -> None:
    """200 runs open in 20 threads against a real server, then SIGTERM: every run ends KILLED.
    Before, the runs not reached before the deadline had no journal entry and stayed RUNNING;
    now each is journaled before the first write, so one the deadline cut off lands at the first
    replay."""
    code = """
import os, threading
import lifeguard
lifeguard.install()
import mlflow
from lifeguard import demo
ids, lock, ready = [], threading.Lock(), threading.Barrier(21)
def worker():
    for _ in range(10):
        run = mlflow.start_run(nested=bool(mlflow.active_run()))
        with lock:
            ids.append(run.info.run_id)
    ready.wait()
    threading.Event().wait()
for _ in range(20):
    threading.Thread(target=worker, daemon=True).start()
ready.wait()
demo.announce(run_ids=ids)
threading.Event().wait()
"""
    from lifeguard.demo import run_child

    env = child_env(store, MLFLOW_TRACKING_URI=server.uri)
    result = run_child([sys.executable, "-c", code], env=env, send=(signal.SIGTERM,), timeout=300)
    assert result.returncode == -signal.SIGTERM, result.stderr
    run_ids = result.ready["run_ids"]
    assert isinstance(run_ids, list) and len(run_ids) == 200
    client = MlflowClient(tracking_uri=server.uri)
    statuses = {run_id: client.get_run(run_id).info.status for run_id in run_ids}
    if "RUNNING" in statuses.values():
        replay = sweep(server.uri, journal_dir(store))  # the first replay
        assert replay.returncode == 0, replay.stdout + replay.stderr
        statuses = {run_id: client.get_run(run_id).info.status for run_id in run_ids}
    assert set(statuses.values()) == {"KILLED"}
