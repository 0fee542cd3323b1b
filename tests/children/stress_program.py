"""The child of the signal stress harness (scripts/stress.py): a training-like loop that a signal
interrupts at a random instant.

It installs lifeguard, starts a run against MLFLOW_TRACKING_URI, writes a ready line with the run
id, then loops forever over one workload (or a random mix). The parent sends the signal; nothing
here catches anything, so the process ends exactly as lifeguard lets it.

Every line for the parent is one ``os.write`` to fd 1, never ``print``: the parent's signal may
land while ``sys.stdout`` is in the middle of a write, and an ``os.write`` of a short line to a
pipe is atomic. (A buffered ``print`` from the workload may still leave half a line just before a
marker; the parent looks for the marker anywhere in a line.)

Markers: ``STRESS-READY {json}`` once; ``STRESS-FINALIZED`` when lifeguard's finalizers are done;
for nested runs ``STRESS-START``, ``STRESS-ENDING`` (just
before ``end_run()``) and ``STRESS-ENDED`` (just after), so the parent knows which runs the
program itself ended and which were open when the signal came.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

WORKLOADS = (
    "log_metric",
    "log_metrics",
    "log_param",
    "set_tag",
    "log_artifact",
    "nested",
    "async",
    "import",
    "print_logging",
    "tracking",
    "mixed",
)

parser = argparse.ArgumentParser()
parser.add_argument("--workload", choices=WORKLOADS, required=True)
parser.add_argument("--experiment", required=True)
parser.add_argument("--scratch", required=True, help="a directory of the child's own")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--watchdog", action="store_true", help="install(watchdog=True)")
parser.add_argument("--mlflow-first", action="store_true", help="import mlflow before install()")
parser.add_argument("--bare", action="store_true", help="without lifeguard: the baseline")


def say(marker: str, **info: object) -> None:
    os.write(1, f"STRESS-{marker} {json.dumps(info)}\n".encode())


class StepTracking:
    """Our look-alike of verl's ``Tracking.log()`` for its MLflow backend: holds a client and a
    run, and logs one flat dict of metrics per training step (nested keys joined with ``/``,
    characters MLflow refuses replaced), in one batch."""

    def __init__(self, run_id: str) -> None:
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient()
        self.run_id = run_id

    @staticmethod
    def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, float]:
        flat: dict[str, float] = {}
        for key, value in data.items():
            name = f"{prefix}/{key}" if prefix else key
            if isinstance(value, dict):
                flat.update(StepTracking._flatten(value, name))
            else:
                flat[name.replace("@", "_at_")] = float(value)
        return flat

    def log(self, data: dict[str, Any], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in self._flatten(data).items()]
        self.client.log_batch(self.run_id, metrics=metrics, synchronous=True)


def _say_when_finalized() -> None:
    """The harness's probe: ``STRESS-FINALIZED`` with the time lifeguard's finalizers returned
    (every status written, or journaled). What the exit takes after it is the program's own:
    MLflow's exit work (its async workers joined, its exit hook), the interpreter's teardown."""
    from lifeguard.finalizers import Registry

    run_all = Registry.run_all

    def timed(self: Registry, *args: Any, **kwargs: Any) -> Any:
        backlog = _async_backlog()
        try:
            return run_all(self, *args, **kwargs)
        finally:
            say("FINALIZED", t=time.time(), backlog=backlog)

    Registry.run_all = timed  # type: ignore[method-assign]


def _async_backlog() -> int | None:
    """How many batches wait in MLflow's async logging queue (and its workers' queue) as the
    finalizers start: the harness reports exits with a backlog apart (lifeguard gives a flush
    the time the deadline leaves). None if the program never logged asynchronously."""
    fluent = sys.modules.get("mlflow.tracking.fluent")
    if fluent is None:
        return None
    try:
        queue = fluent._get_store()._async_logging_queue
        if queue.is_idle():
            return None
        work = getattr(queue._batch_logging_worker_threadpool, "_work_queue", None)
        return int(queue._queue.qsize()) + (int(work.qsize()) if work is not None else 0)
    except Exception:  # noqa: BLE001 - MLflow's internals moved: unknown
        return None


def main() -> None:
    args = parser.parse_args()
    rng = random.Random(args.seed)
    scratch = Path(args.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    if args.mlflow_first:
        import mlflow
    watchdog = None
    if not args.bare:
        import lifeguard

        lifeguard.install(watchdog=args.watchdog)
        watchdog = lifeguard.watchdog_pid()
        _say_when_finalized()
    import mlflow

    log = logging.getLogger("stress")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("stress-log: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False

    mlflow.set_experiment(args.experiment)
    top = mlflow.start_run(run_name=f"stress-{args.workload}")
    top_id = top.info.run_id
    sys.path.insert(0, str(scratch))
    tracking = StepTracking(top_id)
    artifact = scratch / "artifact.txt"

    def log_metric(i: int) -> None:
        mlflow.log_metric("loss", 1.0 / i, step=i)

    def log_metrics(i: int) -> None:
        mlflow.log_metrics({f"m{k}": k * 0.5 + i for k in range(40)}, step=i)

    def log_param(i: int) -> None:
        mlflow.log_param(f"p{i}", rng.random())

    def set_tag(i: int) -> None:
        mlflow.set_tag(f"tag{i % 50}", f"value {i}")

    def log_artifact(i: int) -> None:
        artifact.write_text(f"step {i}\n" * 20)
        mlflow.log_artifact(str(artifact), artifact_path=f"a{i % 5}")

    def nested(i: int) -> None:
        child = mlflow.start_run(run_name=f"nested-{i}", nested=True)
        run_id = child.info.run_id
        say("START", run_id=run_id)
        mlflow.log_metric("inner", float(i), step=i)
        say("ENDING", run_id=run_id)
        mlflow.end_run()
        say("ENDED", run_id=run_id)

    def async_metric(i: int) -> None:
        mlflow.log_metric("async_loss", 1.0 / i, step=i, synchronous=False)
        # Paced like a fast training loop (1,000 values a second), not as fast as the loop can
        # spin: unpaced, the backlog grows without bound, and on SIGINT MLflow's own atexit
        # hook (not lifeguard's) flushes all of it before the process may die, with or
        # without lifeguard (tests/test_signal_anywhere.py bounds lifeguard's own share).
        time.sleep(0.001)

    def import_module(i: int) -> None:
        # A fresh module each time: the import system's lock is held while it runs.
        name = f"stress_mod_{os.getpid()}_{i}"
        body = "".join(f"def f{k}(x):\n    return x * {k}\n\n" for k in range(30))
        (scratch / f"{name}.py").write_text(f"import json, textwrap\nVALUE = {i}\n{body}")
        importlib.invalidate_caches()
        importlib.import_module(name)
        if i % 5 == 0:
            reloaded = scratch / "stress_reloaded.py"
            reloaded.write_text(f"VALUE = {i}\n")
            module = sys.modules.get("stress_reloaded")
            if module is None:
                importlib.import_module("stress_reloaded")
            else:
                importlib.reload(module)

    def print_logging(i: int) -> None:
        print(f"step {i} loss {1.0 / i:.6f} " + "." * 80)
        log.info("step %d: %s", i, "-" * 60)
        if i % 10 == 0:
            sys.stdout.flush()

    def step_tracking(i: int) -> None:
        tracking.log(
            {"actor": {"loss": 1.0 / i, "lr": 1e-5, "pg_clipfrac": 0.1}, "val/acc@1": 0.5}, step=i
        )

    steps: dict[str, Callable[[int], None]] = {
        "log_metric": log_metric,
        "log_metrics": log_metrics,
        "log_param": log_param,
        "set_tag": set_tag,
        "log_artifact": log_artifact,
        "nested": nested,
        "async": async_metric,
        "import": import_module,
        "print_logging": print_logging,
        "tracking": step_tracking,
    }
    say("READY", run_id=top_id, pid=os.getpid(), watchdog=watchdog)
    i = 0
    if args.workload == "mixed":
        choices = list(steps.values())
        while True:
            i += 1
            rng.choice(choices)(i)
    step = steps[args.workload]
    while True:
        i += 1
        step(i)


if __name__ == "__main__":
    main()
