"""A signal at any instant: in the middle of a store write, with a program handler of its own,
twice in a row. The status always lands, and finalization never waits on the program's locks.

Each child is a real process on a real sqlite store. The signal is sent *from inside* the write
(a SQLAlchemy event fires between MLflow's INSERT and its COMMIT, while sqlite's write lock is
held), so no timing luck is needed to hit the window.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lifeguard.demo import ChildResult, run_child
from lifeguard.journal import REPLAY_STAMP
from tests.conftest import (
    CHILD_TIMEOUT,
    REPO,
    Store,
    child_env,
    shows_lifeguard,
    sweep,
    trials,
    without_and_with,
)

pytestmark = pytest.mark.slow

# The child's preamble: install, a run, one metric, the ready line.
PREAMBLE = """
import json, os, signal, sys, threading, time
import lifeguard
lifeguard.install(**json.loads(os.environ.get("TEST_INSTALL", "{}")))
import mlflow, sqlalchemy
from lifeguard import demo
run = mlflow.start_run()
mlflow.log_metric("loss", 1.0)
"""

# Sends `SIG` to the process itself from inside MLflow's INSERT INTO metrics: sqlite's write lock
# is held from there to the COMMIT.
MID_WRITE = """
engine = mlflow.tracking._tracking_service.utils._get_store().engine
fired = []
@sqlalchemy.event.listens_for(engine, "after_cursor_execute")
def _(conn, cursor, statement, *rest):
    if statement.lstrip().upper().startswith("INSERT INTO METRICS") and not fired:
        fired.append(1)
        os.write(1, b"SIGNAL %.6f\\n" % time.time())
        os.kill(os.getpid(), SIG)
"""


# A nested run, and Ctrl-C sent from inside end_run's status write (its UPDATE), after MLflow
# popped the run off its stack.
CTRL_C_IN_END_RUN = """
child = mlflow.start_run(nested=True)
engine = mlflow.tracking._tracking_service.utils._get_store().engine
fired = []
@sqlalchemy.event.listens_for(engine, "before_cursor_execute")
def _(conn, cursor, statement, *rest):
    if statement.lstrip().upper().startswith("UPDATE RUNS") and not fired:
        fired.append(1)
        os.kill(os.getpid(), signal.SIGINT)
