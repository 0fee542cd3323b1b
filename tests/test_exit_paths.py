"""One test per row of the status contract (docs/design.md section 1), with real subprocesses and a
real sqlite store, with ``import mlflow`` both before and after ``install()``."""

from __future__ import annotations

import signal
import sys
import time

import pytest

from lifeguard import demo
from tests.conftest import Scenario, Store

pytestmark = pytest.mark.slow

# path -> (MLflow status, exit status as subprocess reports it). This is the contract.
CONTRACT = {
    "return": ("FINISHED", 0),
    "sys.exit(0)": ("FINISHED", 0),
    "sys.exit()": ("FINISHED", 0),
    "sys.exit(3)": ("FAILED", 3),
    'sys.exit("msg")': ("FAILED", 1),
    "exception": ("FAILED", 1),
    "KeyboardInterrupt": ("KILLED", -signal.SIGINT),
    "SIGINT": ("KILLED", -signal.SIGINT),
    "SIGTERM": ("KILLED", -signal.SIGTERM),
    "SIGHUP": ("KILLED", -signal.SIGHUP),
    "SIGHUP under nohup": ("FINISHED", 0),
}


def test_contract_covers_every_demo_path() -> None:
    assert set(CONTRACT) == set(demo.PATHS)


def assert_ended(store: Store, run_id: str, status: str, before_ms: int, after_ms: int) -> None:
    info = store.run(run_id).info
    assert info.status == status
    assert info.end_time is not None, "end time must be real, never '(unknown)'"
    assert info.start_time <= info.end_time <= after_ms
    assert info.end_time >= before_ms


@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("path", list(CONTRACT))
def test_exit_path(scenario: Scenario, store: Store, path: str, order: str) -> None:
    status, returncode = CONTRACT[path]
    sig = demo.PATHS[path][1]
    before = int(time.time() * 1000)
    result = scenario.run("--path", path, "--order", order, send=() if sig is None else (sig,))
    after = int(time.time() * 1000)

    assert result.returncode == returncode, result.stderr
    [run_id] = result.ready["run_ids"]
    assert_ended(store, run_id, status, before, after)
    assert scenario.calls() == [(result.ready["pid"], status)]
    tags = store.run(run_id).data.tags
    assert tags["lifeguard.ended_by"] == "process"
    assert tags["lifeguard.owner.pid"] == str(result.ready["pid"])
    if sig is not None and status == "KILLED":
        assert tags["lifeguard.signal"] == signal.Signals(sig).name


@pytest.mark.parametrize(
    "path", ["exception", 'sys.exit("msg")', "sys.exit(3)", "KeyboardInterrupt"]
)
def test_stderr_and_exit_status_as_without_lifeguard(scenario: Scenario, path: str) -> None:
    raw = scenario.run("--path", path, "--order", "none")
    guarded = scenario.run("--path", path, "--order", "before")
    assert guarded.stderr == raw.stderr
    if path == "KeyboardInterrupt" and raw.returncode == 1 and sys.version_info < (3, 11):
        # Raw MLflow's own atexit end_run, on 3.10 with a SQL store, makes SQLAlchemy generate
        # code (an exec) and CPython forgets the Ctrl-C: the program exits 1. With lifeguard the
        # run is already ended, MLflow's hook writes nothing, and it dies of SIGINT
        # (docs/limitations.md).
        assert guarded.returncode == -signal.SIGINT
        return
    assert guarded.returncode == raw.returncode


def test_exit_message_printed_and_recorded(scenario: Scenario, store: Store) -> None:
    result = scenario.run("--path", 'sys.exit("msg")')
    assert result.returncode == 1
    assert result.stderr.strip() == "fatal: bad config"
    [run_id] = result.ready["run_ids"]
    tags = store.run(run_id).data.tags
    assert tags["lifeguard.reason"] == "exit code 1: fatal: bad config"


def test_exception_recorded_as_tags(scenario: Scenario, store: Store) -> None:
    result = scenario.run("--path", "exception")
    [run_id] = result.ready["run_ids"]
    tags = store.run(run_id).data.tags
    assert tags["lifeguard.exception"] == "RuntimeError"
    assert tags["lifeguard.reason"] == "RuntimeError: loss is NaN"
    assert tags["lifeguard.outcome"] == "exception"


@pytest.mark.parametrize("path", ["sys.exit(3)", "exception", "SIGINT", "SIGTERM"])
def test_raw_mlflow_lies(scenario: Scenario, store: Store, path: str) -> None:
    """The baseline that makes lifeguard necessary: without it, the status is wrong. If MLflow
    ever fixes this, this test says so."""
    sig = demo.PATHS[path][1]
    result = scenario.run("--path", path, "--order", "none", send=() if sig is None else (sig,))
    [run_id] = result.ready["run_ids"]
    assert store.status(run_id) in ("FINISHED", "RUNNING")
    assert store.status(run_id) != CONTRACT[path][0]
