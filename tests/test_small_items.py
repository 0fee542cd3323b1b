"""The smaller items of issue 24, each against real processes or a real `mlflow server`:

* the status is written before the reason tags, so that a write cut short between the two never
  leaves a RUNNING run that already says "killed" (REST path, mlflow path, the sweep);
* a refused turns directory is said in one line, like the journal's refusal;
* a failed `start_run` (no run exists) gets no line of lifeguard's;
* a full disk under the journal with a dead server: one line, no traceback, same exit status.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from lifeguard.journal import Journal
from lifeguard.outcome import Outcome
from tests.conftest import CHILDREN, Scenario, Store, child_env, shows_lifeguard, without_and_with
from tests.servers import FaultProxy, MlflowServer, free_port
from tests.test_sweep_trust import Recorder

REASON_TAGS = ("lifeguard.reason", "lifeguard.outcome", "lifeguard.ended_by")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    srv = MlflowServer(tmp_path_factory.mktemp("server")).start()
    yield srv
    srv.stop()


# -- the status before the reason ----------------------------------------------------------------


def _end_over_rest(uri: str, run_id: str, journal: Journal) -> str:
    from lifeguard.guardian import rest

    store = rest.RestStore(uri, rest.Budget(20))
    return store.terminate(run_id, Outcome.lost("test"), ended_by="watchdog", journal=journal)


def _end_through_mlflow(uri: str, run_id: str, journal: Journal) -> str:
    from lifeguard.backends.mlflow import runs

    with runs.bounded_http(20):
        client = MlflowClient(tracking_uri=uri)
        return runs.terminate(
            client, run_id, Outcome.lost("test"), ended_by="watchdog", journal=journal
        )


def _end_by_sweep(uri: str, run_id: str, journal: Journal) -> str:
    from lifeguard.backends.mlflow.sweep import _end
    from lifeguard.sweep import END, Decision, RunFacts

    decision = Decision(RunFacts(run_id, "0", 1, {}), END, "test", end_time=5)
    with_retries = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
    saved = {k: os.environ.get(k) for k in with_retries}
    os.environ.update(with_retries)
    try:
        ended, error = _end(MlflowClient(tracking_uri=uri), decision)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return "ended" if ended and error is None else "failed"


@pytest.mark.slow
@pytest.mark.parametrize(
    "writer",
    [_end_over_rest, _end_through_mlflow, _end_by_sweep],
    ids=["rest", "mlflow", "sweep"],
)
def test_a_status_write_that_fails_leaves_no_reason_on_a_running_run(
    server: MlflowServer, tmp_path: Path, writer: object
) -> None:
    """The server takes the reason tags but not the status (a deadline, a crash, a proxy in
    between): the reason used to be written first, and the run read RUNNING while it said
    "killed". Now the status goes first: nothing lands, the status is journaled (guardians)
    or retried (the sweep), and once it lands the reason follows."""
    client = MlflowClient(tracking_uri=server.uri)
    run_id = client.create_run("0").info.run_id
    recorder = Recorder(server.port)
    journal = Journal(str(tmp_path / "journal"))
    try:
        recorder.mode = "deny-status"
        result = writer(recorder.uri, run_id, journal)  # type: ignore[operator]
        run = client.get_run(run_id)
        assert run.info.status == "RUNNING"
        assert not [tag for tag in REASON_TAGS if tag in run.data.tags], run.data.tags
        assert result in ("journaled", "failed")
        recorder.mode = "forward"
        assert writer(recorder.uri, run_id, journal) == "ended"  # type: ignore[operator]
        run = client.get_run(run_id)
        assert run.info.status == "KILLED"
        assert all(tag in run.data.tags for tag in REASON_TAGS), run.data.tags
    finally:
        recorder.close()


# -- the turns refusal ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["symlink", "another user's directory", "group-writable"])
def test_a_refused_turns_directory_is_said_in_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    from lifeguard.guardian.turns import turn

    turns = tmp_path / "turns"
    if kind == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        turns.symlink_to(tmp_path / "elsewhere")
    else:
        turns.mkdir(mode=0o700)
        if kind == "group-writable":
            turns.chmod(0o770)
        else:
            os.chown(turns, 65534, 65534)
    with caplog.at_level(logging.DEBUG, logger="lifeguard"), turn(str(turns), wait=1) as held:
        assert held is None  # no turn taken there; the guardian goes ahead
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 1, said
    assert said[0].startswith(f"refusing guardian turns directory {turns}: it ")
    assert "\n" not in said[0]
    if kind == "symlink":
        assert list((tmp_path / "elsewhere").iterdir()) == []  # nothing made through it


# -- a failed start_run ---------------------------------------------------------------------------


@pytest.mark.slow
def test_a_failed_start_run_gets_no_line_of_lifeguards(store: Store) -> None:
    """start_run() against a server that is not there raises; raw MLflow prints its traceback
    and exits 1. Under lifeguard the same, and nothing more: no run exists, and the search for
    one "created outside start_run" (against the same dead server) used to add a line."""
    env = child_env(
        store,
        MLFLOW_TRACKING_URI=f"http://127.0.0.1:{free_port()}",
        MLFLOW_HTTP_REQUEST_MAX_RETRIES="0",
        MLFLOW_HTTP_REQUEST_TIMEOUT="5",
    )
    done = without_and_with(CHILDREN / "failed_start.py", env)
    assert done["on"].returncode == done["off"].returncode == 1, done["on"].stderr
    assert not shows_lifeguard(done["on"].stderr), done["on"].stderr
    last = [line for line in done["off"].stderr.splitlines() if line.strip()][-1]
    assert done["on"].stderr.rstrip().endswith(last)  # the same error, last


# -- a full disk ---------------------------------------------------------------------------------


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A directory on a tmpfs of 64 KiB, filled to the last byte: nothing can be written."""
    mount = tmp_path / "full"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(mount)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    if made.returncode != 0:
        why = f"cannot mount a small tmpfs here: {made.stderr.strip()}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{why} (CI=true: this test must run)")
        pytest.skip(why)
    try:
        (mount / "journal").mkdir(mode=0o700)
        fd = os.open(mount / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while os.write(fd, b"\0" * 512):
                pass
        except OSError:
            pass  # ENOSPC: full
        finally:
            os.close(fd)
        yield mount / "journal"
    finally:
        subprocess.run(["umount", "-l", str(mount)], timeout=60, check=False)


@pytest.mark.slow
def test_a_full_disk_and_a_dead_server_cost_one_line(
    scenario: Scenario, store: Store, server: MlflowServer, full_disk: Path
) -> None:
    """SIGTERM with the journal's filesystem full and the tracking server failing: the status
    can be kept nowhere. One line says so and what happens next; no traceback; the process
    dies of SIGTERM as without lifeguard. It used to print three: "cannot journal run" twice,
    then a long error of urllib3's, none saying the run stays RUNNING."""
    proxy = FaultProxy(server.port)
    try:
        env = child_env(store, MLFLOW_TRACKING_URI=proxy.uri, LIFEGUARD_JOURNAL_DIR=str(full_disk))

        def server_dies(ready: dict[str, object]) -> None:
            proxy.mode = "error500"

        result = scenario.run(
            "--path", "SIGTERM", send=(signal.SIGTERM,), env=env, after_ready=server_dies
        )
    finally:
        proxy.close()
    assert result.returncode == -signal.SIGTERM, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr, result.stderr
    assert len(lines) == 1, result.stderr
    assert "lifeguard" in lines[0] and "RUNNING" in lines[0], lines[0]


def test_the_full_disk_fixture_is_full(full_disk: Path) -> None:
    """The fixture itself: a journal entry cannot be written there."""
    from lifeguard.journal import Entry

    assert not Journal(str(full_disk)).keep(Entry("e" * 32, "http://h", "KILLED", 1, {}))
