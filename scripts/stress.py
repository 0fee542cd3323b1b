"""A signal at any instant: randomized stress of lifeguard's signal path (issue 11).

    python scripts/stress.py [--trials N] [--seed S] [--jobs J] [--store sqlite|server|both]
                             [--watchdog on|off|both] [--quick] [--replay SPEC ...]

Each trial starts tests/children/stress_program.py as a real subprocess in its own session,
against a real MLflow store (a sqlite file of its own, or one `mlflow server` on 127.0.0.1 that
this script starts and stops, with an experiment per trial) and a journal directory of its own.
The child installs lifeguard, starts a run, writes a ready line and loops over a workload. After
a random delay the harness sends SIGTERM, SIGINT, SIGHUP, or SIGTERM and a second SIGTERM during
finalization, and checks the contract (DESIGN.md section 1):

  - the process dies of that signal (SIGINT: -2, CPython's re-kill after KeyboardInterrupt);
  - it exits within --slow seconds of the last signal (finalization never waits on the
    program's locks; a finalization that hits lifeguard's deadline shows up here); within 10 s
    for SIGINT, whose KeyboardInterrupt runs the program's own slow atexit work (SLOW_SIGINT);
  - every run the program started and had not ended itself reads KILLED with an end time
    between the signal and the exit; a run the program ended itself reads FINISHED;
  - stderr holds no traceback but the KeyboardInterrupt one that SIGINT prints without
    lifeguard.

For double-SIGTERM trials, and whenever a run is still RUNNING after the exit, it replays the
journal as a user would (`lifeguard sweep --tracking-uri URI --journal-dir DIR`) and counts the
run right only if it then reads KILLED with a true end time, written from the journal (a run the
sweep had to end as an orphan, with a guessed end time, lost its status). Trials that needed the
replay are counted separately. With the watchdog on, it waits for the watchdog to exit first.

It prints the trials per (store, watchdog, signal, workload) cell with how many were right, the
failures (each with a --replay spec that reruns exactly that trial), and the spread of
signal-to-exit times. Exit status 1 if any trial was wrong.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import re
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CHILD = REPO / "tests" / "children" / "stress_program.py"
sys.path.insert(0, str(REPO))  # run as a script from a checkout: lifeguard and tests importable

from tests.children.stress_program import WORKLOADS  # noqa: E402

SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGTERMx2")
EXPECTED_DEATH = {"SIGTERM": -15, "SIGINT": -2, "SIGHUP": -1, "SIGTERMx2": -15}
SIGNUMS = {"SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT, "SIGHUP": signal.SIGHUP,
           "SIGTERMx2": signal.SIGTERM}  # fmt: skip
STORES = ("sqlite", "server")

# The random instant: after the ready line, inside the loop.
DELAY = (0.0, 0.3)
# The second SIGTERM of an escalation, during finalization.
SECOND_DELAY = (0.05, 1.5)
# An end time may be this much before the signal was sent (ms rounding) ...
BEFORE_MS = 50
# ... or after the exit was seen (the watchdog stamps the death it observed).
AFTER_MS = 1000
# Bounds on waits, not expectations: a loaded 2-core machine is slow to start mlflow.
READY_TIMEOUT = 120.0
EXIT_TIMEOUT = 30.0  # the grace period a launcher gives before SIGKILL
WATCHDOG_TIMEOUT = 60.0
# A last-gasp replayer writes within a second on sqlite and a live server; its bound is 600 s.
REPLAYER_TIMEOUT = 60.0
SWEEP_TIMEOUT = 120.0
# An exit slower than this after the last signal means finalization waited on something.
SLOW = 5.0
# SIGINT is different: the program's own atexit hooks run then (MLflow's end_run and its async
# queue flush), and on sqlite MLflow's end_run may wait out sqlite's 5 s busy timeout on a lock
# held by the very commit the KeyboardInterrupt broke. Without lifeguard that alone took 5.8-7.6 s
# on a loaded 2-core machine (tests/children/stress_program.py --bare, log_metric and async). A
# finalizer that runs into lifeguard's 10 s deadline still shows: its exit is past 10 s.
SLOW_SIGINT = 10.0
# The report lists this many of the slowest exits.
SHOW_SLOWEST = 10

# Two ways a Ctrl-C ends differently with or without lifeguard, seen in 1000-trial runs, both
# decided by CPython and the program's own code at the instant the KeyboardInterrupt lands:
#  - it lands in a weakref callback or a __del__: CPython prints "Exception ignored in ..."
#    and drops it, and the program runs on. A launcher's next step is a SIGTERM: the harness
#    sends one after EXIT_TIMEOUT, and that ending is judged (death by SIGTERM, runs KILLED);
#  - it lands in cleanup code that then fails (MLflow's log_artifact closes an fd twice when
#    os.fdopen is interrupted): the program dies of that exception, exit 1, and its runs must
#    read FAILED, as for any uncaught exception.
DROPPED = "CPython dropped the KeyboardInterrupt"
RAISED_IN_CLEANUP = "the program's cleanup raised while handling the KeyboardInterrupt"
PROGRAMS_OWN = (DROPPED, RAISED_IN_CLEANUP)

READY = "STRESS-READY"
MARKER = re.compile(r"STRESS-(READY|START|ENDING|ENDED|FINALIZED) (\{.*\})")


# -- the plan --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Trial:
    """One trial: its cell and its own seed; the seed decides everything random in it."""

    seed: int
    store: str
    watchdog: bool
    signal: str
    workload: str

    @property
    def cell(self) -> tuple[str, str, str, str]:
        return (self.store, "watchdog" if self.watchdog else "-", self.signal, self.workload)

    @property
    def spec(self) -> str:
        """What --replay takes to rerun exactly this trial."""
        wd = "on" if self.watchdog else "off"
        return f"{self.seed}/{self.store}/{wd}/{self.signal}/{self.workload}"

    @classmethod
    def parse(cls, spec: str) -> Trial:
        seed, store, wd, sig, workload = spec.split("/")
        if store not in STORES or wd not in ("on", "off") or sig not in SIGNALS:
            raise ValueError(f"bad trial spec {spec!r}")
        if workload not in WORKLOADS:
            raise ValueError(f"unknown workload {workload!r}")
        return cls(int(seed), store, wd == "on", sig, workload)

    def params(self) -> tuple[float, float, bool]:
        """(delay before the signal, delay before a second SIGTERM, import mlflow first)."""
        rng = random.Random(self.seed)
        return rng.uniform(*DELAY), rng.uniform(*SECOND_DELAY), rng.random() < 0.5


def plan(
    trials: int,
    seed: int,
    stores: Sequence[str],
    watchdogs: Sequence[bool],
    signals: Sequence[str] = SIGNALS,
) -> list[Trial]:
    """``trials`` trials spread evenly over the cells (in a shuffled order, so that a short run
    still covers many), each with its own seed drawn from ``seed``."""
    rng = random.Random(seed)
    cells = list(itertools.product(stores, watchdogs, signals, WORKLOADS))
    rng.shuffle(cells)
    out = []
    for i in range(trials):
        store, wd, sig, workload = cells[i % len(cells)]
        out.append(Trial(rng.getrandbits(31), store, wd, sig, workload))
    return out


# -- processes: everything started is killed, even on Ctrl-C ----------------------------------


class Reaper:
    """Every process group and pidfd the harness is responsible for, killed by ``kill_all``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._groups: set[int] = set()
        self._pidfds: set[int] = set()
        self.stopping = threading.Event()

    def add_group(self, pgid: int) -> None:
        with self._lock:
            self._groups.add(pgid)
        if self.stopping.is_set():  # started while kill_all ran: it must not outlive the harness
            self.kill_all()

    def drop_group(self, pgid: int) -> None:
        with self._lock:
            self._groups.discard(pgid)

    def add_pidfd(self, fd: int) -> None:
        with self._lock:
            self._pidfds.add(fd)
        if self.stopping.is_set():
            self.kill_all()

    def drop_pidfd(self, fd: int) -> None:
        with self._lock:
            self._pidfds.discard(fd)

    def kill_all(self) -> None:
        self.stopping.set()
        with self._lock:
            groups, pidfds = list(self._groups), list(self._pidfds)
        for pgid in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        for fd in pidfds:
            # A pidfd names the very process it was opened for: no risk of a reused pid.
            with contextlib.suppress(ProcessLookupError, OSError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)


