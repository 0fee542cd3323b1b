"""A training-like program that the Slurm tests submit with sbatch.

It starts (or, on a requeued attempt, resumes) one MLflow run against MLFLOW_TRACKING_URI, logs
a metric per step and writes one line to ``--out`` at each milestone, which the test waits for:

    ready <run_id> <pid> <attempt>     the run exists and training is under way
    preempted <signum>                 the on_preemption callback ran
    done                               the loop is over (only --steps)

``--raw`` runs the very same program without lifeguard: the baseline the tests print beside
each case. Nothing here sleeps to synchronise: the test reads these lines.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True, help="file the milestone lines are appended to")
parser.add_argument("--raw", action="store_true", help="no lifeguard: the raw-MLflow baseline")
parser.add_argument("--steps", type=int, default=0, help="steps, then end (0: train forever)")
parser.add_argument(
    "--finish-on-attempt",
    type=int,
    help="from this Slurm attempt on (SLURM_RESTART_COUNT), train 10 steps and end",
)
parser.add_argument("--exit", type=int, default=0, help="sys.exit(N) after --steps")
parser.add_argument("--watchdog", action="store_true", help="install(watchdog=True)")
parser.add_argument("--heartbeat", type=float, help="install(heartbeat=S)")
parser.add_argument("--ignore-term", action="store_true", help="SIG_IGN for SIGTERM, after install")
parser.add_argument("--preemption", action="store_true", help="on_preemption(checkpoint)")
parser.add_argument(
    "--early-warning",
    action="store_true",
    help="wait for SIGUSR1 before starting the run (a warning that comes before start_run)",
)
parser.add_argument(
    "--resume-file",
    help="run id kept here: a requeued attempt resumes the run the first attempt started",
)
args = parser.parse_args()


def milestone(text: str) -> None:
    # One write per line, flushed: the test reads the file while the job runs.
    with open(args.out, "a") as f:
        f.write(text + "\n")


if not args.raw:
    import lifeguard

    options: dict[str, object] = {"watchdog": args.watchdog}
    if args.heartbeat is not None:
        options["heartbeat"] = args.heartbeat
    lifeguard.install(**options)  # type: ignore[arg-type]

warned = False


def checkpoint(signum: int) -> None:
    global warned
    warned = True
    milestone(f"preempted {signum}")


if args.preemption:
    if args.raw:
        signal.signal(signal.SIGUSR1, lambda signum, frame: checkpoint(signum))
    else:
        lifeguard.on_preemption(checkpoint)

if args.ignore_term:
    # The program's own choice, made after install(): it stands (lifeguard's handler is gone).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

import mlflow  # noqa: E402 - after install(), as a program that installs first does

attempt = int(os.environ.get("SLURM_RESTART_COUNT", "0"))

if args.early_warning:
    milestone("waiting")
    deadline = time.monotonic() + 120
    while not warned:
        if time.monotonic() > deadline:
            sys.exit("no SIGUSR1 within 120 s")
        time.sleep(0.05)  # polls a flag the handler sets

resume_id = None
if args.resume_file and os.path.exists(args.resume_file):
    with open(args.resume_file) as f:
        resume_id = f.read().strip() or None

run = mlflow.start_run(run_id=resume_id)
if args.resume_file and resume_id is None:
    with open(args.resume_file + ".tmp", "w") as f:
        f.write(run.info.run_id)
    os.replace(args.resume_file + ".tmp", args.resume_file)
mlflow.log_param(f"attempt_{attempt}_pid", os.getpid())
milestone(f"ready {run.info.run_id} {os.getpid()} {attempt}")

steps = args.steps
if args.finish_on_attempt is not None and attempt >= args.finish_on_attempt:
    steps = 10
step = 0
while steps == 0 or step < steps:
    mlflow.log_metric("loss", 1.0 / (step + 1), step=step)
    step += 1
    time.sleep(0.2)  # a training step, not synchronisation

milestone("done")
if args.exit:
    sys.exit(args.exit)
