"""A training program that logs through a verl-style ``Tracking`` and is stopped in the middle
of a slow store write: the child of tests/test_last_gasp.py.

It installs lifeguard (``TEST_INSTALL``: install()'s options as JSON), starts a run against
MLFLOW_TRACKING_URI, and logs each step the way verl's ``Tracking.log()`` does for its MLflow
backend (tests/children/stress_program.py's ``StepTracking``: one ``log_batch`` of the flattened
metrics). Then, by ``--mode``:

- ``slow-write``: the next step's write is slow, as on a slow disk or NFS: a SQLAlchemy event
  between MLflow's INSERT and its COMMIT (sqlite's write lock held) sends the process SIGTERM,
  prints ``SIGNAL <time>``, and goes on writing for minutes. The signal path journals the
  status, waits for the main thread to leave MLflow (it does not), and its own write then waits
  on the lock the program holds until the time left runs out: the status stays journaled, and
  the process dies of SIGTERM with sqlite's lock released only by its death.
- ``slow-write-twice``: the same, with a finalizer of the program's that prints ``FINALIZING``
  and blocks, so that the test's second SIGTERM lands during finalization.
- ``wait``: the ready line, then wait for the test's signal (on stdin's EOF: return).
- ``async N``: queue N metrics with ``synchronous=False``, print the ready line, then wait.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lifeguard

lifeguard.install(**json.loads(os.environ.get("TEST_INSTALL", "{}")))

import mlflow  # noqa: E402
import sqlalchemy  # noqa: E402

from lifeguard import demo  # noqa: E402
from tests.children.stress_program import StepTracking  # noqa: E402

mode = sys.argv[1]
run = mlflow.start_run()
tracking = StepTracking(run.info.run_id)
tracking.log({"actor": {"loss": 1.0, "lr": 1e-5}, "val/acc@1": 0.1}, step=0)

if mode.startswith("slow-write"):
    engine = mlflow.tracking._tracking_service.utils._get_store().engine
    armed: list[int] = []

    @sqlalchemy.event.listens_for(engine, "after_cursor_execute")
    def slow_disk(conn: object, cursor: object, statement: str, *rest: object) -> None:
        if armed and statement.lstrip().upper().startswith("INSERT INTO METRICS"):
            armed.clear()
            os.write(1, b"SIGNAL %.6f\n" % time.time())
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(600)  # the write goes on, sqlite's lock held, until the process dies

    if mode == "slow-write-twice":

        def block(outcome: lifeguard.Outcome) -> None:
            os.write(1, b"FINALIZING\n")
            threading.Event().wait()

        lifeguard.register(block, name="block")
    demo.announce(run_ids=[run.info.run_id], pid=os.getpid())
    sys.stdin.readline()  # the test has the ready line: now the slow step
    armed.append(1)
    tracking.log({"actor": {"loss": 0.5, "lr": 1e-5}, "val/acc@1": 0.2}, step=1)
    os.write(1, b"UNREACHED\n")
elif mode == "async":
    for step in range(int(sys.argv[2])):
        mlflow.log_metric("async_loss", 1.0 / (step + 1), step=step, synchronous=False)
    demo.announce(run_ids=[run.info.run_id], pid=os.getpid(), queued_at=time.time())
    sys.stdin.readline()
else:
    demo.announce(run_ids=[run.info.run_id], pid=os.getpid())
    sys.stdin.readline()
