"""``lifeguard demo``: every in-process exit path, with raw MLflow and with lifeguard, side by side.

The same module is the child program: ``python -m lifeguard.demo --child PATH`` starts a run, logs
a metric, prints a ready line and then ends the way PATH says. The parent reads the ready line
before it sends any signal, so nothing here depends on timing. The test-suite drives its own
child programs with the same runner (:func:`run_child`).

The demo itself does not exec a new interpreter per child: each would pay ``import mlflow``
(~1.5 s of CPU), 36 times. A *zygote* (``python -m lifeguard.demo --zygote FD``, a
:mod:`lifeguard.forkserver`) imports mlflow once, with no thread, no engine and no lifeguard
hooks, and forks each child from that warm state. The
forked child then runs the child program at the top of ``__main__``, exactly as
``python -m lifeguard.demo --child PATH`` would: it calls ``install()`` (or not), starts its run,
meets its exit path and leaves through the interpreter's own exit (its atexit hooks, its
traceback, its death by a signal). The zygote reaps it and reports the real wait status.

Nothing the demo starts outlives it, even a SIGKILL of it: a reaper (``--reaper``) waits for the
demo's death on a pidfd and kills every process that carries the demo's marker in its
environment (the zygote and its children, their watchdogs, the server tree), then removes the
demo's temporary directory.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

from lifeguard.forkserver import PR_SET_PDEATHSIG

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence
    from typing import IO, Protocol

    from lifeguard.localserver import MlflowServer

    class _Process(Protocol):
        """What :func:`drive` needs of a child: a Popen, or a child forked by the zygote."""

        @property
        def pid(self) -> int: ...
        @property
        def stdin(self) -> IO[str] | None: ...
        @property
        def stdout(self) -> IO[str] | None: ...
        @property
        def stderr(self) -> IO[str] | None: ...

        def poll(self) -> int | None: ...
        def wait(self, timeout: float | None = None) -> int: ...
        def send_signal(self, sig: int) -> None: ...
        def kill(self) -> None: ...


__all__ = ["PATHS", "ChildResult", "enact", "main", "run_child"]

READY = "LIFEGUARD-READY"
# MLflow's telemetry, off in every process the demo starts: on, it writes an installation id
# to ~/.config/mlflow/telemetry.json, and the demo writes nothing outside its own directory.
NO_TELEMETRY = {"MLFLOW_DISABLE_TELEMETRY": "true"}

# Every process the demo starts carries this in its environment, set to the demo's directory.
MARKER = "LIFEGUARD_DEMO_DIR"
# The signals the exit paths are about: a child starts with their default dispositions,
# unblocked, whatever its parent inherited (nohup ignores SIGHUP; some runners block signals).
TESTED_SIGNALS = (
    signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
)  # fmt: skip

# name -> (what the child does, signal the parent sends after the ready line)
PATHS: dict[str, tuple[str, int | None]] = {
    "return": ("main returns", None),
    "sys.exit(0)": ("sys.exit(0)", None),
    "sys.exit()": ("sys.exit()", None),
    "sys.exit(3)": ("sys.exit(3)", None),
    'sys.exit("msg")': ('sys.exit("fatal: bad config")', None),
    "exception": ("raise RuntimeError", None),
    "KeyboardInterrupt": ("raise KeyboardInterrupt", None),
    "SIGINT": ("Ctrl-C (SIGINT)", signal.SIGINT),
    "SIGTERM": ("SIGTERM", signal.SIGTERM),
    "SIGHUP": ("SIGHUP", signal.SIGHUP),
    "SIGHUP under nohup": ("SIGHUP, ignored by nohup", signal.SIGHUP),
}

# Deaths no in-process hook can see: only a guardian (watchdog, `lifeguard run`) ends the run.
DEATHS: dict[str, tuple[str, int | None]] = {
    "SIGKILL": ("SIGKILL (OOM killer, end of a grace period)", signal.SIGKILL),
    "self-SIGKILL": ("os.kill(os.getpid(), SIGKILL)", None),
    "os._exit(0)": ("os._exit(0)", None),
    "os._exit(5)": ("os._exit(5)", None),
    "segfault": ("a segfault in C code", None),
    "blocked in C": ("SIGTERM while the main thread is stuck in a C call", signal.SIGTERM),
}

# Paths on which the child waits (on stdin) for the parent's signal, then returns on EOF.
WAITING = frozenset(name for name, (_, sig) in {**PATHS, **DEATHS}.items() if sig is not None)


def prepare(path: str) -> None:
    """Set the signal dispositions a program started from a terminal has, before install().

    A parent that ignores SIGINT (a shell's background job, a pytest-xdist worker, some CI
    runners) passes SIG_IGN on to its children, and then Ctrl-C does nothing at all; a terminal
    gives Python's KeyboardInterrupt handler. nohup, for its path, sets SIGHUP to SIG_IGN."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if path == "SIGHUP under nohup":
        signal.signal(signal.SIGHUP, signal.SIG_IGN)


