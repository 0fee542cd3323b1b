"""`lifeguard run -- CMD` and `python -m lifeguard script.py`: the exact exit status, always."""

from __future__ import annotations

import contextlib
import json
import os
import select
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lifeguard import demo
from tests.conftest import CHILD_TIMEOUT, Scenario, Store, child_env, wait_blocked
from tests.test_guardian import DEATHS, IN_PROCESS

pytestmark = pytest.mark.slow

RUN = ("-m", "lifeguard", "run", "--", sys.executable)
SCRIPT = ("-m", "lifeguard")


@pytest.mark.parametrize("path", list(DEATHS))
def test_supervisor_ends_the_run_of_a_death(scenario: Scenario, store: Store, path: str) -> None:
    status, returncode = DEATHS[path]
    sig = demo.DEATHS[path][1]
    result = scenario.run(
        "--path", path, send=() if sig is None else (sig,), launcher=RUN, to_ready_pid=True
    )
    # The supervisor exits exactly as its child did: same code, or death by the same signal.
    assert result.returncode == returncode, result.stderr
    [run_id] = result.ready["run_ids"]
    run = store.run(run_id)
    assert run.info.status == status
    assert run.info.end_time is not None and run.info.end_time >= run.info.start_time
    expected = "process" if path in IN_PROCESS else "supervisor"
    assert run.data.tags["lifeguard.ended_by"] == expected


@pytest.mark.parametrize(("code", "status"), [(0, "FINISHED"), (4, "FAILED")])
def test_bare_system_exit_is_known_exactly(
    scenario: Scenario, store: Store, code: int, status: str
) -> None:
    """In-process, `raise SystemExit(4)` is invisible before 3.12 (from 3.12 on the program sees
    it leave its top level, and ends the run itself); the supervisor's waitpid is not."""
    result = scenario.run("--path", "return", "--bare-exit", str(code), launcher=SCRIPT)
    assert result.returncode == code
    [run_id] = result.ready["run_ids"]
    run = store.run(run_id)
    assert run.info.status == status
    assert run.data.tags["lifeguard.exit_code"] == str(code)
    seen_in_process = sys.version_info >= (3, 12)
    assert run.data.tags["lifeguard.ended_by"] == ("process" if seen_in_process else "supervisor")


@pytest.mark.parametrize(
    ("sig", "ended_by"),
    [
        # Hooked in the unedited program (autoboot): it ends its own run.
        (signal.SIGTERM, "process"),
        (signal.SIGINT, "process"),
        (signal.SIGHUP, "process"),
        # Forwarded too, but not hooked: the program dies of the default action and the
        # supervisor, which sees the signal in waitpid, ends the run.
        (signal.SIGUSR1, "supervisor"),
        (signal.SIGUSR2, "supervisor"),
    ],
)
def test_signals_to_the_supervisor_reach_the_program(
    scenario: Scenario, store: Store, sig: int, ended_by: str
) -> None:
    # stdin stays open: the program must be ended by the forwarded signal, not by EOF. Sent
    # once the program waits in its read of stdin: its SIGINT is Python's KeyboardInterrupt, and
    # one that lands just before the read's system call would be raised only at EOF.
    result = scenario.run(
        "--path", "SIGTERM", send=(sig,), launcher=RUN, close_stdin_after_signals=False,
        after_ready=lambda ready: wait_blocked(int(ready["pid"]), "pipe_read"),  # type: ignore[call-overload]
    )  # fmt: skip
    assert result.returncode == -sig
    [run_id] = result.ready["run_ids"]
    run = store.run(run_id)
    assert run.info.status == "KILLED"
    assert run.data.tags["lifeguard.signal"] == signal.Signals(sig).name
    assert run.data.tags["lifeguard.ended_by"] == ended_by


# A SIGTERM that the supervisor's main thread does not see while it waits in select(), as one
# that lands just before select()'s system call: another thread of the supervisor takes it
# (pthread_kill to itself, once the main thread sleeps in select). CPython's C handler runs in
# that thread; the main thread's select is not interrupted. Only the wakeup fd can wake it for
# the Python handler that forwards the signal.
SIGNAL_BESIDE_THE_SELECT = """
import os, signal, sys, threading, time
from lifeguard.guardian.supervisor import supervise

main = threading.get_native_id()

def take_signal():
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    sys.stdin.read()  # EOF: the test has the program's ready line; the supervisor waits now
    # select() sleeps in poll_schedule_timeout (do_select on older kernels)
    while not any(w in open(f"/proc/self/task/{main}/wchan").read() for w in ("poll", "select")):
        time.sleep(0.005)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
    threading.Event().wait()

threading.Thread(target=take_signal, daemon=True).start()
sys.exit(supervise(sys.argv[1:]))
"""

