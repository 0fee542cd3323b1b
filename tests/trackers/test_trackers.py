"""Real trackers, offline, in real subprocesses: each one records the truth on every main exit path.

Runs in the ``trackers`` tox env, which installs wandb, tensorboardX (+ tensorboard to read the
event files), torch's tensorboard, swanlab and trackio. Elsewhere a missing library skips its
tests, unless LIFEGUARD_TEST_TRACKERS=1 (set by tox) turns that into a failure.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
from pathlib import Path

import pytest

from lifeguard.demo import ChildResult, run_child
from tests.conftest import CHILD_TIMEOUT, CHILDREN, Store, child_env
from tests.trackers.readers import SwanlabRun, TrackioRun, WandbRun, tensorboard_events

pytestmark = pytest.mark.slow

REQUIRED = os.environ.get("LIFEGUARD_TEST_TRACKERS") == "1"
NEEDS = {
    "wandb": ("wandb",),
    "tensorboardX": ("tensorboardX", "tensorboard"),
    "torch-tensorboard": ("torch", "tensorboard"),
    "swanlab": ("swanlab",),
    "trackio": ("trackio",),
    "mlflow": ("mlflow",),
    "lightning": ("lightning", "torch", "mlflow"),
    "transformers": ("transformers", "accelerate", "torch", "mlflow"),
}


def need(*trackers: str) -> None:
    missing = [m for t in trackers for m in NEEDS[t] if importlib.util.find_spec(m) is None]
    if missing:
        if REQUIRED:
            pytest.fail(f"LIFEGUARD_TEST_TRACKERS=1 but {', '.join(missing)} not installed")
        pytest.skip(f"{', '.join(missing)} not installed")


# path -> (status, the exit code wandb should record: the shell's view, 0 only for success)
PATHS = {
    "return": ("FINISHED", 0),
    "sys.exit(3)": ("FAILED", 3),
    "exception": ("FAILED", 1),
    "SIGINT": ("KILLED", 128 + signal.SIGINT),
    "SIGTERM": ("KILLED", 128 + signal.SIGTERM),
}
SIGNALS = {"SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM}
SWANLAB_STATES = {"FINISHED": "RUN_STATE_FINISHED", "FAILED": "RUN_STATE_CRASHED",
                  "KILLED": "RUN_STATE_ABORTED"}  # fmt: skip
STEPS = [0, 1, 2]


def run_program(
    store: Store, out: Path, path: str, *trackers: str, extra: tuple[str, ...] = ()
) -> ChildResult:
    env = child_env(
        store,
        HOME=str(out / "home"),  # wandb, swanlab and clearml keep settings under ~
        TRACKIO_DIR=str(out / "trackio"),
        WANDB_SILENT="true",
        SWANLAB_SAVE_DIR=str(out / "home" / ".swanlab"),
    )
    cmd = [sys.executable, str(CHILDREN / "trackers.py"), "--out", str(out), "--path", path,
           *(arg for t in trackers for arg in ("--tracker", t)), *extra]  # fmt: skip
    send = (SIGNALS[path],) if path in SIGNALS else ()
    return run_child(cmd, env=env, send=send, timeout=CHILD_TIMEOUT)


def expected_returncode(path: str) -> int:
    return {"return": 0, "sys.exit(3)": 3, "exception": 1}.get(path, -SIGNALS.get(path, 0))


def ended(store: Store, out: Path, path: str, *trackers: str) -> ChildResult:
    """Run the program under lifeguard; it must end exactly as ``path`` ends a process."""
    result = run_program(store, out, path, *trackers)
    assert result.returncode == expected_returncode(path), result.stderr[-3000:]
    return result


@pytest.mark.parametrize("path", PATHS)
def test_wandb_records_the_exit_code(store: Store, tmp_path: Path, path: str) -> None:
    need("wandb")
    status, exit_code = PATHS[path]
    result = ended(store, tmp_path, path, "wandb")
    run = WandbRun(tmp_path, str(result.ready["wandb_id"]))
    assert run.exit_code == exit_code
    assert run.history_steps == len(STEPS)
    if path == "return":
        # Nothing of ours sees a plain return before atexit, and wandb's own atexit hook
        # (registered at wandb.init, after install) ends the run first: with 0, the truth.
        assert run.summary.get("lifeguard/status") in (None, "FINISHED")
    else:
        assert run.summary["lifeguard/status"] == status


def test_wandb_traceback_printed_once(store: Store, tmp_path: Path) -> None:
    """wandb's excepthook prints the traceback and then calls the previous hook unless it is
    Python's default: with lifeguard's in between, stderr must still match the program's own."""
    need("wandb")
    guarded = run_program(store, tmp_path / "with", "exception", "wandb")
    raw = run_program(store, tmp_path / "without", "exception", "wandb", extra=("--no-lifeguard",))
    assert guarded.returncode == raw.returncode == 1
    assert raw.stderr.count("Traceback (most recent call last)") == 1
    assert guarded.stderr.count("Traceback (most recent call last)") == 1
    assert "RuntimeError: loss is NaN" in guarded.stderr