def enact(path: str) -> None:
    """End the process (or return from main) the way ``path`` says."""
    if path not in PATHS and path not in DEATHS:
        known = ", ".join([*PATHS, *DEATHS])
        raise ValueError(f"unknown exit path {path!r}; known: {known}")
    if path == "self-SIGKILL":
        os.kill(os.getpid(), signal.SIGKILL)
    if path == "os._exit(0)":
        os._exit(0)
    if path == "os._exit(5)":
        os._exit(5)
    if path == "segfault":
        import ctypes

        ctypes.string_at(0)  # reads address 0: SIGSEGV in C, no Python code runs after it
    if path == "blocked in C":
        import ctypes

        # libc sleep() is restarted by nothing Python does: the main thread stays in C,
        # as in a collective that never completes.
        libc = ctypes.CDLL(None)
        while True:
            libc.sleep(600)
    if path == "sys.exit(0)":
        sys.exit(0)
    if path == "sys.exit()":
        sys.exit()
    if path == "sys.exit(3)":
        sys.exit(3)
    if path == 'sys.exit("msg")':
        sys.exit("fatal: bad config")
    if path == "exception":
        raise RuntimeError("loss is NaN")
    if path == "KeyboardInterrupt":
        raise KeyboardInterrupt
    if path in WAITING:
        # Blocks until a signal ends the process, or until the parent closes stdin (a signal
        # that was ignored): then main returns.
        sys.stdin.readline()


def announce(**info: object) -> None:
    """The ready line: the parent may signal us once it has read it.

    Written with os.write, not through sys.stdout: the parent signals us the moment the line
    reaches the pipe, and a signal handler that prints would otherwise find the buffered
    stdout still inside this flush ("reentrant call" RuntimeError)."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), f"{READY} {json.dumps(info)}\n".encode())


# -- the parent side --------------------------------------------------------------------------


class ChildResult:
    __slots__ = ("ready", "returncode", "seconds", "stderr", "stdout")

    def __init__(
        self, returncode: int, stdout: str, stderr: str, ready: dict[str, object], seconds: float
    ):
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        self.ready = ready
        self.seconds = seconds

    def __repr__(self) -> str:
        return f"ChildResult(rc={self.returncode}, ready={self.ready}, stderr={self.stderr!r})"


class ChildError(RuntimeError):
    pass


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """A process's state letter, parent and session from /proc; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # The command name is in parentheses and may hold anything: split after its end.
            state, ppid, _pgid, sid = f.read().rsplit(b")", 1)[1].split()[:4]
        return state.decode(errors="replace"), int(ppid), int(sid)
    except (OSError, ValueError, IndexError):
        return None