"""


def program(body: str, *, sig: int | None = None) -> list[str]:
    code = PREAMBLE + (MID_WRITE.replace("SIG)", f"{int(sig)})") if sig else "") + body
    return [sys.executable, "-c", textwrap.dedent(code)]


def run(
    cmd: list[str],
    store: Store,
    install: dict[str, object] | None = None,
    *,
    last_gasp: bool = True,
    **kwargs: object,
) -> ChildResult:
    """``last_gasp=False``: no replayer is left behind (LIFEGUARD_REPLAY_BOUND=0), for a test
    that looks at the journal the process left and replays it itself, as the sweep does (the
    last gasp is tests/test_last_gasp.py's)."""
    env = child_env(store, TEST_INSTALL=json.dumps(install or {}))
    if not last_gasp:
        env["LIFEGUARD_REPLAY_BOUND"] = "0"
    return run_child(cmd, env=env, timeout=CHILD_TIMEOUT, **kwargs)  # type: ignore[arg-type]


def signalled_at(result: ChildResult) -> float:
    line = next(line for line in result.stdout.splitlines() if line.startswith("SIGNAL "))
    return float(line.split()[1])


def journal_files(store: Store) -> list[Path]:
    journal = store.path.parent / "journal"
    return sorted(journal.glob("*.json")) if journal.exists() else []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
@pytest.mark.parametrize("watchdog", [False, True], ids=["in-process", "watchdog"])
def test_signal_in_the_middle_of_a_store_write(store: Store, sig: int, watchdog: bool) -> None:
    """The issue's reproduction: before, the finalizer waited on sqlite's lock, held by the
    frozen main thread, for the whole deadline, and the run stayed RUNNING with no journal."""
    result = run(
        program(
            """
demo.announce(run_ids=[run.info.run_id])
while True:
    mlflow.log_metric("loss", 0.5)
""",
            sig=sig,
        ),
        store,
        # A deadline far below sqlite's 20 s busy timeout: a finalizer that waited on the lock
        # would be cut off, and the run left RUNNING.
        install={"deadline": 5.0, "watchdog": watchdog},
    )
    assert result.returncode == -sig, result.stderr
    [run_id] = result.ready["run_ids"]  # type: ignore[misc]
    info = store.run(run_id).info
    assert info.status == "KILLED", result.stderr
    # The signal's time (read by lifeguard a moment after it was sent), not the write's.
    assert signalled_at(result) * 1000 - 1 <= info.end_time <= signalled_at(result) * 1000 + 500
    assert store.run(run_id).data.tags["lifeguard.signal"] == signal.Signals(sig).name
    assert journal_files(store) == []
    assert "Traceback" not in result.stderr, result.stderr


def test_sigint_in_the_middle_of_a_multi_metric_write(store: Store) -> None:
    """Ctrl-C's KeyboardInterrupt unwinds through the write; its traceback kept the SQLAlchemy
    connection, and with it sqlite's lock, alive until after the exit hooks (31 s before)."""
    result = run(
        program(
            """
demo.announce(run_ids=[run.info.run_id])
while True:
    mlflow.log_metrics({f"m{i}": float(i) for i in range(50)})
""",
            sig=signal.SIGINT,
        ),
        store,
        install={"deadline": 5.0},
    )
    assert result.returncode == -signal.SIGINT, result.stderr
    [run_id] = result.ready["run_ids"]  # type: ignore[misc]
    assert store.status(run_id) == "KILLED"
    assert journal_files(store) == []
    # The traceback is the program's own: no frame of lifeguard's at its tip.
    assert "KeyboardInterrupt" in result.stderr
    assert not shows_lifeguard(result.stderr), result.stderr


# Sends SIGINT from inside SQLAlchemy's session flush, as it registers the new rows in the
# session's identity map: the KeyboardInterrupt leaves ORM states half-registered (no identity
# key yet), held alive only by the frames of its traceback.
MID_FLUSH = """
def tracer(frame, event, arg):
    if frame.f_code.co_filename.endswith(os.path.join("orm", "identity.py")):
        if frame.f_code.co_name == "replace" and event == "return":
            sys.settrace(None)
            os.kill(os.getpid(), signal.SIGINT)
        return tracer
    return tracer if event == "call" and "sqlalchemy" in frame.f_code.co_filename else None
demo.announce(run_ids=[run.info.run_id])
sys.settrace(tracer)
mlflow.log_metrics({f"m{i}": float(i) for i in range(20)})
"""


def test_sigint_in_the_middle_of_an_orm_flush_adds_nothing_to_stderr(store: Store) -> None:
    """Releasing the frames of the KeyboardInterrupt's traceback (so that sqlite's lock goes)
    frees half-registered ORM states whose weakref callbacks then fail an assertion. Before,
    each printed "Exception ignored in InstanceState._cleanup ... AssertionError" (20 of them
    here) after the program's own traceback: stderr the program would not have had."""
    result = run(program(MID_FLUSH), store, install={"deadline": 5.0})
    assert result.returncode == -signal.SIGINT, result.stderr
    [run_id] = result.ready["run_ids"]  # type: ignore[misc]
    assert store.status(run_id) == "KILLED"
    # What the program printed itself ends with its traceback's last line; anything after it
    # would come from the exit hooks, lifeguard's among them.
    tail = result.stderr.rstrip().rpartition("KeyboardInterrupt")[2]
    assert tail == "", result.stderr
    assert "Exception ignored" not in result.stderr, result.stderr


# Ctrl-C while SQLAlchemy turns a query's rows into objects (set_tag's read of the run): the list
# comprehension that does it closes over the half-read cursor, whose statement holds sqlite's
# shared lock. Found by scripts/stress.py's set_tag workload (about 1 trial in 60).
MID_ROWS = """
def tracer(frame, event, arg):
    code = frame.f_code
    if event == "call" and code.co_name == "row_processor" and "sqlalchemy" in code.co_filename:
        sys.settrace(None)
        os.kill(os.getpid(), signal.SIGINT)
        return None
    return tracer if event == "call" and "site-packages" in code.co_filename else None
demo.announce(run_ids=[run.info.run_id])
sys.settrace(tracer)
mlflow.set_tag("step", "1")
"""


def test_sigint_while_a_query_reads_its_rows_does_not_wait_on_the_cursors_lock(
    store: Store,
) -> None:
    """``frame.clear()`` drops a finished frame's locals but, from 3.11 on, not its function:
    the comprehension's closure kept the cursor, and its shared lock, alive until after the
    exit hooks. The finalizer's commit waited on it until the write gave up (the deadline's
    worth) and the status was only journaled; MLflow's own exit hook waits 20 s on it too."""
    result = run(program(MID_ROWS), store, install={"deadline": 5.0})
    assert result.returncode == -signal.SIGINT, result.stderr
    [run_id] = result.ready["run_ids"]  # type: ignore[misc]
    assert store.status(run_id) == "KILLED", result.stderr
    assert journal_files(store) == [], result.stderr
    assert not shows_lifeguard(result.stderr), result.stderr


# The state a Ctrl-C leaves when it lands right after an import lock's acquire (stress trial:
# inside importlib's _get_module_lock, under MLflow's `from pyspark.sql import SparkSession`,
# which every MlflowClient() retries): the lock stays the main thread's.
STRANDED_IMPORT_LOCKS = {
    "global": "import _imp; _imp.acquire_lock()",
    # Kept alive, as the interrupted import's frame in the traceback keeps it.
    "module": "import importlib._bootstrap as b; kept = b._ModuleLockManager('pyspark'); "
    "kept.__enter__()",
}


@pytest.mark.parametrize("lock", sorted(STRANDED_IMPORT_LOCKS))
def test_an_import_lock_stranded_by_ctrl_c_does_not_hold_the_finalizer(
    store: Store, lock: str
) -> None:
    """The finalizer runs in a thread of its own; its first import of a module not loaded yet
    waited forever on the main thread's stranded lock, and it was abandoned at the deadline
    with the status only journaled."""
    body = f"""
demo.announce(run_ids=[run.info.run_id])
{STRANDED_IMPORT_LOCKS[lock]}
raise KeyboardInterrupt
"""
    result = run(program(body), store, install={"deadline": 5.0})
    assert result.returncode == -signal.SIGINT, result.stderr
    [run_id] = result.ready["run_ids"]  # type: ignore[misc]
    assert store.status(run_id) == "KILLED", result.stderr
    assert journal_files(store) == [], result.stderr
    assert not shows_lifeguard(result.stderr), result.stderr


# How the program's code ends after Ctrl-C stranded the lock: uncaught, or caught and then
# sys.exit() or a plain return (a training loop's `except KeyboardInterrupt: print(...)`).
CTRL_C_ENDINGS = {
    "uncaught": ("raise KeyboardInterrupt", -signal.SIGINT, "KILLED"),
    "sys.exit": ("sys.exit(130)", 130, "FAILED"),
    "return": ("pass", 0, "FINISHED"),
}


@pytest.mark.parametrize("mlflow_first", [False, True], ids=["install-first", "mlflow-first"])
@pytest.mark.parametrize("ending", sorted(CTRL_C_ENDINGS))
def test_a_worker_thread_waiting_on_a_stranded_import_lock_does_not_hang_the_exit(
    store: Store, ending: str, mlflow_first: bool
) -> None:
    """Stress trial (server, async, Ctrl-C): MLflow's batch-logging workers, a
    ThreadPoolExecutor's, were importing (a request header provider's lazy import) when Ctrl-C
    stranded the global import lock in the main thread. Threading's shutdown joins such workers
    *before* any atexit hook, so releasing the lock at atexit came too late: the process hung
    until the launcher's SIGTERM, and its finalizer, needing an import too, was abandoned. The
    lock is given back when threading's shutdown begins, however the program's code ended, and
    whichever was imported first: mlflow (then concurrent.futures registered its join before
    install() registered the release) or lifeguard (then at import mlflow, after it)."""
    last, code, status = CTRL_C_ENDINGS[ending]
    body = f"""
import _imp, concurrent.futures
pool = concurrent.futures.ThreadPoolExecutor(1)
importing = threading.Event()
def work():
    importing.set()
    try:
        import lifeguard_test_no_such_module  # waits for the global import lock
    except ImportError:
        pass
demo.announce(run_ids=[run.info.run_id])
_imp.acquire_lock()  # what Ctrl-C right after _get_module_lock's acquire leaves
pool.submit(work)
importing.wait()
{last}
"""
    cmd = program(body)
    if mlflow_first:
        cmd[-1] = "import mlflow\n" + cmd[-1]
    result = run(cmd, store, install={"deadline": 5.0})
    assert result.returncode == code, result.stderr
    [run_id] = result.ready["run_ids"]  # type: ignore[misc]
    assert store.status(run_id) == status, result.stderr
    assert journal_files(store) == [], result.stderr
    assert not shows_lifeguard(result.stderr), result.stderr


# C code that prints an error and goes on (an embedding host's PyRun_SimpleString; sqlite3's
# callbacks on 3.10) calls sys.excepthook with sys.last_value set, as the top level does.
HOLDS_THE_IMPORT_LOCK = """
import _imp, ctypes, sys
if sys.argv[1] == "on":
    import lifeguard
    lifeguard.install(signals=())
    lifeguard.register(lambda outcome: None)
_imp.acquire_lock()  # the program's own hold, released below
ctypes.pythonapi.PyRun_SimpleString(b"1/0")
_imp.release_lock()
print("released it myself")
"""


def test_an_error_printed_from_c_does_not_take_the_programs_import_lock(
    store: Store, tmp_path: Path
) -> None:
    """An excepthook called by C code that then goes on is not the end of the program: an
    import lock the program holds is still its own (the release was once done there; a helper
    found the program's own release then failed)."""
    path = tmp_path / "holds_the_import_lock.py"
    path.write_text(HOLDS_THE_IMPORT_LOCK)
    runs = without_and_with(path, child_env(store, PYTHONPATH=str(REPO)))
    assert runs["off"].returncode == 0, runs["off"].stderr
    assert runs["on"].returncode == 0, runs["on"].stderr
    assert runs["on"].stdout == runs["off"].stdout == "released it myself\n"


def test_a_parked_main_thread_starts_no_run_between_the_finalizers_and_the_death(
    store: Store,
) -> None:
    """The parked main thread was let go when the finalizers were done, a moment before the
    ender's kill: the program ran on, and a nested run it started then (created on the server
    just before the death, in a stress trial) was one nobody ended. The moment is widened here
    to a second, as a loaded machine can stretch it."""
    body = """
import lifeguard.signals as watch
dies = watch.die_from_any_thread
def slowly(signum):
    time.sleep(1.0)  # the moment between the finalizers and the death, widened
    dies(signum)
watch.die_from_any_thread = slowly
demo.announce(run_ids=[run.info.run_id])
while True:
    time.sleep(0.001)  # outside every tracker: parked in the handler
    with mlflow.start_run(nested=True):  # inside one: parked at the next call
        mlflow.log_metric("loss", 0.5)
"""
    result = run(program(body), store, send=(signal.SIGTERM,))
    assert result.returncode == -signal.SIGTERM, result.stderr
    [run_id] = result.ready["run_ids"]  # type: ignore[misc]
    experiment = store.run(run_id).info.experiment_id
    statuses = [r.info.status for r in store.client.search_runs([experiment])]
    assert "RUNNING" not in statuses, (statuses, result.stderr[-3000:])


def test_a_second_signal_exits_at_once_and_the_status_lands_later(store: Store) -> None:
    """A finalizer of the program's own blocks; the second SIGTERM, a second later, ends the
    process at once. The MLflow finalizer never got to run, but the run's status and the first
    signal's time were journaled before any finalizer ran: the sweep writes them."""
    result = run(
        program(
            """
def block(outcome):
    time.sleep(1.0)  # the person at the keyboard loses patience a second in
    os.write(1, b"FINALIZING\\n")
    threading.Event().wait()
lifeguard.register(block)
demo.announce(run_ids=[run.info.run_id])
while True:
    mlflow.log_metric("loss", 0.5)
"""
        ),
        store,
        install={"deadline": 600.0},
        send=(signal.SIGTERM,),
        on_line={"FINALIZING": signal.SIGTERM},
        last_gasp=False,
    )
    sent_second = time.time()
    assert result.returncode == -signal.SIGTERM, result.stderr
    assert "FINALIZING" in result.stdout
    [run_id] = result.ready["run_ids"]  # type: ignore[misc]
    assert store.status(run_id) == "RUNNING"
    assert len(journal_files(store)) == 1
    sweep(store)
    info = store.run(run_id).info
    assert info.status == "KILLED"
    assert info.end_time <= sent_second * 1000  # the first signal's time, not the sweep's
    assert journal_files(store) == []


def test_a_second_signal_while_the_ender_waits_for_the_main_thread_finds_the_journal(
    store: Store,
) -> None:
    """The first SIGTERM comes while the main thread is stuck in C inside MLflow's write (a
    stress trial: in a call the ender waits up to 2.5 s for), and a second one a second later,
    during that wait: the process exits at once, and the run's status, with the first signal's
    time, was journaled before the wait (it used to be journaled only after it: nothing was,
    and the sweep could only end the run as an orphan)."""
    result = run(
        program(
            """
import ctypes
libc = ctypes.CDLL(None)
stuck = threading.Event()
def launcher():
    stuck.wait()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(1.0)  # past REPEAT_WINDOW: a second stop, while the ender still waits
    os.write(1, ("SECOND %.6f\\n" % time.time()).encode())
    os.kill(os.getpid(), signal.SIGTERM)
threading.Thread(target=launcher, daemon=True).start()
engine = mlflow.tracking._tracking_service.utils._get_store().engine
@sqlalchemy.event.listens_for(engine, "after_cursor_execute")
def _(conn, cursor, statement, *rest):
    if statement.lstrip().upper().startswith("INSERT INTO METRICS") and not stuck.is_set():
        # Stuck in C inside MLflow's write, as in a collective or a dead NFS: the main thread
        # never gets to run its Python-level handler.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        stuck.set()
        while True:
            libc.sleep(600)
demo.announce(run_ids=[run.info.run_id])
sys.stdin.readline()
mlflow.log_metric("loss", 0.5)
"""
        ),
        store,
        last_gasp=False,
    )
    assert result.returncode == -signal.SIGTERM, result.stderr
    second = float(
        next(x for x in result.stdout.splitlines() if x.startswith("SECOND ")).split()[1]
    )
    [run_id] = result.ready["run_ids"]  # type: ignore[misc]
    assert len(journal_files(store)) == 1, result.stderr
    sweep(store)
    run_ = store.run(run_id)
    assert run_.info.status == "KILLED"
    assert run_.info.end_time <= second * 1000  # the first signal's time, from the journal
    assert run_.data.tags["lifeguard.signal"] == "SIGTERM"
    assert journal_files(store) == []


def test_two_sigterms_of_one_stop_do_not_cut_finalization_short(store: Store) -> None:
    """slurmd sends each srun task two SIGTERMs 3-9 ms apart on a time limit: one stop. The
    finalizers (a slow one of the program's, then MLflow's) all run; the process dies of
    SIGTERM."""
    result = run(
        program(
            """
def slow(outcome):
    os.write(1, b"FINALIZING\\n")
    time.sleep(1.0)
    os.write(1, b"SLOW DONE\\n")
lifeguard.register(slow)
demo.announce(run_ids=[run.info.run_id])
while True:
    mlflow.log_metric("loss", 0.5)
"""
        ),
        store,
        send=(signal.SIGTERM, signal.SIGTERM),
    )
    assert result.returncode == -signal.SIGTERM, result.stderr
    assert "SLOW DONE" in result.stdout
    [run_id] = result.ready["run_ids"]  # type: ignore[misc]
    assert store.status(run_id) == "KILLED"
    assert journal_files(store) == []


def test_async_metrics_get_a_bounded_share(store: Store) -> None:
    """1,000 metrics queued with synchronous=False behind a store that takes 60 s for a batch:
    an unbounded flush would eat the whole deadline and leave the run RUNNING. The flush sends
    nothing for a second and is given up; the run ends KILLED; the log counts what was not
    sent."""
    result = run(
        program(
            """
queue = mlflow.tracking._tracking_service.utils._get_store()._async_logging_queue
original = queue._logging_func
def slow_store(**batch):
    time.sleep(60)  # part of the program under test: a store that takes its time
    return original(**batch)
queue._logging_func = slow_store
for step in range(1000):
    mlflow.log_metric("async_loss", 1.0 / (step + 1), step=step, synchronous=False)
demo.announce(run_ids=[run.info.run_id])
threading.Event().wait()
"""
        ),
        store,
        install={"deadline": 3.0},
        send=(signal.SIGTERM,),
    )
    assert result.returncode == -signal.SIGTERM, result.stderr
    [run_id] = result.ready["run_ids"]  # type: ignore[misc]
    assert store.status(run_id) == "KILLED", result.stderr
    # Less what MLflow's workers and the flush had in flight (stuck in the 60 s write).
    unsent = re.search(r"did not flush in time; (\d+) queued metric", result.stderr)
    assert unsent and 0 < int(unsent.group(1)) <= 1000, result.stderr
    assert result.seconds < CHILD_TIMEOUT


# Async metrics behind a slow store, then Ctrl-C: the queue still holds batches at the exit.
ASYNC_AT_EXIT = """
import sys, time
if sys.argv[1] == "on":
    import lifeguard
    lifeguard.install(deadline=2.0)
import mlflow
import mlflow.utils.async_logging.async_logging_queue as q
run = mlflow.start_run()
original = q.AsyncLoggingQueue._log_run_data
def slow_store(self):
    time.sleep(0.5)  # part of the program under test: a store that takes its time
    return original(self)
q.AsyncLoggingQueue._log_run_data = slow_store
for step in range(8):  # one batch each: 4 s to flush, twice the deadline
    mlflow.log_metric("async_loss", 1.0 / (step + 1), step=step, synchronous=False)
print("run", run.info.run_id, flush=True)
raise KeyboardInterrupt
"""


def test_an_exit_leaves_the_async_flush_to_mlflows_own_exit_hook(
    store: Store, tmp_path: Path
) -> None:
    """Exiting through atexit (here Ctrl-C's KeyboardInterrupt), MLflow's own exit hook flushes
    its async queue after ours, as it does without lifeguard. Before, the finalizer flushed
    first, with a share of the deadline: behind a slow store the share ran out and stderr got a
    line of lifeguard's; behind a fast one, every exit waited a second of MLflow's idle poll.
    Now the status is written first, and the metrics that land are the ones that land without
    lifeguard (MLflow 3.17 lands none: threading's shutdown has closed its worker pool)."""
    program = tmp_path / "async_at_exit.py"
    program.write_text(ASYNC_AT_EXIT)
    runs = without_and_with(program, child_env(store, PYTHONPATH=str(REPO)))
    # Without lifeguard, 3.10 exits 1: MLflow's exit hook execs code, which resets CPython's
    # die-of-SIGINT flag (lifeguard.hooks._keep_ctrl_c_exit sets it again).
    assert runs["on"].returncode == -signal.SIGINT, runs["on"].stderr
    landed = {}
    for mode, done in runs.items():
        run_id = done.stdout.split()[1]
        landed[mode] = sorted(m.step for m in store.client.get_metric_history(run_id, "async_loss"))
    assert store.status(runs["on"].stdout.split()[1]) == "KILLED", runs["on"].stderr
    assert not shows_lifeguard(runs["on"].stderr), runs["on"].stderr
    assert landed["on"] == landed["off"]


def test_a_handler_installed_after_install_stands(store: Store) -> None:
    """The graceful-shutdown pattern: the program's own SIGTERM handler, set after install(),
    sets a flag; the loop finishes its step, saves a checkpoint for a while, and exits 0. Before,
    lifeguard's stuck-main-thread helper killed it 0.8 s later. Same output with and without
    lifeguard, and the run FINISHED."""
    body = """
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
demo.announce(run_ids=[run.info.run_id])
while not stop:
    mlflow.log_metric("loss", 0.5)
print("saving checkpoint", flush=True)
deadline = time.monotonic() + 3.0
while time.monotonic() < deadline:
    time.sleep(0.05)
print("saved", flush=True)
mlflow.end_run()
"""
    results = []
    for guarded in (True, False):
        cmd = program(body)
        if not guarded:
            cmd[-1] = cmd[-1].replace("lifeguard.install(", "dict(")
        results.append(run(cmd, store, send=(signal.SIGTERM,)))
    for result in results:
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines()[-2:] == ["saving checkpoint", "saved"]
        [run_id] = result.ready["run_ids"]  # type: ignore[misc]
        assert store.status(run_id) == "FINISHED"
    assert results[0].stderr == results[1].stderr


# SIGTERM from inside the store's INSERT of a nested run, then (SLOW seconds, part of the
# program under test: a store slow to create a run) the rest of start_run.
INSIDE_START_RUN = """
engine = mlflow.tracking._tracking_service.utils._get_store().engine
fired = []
@sqlalchemy.event.listens_for(engine, "after_cursor_execute")
def _(conn, cursor, statement, *rest):
    if statement.lstrip().upper().startswith("INSERT INTO RUNS") and not fired:
        fired.append(1)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(SLOW)
demo.announce(run_ids=[run.info.run_id])
sys.stdin.readline()  # the test has the ready line: now the nested start_run
child = mlflow.start_run(nested=True)
os.write(1, b"UNREACHED %s\\n" % child.info.run_id.encode())
threading.Event().wait()
"""


@pytest.mark.parametrize(
    "slow",
    [
        # The signal arrives after the store created the run but before start_run put it on
        # the active-run stack: the ender waits for the main thread to leave MLflow, so the run
        # is on the stack when the finalizer looks.
        0.0,
        # The stress test's one lost run: a nested start_run against a slow store (a loaded
        # server) was still creating its run when the ender stopped waiting and made its plan;
        # the run was pushed after, without owner tags (lifeguard had left MLflow's context),
        # and stayed RUNNING. 3 s is past the ender's wait (at most 2.5 s), holding sqlite's
        # lock: the run appears only after the plan, and must still end KILLED.
        3.0,
    ],
    ids=["inside", "outlasting-the-ender-s-wait"],
)
def test_sigterm_inside_start_run_ends_the_run_it_was_creating(store: Store, slow: float) -> None:
    result = run(
        program(INSIDE_START_RUN.replace("SLOW", repr(slow))),
        store,
        install={"deadline": 20.0},
    )
    assert result.returncode == -signal.SIGTERM, result.stderr
    runs = store.client.search_runs(["0"])
    assert len(runs) == 2
    assert {r.info.status for r in runs} == {"KILLED"}, result.stderr
    # Both carry their owner, the late one too.
    assert all("lifeguard.owner.pid" in r.data.tags for r in runs)
    assert journal_files(store) == []


def test_a_forked_worker_ends_its_own_run(store: Store) -> None:
    """A multiprocessing worker started with fork calls install() and starts its own run. Its
    install() used to chain to the parent's handler, which saw a foreign pid and killed at once,
    leaving the worker's run RUNNING. It ends KILLED; the parent's run is the parent's."""
    result = run(
        program(
            """
import multiprocessing
def worker(conn):
    lifeguard.install()
    # MLflow's stacks are per thread and reset in a forked child: a fresh top-level run.
    own = mlflow.start_run(run_name="worker")
    conn.send((os.getpid(), own.info.run_id))
    threading.Event().wait()
parent_end, child_end = multiprocessing.Pipe()
proc = multiprocessing.get_context("fork").Process(target=worker, args=(child_end,))
proc.start()
pid, worker_run = parent_end.recv()
demo.announce(run_ids=[run.info.run_id, worker_run], worker=pid)
proc.join()
os.write(1, b"WORKER %d\\n" % proc.exitcode)
threading.Event().wait()
"""
        ),
        store,
        after_ready=lambda ready: os.kill(int(ready["worker"]), signal.SIGTERM),  # type: ignore[call-overload]
        on_line={"WORKER": signal.SIGTERM},
    )
    assert f"WORKER {-signal.SIGTERM}" in result.stdout, result.stdout + result.stderr
    parent_run, worker_run = result.ready["run_ids"]  # type: ignore[misc]
    assert store.status(worker_run) == "KILLED"
    assert store.status(parent_run) == "KILLED"  # by the parent's own SIGTERM afterwards


# The issue measured a failure in 7 of 10 runs; 30 in a row with the full trials (CI), 5 in a
# contributor's `tox` (which miss that race once in 400 runs), 50 when
# LIFEGUARD_TEST_IMPORT_REPEAT=50 is set by hand (each child and each replayer it starts
# imports mlflow).
IMPORT_REPEAT = int(os.environ.get("LIFEGUARD_TEST_IMPORT_REPEAT", trials(30, 5)))


@pytest.mark.long
@pytest.mark.timeout(60 * IMPORT_REPEAT)
def test_a_pending_journal_entry_never_disturbs_the_program_s_import(store: Store) -> None:
    """A pending entry (its server down) makes install() start a replay. It used to replay in a
    thread that imported mlflow beside the program's own `import mlflow` (a _DeadlockError in 7
    of 10 runs) and set MLflow's HTTP variables in the program's environment. Many in a row: the
    program imports mlflow and sees its environment as it was."""
    journal = store.path.parent / "journal"
    journal.mkdir(mode=0o700)
    entry = journal / "0123456789abcdef0123456789abcdef.json"
    entry.write_text(
        json.dumps(
            {
                "version": 1,
                "run_id": entry.stem,
                "tracking_uri": "http://127.0.0.1:9",  # nothing listens there
                "status": "KILLED",
                "end_time": 1,
                "tags": {},
                "journaled_at": 1,
                "pid": 999999999,  # long gone
            }
        )
    )
    entry.chmod(0o600)
    code = textwrap.dedent(
        """
        import os, lifeguard
        lifeguard.install()
        import mlflow
        from lifeguard import journaldir
        assert journaldir.replay_pid is not None, "no replay was started"
        print(sorted(k for k in os.environ if k.startswith("MLFLOW_HTTP")))
        """
    )
    for attempt in range(IMPORT_REPEAT):
        # As if the last replay were long ago: each attempt starts one (journal.replay_due).
        (journal / REPLAY_STAMP).unlink(missing_ok=True)
        done = subprocess.run(
            [sys.executable, "-c", code],
            env=child_env(store),
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT,
        )
        assert done.returncode == 0, f"attempt {attempt}: {done.stderr}"
        assert done.stdout.strip() == "[]", done.stdout


def test_runs_started_after_finish_are_the_process_s_too(store: Store) -> None:
    """lifeguard.finish() ends the training run; the evaluation run started after it gets owner
    tags and, on SIGTERM, ends KILLED (it used to be left RUNNING, untagged)."""
    result = run(
        program(
            """
lifeguard.finish()
evaluation = mlflow.start_run(run_name="evaluation")
demo.announce(run_ids=[run.info.run_id, evaluation.info.run_id])
while True:
    mlflow.log_metric("accuracy", 0.9)
"""
        ),
        store,
        send=(signal.SIGTERM,),
    )
    assert result.returncode == -signal.SIGTERM, result.stderr
    training, evaluation = result.ready["run_ids"]  # type: ignore[misc]
    assert store.status(training) == "FINISHED"
    assert store.status(evaluation) == "KILLED"
    assert "lifeguard.owner.pid" in store.run(evaluation).data.tags


def test_the_run_end_run_was_ending_is_journaled_before_any_write(store: Store) -> None:
    """Ctrl-C inside end_run's status write: the run, popped off its stack, is in the plan
    journaled before anything slow, like the runs still on a stack. A search for it after the
    writes (the stress harness: a write stuck until the deadline) would never be reached. A
    finalizer of the program's own, run first (LIFO), sees the journal as it then is."""
    result = run(
        program(
            CTRL_C_IN_END_RUN
            + """
journal = os.environ["LIFEGUARD_JOURNAL_DIR"]
lifeguard.register(lambda outcome: os.write(
    1, ("JOURNAL " + json.dumps(sorted(os.listdir(journal))) + "\\n").encode()), name="peek")
demo.announce(run_ids=[run.info.run_id, child.info.run_id])
sys.stdin.readline()
mlflow.end_run()
threading.Event().wait()
"""
        ),
        store,
    )
    assert result.returncode == -signal.SIGINT, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("JOURNAL "))
    journaled = {name.removesuffix(".json") for name in json.loads(line[len("JOURNAL ") :])}
    assert set(result.ready["run_ids"]) <= journaled, (journaled, result.stderr)  # type: ignore[arg-type]
    for run_id in result.ready["run_ids"]:  # type: ignore[attr-defined]
        assert store.status(run_id) == "KILLED", result.stderr
    assert journal_files(store) == []  # written, so removed


