"""``lifeguard demo``: every in-process exit path, with raw MLflow and with lifeguard, side by side.

The same module is the child program: ``python -m lifeguard.demo --child PATH`` starts a run, logs
a metric, prints a ready line and then ends the way PATH says. The parent reads the ready line
before it sends any signal, so nothing here depends on timing. The test-suite drives its own
child programs with the same runner (:func:`run_child`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

__all__ = ["PATHS", "ChildResult", "enact", "main", "run_child"]

READY = "LIFEGUARD-READY"

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
) -> ChildResult:
    """Start ``cmd``, wait for its ready line, send ``send`` signals in order, then wait for it.

    ``to_ready_pid`` sends the signals to the pid the ready line names (the program under a
    supervisor) instead of the process started. ``on_line`` maps a marker printed by the child
    later (e.g. ``"FINALIZING"``) to a signal to send when it appears: the way to hit a window
    such as "during finalization" without sleeps. ``after_ready(ready)`` is called once the ready
    line is read, before any signal: the moment to break something (a server) under the child.
    Every wait is bounded by ``timeout``; on expiry the child is killed and ChildError raised.
    """
    started = time.monotonic()
    proc = subprocess.Popen(
        list(cmd),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=None if env is None else dict(env),
        text=True,
        start_new_session=new_session,
    )
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
        stderr_chunks.append(proc.stderr.read())

    readers = [threading.Thread(target=read_stdout), threading.Thread(target=read_stderr)]
    for reader in readers:
        reader.daemon = True
        reader.start()
    try:
        if not ready_event.wait(timeout):
            raise ChildError(f"no ready line within {timeout}s from {cmd}")
        if ready:
            if after_ready is not None:
                after_ready(ready)
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
            raise ChildError(f"child did not exit within {timeout}s: {cmd}") from None
        for reader in readers:
            reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    result = ChildResult(
        returncode, "".join(stdout_lines), "".join(stderr_chunks), ready, time.monotonic() - started
    )
    if not ready:
        raise ChildError(f"child exited ({returncode}) without a ready line: {result.stderr}")
    return result


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


# -- the demo -------------------------------------------------------------------------------


DEAD_SERVER = "SIGTERM while the tracking server is down"


def dead_server_case(tmp: str) -> tuple[str, str, int, int, bool]:
    """A real ``mlflow server`` that dies after the run starts; then SIGTERM. Raw MLflow, then
    lifeguard, each on the same server. lifeguard cannot write the status, so it journals it and
    exits at once; once the server is back, the journal is replayed (as the next ``install()``
    on this machine, or ``lifeguard sweep``, would) and the run must read KILLED, with the time
    of the signal as its end time. Returns (raw status, lifeguard status, raw exit status,
    lifeguard exit status, whether the end time is the signal's)."""
    import time
    from pathlib import Path

    from mlflow.tracking import MlflowClient

    from lifeguard.backends.mlflow.runs import replay_journal
    from lifeguard.guardian.journal import Journal
    from lifeguard.localserver import MlflowServer

    journal_dir = os.path.join(tmp, "journal")
    server = MlflowServer(Path(tmp) / "server").start()
    try:
        env = {**os.environ, "MLFLOW_TRACKING_URI": server.uri, "PYTHONWARNINGS": "ignore",
               "LIFEGUARD_JOURNAL_DIR": journal_dir}  # fmt: skip
        ended: dict[bool, tuple[str, int]] = {}
        signalled_at = 0.0
        for with_lifeguard in (False, True):
            if server.proc is None:
                server.start()  # same port, same store: the URI in the journal stays valid
            cmd = [sys.executable, "-m", "lifeguard.demo", "--child", "SIGTERM"]
            if with_lifeguard:
                cmd.append("--with-lifeguard")
            result = run_child(
                cmd, env=env, send=(signal.SIGTERM,), after_ready=lambda ready: server.stop()
            )
            signalled_at = time.time()
            ended[with_lifeguard] = (str(result.ready["run_id"]), result.returncode)
        server.start()
        replay_journal(Journal(journal_dir), budget=30.0)
        client = MlflowClient(tracking_uri=server.uri)
        raw = client.get_run(ended[False][0]).info
        guarded = client.get_run(ended[True][0]).info
        # The end time is when the process learned it was ending, before the server came back.
        true_end = guarded.end_time is not None and guarded.end_time <= signalled_at * 1000 + 1
        return raw.status, guarded.status, ended[False][1], ended[True][1], true_end
    finally:
        server.stop()


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        return f"{-returncode + 128} ({signal.Signals(-returncode).name})"
    return str(returncode)


def main(argv: Sequence[str] | None = None, *, jobs: int = 4) -> int:
    """Run the demo and print its table. Returns 0 when lifeguard told the truth every time."""
    from concurrent.futures import ThreadPoolExecutor

    from mlflow.tracking import MlflowClient

    from lifeguard.outcome import Outcome

    out = sys.stdout
    with tempfile.TemporaryDirectory(prefix="lifeguard-demo-") as tmp:
        uri = f"sqlite:///{os.path.join(tmp, 'mlflow.db')}"
        import logging

        # MLflow announces its schema migration at INFO on stderr; it is noise here.
        logging.getLogger("mlflow").setLevel(logging.WARNING)
        client = MlflowClient(tracking_uri=uri)
        client.search_experiments()  # creates the schema once, before children race to
        env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONWARNINGS": "ignore"}
        paths = {**PATHS, **DEATHS}
        out.write(f"lifeguard demo: {len(paths) + 1} exit paths, raw MLflow vs lifeguard ({uri})\n")
        out.flush()

        def one(path: str, with_lifeguard: bool) -> tuple[str, int, str]:
            cmd = [sys.executable, "-m", "lifeguard.demo", "--child", path]
            if with_lifeguard:
                cmd.append("--with-lifeguard")
            sig = paths[path][1]
            result = run_child(cmd, env=env, send=() if sig is None else (sig,))
            if result.ready.get("watchdog"):
                wait_gone(int(result.ready["watchdog"]))  # type: ignore[call-overload]
            run = client.get_run(str(result.ready["run_id"]))
            return run.info.status, result.returncode, run.info.end_time

        with ThreadPoolExecutor(max_workers=jobs) as pool:
            dead_server = pool.submit(dead_server_case, tmp)
            futures = {
                (path, lg): pool.submit(one, path, lg) for path in paths for lg in (False, True)
            }
            rows = []
            honest = True
            for path in paths:
                raw_status, raw_rc, _ = futures[(path, False)].result()
                status, rc, end_time = futures[(path, True)].result()
                expected = Outcome.from_wait_status(rc).status.value
                # The truth, a real end time, and the very exit status raw MLflow had.
                ok = status == expected and end_time is not None and rc == raw_rc
                honest &= ok
                label = paths[path][0] + (" [watchdog]" if path in DEATHS else "")
                rows.append((label, raw_status, status, describe_exit(rc), ok))
            raw_status, status, raw_rc, rc, true_end = dead_server.result()
            ok = status == "KILLED" and true_end and rc == raw_rc == -signal.SIGTERM
            honest &= ok
            rows.append((DEAD_SERVER + " [journal]", raw_status, status, describe_exit(rc), ok))
    headers = ("exit path", "raw MLflow", "with lifeguard", "exit code")
    widths = [max(len(h), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    out.write(line + "\n" + "  ".join("-" * w for w in widths) + "\n")
    for row in rows:
        cells = [str(c).ljust(w) for c, w in zip(row[:4], widths, strict=True)]
        out.write("  ".join(cells) + ("" if row[4] else "  <- wrong") + "\n")
    out.write(
        "\nraw MLflow: its atexit hook writes FINISHED whatever happened, and a signal leaves the"
        "\nrun RUNNING forever. lifeguard: the status the exit code says, the same exit code;"
        "\n[watchdog]: with the sidecar on, which ends the runs of deaths that run no Python code"
        "\n(a main thread stuck in C is finalized in-process by a helper thread);"
        "\n[journal]: the status could not be written, so it was journaled and written once the"
        "\nserver was back, with the signal's time as the end time.\n"
    )
    return 0 if honest else 1


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--child":
        child_main(sys.argv[2], with_lifeguard="--with-lifeguard" in sys.argv[3:])
    else:
        raise SystemExit(main(sys.argv[1:]))