def _describe_processes(pid: int) -> str:
    """Where a hung child and the processes it started wait (state, and the kernel function each
    sleeps in): what a timeout needs to be diagnosed from a CI log alone. Its descendants, and
    its whole session if it leads one (a grandchild whose parent died is still in it). Linux's
    /proc only; a process that goes meanwhile is left out."""
    try:
        names = [name for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return "(no /proc: its processes cannot be listed)"
    stats = {int(name): stat for name in names if (stat := proc_stat(int(name))) is not None}
    shown = {pid}
    if stats.get(pid, ("", 0, 0))[2] == pid:
        shown |= {p for p, (_, _, sid) in stats.items() if sid == pid}
    while more := {p for p, (_, ppid, _) in stats.items() if ppid in shown} - shown:
        shown |= more
    rows = []
    for p in sorted(shown & stats.keys()):
        # wchan and cmdline only for these: reading a process's cmdline can wait on its memory.
        details = []
        for item in ("wchan", "cmdline"):
            try:
                with open(f"/proc/{p}/{item}", "rb") as f:
                    details.append(f.read().replace(b"\0", b" ").decode(errors="replace").strip())
            except OSError:
                details.append("?")
        wchan = details[0] if details[0] not in ("", "0") else "-"
        rows.append(
            f"  pid {p} ppid {stats[p][1]} state {stats[p][0]} in {wchan}: {details[1][:200]}"
        )
    return "its processes:\n" + ("\n".join(rows) or "  (none left)")


def _libc_prctl() -> Callable[..., int]:
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl


def default_signals() -> None:
    """Give this process the default disposition of every signal under test, unblocked."""
    for signum in TESTED_SIGNALS:
        if signum == signal.SIGINT:
            # What a fresh interpreter has: KeyboardInterrupt (default_int_handler).
            signal.signal(signum, signal.default_int_handler)
        else:
            signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, TESTED_SIGNALS)


def _child_preexec(prctl: Callable[..., int] | None) -> Callable[[], None]:
    """Runs in the child between fork and exec. Default dispositions: an exec keeps an ignored
    signal ignored (and a blocked one blocked), so a runner under ``nohup`` would otherwise hand
    its children an ignored SIGHUP, and lifeguard rightly keeps an ignored signal ignored. A
    child that is to ignore one (the nohup path) sets that up itself. PR_SET_PDEATHSIG: the
    child dies with the thread that started it, even if that thread's process is SIGKILLed;
    run_child waits for its child in that very thread, so the thread outlives a normal child."""

    def preexec() -> None:
        for signum in TESTED_SIGNALS:
            signal.signal(signum, signal.SIG_DFL)  # SIGINT too: the exec'd Python installs its own
        signal.pthread_sigmask(signal.SIG_UNBLOCK, TESTED_SIGNALS)
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    return preexec


def run_child(
    cmd: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    send: Sequence[int] = (),
    close_stdin_after_signals: bool = True,
    timeout: float = 60.0,
    new_session: bool = True,
    to_group: bool = False,
    to_ready_pid: bool = False,
    on_line: Mapping[str, int] | None = None,
    after_ready: Callable[[dict[str, object]], object] | None = None,
    die_with_parent: bool = True,
    cwd: str | None = None,
) -> ChildResult:
    """Start ``cmd``, wait for its ready line, send ``send`` signals in order, then wait for it.

    ``to_ready_pid`` sends the signals to the pid the ready line names (the program under a
    supervisor) instead of the process started. ``on_line`` maps a marker printed by the child
    later (e.g. ``"FINALIZING"``) to a signal to send when it appears: the way to hit a window
    such as "during finalization" without sleeps. ``after_ready(ready)`` is called once the ready
    line is read, before any signal: the moment to break something (a server) under the child.
    Every wait is bounded by ``timeout``; on expiry the child is killed and ChildError raised.

    The child starts with the default disposition of each signal under test, unblocked, whatever
    this process inherited; and (``die_with_parent``) it is SIGKILLed if we die first.
    """
    started = time.monotonic()
    prctl = _libc_prctl() if die_with_parent and sys.platform == "linux" else None
    proc = subprocess.Popen(
        list(cmd),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=None if env is None else dict(env),
        cwd=cwd,
        text=True,
        errors="replace",  # a stray byte in its output must not stop a reader (and hang it)
        start_new_session=new_session,
        preexec_fn=_child_preexec(prctl),
    )
    return drive(
        proc, list(cmd), started,
        send=send, close_stdin_after_signals=close_stdin_after_signals, timeout=timeout,
        to_group=to_group, to_ready_pid=to_ready_pid, on_line=on_line, after_ready=after_ready,
    )  # fmt: skip


