"""A program that holds runs on a shared tracking server, for the sweep's tests: it starts (or
resumes) its runs, prints the demo's ready line with their ids and its own pid, and lives until
its stdin closes; then it returns from main (FINISHED).

``--runs K``: K runs, nested on its active-run stack (each one beats). ``--plain``: plain MLflow,
no lifeguard (a program from before lifeguard, or that never adopted it). ``--resume RUN_ID``:
resume that run (``mlflow.start_run(run_id=...)``) instead of starting new ones, as an
evaluation script does after training. ``--metric``: log one metric once ready.
``--watchdog``: install(watchdog=True). ``--hold-gil S``: once ready, beat once and then hold
the GIL for S seconds in one C call (as a C extension's long loop does), printing ``HOLDING
<epoch ms>`` before and ``RELEASED <epoch ms>`` after. ``--slow-ending S``: a finalizer of
the program's own takes S seconds (it runs before the MLflow finalizer ends the runs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--runs", type=int, default=1)
parser.add_argument("--plain", action="store_true")
parser.add_argument("--resume")
parser.add_argument("--metric", action="store_true")
parser.add_argument("--watchdog", action="store_true")
parser.add_argument("--hold-gil", type=float)
parser.add_argument("--slow-ending", type=float)
args = parser.parse_args()

if not args.plain:
    import lifeguard

    lifeguard.install(watchdog=args.watchdog)
    if args.slow_ending:
        import time

        lifeguard.register(lambda outcome: time.sleep(args.slow_ending), name="slow")

import mlflow  # noqa: E402 - after install(), as a program adopting lifeguard writes it

from lifeguard import demo  # noqa: E402

if args.resume:
    runs = [mlflow.start_run(run_id=args.resume)]
else:
    runs = [mlflow.start_run(nested=i > 0) for i in range(args.runs)]
if args.metric:
    mlflow.log_metric("loss", 1.0)
ready = {"run_ids": [run.info.run_id for run in runs], "pid": os.getpid()}
sys.stdout.write(demo.READY + json.dumps(ready) + "\n")
sys.stdout.flush()
if args.hold_gil:
    import ctypes
    import time

    from lifeguard.backends.mlflow.heartbeat import heartbeat

    heartbeat.beat()  # what the heartbeat thread does each interval (and tells the watchdog)
    libc = ctypes.PyDLL(None)  # PyDLL: the call keeps the GIL, as a C extension's loop can
    print(f"HOLDING {int(time.time() * 1000)}", flush=True)
    libc.usleep(int(args.hold_gil * 1_000_000))
    print(f"RELEASED {int(time.time() * 1000)}", flush=True)
sys.stdin.read()
for _ in runs:
    mlflow.end_run()
