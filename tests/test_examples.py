"""The verl-style Tracking example: its finish(exit_code) runs once, with the truth."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest

from lifeguard.demo import run_child
from tests.conftest import REPO, Store, child_env

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("args", "send", "returncode", "exit_code", "status"),
    [
        ((), (), 0, 0, "FINISHED"),
        (("--exit", "3"), (), 3, 3, "FAILED"),
        (("--wait",), (signal.SIGTERM,), -signal.SIGTERM, 143, "KILLED"),
    ],
)
def test_verl_tracking_finishes_with_the_truth(
    store: Store, tmp_path: Path, args: tuple[str, ...], send: tuple[int, ...],
    returncode: int, exit_code: int, status: str,
) -> None:  # fmt: skip
    cmd = [sys.executable, str(REPO / "examples" / "verl_tracking.py"),
           "--log-dir", str(tmp_path / "track"), *args]  # fmt: skip
    result = run_child(cmd, env=child_env(store), send=send, timeout=90)
    assert result.returncode == returncode, result.stderr
    lines = [
        json.loads(x) for x in (tmp_path / "track" / "metrics.jsonl").read_text().split("\n") if x
    ]
    assert [x["step"] for x in lines if "step" in x] == [0, 1, 2]
    assert [x for x in lines if "finished" in x] == [{"finished": True, "exit_code": exit_code}]
    [run_id] = result.ready["run_ids"]
    assert store.status(run_id) == status