def drive(
    proc: _Process,
    cmd: object,
    started: float,
    *,
    send: Sequence[int] = (),
    close_stdin_after_signals: bool = True,
    timeout: float = 60.0,
    to_group: bool = False,
    to_ready_pid: bool = False,
    on_line: Mapping[str, int] | None = None,
    after_ready: Callable[[dict[str, object]], object] | None = None,
    expect_ready: bool = True,
) -> ChildResult:
    """The parent's side of :func:`run_child`, for a child already started. ``expect_ready``
    False: a command that prints no ready line (a CLI run to its end), waited for as it is."""
    stdout_lines: list[str] = []
    stderr_chunks: list[str] = []
    ready_event = threading.Event()
    ready: dict[str, object] = {}
    pending = dict(on_line or {})

    def kill(sig: int) -> None:
        try:
            if to_group:
                os.killpg(proc.pid, sig)
            elif to_ready_pid:
                os.kill(int(ready["pid"]), sig)  # type: ignore[call-overload]
            else:
                proc.send_signal(sig)
        except ProcessLookupError:
            pass

    def read_stdout() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            stdout_lines.append(line)
            if line.startswith(READY) and not ready_event.is_set():
                ready.update(json.loads(line[len(READY) :]))
                ready_event.set()
            for marker in list(pending):
                if line.startswith(marker):
                    kill(pending.pop(marker))
        ready_event.set()  # EOF: the child died before (or without) a ready line

    def read_stderr() -> None:
        assert proc.stderr is not None
        # Line by line, not read() to EOF: a child that hangs has its stderr so far shown.
        for line in proc.stderr:
            stderr_chunks.append(line)

    def so_far() -> str:
        """The child's state for an error raised while it still runs: taken before it is killed."""
        try:
            processes = _describe_processes(proc.pid)
        except Exception as exc:  # noqa: BLE001 - a description must never hide the error
            processes = f"(its processes could not be listed: {exc!r})"
        return (
            f"{processes}\n"
            f"its stdout so far: {''.join(stdout_lines)[-2000:]!r}\n"
            f"its stderr so far: {''.join(stderr_chunks)[-4000:]!r}"
        )

    readers = [threading.Thread(target=read_stdout), threading.Thread(target=read_stderr)]
    for reader in readers:
        reader.daemon = True
        reader.start()
    try:
        if expect_ready and not ready_event.wait(timeout):
            raise ChildError(f"no ready line within {timeout}s from {cmd}\n{so_far()}")
        if ready:
            if after_ready is not None:
                try:
                    after_ready(ready)
                except BaseException as exc:  # pytest.fail() raises a BaseException
                    # A test's own check failed while the child ran: say what the child was doing.
                    if hasattr(exc, "add_note"):  # 3.11+
                        exc.add_note(f"while the child ran: {cmd}\n{so_far()}")
                    raise
            for sig in send:
                kill(sig)
        if close_stdin_after_signals and proc.stdin is not None:
            try:
                proc.stdin.close()
            except BrokenPipeError:
                pass
        remaining = max(0.1, timeout - (time.monotonic() - started))
        try:
            returncode = proc.wait(remaining)
        except subprocess.TimeoutExpired:
            raise ChildError(f"child did not exit within {timeout}s: {cmd}\n{so_far()}") from None
        for reader in readers:
            reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    result = ChildResult(
        returncode, "".join(stdout_lines), "".join(stderr_chunks), ready, time.monotonic() - started
    )
    if expect_ready and not ready:
        raise ChildError(f"child exited ({returncode}) without a ready line: {result.stderr}")
    return result