def wait_pidfd(fd: int, timeout: float) -> bool:
    """Whether the process exited within ``timeout``: a pidfd is readable exactly then."""
    return bool(select.select([fd], [], [], max(0.0, timeout))[0])


def default_dispositions() -> None:
    """Between fork and exec: SIG_DFL and unblocked for every signal a trial sends."""
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGHUP})


def child_env(uri: str, journal: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LIFEGUARD_", "MLFLOW_"))}
    env.update(
        MLFLOW_TRACKING_URI=uri,
        LIFEGUARD_JOURNAL_DIR=str(journal),
        PYTHONWARNINGS="ignore",
    )
    return env


# -- one trial -------------------------------------------------------------------------------


@dataclass
class RunState:
    run_id: str
    status: str
    end_time: int | None
    tags: dict[str, str]


@dataclass
class Result:
    trial: Trial
    wrong: list[str] = field(default_factory=list)
    exit_seconds: float | None = None  # first signal to exit
    # First signal to the end of lifeguard's finalizers (the child's STRESS-FINALIZED): the
    # statuses are written or journaled. After it, the exit is the program's own work.
    finalized_seconds: float | None = None
    returncode: int | None = None
    needed_replay: bool = False
    # Lines lifeguard itself wrote to stderr (its logger's last-resort output): counted and
    # shown, not judged here -- a warning when something went wrong is by design.
    lifeguard_lines: list[str] = field(default_factory=list)
    workdir: str = ""
    runs: int = 0
    # The batches MLflow's async logging had queued as lifeguard's finalizers started (None: the
    # program never logged asynchronously): exits with a backlog are reported apart, for the
    # flush may use the time the deadline leaves.
    backlog: int | None = None
    # The process left a last-gasp replayer (lifeguard.lastgasp): a status it could only journal,
    # which the replayer wrote after its death (waited for before the runs are read).
    last_gasp: bool = False
    # Set when the program, not lifeguard, changed how the signal ended it (see PROGRAMS_OWN):
    # the trial is then judged by the contract for the ending the program actually had.
    programs_own: str = ""

    @property
    def ok(self) -> bool:
        return not self.wrong


class Context:
    """What all trials share: the root directory, the template store, the server."""

    def __init__(
        self, root: Path, reaper: Reaper, server_uri: str | None, slow: float = SLOW
    ) -> None:
        self.root = root
        self.reaper = reaper
        self.server_uri = server_uri
        self.slow = slow
        self.template = root / "template.db"
        self._counter = itertools.count()
        self._lock = threading.Lock()
        global PACKAGE
        seen = subprocess.run(
            [sys.executable, "-c", "import lifeguard; print(lifeguard.__path__[0])"],
            env=child_env("sqlite:///:memory:", root / "journal"),
            capture_output=True, text=True, check=True, timeout=60,
        )  # fmt: skip
        PACKAGE = os.path.realpath(seen.stdout.strip())

    def make_template(self) -> None:
        """An empty, migrated sqlite store; migrating takes seconds, so it is done once and
        copied into each trial."""
        import logging

        from mlflow.tracking import MlflowClient

        logging.getLogger("mlflow").setLevel(logging.WARNING)  # its migration chatter
        MlflowClient(tracking_uri=f"sqlite:///{self.template}").search_experiments()

    def next_dir(self) -> Path:
        with self._lock:
            n = next(self._counter)
        path = self.root / f"trial-{n:05d}"
        path.mkdir()
        return path


def run_trial(ctx: Context, trial: Trial) -> Result:
    result = Result(trial)
    if ctx.reaper.stopping.is_set():
        result.wrong.append("not run: the harness is stopping")
        return result
    workdir = ctx.next_dir()
    result.workdir = str(workdir)
    delay, second_delay, mlflow_first = trial.params()
    if trial.store == "sqlite":
        shutil.copy(ctx.template, workdir / "mlflow.db")
        uri, experiment = f"sqlite:///{workdir / 'mlflow.db'}", "stress"
    else:
        assert ctx.server_uri is not None, "server trials need the server"
        uri, experiment = ctx.server_uri, f"stress-{workdir.name}-{trial.seed}"
    journal = workdir / "journal"
    cmd = [
        sys.executable, str(CHILD), "--workload", trial.workload, "--experiment", experiment,
        "--scratch", str(workdir / "scratch"), "--seed", str(trial.seed),
        *(["--watchdog"] if trial.watchdog else []),
        *(["--mlflow-first"] if mlflow_first else []),
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=workdir,  # MLflow's default artifact root for a sqlite store is ./mlruns
        env=child_env(uri, journal),
        start_new_session=True,
        # Default dispositions for the signals under test, whatever this harness inherited: an
        # exec keeps an ignored signal ignored (SIGHUP under nohup; SIGINT for a background job
        # of a non-interactive shell), and lifeguard rightly keeps it so.
        preexec_fn=default_dispositions,
    )
    ctx.reaper.add_group(proc.pid)
    pidfd = os.pidfd_open(proc.pid)
    watchdog_fd: int | None = None
    events: list[tuple[str, dict[str, Any]]] = []
    stderr_chunks: list[bytes] = []
    ready = threading.Event()

    def read_stdout() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            match = MARKER.search(raw.decode(errors="replace"))
            if match:
                with contextlib.suppress(ValueError):
                    events.append((match.group(1), json.loads(match.group(2))))
                    if match.group(1) == "READY":
                        ready.set()
        ready.set()  # EOF: died before (or without) a ready line

    def read_stderr() -> None:
        assert proc.stderr is not None
        stderr_chunks.append(proc.stderr.read())

    readers = [
        threading.Thread(target=read_stdout, daemon=True),
        threading.Thread(target=read_stderr, daemon=True),
    ]
    for reader in readers:
        reader.start()
    sig = SIGNUMS[trial.signal]
    try:
        if not ready.wait(READY_TIMEOUT) or not events or events[0][0] != "READY":
            how = f"exited {proc.poll()}" if wait_pidfd(pidfd, 0) else "hung"
            result.wrong.append(f"no ready line ({how})" + _tail(b"".join(stderr_chunks)))
            return result
        info = events[0][1]
        if info.get("watchdog"):
            with contextlib.suppress(ProcessLookupError):
                watchdog_fd = os.pidfd_open(int(info["watchdog"]))
                ctx.reaper.add_pidfd(watchdog_fd)
        elif trial.watchdog:
            result.wrong.append("install(watchdog=True) started no watchdog")

        time.sleep(delay)  # the point of the harness: a random instant inside the loop
        sent = time.time()
        last_sent = time.monotonic()
        sent_mono = last_sent
        os.kill(proc.pid, sig)
        if trial.signal == "SIGTERMx2" and not wait_pidfd(pidfd, second_delay):
            last_sent = time.monotonic()
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
        exited = wait_pidfd(pidfd, EXIT_TIMEOUT - (last_sent - sent_mono))
        expected_death, signame = EXPECTED_DEATH[trial.signal], trial.signal
        if not exited and trial.signal == "SIGINT":
            # Ctrl-C did nothing: a launcher's next step. Judged below if CPython dropped it.
            sent, last_sent = time.time(), time.monotonic()
            sent_mono = last_sent
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
            exited = wait_pidfd(pidfd, EXIT_TIMEOUT)
            expected_death, signame = -signal.SIGTERM, "SIGTERM"
            result.programs_own = DROPPED
        exit_mono = time.monotonic()
        exit_wall = time.time()
        if not exited:
            result.wrong.append(f"did not exit within {EXIT_TIMEOUT:.0f}s of the signal")
            os.killpg(proc.pid, signal.SIGKILL)
        returncode = proc.wait(10)
        result.returncode = returncode
        if exited and not result.programs_own:
            result.exit_seconds = exit_mono - sent_mono
            slow = SLOW_SIGINT if trial.signal == "SIGINT" else ctx.slow
            if exit_mono - last_sent > slow:
                result.wrong.append(
                    f"slow exit: {exit_mono - last_sent:.2f}s after the last signal "
                    f"(> {slow:g}s: finalization waited)"
                )
        for reader in readers:
            reader.join(10)
        finalized = [e["t"] for kind, e in events if kind == "FINALIZED"]
        if result.exit_seconds is not None and finalized:
            result.finalized_seconds = max(0.0, finalized[0] - sent)
        backlogs = [e.get("backlog") for kind, e in events if kind == "FINALIZED"]
        result.backlog = backlogs[0] if backlogs else None
        stderr = b"".join(stderr_chunks).decode(errors="replace")
        if trial.signal == "SIGINT" and returncode == 1 and raised_in_cleanup(stderr):
            result.programs_own = RAISED_IN_CLEANUP
            expected_death = 1
        if result.programs_own == DROPPED and not dropped_keyboard_interrupt(stderr):
            result.wrong.append("Ctrl-C did not end it, and CPython did not say it dropped it")
        if returncode != expected_death:
            result.wrong.append(f"exit status {returncode}, expected {expected_death}")
        if watchdog_fd is not None and not wait_pidfd(watchdog_fd, WATCHDOG_TIMEOUT):
            result.wrong.append(f"the watchdog still runs {WATCHDOG_TIMEOUT:.0f}s after the exit")
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(watchdog_fd, signal.SIGKILL)
        # A status the process could only journal is written by the replayer it left behind:
        # its verdict is awaited here, as a user with no sweep would wait for it.
        for replayer_fd in last_gasp_replayers(proc.pid, ctx.reaper):
            result.last_gasp = True
            if not wait_pidfd(replayer_fd, REPLAYER_TIMEOUT):
                result.wrong.append(
                    f"its last-gasp replayer still runs {REPLAYER_TIMEOUT:.0f}s after the exit"
                )
                with contextlib.suppress(OSError):
                    signal.pidfd_send_signal(replayer_fd, signal.SIGKILL)
            ctx.reaper.drop_pidfd(replayer_fd)
            os.close(replayer_fd)
        if any(reader.is_alive() for reader in readers):
            result.wrong.append("stdout/stderr still open 10s after the exit (a descendant?)")
            os.killpg(proc.pid, signal.SIGKILL)

        (workdir / "stderr.txt").write_text(stderr)  # kept with the directory of a failure
        (workdir / "events.json").write_text(json.dumps(events))
        if result.programs_own == DROPPED:
            # Judged as the SIGTERM ending it then had: nothing on stderr but the drop.
            result.wrong.extend(check_stderr(without_dropped_reports(stderr), "SIGTERM"))
        elif not result.programs_own:
            result.wrong.extend(check_stderr(stderr, trial.signal))
        result.lifeguard_lines = [
            line.strip()[:200] for line in stderr.splitlines() if line.startswith("lifeguard")
        ]

        window = (int(sent * 1000) - BEFORE_MS, int(exit_wall * 1000) + AFTER_MS)
        ended = {e["run_id"] for kind, e in events if kind == "ENDED"}
        ending = {e["run_id"] for kind, e in events if kind == "ENDING"}
        runs = read_runs(uri, experiment)
        result.runs = len(runs)
        if info["run_id"] not in {r.run_id for r in runs}:
            result.wrong.append(f"the top run {info['run_id']} is not in the store")
        status = "FAILED" if result.programs_own == RAISED_IN_CLEANUP else "KILLED"
        before = check_runs(runs, window, ended, ending, signame, status=status)
        if trial.signal == "SIGTERMx2" or any(r.status == "RUNNING" for r in runs):
            if ctx.reaper.stopping.is_set():
                result.wrong.append("not replayed: the harness is stopping")
                return result
            sweep_note = replay(uri, experiment, journal, workdir / "sweep.json")
            runs = read_runs(uri, experiment)
            after = check_runs(runs, window, ended, ending, signame, status=status, replayed=True)
            if before and not after:
                result.needed_replay = True
            if after and sweep_note:
                after.append(sweep_note)
            result.wrong.extend(after)
        else:
            result.wrong.extend(before)
        if not result.ok:
            result.wrong.append(
                f"(delay {delay * 1000:.0f} ms, second {second_delay * 1000:.0f} ms, "
                f"mlflow {'before' if mlflow_first else 'after'} install, dir {workdir})"
            )
        return result
    except Exception as exc:  # noqa: BLE001 - a harness error is reported as a wrong trial
        result.wrong.append(f"harness error: {type(exc).__name__}: {exc}")
        return result
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        ctx.reaper.drop_group(proc.pid)
        os.close(pidfd)
        if watchdog_fd is not None:
            ctx.reaper.drop_pidfd(watchdog_fd)
            os.close(watchdog_fd)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        if result.ok:
            shutil.rmtree(workdir, ignore_errors=True)


def last_gasp_replayers(pid: int, reaper: Reaper) -> list[int]:
    """Pidfds of the last-gasp replayers process ``pid`` left (``--writer PID`` on their
    command line), each handed to the reaper: detached, they are in no process group of ours."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            argv = Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"lifeguard.guardian.replay" not in argv or b"--writer" not in argv:
            continue
        if argv[argv.index(b"--writer") + 1] != str(pid).encode():
            continue
        with contextlib.suppress(ProcessLookupError):
            fd = os.pidfd_open(int(name))
            reaper.add_pidfd(fd)
            found.append(fd)
    return found


def _tail(data: bytes, lines: int = 6) -> str:
    text = data.decode(errors="replace").strip().splitlines()[-lines:]
    return ("; stderr: " + " | ".join(text)) if text else ""


TRACEBACK = "Traceback (most recent call last):"
CHAINED = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)


def tracebacks(stderr: str) -> Iterator[str]:
    """The final exception line of each traceback printed (a chain counts once, by its last)."""
    lines = stderr.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() != TRACEBACK:
            i += 1
            continue
        # The exception line is the first unindented line after the frames.
        j = i + 1
        while j < len(lines) and (lines[j].startswith((" ", "\t")) or not lines[j].strip()):
            j += 1
        final = lines[j] if j < len(lines) else "<truncated traceback>"
        k = j + 1
        while k < len(lines) and not lines[k].strip():
            k += 1
        if k < len(lines) and lines[k].strip() in CHAINED:
            i = k + 1  # the chain goes on: its last exception is the one that counts
            continue
        yield final
        i = j + 1


KEYBOARD_INTERRUPT = ("KeyboardInterrupt", "KeyboardInterrupt:")


# The lifeguard package the children import (set by Context from a child's own view: a
# checkout's PYTHONPATH or an installed copy). A frame of it in the wrong place means the
# ending was lifeguard's doing, never the program's.
PACKAGE = os.path.realpath(REPO / "lifeguard")
FRAME = re.compile(r'^\s*File "([^"]+)", line \d+, in (\S+)')
# Where a dropped KeyboardInterrupt rightly shows lifeguard: its handler, chaining to Python's.
HANDLER_FRAMES = {
    ("sentry.py", "handler"),
    ("hooks.py", "on_signal"),
    ("signals.py", "on_signal"),
    ("signals.py", "_chain"),
}


def _lifeguard_frames(text: str) -> list[tuple[str, str]]:
    """(file name, function) of each frame of the lifeguard package in ``text``."""
    frames = []
    for line in text.splitlines():
        match = FRAME.match(line)
        if match and os.path.realpath(match.group(1)).startswith(PACKAGE + os.sep):
            frames.append((os.path.basename(match.group(1)), match.group(2)))
    return frames


def _dropped_reports(stderr: str) -> list[str]:
    """CPython's reports of a KeyboardInterrupt it could only print and drop: "Exception
    ignored in: ..." down to the KeyboardInterrupt line."""
    reports, current = [], None
    for line in stderr.splitlines():
        if line.startswith("Exception ignored in"):
            current = [line]
        elif current is not None:
            current.append(line)
            if line.strip() in KEYBOARD_INTERRUPT:
                reports.append("\n".join(current))
                current = None
    return reports


def dropped_keyboard_interrupt(stderr: str) -> bool:
    """A KeyboardInterrupt raised where CPython can only print and drop it (a weakref
    callback, a __del__), in the program's code or a library's: no frame of lifeguard's but
    its signal handler's."""
    return any(
        set(_lifeguard_frames(report)) <= HANDLER_FRAMES for report in _dropped_reports(stderr)
    )


def without_dropped_reports(stderr: str) -> str:
    for report in _dropped_reports(stderr):
        stderr = stderr.replace(report, "", 1)
    return stderr


def raised_in_cleanup(stderr: str) -> bool:
    """One traceback chain that starts with the KeyboardInterrupt and ends in another
    exception, raised while handling it."""
    first_exceptions = [
        line.strip()
        for line in stderr.splitlines()
        if line and not line.startswith((" ", "\t")) and line.strip() not in (TRACEBACK, *CHAINED)
    ]
    finals = [f.strip() for f in tracebacks(stderr)]
    # The last exception's frames: none of them lifeguard's, or it is not the program's doing.
    last = stderr.rsplit(CHAINED[0], 1)[-1]
    return (
        len(finals) == 1
        and "KeyboardInterrupt" in first_exceptions
        and finals[0] != "KeyboardInterrupt"
        and CHAINED[0] in stderr
        and not _lifeguard_frames(last)
    )


# What SQLAlchemy logs (its pool's logger, printed by logging's last resort) when a
# KeyboardInterrupt cuts a fetch short: it invalidates the connection, then fails to close the
# cursor on it. A library's own report of the Ctrl-C, with or without lifeguard.
LIBRARY_REPORTS = ("Error closing cursor",)


def without_library_reports(stderr: str) -> str:
    """``stderr`` less each LIBRARY_REPORTS line and the traceback chain logged with it, when
    that chain starts with the KeyboardInterrupt and shows no frame of lifeguard's but its
    signal handler's."""
    lines = stderr.splitlines()
    kept: list[str] = []
    i = 0
    while i < len(lines):
        if lines[i].strip() not in LIBRARY_REPORTS:
            kept.append(lines[i])
            i += 1
            continue
        j = i + 1
        while j < len(lines) and lines[j].strip() == TRACEBACK:
            j += 1
            while j < len(lines) and (lines[j].startswith((" ", "\t")) or not lines[j].strip()):
                j += 1
            j += 1  # the exception line
            k = j
            while k < len(lines) and not lines[k].strip():
                k += 1
            if k >= len(lines) or lines[k].strip() not in CHAINED:
                break  # the chain ends here: what follows is not part of the report
            j = k + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
        report = "\n".join(lines[i:j])
        if "KeyboardInterrupt" in report and set(_lifeguard_frames(report)) <= HANDLER_FRAMES:
            i = j
        else:
            kept.append(lines[i])
            i += 1
    return "\n".join(kept)


def check_stderr(stderr: str, sig: str) -> list[str]:
    """stderr as without lifeguard: no traceback, except SIGINT's KeyboardInterrupt."""
    wrong = []
    if sig == "SIGINT":
        stderr = without_library_reports(stderr)
    finals = list(tracebacks(stderr))
    expected = ["KeyboardInterrupt"] if sig == "SIGINT" else []
    if [f.strip() for f in finals] != expected:
        shown = "; ".join(f.strip()[:160] for f in finals) or "none"
        want = "one KeyboardInterrupt traceback" if expected else "no traceback"
        wrong.append(f"stderr: tracebacks ending in [{shown}], expected {want}")
    for line in stderr.splitlines():
        if line.startswith(("Fatal Python error", "Exception ignored in")):
            wrong.append(f"stderr: {line.strip()[:160]}")
    return wrong


def read_runs(uri: str, experiment: str) -> list[RunState]:
    from mlflow.entities import ViewType
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    runs = client.search_runs([exp.experiment_id], run_view_type=ViewType.ALL, max_results=5000)
    return [
        RunState(r.info.run_id, r.info.status, r.info.end_time, dict(r.data.tags)) for r in runs
    ]


def check_runs(
    runs: list[RunState],
    window: tuple[int, int],
    ended: set[str],
    ending: set[str],
    sig: str,
    status: str = "KILLED",
    replayed: bool = False,
) -> list[str]:
    """What is wrong with the runs: every run the program had not ended reads ``status``
    (KILLED), ended between the signal and the exit, with the signal as its reason; a run it
    ended reads FINISHED, never overwritten."""
    wrong = []
    signame = "SIGTERM" if sig == "SIGTERMx2" else sig
    after = " after the journal replay" if replayed else ""
    for run in runs:
        short = run.run_id[:8]
        if run.run_id in ended:
            if run.status != "FINISHED":
                wrong.append(f"run {short}: the program ended it, but it reads {run.status}")
            continue
        if run.run_id in ending and run.status == "FINISHED":
            continue  # the program's end_run() got there before the signal
        if run.status != status:
            wrong.append(f"run {short}: {run.status}{after}, expected {status}")
            continue
        ended_by = run.tags.get("lifeguard.ended_by")
        if ended_by == "sweep":
            wrong.append(
                f"run {short}: status lost: only the sweep's orphan guess ended it "
                f"({run.tags.get('lifeguard.reason', '')})"
            )
            continue
        if run.end_time is None or not window[0] <= run.end_time <= window[1]:
            offset = (
                "none" if run.end_time is None else f"{run.end_time - window[0] - BEFORE_MS:+d} ms"
            )
            wrong.append(
                f"run {short}: end time {offset} from the signal, outside "
                f"[-{BEFORE_MS} ms, exit + {AFTER_MS} ms]{after}"
            )
        tag = run.tags.get("lifeguard.signal")
        if status != "KILLED":
            continue  # an exception's ending: no signal to name
        if (tag is None and ended_by == "process") or (tag is not None and tag != signame):
            wrong.append(f"run {short}: lifeguard.signal tag {tag!r}, expected {signame!r}")
    return wrong


def replay(uri: str, experiment: str, journal: Path, output: Path) -> str:
    """``lifeguard sweep`` as a user would run it after the fact (its report goes to
    ``output``); returns a note if it failed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LIFEGUARD_", "MLFLOW_"))}
    env["PYTHONWARNINGS"] = "ignore"
    cmd = [
        sys.executable, "-m", "lifeguard", "sweep", "--tracking-uri", uri,
        "--experiment", experiment, "--journal-dir", str(journal), "--json",
    ]  # fmt: skip
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, env=env, timeout=SWEEP_TIMEOUT, cwd=REPO
        )
    except subprocess.TimeoutExpired:
        return f"(lifeguard sweep did not finish within {SWEEP_TIMEOUT:.0f}s)"
    output.write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        return f"(lifeguard sweep exited {done.returncode}: {done.stderr.strip()[-300:]})"
    return ""


# -- many trials -----------------------------------------------------------------------------


def run_trials(
    trials: Sequence[Trial],
    *,
    jobs: int,
    root: Path,
    server_uri: str | None = None,
    slow: float = SLOW,
    progress: bool = False,
) -> list[Result]:
    """Run ``trials`` (``jobs`` at once) under ``root``. Server trials use ``server_uri``, or a
    server this starts and stops. Every process started is killed on the way out, whatever
    happens."""
    from lifeguard.localserver import MlflowServer

    reaper = Reaper()
    server: MlflowServer | None = None
    results: list[Result] = []
    try:
        if server_uri is None and any(t.store == "server" for t in trials):
            server = MlflowServer(root / "server")  # assigned first: stopped even mid-start
            server.start()
            server_uri = server.uri
        ctx = Context(root, reaper, server_uri, slow)
        ctx.make_template()
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            futures = [pool.submit(run_trial, ctx, t) for t in trials]
            try:
                for n, future in enumerate(futures, 1):
                    results.append(future.result())
                    if progress:
                        r = results[-1]
                        mark = "." if r.ok else "F"
                        sys.stderr.write(mark + ("\n" if n % 50 == 0 else ""))
                        sys.stderr.flush()
            except BaseException:
                reaper.kill_all()
                for future in futures:
                    future.cancel()
                raise
        if progress:
            sys.stderr.write("\n")
    finally:
        reaper.kill_all()
        if server is not None:
            server.stop()
    return results


def percentile(xs: Sequence[float], q: float) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def report(results: Sequence[Result], out: Any = sys.stdout) -> int:
    """Print the tables; returns the number of wrong trials."""
    cells: dict[tuple[str, ...], list[Result]] = defaultdict(list)
    for r in results:
        cells[r.trial.cell].append(r)
    w = out.write
    w(f"{'store':7} {'watchdog':8} {'signal':9} {'workload':13} {'trials':>6} {'right':>5} "
      f"{'replay':>6}\n")  # fmt: skip
    for cell in sorted(cells):
        rs = cells[cell]
        right = sum(r.ok for r in rs)
        replayed = sum(r.needed_replay and r.ok for r in rs)
        flag = "" if right == len(rs) else "  <-"
        w(f"{cell[0]:7} {cell[1]:8} {cell[2]:9} {cell[3]:13} {len(rs):>6} {right:>5} "
          f"{replayed:>6}{flag}\n")  # fmt: skip
    for title, index in (("store/watchdog/signal", (0, 1, 2)), ("workload", (3,))):
        w(f"\nby {title}:\n")
        groups: dict[tuple[str, ...], list[Result]] = defaultdict(list)
        for r in results:
            groups[tuple(r.trial.cell[i] for i in index)].append(r)
        for key in sorted(groups):
            rs = groups[key]
            right = sum(r.ok for r in rs)
            replayed = sum(r.needed_replay and r.ok for r in rs)
            pct = 100.0 * (len(rs) - right) / len(rs)
            w(f"  {' '.join(key):32} {right:>5}/{len(rs):<5} right  {pct:5.1f}% wrong  "
              f"{replayed} needed the replay\n")  # fmt: skip
    wrong = [r for r in results if not r.ok]
    needed = sum(r.needed_replay and r.ok for r in results)
    w(f"\n{len(results) - len(wrong)}/{len(results)} trials right; {len(wrong)} wrong; "
      f"{needed} right only after the journal replay\n")  # fmt: skip
    gasped = [r for r in results if r.last_gasp]
    if gasped:
        w(
            f"{len(gasped)} trials left a last-gasp replayer for a status they could only "
            f"journal ({sum(r.ok and not r.needed_replay for r in gasped)} of them right "
            "without the sweep)\n"
        )
    for why in PROGRAMS_OWN:
        own = [r for r in results if r.programs_own == why]
        if own:
            w(
                f"{len(own)} trials: {why}; judged by the ending the program had instead "
                f"({sum(r.ok for r in own)} right)\n"
            )
    noisy = [r for r in results if r.lifeguard_lines]
    if noisy:
        w(
            f"{len(noisy)} trials had lines from lifeguard on stderr "
            f"({sum(r.ok for r in noisy)} of them otherwise right), e.g.: "
            f"{noisy[0].lifeguard_lines[0]}\n"
        )
    times = [r.exit_seconds for r in results if r.exit_seconds is not None]
    if times:
        w(
            f"signal to exit (s), {len(times)} exits: median {statistics.median(times):.3f}  "
            f"p90 {percentile(times, 0.9):.3f}  p99 {percentile(times, 0.99):.3f}  "
            f"max {max(times):.3f}\n"
        )
        # On SIGTERM and SIGHUP lifeguard ends the process itself once the statuses are
        # written: their exit time is lifeguard's. On SIGINT the KeyboardInterrupt goes on
        # through the program's own atexit hooks (MLflow's flush of its async queue) and the
        # interpreter's teardown of mlflow's heap, as it would without lifeguard.
        ended = [
            r.exit_seconds
            for r in results
            if r.exit_seconds is not None and r.trial.signal != "SIGINT"
        ]
        if ended:
            w(
                f"  SIGTERM, SIGHUP, SIGTERMx2 ({len(ended)} exits, ended by lifeguard): median "
                f"{statistics.median(ended):.3f}  p99 {percentile(ended, 0.99):.3f}  "
                f"max {max(ended):.3f}\n"
            )
        by_signal: dict[str, list[Result]] = defaultdict(list)
        for r in results:
            if r.exit_seconds is not None:
                by_signal[f"{r.trial.cell[0]}/{r.trial.cell[1]}/{r.trial.signal}"].append(r)
        for where in sorted(by_signal):
            ts = [r.exit_seconds or 0.0 for r in by_signal[where]]
            ws = [r.finalized_seconds for r in by_signal[where] if r.finalized_seconds is not None]
            written = f"  written: p90 {percentile(ws, 0.9):.3f}  max {max(ws):.3f}" if ws else ""
            w(f"  {where:30} median {statistics.median(ts):.3f}  p90 {percentile(ts, 0.9):.3f}  "
              f"max {max(ts):.3f}{written}\n")  # fmt: skip
        # A backlog of async metrics gets the time the deadline leaves (it is sent while it
        # makes progress); without one, the exit is as before.
        for label, group in (
            ("with an async backlog", [r for r in results if r.backlog]),
            ("without a backlog", [r for r in results if not r.backlog]),
        ):
            for signals_, title in ((("SIGTERM", "SIGHUP", "SIGTERMx2"), "SIGTERM/SIGHUP/x2"),
                                    (("SIGINT",), "SIGINT")):  # fmt: skip
                ts = [
                    r.exit_seconds
                    for r in group
                    if r.exit_seconds is not None and r.trial.signal in signals_
                ]
                if ts:
                    w(
                        f"  {label:22} {title:18} {len(ts):>4} exits: median "
                        f"{statistics.median(ts):.3f}  p99 {percentile(ts, 0.99):.3f}  "
                        f"max {max(ts):.3f}\n"
                    )
        done = [r.finalized_seconds for r in results if r.finalized_seconds is not None]
        if done:
            w(
                f"signal to statuses written (lifeguard's finalizers done), {len(done)} exits: "
                f"median {statistics.median(done):.3f}  p90 {percentile(done, 0.9):.3f}  "
                f"p99 {percentile(done, 0.99):.3f}  max {max(done):.3f}\n"
            )
        # Where the tail is: the slowest exits, each with the spec that reruns it.
        slowest = sorted(
            (r for r in results if r.exit_seconds is not None),
            key=lambda r: r.exit_seconds or 0.0,
            reverse=True,
        )[:SHOW_SLOWEST]
        w(f"  slowest {len(slowest)} (--replay SPEC reruns one):\n")
        for r in slowest:
            written = "" if r.finalized_seconds is None else f"{r.finalized_seconds:6.3f}"
            w(f"    {r.exit_seconds:6.3f}  {r.trial.spec:42} statuses written at {written}\n")
    if wrong:
        w("\nfailures (rerun one with: python scripts/stress.py --replay SPEC):\n")
        for r in wrong:
            w(f"  {r.trial.spec}  rc={r.returncode}\n")
            for what in r.wrong:
                w(f"      {what}\n")
            for line in r.lifeguard_lines:
                w(f"      stderr: {line}\n")
    return len(wrong)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, help="number of trials (default 1000; --quick 40)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the plan (default 1)")
    parser.add_argument("--jobs", type=int, default=2, help="trials at once (default 2)")
    parser.add_argument("--store", choices=["sqlite", "server", "both"], default="both")
    parser.add_argument("--watchdog", choices=["on", "off", "both"], default="both")
    parser.add_argument(
        "--signal", choices=[*SIGNALS, "all"], default="all", help="only this signal's trials"
    )
    parser.add_argument("--quick", action="store_true", help="40 trials: a smoke run")
    parser.add_argument(
        "--slow",
        type=float,
        default=SLOW,
        help="an exit slower than this after SIGTERM/SIGHUP is wrong (s; default %(default)s)",
    )
    parser.add_argument(
        "--replay",
        action="append",
        default=[],
        metavar="SPEC",
        help="run exactly this trial (SEED/STORE/on|off/SIGNAL/WORKLOAD, from a failure list)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the trials' directory")
    args = parser.parse_args(argv)
    if args.replay:
        try:
            trials = [Trial.parse(spec) for spec in args.replay]
        except ValueError as exc:
            parser.error(str(exc))
    else:
        n = args.trials if args.trials is not None else (40 if args.quick else 1000)
        stores = STORES if args.store == "both" else (args.store,)
        watchdogs = {"on": (True,), "off": (False,), "both": (False, True)}[args.watchdog]
        signals = SIGNALS if args.signal == "all" else (args.signal,)
        trials = plan(n, args.seed, stores, watchdogs, signals)

    # A SIGTERM or SIGHUP to the harness unwinds it like Ctrl-C: every child and server dies.
    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, stop)
    root = Path(tempfile.mkdtemp(prefix="lifeguard-stress-"))
    started = time.monotonic()
    try:
        results = run_trials(trials, jobs=args.jobs, root=root, slow=args.slow, progress=True)
    except KeyboardInterrupt:
        sys.stderr.write(f"\ninterrupted; trial directories left in {root}\n")
        return 130
    wall = time.monotonic() - started
    wrong = report(results)
    print(f"wall time {wall:.1f}s, {args.jobs} jobs, plan seed {args.seed}")
    if wrong or args.keep:
        print(f"failed trials' directories are kept under {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
