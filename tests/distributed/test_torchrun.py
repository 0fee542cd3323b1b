"""Real torchrun (CPU, gloo, 2 ranks): every rank installs lifeguard, rank 0 owns the run."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from lifeguard.demo import ChildResult, run_child
from tests.conftest import REPO, Store, child_env, wait_gone

pytest.importorskip("torch.distributed")
pytestmark = pytest.mark.slow

SCRIPT = REPO / "examples" / "torchrun_train.py"


def torchrun(
    store: Store, tmp_path: Path, scenario: str, *, watchdog: bool = False, **kwargs: object
) -> tuple[ChildResult, list[tuple[int, int, str]]]:
    record = tmp_path / "record.txt"
    env = child_env(store, **({"LIFEGUARD_WATCHDOG": "1"} if watchdog else {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(SCRIPT), "--scenario", scenario, "--record", str(record)]  # fmt: skip
    result = run_child(cmd, env=env, timeout=180, **kwargs)  # type: ignore[arg-type]
    rows = [line.split() for line in record.read_text().splitlines()] if record.exists() else []
    return result, [(int(rank), int(pid), status) for rank, pid, status in rows]


def test_clean_finish(store: Store, tmp_path: Path) -> None:
    result, calls = torchrun(store, tmp_path, "clean")
    assert result.returncode == 0, result.stderr[-2000:]
    [run_id] = result.ready["run_ids"]
    assert store.status(run_id) == "FINISHED"
    assert calls == [(0, result.ready["pid"], "FINISHED")]  # once, on rank 0


def test_sigterm_to_torchrun(store: Store, tmp_path: Path) -> None:
    """torchrun forwards SIGTERM to every worker, as Slurm or Kubernetes would make it do."""
    result, calls = torchrun(store, tmp_path, "wait", send=(signal.SIGTERM,))
    assert result.returncode != 0
    [run_id] = result.ready["run_ids"]
    run = store.run(run_id)
    assert run.info.status == "KILLED"
    assert run.data.tags["lifeguard.signal"] == "SIGTERM"
    assert run.info.end_time is not None
    assert calls == [(0, result.ready["pid"], "KILLED")]


def test_rank_1_raises(store: Store, tmp_path: Path) -> None:
    """Rank 0 waits in a collective when rank 1 fails. Either gloo reports the lost peer first
    (rank 0 raises: FAILED) or torchrun's SIGTERM reaches rank 0 first (KILLED); a SIGTERM that
    lands while rank 0 is finalizing its FAILED waits for it. Never RUNNING."""
    result, calls = torchrun(store, tmp_path, "rank1-raises")
    assert result.returncode != 0
    assert "rank 1 failed on purpose" in result.stderr
    [run_id] = result.ready["run_ids"]
    status = store.status(run_id)
    assert status in ("FAILED", "KILLED")
    assert calls == [(0, result.ready["pid"], status)]


def test_sigkill_of_rank_0_with_the_watchdog(store: Store, tmp_path: Path) -> None:
    result, calls = torchrun(
        store, tmp_path, "wait", watchdog=True, send=(signal.SIGKILL,), to_ready_pid=True
    )
    assert result.returncode != 0
    wait_gone(result.ready["watchdog"])
    [run_id] = result.ready["run_ids"]
    run = store.run(run_id)
    assert run.info.status == "KILLED"
    assert run.data.tags["lifeguard.ended_by"] == "watchdog"
    assert calls == []  # SIGKILL: no in-process finalizer could run, on any rank 0