# -- the zygote: one warm `import mlflow`, a fork per child ----------------------------------


def _preload() -> None:
    """Import what every child would import, and warm what needs no engine and no thread."""
    import mlflow
    import mlflow.tracking.context.registry  # noqa: F401

    # The SQL store (sqlalchemy, alembic) is not in mlflow-skinny, whose programs log over
    # REST; git: MLflow's git tags; psutil: lifeguard's owner tags.
    for name in (
        "mlflow.store.tracking.sqlalchemy_store",
        "sqlalchemy.dialects.sqlite",
        "git",
        "psutil",
    ):
        try:
            __import__(name)
        except ImportError:
            pass
    try:
        # Parses the migration scripts (no database): each child's store checks its schema.
        from mlflow.store.db.utils import _get_latest_schema_revision

        _get_latest_schema_revision()  # type: ignore[no-untyped-call]
    except Exception:  # noqa: BLE001 - only a warm-up: the child does it for real
        pass


def _zygote_preload() -> None:
    default_signals()
    _preload()


class Zygote:
    """The demo's fork server (:mod:`lifeguard.forkserver`), preloaded by :func:`_preload`: its
    children run ``python -m lifeguard.demo ARGV``."""

    def __init__(self, env: Mapping[str, str]) -> None:
        from lifeguard.forkserver import ForkServer

        self.server = ForkServer([sys.executable, "-m", "lifeguard.demo", "--zygote"], env)

    def run(self, argv: Sequence[str], env: Mapping[str, str], **kwargs: object) -> ChildResult:
        """:func:`run_child`, for a forked child."""
        started = time.monotonic()
        timeout = float(kwargs.get("timeout", 60.0))  # type: ignore[arg-type]
        child = self.server.spawn([__file__, *argv], env, timeout)
        return drive(child, argv, started, **kwargs)  # type: ignore[arg-type]

    def close(self) -> None:
        self.server.close()


# -- the child side --------------------------------------------------------------------------


def child_main(path: str, with_lifeguard: bool) -> None:
    prepare(path)
    watchdog = None
    if with_lifeguard:
        import lifeguard

        # The deaths no hook can see need the guardian; the other paths show install() alone.
        lifeguard.install(watchdog=path in DEATHS)
        watchdog = lifeguard.watchdog_pid()
    import mlflow

    mlflow.set_experiment("lifeguard-demo")
    run = mlflow.start_run(run_name=path)
    mlflow.log_metric("loss", 0.5, step=1)
    announce(run_id=run.info.run_id, pid=os.getpid(), watchdog=watchdog)
    enact(path)


def task_main(task: str, arg: str) -> None:
    """The demo's chores that need mlflow, done in a forked child so that the demo need not
    import it: ``setup URI`` migrates a new store once, before the children race to;
    ``replay DIR`` replays a journal (as the next ``install()``, or ``lifeguard sweep``, would)."""
    import logging

    announce(pid=os.getpid())
    # MLflow announces its schema migration at INFO on stderr; it is noise here.
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    if task == "setup":
        from mlflow.tracking import MlflowClient

        MlflowClient(tracking_uri=arg).search_experiments()
    elif task == "replay":
        from lifeguard.backends.mlflow.runs import replay_journal
        from lifeguard.journal import Journal

        print(json.dumps(replay_journal(Journal(arg), budget=30.0)))
    else:
        raise ValueError(f"unknown task {task!r}")


def wait_gone(pid: int, timeout: float = 60.0) -> bool:
    """Wait for a process that is not our child (a watchdog): pidfd, no polling."""
    import select

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


# -- nothing outlives the demo ----------------------------------------------------------------


