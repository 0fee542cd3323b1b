"""Real Lightning (``MLFlowLogger``) and HuggingFace ``Trainer`` (``report_to=["mlflow"]``) runs,
ended mid-training on the main exit paths, with and without lifeguard.

Lightning's logger creates its run with ``MlflowClient.create_run``, so the run is on no
active-run stack: lifeguard finds it by its owner tags. HuggingFace's ``MLflowCallback`` ends
its run in ``__del__``, which ``sys.exit`` would trigger as FINISHED before atexit.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from lifeguard.demo import ChildResult, run_child
from tests.conftest import CHILDREN, Store, child_env
from tests.trackers.test_trackers import need

pytestmark = pytest.mark.slow

SIGNALS = {"SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM}

# path -> (status, exit status) with lifeguard
LIGHTNING = {
    "return": ("FINISHED", 0),
    "sys.exit(3)": ("FAILED", 3),
    "exception": ("FAILED", 1),
    # Lightning catches KeyboardInterrupt, ends its run FAILED and calls exit(1): a run its
    # owner ended is never overwritten, and the exit status says failure too.
    "SIGINT": ("FAILED", 1),
    "SIGTERM": ("KILLED", -signal.SIGTERM),
}
HF = {
    "return": ("FINISHED", 0),
    "sys.exit(3)": ("FAILED", 3),
    "exception": ("FAILED", 1),
    "SIGINT": ("KILLED", -signal.SIGINT),
    "SIGTERM": ("KILLED", -signal.SIGTERM),
}
# What the same programs record without lifeguard (docs/distributed.md, "without lifeguard").
LIGHTNING_RAW = {"SIGTERM": ("FAILED", 0)}  # Lightning exits 0 after SIGTERM
HF_RAW = {
    "sys.exit(3)": ("FINISHED", 3),
    "exception": ("FINISHED", 1),
    "SIGINT": ("FINISHED", -signal.SIGINT),
    "SIGTERM": ("RUNNING", -signal.SIGTERM),
}


def train(store: Store, tmp_path: Path, framework: str, path: str, guarded: bool) -> ChildResult:
    cmd = [sys.executable, str(CHILDREN / "frameworks.py"), "--framework", framework,
           "--path", path, "--out", str(tmp_path / "out"),
           *(() if guarded else ("--no-lifeguard",))]  # fmt: skip
    env = child_env(store, HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="1")
    send = (SIGNALS[path],) if path in SIGNALS else ()
    return run_child(cmd, env=env, send=send, timeout=240)


def check(store: Store, result: ChildResult, status: str, code: int) -> None:
    assert result.returncode == code, result.stderr[-3000:]
    [run_id] = result.ready["run_ids"]  # type: ignore[misc]
    run = store.run(str(run_id))
    assert run.info.status == status
    if status != "RUNNING":
        assert run.info.end_time is not None


CASES = [
    pytest.param(framework, guarded, path, status, code, id=f"{framework}-{label}-{path}")
    for framework, guarded, label, table in (
        ("lightning", True, "lifeguard", LIGHTNING),
        ("lightning", False, "raw", LIGHTNING_RAW),
        ("hf", True, "lifeguard", HF),
        ("hf", False, "raw", HF_RAW),
    )
    for path, (status, code) in table.items()
]


@pytest.mark.parametrize(("framework", "guarded", "path", "status", "code"), CASES)
def test_framework_run_ends_with(
    store: Store, tmp_path: Path, framework: str, guarded: bool, path: str, status: str, code: int
) -> None:
    need("lightning" if framework == "lightning" else "transformers")
    check(store, train(store, tmp_path, framework, path, guarded), status, code)
