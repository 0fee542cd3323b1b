"""A program for the REST-path tests: starts a run on MLFLOW_TRACKING_URI (optionally a second
one on another store), prints the ready line with the watchdog's pid, then waits for its death.

What its guardian gets is set up before ``install()`` (the watchdog inherits the environment of
that moment, the supervisor the program's own):

* ``LIFEGUARD_TEST_POISON``: a directory put on the guardian's PYTHONPATH whose ``mlflow``
  package records the import (in ``LIFEGUARD_TEST_POISON_MARK``) and fails: any import of mlflow
  in the guardian shows, and the run stays RUNNING.
* ``LIFEGUARD_TEST_PROGRAM_PASSWORD``/``..._TOKEN``: the program's own credentials, set once the
  guardian has the ones in the environment (a guardian with a wrong password).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading

from lifeguard import demo

parser = argparse.ArgumentParser()
parser.add_argument("--watchdog", action="store_true")
parser.add_argument("--second-uri", help="switch the tracking URI here and start a second run")
parser.add_argument("--user-finished", action="store_true", help="end the run FINISHED first")
parser.add_argument("--bare-exit", type=int, help="end with a bare `raise SystemExit(N)`")
args = parser.parse_args()

demo.prepare("SIGKILL")

poison = os.environ.get("LIFEGUARD_TEST_POISON")
saved_path = os.environ.get("PYTHONPATH")
if poison:
    os.environ["PYTHONPATH"] = poison  # this interpreter's sys.path is already set: unaffected

import lifeguard  # noqa: E402

if os.environ.get("LIFEGUARD_AUTOINSTALL") != "1":
    lifeguard.install(watchdog=args.watchdog)

if poison:
    if saved_path is None:
        del os.environ["PYTHONPATH"]
    else:
        os.environ["PYTHONPATH"] = saved_path
for name in ("PASSWORD", "TOKEN"):
    own = os.environ.get(f"LIFEGUARD_TEST_PROGRAM_{name}")
    if own is not None:
        os.environ[f"MLFLOW_TRACKING_{name}"] = own

import mlflow  # noqa: E402

run_ids = [mlflow.start_run().info.run_id]
mlflow.log_metric("loss", 0.5, step=1)
if args.user_finished:
    mlflow.end_run("FINISHED")
if args.second_uri:
    # The process moves to another store; its first run stays open on the first one.
    mlflow.set_tracking_uri(args.second_uri)
    started = threading.Event()

    def worker() -> None:
        # MLflow's active-run stack is per thread: a second top-level run, on the new store.
        run_ids.append(mlflow.start_run(run_name="second-store").info.run_id)
        started.set()
        threading.Event().wait()

    threading.Thread(target=worker, daemon=True).start()
    if not started.wait(120):
        sys.exit("the second run did not start")

demo.announce(run_ids=run_ids, pid=os.getpid(), watchdog=lifeguard.watchdog_pid())
if args.bare_exit is not None:
    raise SystemExit(args.bare_exit)
threading.Event().wait()