def _marked(directory: str) -> list[int]:
    """The live processes whose environment has MARKER=directory. /proc/PID/environ is the
    environment a process was exec'd with: a child forked by the zygote shows the zygote's,
    which has the marker too. A zombie shows none, and needs no killing."""
    entry = f"\0{MARKER}={directory}\0".encode()
    me = os.getpid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                environ = b"\0" + f.read() + b"\0"
        except OSError:  # gone, or not ours
            continue
        if entry in environ:
            found.append(int(name))
    return found


def clean_up(directory: str) -> None:
    """Kill every process of the demo in ``directory``, then remove it."""
    import shutil

    for _ in range(100):  # until a scan finds none: a process may fork while we look
        pids = _marked(directory)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    shutil.rmtree(directory, ignore_errors=True)


def reaper_main(parent: int, directory: str) -> None:
    """Wait for the demo to die, however it dies, then clean up after it."""
    import select

    try:
        fd: int | None = os.pidfd_open(parent)
    except ProcessLookupError:
        fd = None
    if fd is not None and os.getppid() == parent:  # else it is gone already
        select.select([fd], [], [])
    clean_up(directory)


def _start_reaper(directory: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != MARKER}
    return subprocess.Popen(
        [sys.executable, "-m", "lifeguard.demo", "--reaper", str(os.getpid()), directory],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        env=env,
        # Its own session: the Ctrl-C or hangup that stops the demo must not stop its reaper.
        start_new_session=True,
    )


# -- the demo ---------------------------------------------------------------------------------


DEAD_SERVER = "SIGTERM while the tracking server is unreachable"
HEADERS = ("exit path", "raw MLflow", "with lifeguard", "exit code")
# Bounds each wait for one child, not the expected duration (well under a second, quiet).
CHILD_TIMEOUT = 60.0
_reaper: subprocess.Popen[bytes] | None = None


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        return f"{-returncode + 128} ({signal.Signals(-returncode).name})"
    return str(returncode)


def _status_in_store(db: str, run_id: str) -> tuple[str, int | None]:
    """What MLflow recorded, read straight from its sqlite store (the demo imports no mlflow)."""
    import sqlite3
    from contextlib import closing

    with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)) as db_conn:
        row = db_conn.execute(
            "SELECT status, end_time FROM runs WHERE run_uuid = ?", (run_id,)
        ).fetchone()
    return str(row[0]), None if row[1] is None else int(row[1])


def _status_on_server(uri: str, run_id: str) -> tuple[str, int | None]:
    """What the tracking server says, through its REST API."""
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1: no proxy
    with opener.open(f"{uri}/api/2.0/mlflow/runs/get?run_id={run_id}", timeout=30) as answer:
        info = json.load(answer)["run"]["info"]
    end = info.get("end_time")
    return str(info["status"]), None if end is None else int(end)