@pytest.mark.parametrize("tracker", ["tensorboardX", "torch-tensorboard"])
@pytest.mark.parametrize("path", PATHS)
def test_tensorboard_keeps_every_scalar(
    store: Store, tmp_path: Path, path: str, tracker: str
) -> None:
    need(tracker)
    status, _ = PATHS[path]
    ended(store, tmp_path, path, tracker)
    scalars, texts = tensorboard_events(tmp_path / tracker)
    assert [step for tag, step, _ in scalars if tag == "loss"] == STEPS
    outcome = [v for tag, v in texts.items() if tag.startswith("lifeguard/outcome")]
    if path == "return" and tracker == "tensorboardX":
        # tensorboardX's own atexit hook (registered after install) closed the writer first.
        assert outcome in ([], [f"{status} (exit code 0)"])
    else:
        assert len(outcome) == 1 and outcome[0].startswith(f"{status} (")


@pytest.mark.parametrize("path", PATHS)
def test_swanlab_records_the_state(store: Store, tmp_path: Path, path: str) -> None:
    need("swanlab")
    status, _ = PATHS[path]
    ended(store, tmp_path, path, "swanlab")
    run = SwanlabRun(tmp_path)
    assert run.state == SWANLAB_STATES[status]
    assert run.scalars == len(STEPS)


@pytest.mark.parametrize("path", PATHS)
def test_trackio_flushes_and_alerts(store: Store, tmp_path: Path, path: str) -> None:
    need("trackio")
    status, _ = PATHS[path]
    ended(store, tmp_path, path, "trackio")
    run = TrackioRun(tmp_path / "trackio", "lifeguard", "trackers")
    assert run.steps == STEPS
    if status == "FINISHED":
        assert run.alerts == []
    else:
        [(title, _text)] = run.alerts
        assert title == f"run {status}"


ALL = ("mlflow", "wandb", "tensorboardX", "swanlab", "trackio")


@pytest.mark.parametrize("path", ["sys.exit(3)", "SIGTERM"])
def test_every_tracker_tells_the_same_truth(store: Store, tmp_path: Path, path: str) -> None:
    need(*ALL)
    status, exit_code = PATHS[path]
    result = ended(store, tmp_path, path, *ALL)
    [run_id] = result.ready["run_ids"]
    assert store.status(run_id) == status
    assert WandbRun(tmp_path, str(result.ready["wandb_id"])).exit_code == exit_code
    assert SwanlabRun(tmp_path).state == SWANLAB_STATES[status]
    _, texts = tensorboard_events(tmp_path / "tensorboardX")
    assert next(iter(texts.values())).startswith(status)
    assert TrackioRun(tmp_path / "trackio", "lifeguard", "trackers").alerts[0][0] == f"run {status}"


def test_a_hanging_and_a_raising_tracker_stop_no_other(store: Store, tmp_path: Path) -> None:
    """A tracked object whose close() never returns and one whose finish() raises run first
    (registered last); each backend after them still ends its run, within the deadline."""
    need(*ALL)
    extra = ("--hanging", "--raising", "--deadline", "8")
    result = run_program(store, tmp_path, "SIGTERM", *ALL, extra=extra)
    assert result.returncode == -signal.SIGTERM, result.stderr[-3000:]
    assert "STUCK-CLOSE" in result.stdout
    assert "finalizer 'stuck' did not finish within" in result.stderr
    assert "finalizer 'broken' raised ConnectionError" in result.stderr
    [run_id] = result.ready["run_ids"]
    assert store.status(run_id) == "KILLED"
    assert WandbRun(tmp_path, str(result.ready["wandb_id"])).exit_code == 128 + signal.SIGTERM
    assert SwanlabRun(tmp_path).state == "RUN_STATE_ABORTED"
    scalars, _ = tensorboard_events(tmp_path / "tensorboardX")
    assert len(scalars) == len(STEPS)
    assert TrackioRun(tmp_path / "trackio", "lifeguard", "trackers").steps == STEPS


def test_without_lifeguard_sigterm_loses_them(store: Store, tmp_path: Path) -> None:
    """The baseline docs/trackers.md's table states: unguarded, SIGTERM leaves wandb with no exit
    record and no history, TensorBoard, SwanLab and trackio without any of the metrics logged."""
    need("wandb", "tensorboardX", "swanlab", "trackio")
    trackers = ("wandb", "tensorboardX", "swanlab", "trackio")
    result = run_program(store, tmp_path, "SIGTERM", *trackers, extra=("--no-lifeguard",))
    assert result.returncode == -signal.SIGTERM
    wandb_run = WandbRun(tmp_path, str(result.ready["wandb_id"]))
    assert (wandb_run.exit_code, wandb_run.history_steps) == (None, 0)
    assert tensorboard_events(tmp_path / "tensorboardX")[0] == []
    swanlab_run = SwanlabRun(tmp_path)
    assert (swanlab_run.state, swanlab_run.scalars) == (None, 0)
    db = tmp_path / "trackio" / "lifeguard.db"
    assert not db.exists() or TrackioRun(tmp_path / "trackio", "lifeguard", "trackers").steps == []


def test_without_lifeguard_swanlab_calls_a_failed_exit_a_success(
    store: Store, tmp_path: Path
) -> None:
    need("swanlab")
    result = run_program(store, tmp_path, "sys.exit(3)", "swanlab", extra=("--no-lifeguard",))
    assert result.returncode == 3
    assert SwanlabRun(tmp_path).state == "RUN_STATE_FINISHED"
