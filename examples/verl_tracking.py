"""A verl-style multi-backend ``Tracking`` logger whose ``finish(exit_code)`` runs under lifeguard.

verl's ``Tracking`` fans each ``log()`` out to several backends and relies on ``__del__`` to
finish them, which never runs on SIGTERM and reports success on a crash. Registered with
lifeguard, ``finish`` runs exactly once, however the process ends, with the exit code the
Outcome maps to (0 = success, as wandb's ``finish(exit_code)`` reads it) and the matching status.

    python examples/verl_tracking.py --log-dir /tmp/track [--exit N | --wait]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import lifeguard

lifeguard.install()

import mlflow  # noqa: E402


class Tracking:
    """Logs to MLflow and to a JSON-lines file; ``finish`` closes both, once."""

    def __init__(self, log_dir: str) -> None:
        os.makedirs(log_dir, exist_ok=True)
        self._file = open(os.path.join(log_dir, "metrics.jsonl"), "a")  # noqa: SIM115
        self.run = mlflow.start_run()
        self._finished = False
        # Runs before lifeguard's own MLflow finalizer (newest first), so the run is still
        # open here and the backends end it with the same truth.
        self.handle = lifeguard.register(self._finalize, name="verl-tracking")

    def log(self, data: dict[str, float], step: int) -> None:
        mlflow.log_metrics(data, step=step)
        self._file.write(json.dumps({"step": step, **data}) + "\n")
        self._file.flush()

    def _finalize(self, outcome: lifeguard.Outcome) -> None:
        self.finish(exit_code=outcome.process_exit_code, status=outcome.status.value)

    def finish(self, exit_code: int = 0, status: str | None = None) -> None:
        if self._finished:
            return
        self._finished = True
        self._file.write(json.dumps({"finished": True, "exit_code": exit_code}) + "\n")
        self._file.close()
        if mlflow.active_run() is not None:
            mlflow.end_run(status or ("FINISHED" if exit_code == 0 else "FAILED"))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--log-dir", required=True)
    parser.add_argument("--exit", type=int, default=0)
    parser.add_argument("--wait", action="store_true", help="wait for a signal after training")
    args = parser.parse_args()
    tracking = Tracking(args.log_dir)
    for step in range(3):
        tracking.log({"loss": 1.0 / (step + 1)}, step=step)
    print("LIFEGUARD-READY " + json.dumps({"run_ids": [tracking.run.info.run_id],
                                           "pid": os.getpid()}), flush=True)  # fmt: skip
    if args.wait:
        sys.stdin.readline()
    return args.exit


if __name__ == "__main__":
    sys.exit(main())