def dead_server_case(
    zygote: Zygote, server: MlflowServer, tmp: str, env: Mapping[str, str]
) -> tuple[str, str, int, int, bool]:
    """The tracking server goes away after the runs start; then SIGTERM. Raw MLflow and
    lifeguard, side by side. lifeguard cannot write the status, so it journals it and exits at
    once; once the server is back, the journal is replayed (as the next ``install()`` on this
    machine, or ``lifeguard sweep``, would) and the run must read KILLED, with the time of the
    signal as its end time. The programs reach the demo's `mlflow server` through a
    :class:`Relay`, whose port goes dark (connections reset, new ones refused: to a client, a
    dead server) and comes back, so that the server need not be started twice. Returns (raw
    status, lifeguard status, raw exit status, lifeguard exit status, whether the end time is
    the signal's)."""
    from concurrent.futures import ThreadPoolExecutor

    from lifeguard.localserver import Relay

    journal_dir = os.path.join(tmp, "journal-server")
    relay = Relay(server.port).up()
    try:
        env = {**env, "MLFLOW_TRACKING_URI": relay.uri, "LIFEGUARD_JOURNAL_DIR": journal_dir}
        # Both runs started, then the server goes away, then both get their SIGTERM.
        both_started = threading.Barrier(2, action=relay.down, timeout=CHILD_TIMEOUT)

        def one(with_lifeguard: bool) -> ChildResult:
            argv = ["--child", "SIGTERM", *(["--with-lifeguard"] if with_lifeguard else [])]
            return zygote.run(
                argv, env, send=(signal.SIGTERM,), timeout=CHILD_TIMEOUT,
                after_ready=lambda ready: both_started.wait(),
            )  # fmt: skip

        with ThreadPoolExecutor(max_workers=2) as pool:
            raw, guarded = pool.map(one, (False, True))
        signalled_before = time.time()
        relay.up()  # same port: the URI in the journal stays valid
        zygote.run(["--task", "replay", journal_dir], env, timeout=CHILD_TIMEOUT)
    finally:
        relay.down()
    raw_status, _ = _status_on_server(server.uri, str(raw.ready["run_id"]))
    status, end_time = _status_on_server(server.uri, str(guarded.ready["run_id"]))
    # The end time is when the process learned it was ending, before the server came back.
    true_end = end_time is not None and end_time <= signalled_before * 1000 + 1
    return raw_status, status, raw.returncode, guarded.returncode, true_end


def main(argv: Sequence[str] | None = None, *, jobs: int = 4) -> int:
    """Run the demo and print its table, row by row. Returns 0 when lifeguard told the truth
    every time, 1 otherwise."""
    import tempfile

    global _reaper
    directory = tempfile.mkdtemp(prefix="lifeguard-demo-")
    _reaper = _start_reaper(directory)  # first, before anything it must clean up
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        # Ctrl-C: die of it at once, and let the reaper clean up. A KeyboardInterrupt would
        # wait for every row in flight (the pool's exit), and even a Python handler may run
        # only once a row ends: the kernel may hand the signal to any of our threads.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        return 0 if _demo(directory, jobs) else 1
    finally:
        clean_up(directory)


