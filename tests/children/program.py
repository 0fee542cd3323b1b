"""A tiny training-like program that the exit-path tests run as a real subprocess.

It starts MLflow runs against MLFLOW_TRACKING_URI (a sqlite store in the test's tmp_path), prints
the demo's ready line with the run ids, then ends the way ``--path`` says. The flags switch on
the interactions the tests need; each one is something a real program does.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from lifeguard import demo

parser = argparse.ArgumentParser()
parser.add_argument("--path", required=True, choices=[*demo.PATHS, *demo.DEATHS])
parser.add_argument(
    "--order",
    choices=["before", "after", "none"],
    default="before",
    help="import mlflow before or after install(), or run without lifeguard",
)
parser.add_argument("--record", help="file the recording finalizer appends 'pid status' to")
parser.add_argument("--runs", choices=["one", "nested", "thread"], default="one")
parser.add_argument("--user-sigterm", choices=["exit7", "return"])
parser.add_argument("--raising-finalizer", action="store_true")
parser.add_argument("--hanging-finalizer", action="store_true")
parser.add_argument(
    "--blocking-finalizer",
    action="store_true",
    help="a finalizer that prints FINALIZING and blocks (second-signal test)",
)
parser.add_argument("--deadline", type=float)
parser.add_argument("--fork", action="store_true", help="fork children that outlive the ready line")
parser.add_argument("--finish-first", action="store_true", help="call lifeguard.finish() first")
parser.add_argument("--with-block", action="store_true", help="run ended by a with block first")
parser.add_argument("--user-ended", action="store_true", help="user ends the run via the client")
parser.add_argument("--attach", action="store_true", help="MLFLOW_RUN_ID names the run to use")
parser.add_argument("--end-attached", action="store_true")
parser.add_argument("--watchdog", action="store_true", help="install(watchdog=True)")
parser.add_argument("--wait-replay", action="store_true", help="join install()'s journal replay")
parser.add_argument("--wait-stdin", action="store_true", help="wait for stdin EOF, then exit")
parser.add_argument("--preemption", action="store_true", help="checkpoint on SIGUSR1")
parser.add_argument("--bare-exit", type=int, help="end with a bare `raise SystemExit(N)`")
parser.add_argument(
    "--ended-by-del",
    action="store_true",
    help="a local object whose __del__ ends the run (HuggingFace's MLflowCallback does)",
)
parser.add_argument("--run-name", help="name of the main run (the browser test shows it)")
parser.add_argument("--async-metrics", type=int, default=0, help="queue N metrics asynchronously")
args = parser.parse_args()

demo.prepare(args.path)


def lifeguard_preinstalled() -> bool:
    """Under `lifeguard run` the hooks are already in (autoboot); the program is unedited."""
    return os.environ.get("LIFEGUARD_AUTOINSTALL") == "1"


if args.user_sigterm:

    def user_sigterm(signum: int, frame: object) -> None:
        os.write(1, b"USER-HANDLER\n")  # a signal handler: no buffered I/O
        if args.user_sigterm == "exit7":
            sys.exit(7)

    signal.signal(signal.SIGTERM, user_sigterm)

if args.order == "before":
    import mlflow

if args.order != "none" and not lifeguard_preinstalled():
    import lifeguard

    options: dict[str, object] = {}
    if args.deadline is not None:
        options["deadline"] = args.deadline
    if args.end_attached:
        options["end_attached"] = True
    if args.watchdog:
        options["watchdog"] = True
    lifeguard.install(**options)

    if args.record:
        record_path = args.record

        def record(outcome: lifeguard.Outcome) -> None:
            fd = os.open(record_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, f"{os.getpid()} {outcome.status.value}\n".encode())
            finally:
                os.close(fd)

        lifeguard.register(record, name="record")
    if args.raising_finalizer:

        def explode(outcome: lifeguard.Outcome) -> None:
            raise RuntimeError("finalizer exploded on purpose")

        lifeguard.register(explode, name="explode")
    if args.hanging_finalizer:
        lifeguard.register(lambda outcome: threading.Event().wait(), name="hang")
    if args.blocking_finalizer:

        def block(outcome: lifeguard.Outcome) -> None:
            os.write(1, b"FINALIZING\n")
            threading.Event().wait()

        lifeguard.register(block, name="block")

if args.wait_replay:
    from lifeguard import journaldir as _journaldir

    assert _journaldir.replay_pid is not None, "install() found no journal to replay"
    import select

    # The replayer is detached (nobody's child): a pidfd says when it is gone.
    try:
        _pidfd = os.pidfd_open(_journaldir.replay_pid)
    except ProcessLookupError:
        pass
    else:
        select.select([_pidfd], [], [], 120)

import mlflow  # noqa: E402  (the "after" order: imported only now)
from mlflow.tracking import MlflowClient  # noqa: E402

run_ids: list[str] = []

if args.with_block:
    with mlflow.start_run() as done:
        mlflow.log_metric("loss", 1.0)
    run_ids.append(done.info.run_id)

run = mlflow.start_run(run_name=args.run_name)
mlflow.log_metric("loss", 0.5, step=1)
run_ids.append(run.info.run_id)
if args.attach and os.environ.get("MLFLOW_RUN_ID_EXPECTED") != run.info.run_id:
    raise SystemExit("MLFLOW_RUN_ID was not honoured")

if args.runs == "nested":
    child = mlflow.start_run(nested=True)
    run_ids.append(child.info.run_id)
elif args.runs == "thread":
    started = threading.Event()

    def worker() -> None:
        # MLflow's active-run stack is thread-local: this run lives in the worker's stack.
        run_ids.append(mlflow.start_run(run_name="worker").info.run_id)
        started.set()
        threading.Event().wait()

    threading.Thread(target=worker, daemon=True).start()
    started.wait(60)

for step in range(args.async_metrics):
    mlflow.log_metric("async_loss", 1.0 / (step + 1), step=step, synchronous=False)

if args.user_ended:
    MlflowClient().set_terminated(run.info.run_id, "FAILED")

children: list[int] = []
if args.fork:
    import multiprocessing
    import time

    read_fd, write_fd = os.pipe()

    def wait_forever() -> None:
        os.write(write_fd, b"x")
        # Not signal.pause(): a SIGINT that lands just before its system call leaves it paused
        # for good (CPython runs the handler between bytecodes). A sleep ends.
        while True:
            time.sleep(0.1)

    pid = os.fork()
    if pid == 0:
        wait_forever()  # SIGINT raises KeyboardInterrupt here, which unwinds like the parent's
        sys.exit(0)
    children.append(pid)
    proc = multiprocessing.get_context("fork").Process(target=wait_forever)
    proc.start()
    children.append(proc.pid or 0)
    for _ in range(2):
        os.read(read_fd, 1)

if args.preemption:

    def checkpoint(signum: int) -> None:
        # Runs inside a signal handler: os.write, not print, which may be mid-flush of the
        # ready line (a "reentrant call" RuntimeError). A real program sets a flag here.
        os.write(1, f"CHECKPOINT {signum}\n".encode())

    lifeguard.on_preemption(checkpoint)

if args.finish_first:
    lifeguard.finish()

guardian = None
if args.order != "none" and not lifeguard_preinstalled():
    from lifeguard import api

    guardian = api.current().guardian_pid  # type: ignore[union-attr]
demo.announce(run_ids=run_ids, pid=os.getpid(), children=children, watchdog=guardian)
if args.wait_stdin:
    sys.stdin.read()  # the parent breaks something meanwhile, then closes our stdin
if args.bare_exit is not None:
    raise SystemExit(args.bare_exit)
if args.ended_by_del:

    class EndsRunOnDel:
        def __del__(self) -> None:
            mlflow.end_run()  # always FINISHED: what a __del__-based cleanup says

    def train() -> None:
        callback = EndsRunOnDel()  # noqa: F841 - held by this frame only, like a Trainer's
        demo.enact(args.path)

    train()
else:
    demo.enact(args.path)