PROGRAM = """
import json, os, threading
print("LIFEGUARD-READY " + json.dumps({"pid": os.getpid()}), flush=True)
threading.Event().wait()  # it ends only if the SIGTERM reaches it
"""


def test_a_signal_the_select_never_sees_is_forwarded(tmp_path: Path) -> None:
    script = tmp_path / "supervisor.py"
    script.write_text(SIGNAL_BESIDE_THE_SELECT)
    # Its stdin is closed once the program's ready line is read: the supervisor's thread goes on.
    result = demo.run_child(
        [sys.executable, str(script), sys.executable, "-c", PROGRAM], timeout=CHILD_TIMEOUT
    )
    assert result.returncode == -signal.SIGTERM, result.stderr


@pytest.mark.parametrize("path", ["sys.exit(3)", "exception", "return"])
def test_in_process_paths_under_the_supervisor(scenario: Scenario, store: Store, path: str) -> None:
    from tests.test_exit_paths import CONTRACT

    status, returncode = CONTRACT[path]
    result = scenario.run("--path", path, launcher=SCRIPT)
    assert result.returncode == returncode
    [run_id] = result.ready["run_ids"]
    assert store.status(run_id) == status


def test_script_runs_as_python_would(tmp_path: Path, store: Store) -> None:
    """sys.argv, __main__ and imports from the script's own folder, as with `python script.py`."""
    folder = tmp_path / "proj"
    folder.mkdir()
    (folder / "helper.py").write_text("VALUE = 'from the script folder'\n")
    (folder / "train.py").write_text(
        textwrap.dedent(
            """
            import sys
            import helper
            print(repr(sys.argv), __name__, helper.VALUE, sep="|")
            """
        )
    )
    env = child_env(store)
    direct = subprocess.run(
        [sys.executable, "proj/train.py", "--lr", "3"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    guarded = subprocess.run(
        [sys.executable, "-m", "lifeguard", "proj/train.py", "--lr", "3"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert direct.returncode == guarded.returncode == 0, guarded.stderr
    assert guarded.stdout == direct.stdout
    assert (
        guarded.stdout.strip() == "['proj/train.py', '--lr', '3']|__main__|from the script folder"
    )


def test_missing_command_is_a_clear_error() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lifeguard", "run", "--", "no-such-program-xyz"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 127
    assert "cannot start 'no-such-program-xyz'" in result.stderr
    empty = subprocess.run(
        [sys.executable, "-m", "lifeguard", "run"], capture_output=True, text=True, timeout=60
    )
    assert empty.returncode == 2
    assert "no command given" in empty.stderr


# -- do no harm under `lifeguard run` (issue 12) ---------------------------------------------


@pytest.mark.parametrize("to_group", [False, True], ids=["supervisor", "its-group"])
def test_sigkill_of_the_supervisor_takes_the_program_along(
    scenario: Scenario, store: Store, to_group: bool
) -> None:
    """`timeout -s KILL`, an OOM kill or a killpg of the supervisor: the program (in its own
    process group, so a group kill misses it) must not live on as an orphan. It gets SIGTERM
    (PR_SET_PDEATHSIG), so lifeguard in it ends the run KILLED and it dies of SIGTERM."""
    killed_at: list[float] = []
    result = scenario.run(
        "--path",
        "SIGTERM",
        send=(signal.SIGKILL,),
        launcher=RUN,
        to_group=to_group,
        close_stdin_after_signals=False,  # EOF on stdin would end the program by itself
        after_ready=lambda ready: killed_at.append(time.time()),
    )
    pid = int(result.ready["pid"])  # type: ignore[call-overload]
    try:
        assert result.returncode == -signal.SIGKILL
        assert demo.wait_gone(pid, CHILD_TIMEOUT), "the program outlived its supervisor"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    [run_id] = result.ready["run_ids"]
    run = store.run(run_id)
    assert run.info.status == "KILLED"
    assert run.data.tags["lifeguard.signal"] == "SIGTERM"
    assert run.data.tags["lifeguard.ended_by"] == "process"
    # The end time is when the program got its SIGTERM: just after the SIGKILL (seconds at
    # most on a loaded machine), not when anything later ran.
    assert killed_at[0] - 0.01 <= run.info.end_time / 1000 < killed_at[0] + 5.0


def fd_program(tmp_path: Path, body: str) -> tuple[str, str]:
    """The output of ``bash -c 'exec 3<file; python -c BODY'``, plain and under lifeguard run."""
    data = tmp_path / "given.txt"
    data.write_text("hello from fd 3\n")
    outputs = []
    for launcher in ("", f"{sys.executable} -m lifeguard run -- "):
        script = (
            f"exec 3<{shlex.quote(str(data))}; {launcher}{sys.executable} -c {shlex.quote(body)}"
        )
        result = subprocess.run(
            ["bash", "-c", script], capture_output=True, text=True, timeout=CHILD_TIMEOUT
        )
        assert result.returncode == 0, result.stderr
        outputs.append(result.stdout)
    return outputs[0], outputs[1]


def test_inherited_fds_reach_the_program(tmp_path: Path) -> None:
    """fd 3 of `3<file` (PMI_FD, systemd's LISTEN_FDS work the same way) is the program's."""
    plain, guarded = fd_program(tmp_path, "import os; print(os.read(3, 15))")
    assert plain == "b'hello from fd 3'\n"
    assert guarded == plain


def test_the_channel_stays_out_of_the_low_fds(tmp_path: Path) -> None:
    """lifeguard's own pipe must not take a low fd number that the program could expect to be
    free (fds 3 and up are where inherited fds and the program's first files go)."""
    body = "import os; print(os.environ.get('LIFEGUARD_GUARDIAN', '0:').split(':')[0])"
    plain, guarded = fd_program(tmp_path, body)
    assert plain == "0\n"
    assert int(guarded) >= 100, guarded


REAPER_PROGRAM = textwrap.dedent(
    """
    import os, sys, time
    # Orphan five grandchildren that exit at once: their parent dies first, so they are
    # reparented to PID 1 -- the supervisor -- which must reap them, as tini does.
    grandchildren = []
    for _ in range(5):
        r, w = os.pipe()
        middle = os.fork()
        if middle == 0:
            if os.fork() == 0:
                os.write(w, str(os.getpid()).encode())
                os._exit(0)
            os._exit(0)
        os.close(w)
        os.waitpid(middle, 0)
        grandchildren.append(int(os.read(r, 32)))
        os.read(r, 1)  # EOF: the grandchild is gone, a zombie until someone reaps it
        os.close(r)

    def state(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):  # ESRCH: reaped as it was read
            return "reaped"

    # Reaping follows SIGCHLD at once; this bounds the wait on a loaded machine.
    end = time.monotonic() + 20
    while any(state(p) != "reaped" for p in grandchildren) and time.monotonic() < end:
        time.sleep(0.05)
    print(os.getppid(), *sorted(set(state(p) for p in grandchildren)))
    sys.exit(7)
    """
)


def test_as_pid_1_the_supervisor_reaps_orphans(tmp_path: Path) -> None:
    """A container's entrypoint is PID 1: orphans are reparented to it, and unless it reaps
    them they stay zombies (tini and dumb-init exist for this)."""
    probe = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, timeout=60
    )
    if probe.returncode != 0:
        pytest.skip(f"unshare --pid is not available here: {probe.stderr.decode().strip()}")
    result = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-m", "lifeguard",
         "run", "--", sys.executable, "-c", REAPER_PROGRAM],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT,
    )  # fmt: skip
    # The program's parent is the supervisor, PID 1; every orphan was reaped; exit status 7.
    assert result.stdout.split() == ["1", "reaped"], result.stderr
    assert result.returncode == 7, result.stderr


# -- the command line as python's (issue 14) --------------------------------------------------


def test_dash_c_runs_like_python_dash_c(tmp_path: Path) -> None:
    code = "import sys, lifeguard; print(sys.argv, __name__, repr(sys.path[0]))"
    plain = subprocess.run(
        [sys.executable, "-c", code, "a", "-b"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    guarded = subprocess.run(
        [sys.executable, "-m", "lifeguard", "-c", code + "; print(lifeguard.is_installed())",
         "a", "-b"],
        cwd=tmp_path, capture_output=True, text=True, timeout=CHILD_TIMEOUT,
    )  # fmt: skip
    assert guarded.returncode == 0, guarded.stderr
    assert plain.stdout == "['-c', 'a', '-b'] __main__ ''\n"
    assert guarded.stdout == plain.stdout + "True\n"


def test_dash_m_runs_like_python_dash_m(tmp_path: Path) -> None:
    """`python -m lifeguard -m torch.distributed.run ...` is how a job is launched: argv[0],
    __main__, __spec__ and sys.path[0] as with `python -m`, and the exit status passed on."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "launch.py").write_text(
        "import sys\n"
        "print(sys.argv, __name__, __spec__.name, sys.path[0])\n"
        "sys.exit(int(sys.argv[-1]))\n"
    )
    plain = subprocess.run(
        [sys.executable, "-m", "pkg.launch", "--nproc", "3"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    guarded = subprocess.run(
        [sys.executable, "-m", "lifeguard", "-m", "pkg.launch", "--nproc", "3"],
        cwd=tmp_path, capture_output=True, text=True, timeout=CHILD_TIMEOUT,
    )  # fmt: skip
    assert plain.returncode == guarded.returncode == 3, guarded.stderr
    assert plain.stdout.startswith(f"[{str(package / 'launch.py')!r}, '--nproc', '3'] __main__")
    assert guarded.stdout == plain.stdout


@pytest.mark.parametrize("flag", ["-c", "-m"])
def test_dash_c_and_dash_m_need_an_argument(flag: str) -> None:
    plain = subprocess.run([sys.executable, flag], capture_output=True, text=True, timeout=60)
    guarded = subprocess.run(
        [sys.executable, "-m", "lifeguard", flag], capture_output=True, text=True, timeout=60
    )
    assert plain.returncode == guarded.returncode == 2
    assert f"Argument expected for the {flag} option" in guarded.stderr


def test_sweep_older_than_alone_is_an_error(tmp_path: Path) -> None:
    store = tmp_path / "never-created.db"
    result = subprocess.run(
        [sys.executable, "-m", "lifeguard", "sweep", "--tracking-uri", f"sqlite:///{store}",
         "--older-than", "7d"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert not store.exists()  # refused before anything is opened
    assert result.stderr.count("\n") == 1
    assert "--older-than" in result.stderr and "--include-untagged" in result.stderr


def test_run_help_says_what_it_does() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lifeguard", "run", "--help"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    for expected in ("CMD", "SIGINT, SIGTERM, SIGHUP, SIGUSR1 and SIGUSR2", "exit status",
                     "dies of the same signal", "SIGTERM when the supervisor dies"):  # fmt: skip
        assert expected in text, expected


def test_the_supervisor_does_not_wait_for_a_guardian_turn(
    scenario: Scenario, store: Store, tmp_path: Path
) -> None:
    """Every turn of the host is taken (fifty watchdogs of a node's other jobs at work): the
    supervisor, whose exit the job's launcher waits on, ends its SIGKILLed child's run at once
    rather than wait up to five minutes in line, where the launcher's own SIGKILL would find
    nothing journaled yet."""
    import fcntl

    turns = tmp_path / "turns"
    turns.mkdir(mode=0o700)
    held = []
    for number in range(4):
        fd = os.open(turns / f".turn-{number}", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.append(fd)
    try:
        result = scenario.run(
            "--path", "SIGKILL",
            send=(signal.SIGKILL,), to_ready_pid=True,
            env=child_env(store, LIFEGUARD_TURNS_DIR=str(turns)),
            launcher=RUN,
        )  # fmt: skip
    finally:
        for fd in held:
            os.close(fd)
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert result.seconds < CHILD_TIMEOUT / 2, result.seconds
    [run_id] = result.ready["run_ids"]
    assert store.status(run_id) == "KILLED"


SERVICE = """
import json
import select
import mlflow, uvicorn

run = mlflow.start_run()


async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
                print("LIFEGUARD-READY " + json.dumps({"run_ids": [run.info.run_id]}), flush=True)
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


uvicorn.run(app, host="127.0.0.1", port=0, log_level="warning")
"""


def test_a_uvicorn_service_stopped_by_ctrl_c_ends_its_own_run(store: Store, tmp_path: Path) -> None:
    """``lifeguard run -- python service.py``, a real uvicorn serving a small ASGI app, and
    Ctrl-C (SIGINT to ``lifeguard run``, forwarded): uvicorn shuts down gracefully and the
    program returns, exit 0, as without lifeguard. The program's own lifeguard knows it
    returned and ends its run; the supervisor has nothing to do (it imports no mlflow). Seen:
    ``ended_by=supervisor``, and 9 to 11 s to exit against raw's 2 s, the supervisor's import of
    mlflow included."""
    service = tmp_path / "service.py"
    service.write_text(SERVICE)
    raw = demo.run_child(
        [sys.executable, str(service)],
        env=child_env(store),
        send=(signal.SIGINT,),
        timeout=CHILD_TIMEOUT,
    )
    supervised = demo.run_child(
        [sys.executable, "-m", "lifeguard", "run", "--", sys.executable, str(service)],
        env=child_env(store),
        send=(signal.SIGINT,),
        timeout=CHILD_TIMEOUT,
    )
    assert supervised.returncode == raw.returncode == 0, supervised.stderr
    assert supervised.stderr == raw.stderr
    [run_id] = supervised.ready["run_ids"]  # type: ignore[misc]
    run = store.run(run_id)
    assert run.info.status == "FINISHED", run.data.tags
    assert run.data.tags["lifeguard.reason"] == "exit code 0"
    assert run.data.tags["lifeguard.ended_by"] == "process"


OWN_OPTIONS = """
import json
import select
import lifeguard
lifeguard.install(watchdog=True, deadline=20)
from lifeguard import api
import mlflow
run = mlflow.start_run()
options = api.current().options
print("OPTIONS", json.dumps({"deadline": options.deadline, "watchdog": options.watchdog}))
print("RUN", run.info.run_id)
"""


def test_the_programs_own_install_options_are_honoured_under_lifeguard_run(
    store: Store, tmp_path: Path
) -> None:
    """``lifeguard run -- python train.py`` installs lifeguard at start-up, with the options of
    the environment; the program then calls ``install(watchdog=True, deadline=20)`` itself.
    Its explicit options are the ones in force, as if it had been first, and nothing is said
    (the supervisor is its guardian already: no watchdog is started beside it). Seen: the
    options dropped, with a 500-character warning on stderr."""
    program = tmp_path / "train.py"
    program.write_text(OWN_OPTIONS)
    done = subprocess.run(
        [sys.executable, *RUN, str(program)],
        env=child_env(store),
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    line = next(x for x in done.stdout.splitlines() if x.startswith("OPTIONS "))
    assert json.loads(line.split(" ", 1)[1]) == {"deadline": 20.0, "watchdog": True}
    run_id = next(x for x in done.stdout.splitlines() if x.startswith("RUN ")).split()[1]
    run = store.run(run_id)
    assert run.info.status == "FINISHED", run.data.tags
    assert run.data.tags["lifeguard.ended_by"] == "process"


# -- job control: Ctrl-Z, fg and bg in an interactive shell ------------------------------------

STOPPABLE = """
import os, signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
import mlflow
run = mlflow.start_run()
print("RUN", run.info.run_id, flush=True)
print("READY", os.getpid(), flush=True)
if os.environ.get("WAIT_FOR_USR1"):
    signal.sigwait({signal.SIGUSR1})
    print("WOKEN", flush=True)
if not os.environ.get("NO_READ"):
    print("GOT", sys.stdin.readline().strip(), flush=True)
"""


class Shell:
    """An interactive bash on a pty, as a person's terminal: it has job control. Every wait for
    its output is bounded; a shell that never shows what is awaited is killed."""

    def __init__(self, env: dict[str, str]) -> None:
        import pty

        env = dict(env, PS1="PROMPT> ", TERM="dumb")
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the shell, leading the pty's session
            os.execve("/bin/bash", ["bash", "--norc", "--noprofile", "-i"], env)
        self.out = bytearray()
        self.expect(b"PROMPT> ")

    def type(self, keys: bytes, marker: bytes) -> bytes:
        """Type ``keys``; return what the shell showed up to ``marker``."""
        mark = len(self.out)
        os.write(self.fd, keys)
        return self.expect(marker, mark)

    def expect(self, marker: bytes, mark: int = 0) -> bytes:
        import select

        give_up = time.monotonic() + CHILD_TIMEOUT
        while marker not in self.out[mark:]:
            left = give_up - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {marker!r} in: {bytes(self.out[mark:])!r}")
            if self.fd in select.select([self.fd], [], [], left)[0]:
                try:
                    data = os.read(self.fd, 4096)
                except OSError:  # EIO: the shell is gone
                    data = b""
                if not data:
                    raise EOFError(bytes(self.out[mark:]).decode(errors="replace"))
                self.out.extend(data)
        return bytes(self.out[mark:])

    def close(self) -> None:
        # Every process of the shell's session: the shell, and each job's group of its own.
        for name in os.listdir("/proc"):
            if name.isdigit():
                with contextlib.suppress(OSError):
                    if os.getsid(int(name)) == self.pid:
                        os.kill(int(name), signal.SIGKILL)
        os.waitpid(self.pid, 0)
        os.close(self.fd)


# How the job is started, and what the person at the terminal does (the test's steps below).
JOBS = {
    "Ctrl-Z, fg": ("{cmd}", {}),
    "Ctrl-Z, bg, fg": ("{cmd}", {}),
    "Ctrl-Z, bg, it ends in the background": ("{cmd}", {"WAIT_FOR_USR1": "1", "NO_READ": "1"}),
    "Ctrl-Z, bg, fg while it runs": ("{cmd}", {"WAIT_FOR_USR1": "1"}),
    "Ctrl-Z under bash -c": ("bash -c '{cmd}; echo after-$?'", {}),
    "started with &": ("{cmd} &", {}),
}


@pytest.mark.skipif(not os.path.exists("/bin/bash"), reason="needs bash for job control")
@pytest.mark.parametrize("job", list(JOBS))
def test_job_control_in_an_interactive_shell(store: Store, tmp_path: Path, job: str) -> None:
    """In an interactive shell, ``lifeguard run -- python train.py`` is a job as ``python
    train.py`` is: Ctrl-Z stops it (the shell says "Stopped" and gives its prompt back), ``fg``
    and ``bg`` resume it, a read from the background stops it until ``fg``, and a job that ends
    in the background leaves the shell its terminal. Its run ends FINISHED. Seen:
    - Ctrl-Z hung the terminal: it stopped the program's process group (which holds the
      terminal), not the supervisor, and the shell waited for the supervisor;
    - then, with only the supervisor stopping too: a job that ended in the background took
      the terminal from the shell, which exited; ``fg`` after ``bg`` left the program without
      the terminal; under ``bash -c`` the wrapper did not stop, and the shell hung."""
    program = tmp_path / "train.py"
    program.write_text(STOPPABLE)
    started, extra = JOBS[job]
    cmd = started.format(cmd=shlex.join([sys.executable, *RUN, str(program)]))
    shell = Shell(child_env(store, **extra))
    try:
        shell.type(b"set -b\n", b"PROMPT> ")  # a background job's change is told at once
        start = len(shell.out)
        if job == "started with &":
            # Its read of the terminal from the background stops it, as it would python.
            shell.type(cmd.encode() + b"\n", b"Stopped")
        else:
            shell.type(cmd.encode() + b"\n", b"READY")
            shell.expect(b"\n", shell.out.index(b"READY", start))  # the READY line whole
            assert b"Stopped" in shell.type(b"\x1a", b"PROMPT> ")
        shown = bytes(shell.out[start:])
        run_id = shown.split(b"RUN ", 1)[1].split()[0].decode()
        pid = int(shown.split(b"READY ", 1)[1].split()[0])
        if job == "Ctrl-Z, bg, fg":
            # In the background its read of the terminal stops it again (SIGTTIN).
            assert b"Stopped" in shell.type(b"bg\n", b"Stopped")
        if job == "Ctrl-Z, bg, it ends in the background":
            shell.type(b"bg\n", b"PROMPT> ")
            mark = len(shell.out)
            os.kill(pid, signal.SIGUSR1)
            shell.expect(b"Done", mark)
            assert b"alive" in shell.type(b"echo alive\n", b"alive")
        elif job == "Ctrl-Z, bg, fg while it runs":
            shell.type(b"bg\n", b"PROMPT> ")
            shell.type(b"fg\n", b"train.py")  # the shell sends a running job no SIGCONT
            mark = len(shell.out)
            os.kill(pid, signal.SIGUSR1)
            shell.expect(b"WOKEN", mark)
            assert b"GOT hello" in shell.type(b"hello\n", b"GOT hello")
        else:
            shell.type(b"fg\n", b"train.py")
            assert b"GOT hello" in shell.type(b"hello\n", b"GOT hello")
            if job == "Ctrl-Z under bash -c":
                shell.expect(b"after-0")
        assert b"rc=0" in shell.type(b"echo rc=$?\n", b"rc=0")
    finally:
        shell.close()
    run = store.run(run_id)
    assert run.info.status == "FINISHED", run.data.tags
    assert run.data.tags["lifeguard.ended_by"] == "process"


PAGER = """
import sys
for _ in range(2):  # the program's RUN and READY lines
    print(sys.stdin.readline(), end="", flush=True)
with open("/dev/tty") as tty:  # the keys, as less reads them
    print("PAGER", tty.readline().strip(), flush=True)
print(sys.stdin.read(), end="", flush=True)
"""


@pytest.mark.skipif(not os.path.exists("/bin/bash"), reason="needs bash for job control")
def test_a_pager_after_the_pipe_keeps_the_terminal(store: Store, tmp_path: Path) -> None:
    """``lifeguard run -- python train.py | less``: the pager reads the keys from the terminal
    while the program runs, as with ``python train.py | less``. Seen: the terminal was handed
    to the program's process group, and the pager, stopped by its read (SIGTTIN), stopped the
    job; ``fg`` handed the terminal to the program again."""
    program = tmp_path / "train.py"
    program.write_text(STOPPABLE)
    pager = tmp_path / "pager.py"
    pager.write_text(PAGER)
    cmd = (
        shlex.join([sys.executable, *RUN, str(program)])
        + " | "
        + shlex.join([sys.executable, str(pager)])
    )
    shell = Shell(child_env(store, WAIT_FOR_USR1="1", NO_READ="1"))
    try:
        shown = shell.type(cmd.encode() + b"\n", b"READY")
        run_id = shown.split(b"RUN ", 1)[1].split()[0].decode()
        shown = shell.expect(b"\n", len(shell.out) - len(shown) + shown.index(b"READY"))
        pid = int(shown.split(b"READY ", 1)[1].split()[0])
        assert b"PAGER q" in shell.type(b"q\n", b"PAGER q")
        mark = len(shell.out)
        os.kill(pid, signal.SIGUSR1)
        shell.expect(b"WOKEN", mark)
        assert b"rc=0" in shell.type(b"echo rc=$?\n", b"rc=0")
    finally:
        shell.close()
    run = store.run(run_id)
    assert run.info.status == "FINISHED", run.data.tags


def test_ctrl_z_where_no_shell_can_continue_the_job_is_discarded(
    store: Store, tmp_path: Path
) -> None:
    """``lifeguard run`` leading the terminal's session itself (``ssh -t host CMD``, ``script
    -c``, ``docker exec -it``): no shell there can continue a stopped job, and the kernel
    discards the terminal's Ctrl-Z for python run directly (its group is orphaned). The
    program goes on and reads its line. Seen: the program's own group, not orphaned, stopped,
    and nothing ever continued it."""
    import pty

    program = tmp_path / "train.py"
    program.write_text(STOPPABLE)
    pid, fd = pty.fork()
    if pid == 0:  # the child: the supervisor, leading the pty's session
        argv = [sys.executable, *RUN, str(program)]
        os.execve(argv[0], argv, child_env(store))
    out = bytearray()
    try:
        for keys, marker in ((b"", b"READY"), (b"\x1ahello\n", b"GOT hello")):
            os.write(fd, keys)
            give_up = time.monotonic() + CHILD_TIMEOUT
            while marker not in out:
                assert time.monotonic() < give_up, f"no {marker!r} in {bytes(out)!r}"
                if select.select([fd], [], [], max(0.0, give_up - time.monotonic()))[0]:
                    data = os.read(fd, 4096)
                    assert data, f"no {marker!r} in {bytes(out)!r}"
                    out.extend(data)
        _, status = os.waitpid(pid, 0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0, bytes(out)
    run_id = bytes(out).split(b"RUN ", 1)[1].split()[0].decode()
    run = store.run(run_id)
    assert run.info.status == "FINISHED", run.data.tags