def _demo(directory: str, jobs: int) -> bool:
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    from lifeguard.localserver import MlflowServer
    from lifeguard.outcome import Outcome

    lock = threading.Lock()

    def emit(line: str) -> None:
        with lock:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    db = os.path.join(directory, "mlflow.db")
    uri = f"sqlite:///{db}"
    env = {k: v for k, v in os.environ.items() if k != MARKER}
    env.update({"MLFLOW_TRACKING_URI": uri, "PYTHONWARNINGS": "ignore", MARKER: directory,
                "LIFEGUARD_JOURNAL_DIR": os.path.join(directory, "journal"),
                # The demo's watchdogs take turns among themselves, not with the host's.
                "LIFEGUARD_TURNS_DIR": os.path.join(directory, "turns"),
                **NO_TELEMETRY})  # fmt: skip
    paths = {**PATHS, **DEATHS}
    labels = {path: paths[path][0] + (" [watchdog]" if path in DEATHS else "") for path in paths}
    last = DEAD_SERVER + " [journal]"
    widths = [max(len(HEADERS[0]), len(last), *map(len, labels.values())),
              len(HEADERS[1]), len(HEADERS[2]), len("143 (SIGTERM)")]  # fmt: skip

    def row(label: str, raw: str, guarded: str, rc: int, ok: bool) -> None:
        cells = [c.ljust(w) for c, w in zip((label, raw, guarded, describe_exit(rc)), widths)]  # noqa: B905
        emit("  ".join(cells) + ("" if ok else "  <- wrong"))

    emit(f"lifeguard demo: {len(paths) + 1} exit paths, raw MLflow vs lifeguard ({uri})")
    zygote = Zygote(env)
    # The rows a guardian ends, and the last row, use a real `mlflow server`, as training fleets
    # do: the watchdog ends those runs over MLflow's REST API without importing mlflow.
    server = MlflowServer(Path(directory) / "server", env={MARKER: directory, **NO_TELEMETRY})

    def start_server() -> MlflowServer:
        server.start()
        emit(f"(the [watchdog] rows' and the last row's mlflow server is up: {server.uri})")
        return server

    def one(path: str, with_lifeguard: bool) -> tuple[str, int, int | None]:
        argv = ["--child", path, *(["--with-lifeguard"] if with_lifeguard else [])]
        sig = paths[path][1]
        child_env = env
        if path in DEATHS:
            server_up.result()
            child_env = {**env, "MLFLOW_TRACKING_URI": server.uri}
        result = zygote.run(
            argv, child_env, send=() if sig is None else (sig,), timeout=CHILD_TIMEOUT
        )
        if result.ready.get("watchdog"):
            wait_gone(int(result.ready["watchdog"]), CHILD_TIMEOUT)  # type: ignore[call-overload]
        run_id = str(result.ready["run_id"])
        if path in DEATHS:
            status, end_time = _status_on_server(server.uri, run_id)
        else:
            status, end_time = _status_in_store(db, run_id)
        return status, result.returncode, end_time

    honest = True
    try:
        with ThreadPoolExecutor(max_workers=jobs + 2) as pool:  # +2: the server's start, the case
            server_up = pool.submit(start_server)  # first: its CPU overlaps the sqlite rows
            # The store's schema once, before the children race to create it.
            zygote.run(["--task", "setup", uri], env, timeout=CHILD_TIMEOUT)
            futures = {
                (path, lg): pool.submit(one, path, lg) for path in paths for lg in (False, True)
            }
            dead_server = pool.submit(
                lambda: dead_server_case(zygote, server_up.result(), directory, env)
            )
            emit("  ".join(h.ljust(w) for h, w in zip(HEADERS, widths, strict=True)))
            emit("  ".join("-" * w for w in widths))
            for path in paths:  # in the table's order, each as soon as it is known
                raw_status, raw_rc, _ = futures[(path, False)].result()
                status, rc, end_time = futures[(path, True)].result()
                expected = Outcome.from_wait_status(rc).status.value
                # The truth, a real end time, and the very exit status raw MLflow had.
                ok = status == expected and end_time is not None and rc == raw_rc
                honest &= ok
                row(labels[path], raw_status, status, rc, ok)
            raw_status, status, raw_rc, rc, true_end = dead_server.result()
            ok = status == "KILLED" and true_end and rc == raw_rc == -signal.SIGTERM
            honest &= ok
            row(last, raw_status, status, rc, ok)
    finally:
        zygote.close()
        server.stop()
    emit(
        "\nraw MLflow: its atexit hook writes FINISHED whatever happened, and a signal leaves the"
        "\nrun RUNNING forever. lifeguard: the status the exit code says, the same exit code;"
        "\n[watchdog]: with the sidecar on, which ends the runs of deaths that run no Python code"
        "\n(a main thread stuck in C is finalized in-process, as every SIGTERM is), over the"
        "\nREST API of a local mlflow server, the store most training fleets log to;"
        "\n[journal]: the status could not be written, so it was journaled and written once the"
        "\nserver was back, with the signal's time as the end time."
    )
    return honest


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--child":
        child_main(sys.argv[2], with_lifeguard="--with-lifeguard" in sys.argv[3:])
    elif len(sys.argv) == 4 and sys.argv[1] == "--task":
        task_main(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 3 and sys.argv[1] == "--zygote":
        from lifeguard.forkserver import serve

        request = serve(int(sys.argv[2]), _zygote_preload)
        if not request:
            raise SystemExit(0)
        # A forked child: from here on, just as ``python -m lifeguard.demo --child PATH``.
        if sys.argv[1] == "--child":
            child_main(sys.argv[2], with_lifeguard="--with-lifeguard" in sys.argv[3:])
        else:
            task_main(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 4 and sys.argv[1] == "--reaper":
        reaper_main(int(sys.argv[2]), sys.argv[3])
    else:
        raise SystemExit(main(sys.argv[1:]))