def test_ctrl_c_before_end_run_s_pop_leaves_the_thread_s_previous_run_alone(
    store: Store,
) -> None:
    """Ctrl-C inside end_run before it pops the run: MLflow's "last active run" still names the
    run ended before, which another process has resumed since (here: set RUNNING again). Only
    end_run's own record of the run it popped counts; the resumed run is not touched, and the
    run still on the stack ends KILLED."""
    result = run(
        program(
            """
import inspect
import mlflow.tracking.fluent as fluent
from mlflow.tracking import MlflowClient
earlier = mlflow.start_run(nested=True).info.run_id
mlflow.end_run()  # FINISHED; MLflow notes it as the thread's last active run
MlflowClient().update_run(earlier, "RUNNING")  # resumed by another process since,
MlflowClient().set_tag(earlier, "lifeguard.owner.pid", str(os.getppid()))  # which owns it now
current = mlflow.start_run(nested=True).info.run_id
source, first = inspect.getsourcelines(fluent.end_run)
[pop] = [first + i for i, line in enumerate(source) if "active_run_stack.pop()" in line]
def local(frame, event, arg):
    if event == "line" and frame.f_lineno == pop:
        raise KeyboardInterrupt  # Ctrl-C, at the instant before the pop
    return local
def tracer(frame, event, arg):
    return local if frame.f_code is fluent.end_run.__code__ else None
demo.announce(run_ids=[run.info.run_id, current, earlier])
sys.stdin.readline()
sys.settrace(tracer)
mlflow.end_run()
"""
        ),
        store,
    )
    assert result.returncode == -signal.SIGINT, result.stderr
    top, current, earlier = result.ready["run_ids"]  # type: ignore[misc]
    assert store.status(current) == "KILLED", result.stderr
    assert store.status(top) == "KILLED", result.stderr
    assert store.status(earlier) == "RUNNING", result.stderr  # not this process's to end
    assert journal_files(store) == []


def test_ctrl_c_inside_end_run_ends_the_run_it_was_ending(store: Store) -> None:
    """Ctrl-C's KeyboardInterrupt raised in end_run's status write, after the run was popped off
    its stack: the write is rolled back and the run is on no stack. Its owner tags find it (the
    stress harness's one status lost, SIGINT in its mixed workload)."""
    result = run(
        program(
            CTRL_C_IN_END_RUN
            + """
demo.announce(run_ids=[run.info.run_id, child.info.run_id])
sys.stdin.readline()
mlflow.end_run()
threading.Event().wait()
"""
        ),
        store,
    )
    assert result.returncode == -signal.SIGINT, result.stderr
    for run_id in result.ready["run_ids"]:  # type: ignore[attr-defined]
        assert store.status(run_id) == "KILLED", result.stderr
