"""Do no harm in every shape a program runs in (issue 23): the REPL through a real pty, a real
Jupyter kernel through jupyter_client, asyncio, and scripts that catch their own Ctrl-C or exit.

What a session showed and carried on from is not how it ended; an exception or exit the program
caught is not either. Each program runs twice where the comparison matters, without and with
lifeguard: its output and exit status must be the same, and with lifeguard its run ends with the
truth.
"""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lifeguard.demo import default_signals, run_child
from tests.conftest import CHILD_TIMEOUT, Store, child_env, shows_lifeguard, trials, wait_gone

pytestmark = pytest.mark.slow

RUN_LINE = re.compile(r"RUN ([0-9a-f]{32})")


def run_id_in(text: str) -> str:
    found = RUN_LINE.search(text)
    assert found, text
    return found.group(1)


# -- scripts that catch what they are sent ---------------------------------------------------

PROLOGUE = """
import json, sys, time
{install}
import mlflow
run = mlflow.start_run()
print("RUN", run.info.run_id, flush=True)

def ready():
    print("LIFEGUARD-READY " + json.dumps({{"run_id": run.info.run_id}}), flush=True)
"""

CAUGHT = {
    # Ctrl-C caught by the program, which saves and returns: exit 0.
    "ctrl-c": """
        def train():
            ready()
            time.sleep(60)

        try:
            train()
        except KeyboardInterrupt:
            print("saved", flush=True)
    """,
    "sys.exit": """
        def main():
            ready()
            try:
                sys.exit(3)
            except SystemExit:
                print("carried on", flush=True)

        main()
    """,
    # At module level, the frame that catches is the program's bottom frame itself.
    "sys.exit at module level": """
        ready()
        try:
            sys.exit(3)
        except SystemExit:
            print("carried on", flush=True)
    """,
    # A Ctrl-C that CPython drops: raised inside a __del__ (or a weakref callback), printed as
    # "Exception ignored", and the program runs on.
    "ctrl-c dropped by CPython": """
        import os, signal

        class Dropped:
            def __del__(self):
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(10**6):  # the handler runs here, inside __del__
                    pass

        ready()
        thing = Dropped()
        del thing
        print("carried on", flush=True)
    """,
    # An error C code prints and survives: CPython calls sys.excepthook as for an uncaught one.
    "an error printed from C": """
        import ctypes

        ready()
        ctypes.pythonapi.PyRun_SimpleString(b"1/0")
        print("carried on", flush=True)
    """,
    # A framework that swallows an exit of 0 (torch.distributed.elastic's @record does this).
    "exit 0 swallowed by a wrapper": """
        def record(fn):
            def wrapper():
                try:
                    return fn()
                except SystemExit as exc:
                    if exc.code == 0:
                        return None
                    raise
            return wrapper

        @record
        def main():
            ready()
            sys.exit(0)

        main()
        print("carried on", flush=True)
    """,
}


def program(body: str, lifeguard_on: bool) -> str:
    install = "import lifeguard; lifeguard.install()" if lifeguard_on else ""
    return PROLOGUE.format(install=install) + textwrap.dedent(body)


@pytest.mark.parametrize("case", list(CAUGHT))
def test_what_the_program_caught_and_carried_on_from_is_not_its_ending(
    store: Store, tmp_path: Path, case: str
) -> None:
    """The contract's first row: a return is FINISHED, whatever the program caught before it.
    The output and exit status are the program's own, with and without lifeguard."""
    results = {}
    for on in (False, True):
        path = tmp_path / f"caught-{on}.py"
        path.write_text(program(CAUGHT[case], on))
        results[on] = run_child(
            [sys.executable, str(path)],
            env=child_env(store),
            send=(signal.SIGINT,) if case == "ctrl-c" else (),
            timeout=CHILD_TIMEOUT,
        )
    without, with_ = results[False], results[True]
    assert with_.returncode == without.returncode == 0, with_.stderr
    assert with_.stdout.replace(run_id_in(with_.stdout), "") == without.stdout.replace(
        run_id_in(without.stdout), ""
    )
    assert _comparable(with_.stderr) == _comparable(without.stderr)
    run = store.run(run_id_in(with_.stdout))
    assert run.info.status == "FINISHED", run.data.tags
    assert run.data.tags["lifeguard.reason"] == "exit code 0"


def _comparable(stderr: str) -> str:
    """Stderr without what differs between any two runs: the program's file name (one per
    mode) and object addresses ("Exception ignored in: <function ... at 0x7f...>")."""
    return re.sub(r"0x[0-9a-f]+", "0x?", re.sub(r"caught-(True|False)\.py", "PROGRAM", stderr))


def test_an_exit_re_raised_at_module_level_still_ends_the_program(
    store: Store, tmp_path: Path
) -> None:
    """The other side of the rule: an exit caught, logged and re-raised (bare ``raise``) at the
    program's bottom frame ends it, FAILED with its code."""
    path = tmp_path / "reraise.py"
    path.write_text(
        program(
            """
            ready()
            try:
                sys.exit(4)
            except SystemExit:
                print("cleanup", flush=True)
                raise
            """,
            True,
        )
    )
    result = run_child([sys.executable, str(path)], env=child_env(store), timeout=CHILD_TIMEOUT)
    assert result.returncode == 4, result.stderr
    run = store.run(run_id_in(result.stdout))
    assert run.info.status == "FAILED"
    assert run.data.tags["lifeguard.exit_code"] == "4"


# -- the REPL, through a real pty ----------------------------------------------------------


class Repl:
    """CPython's REPL on a pty, driven as a person would: type a line and wait for the next
    prompt, press Ctrl-C, press Ctrl-D. Every wait is bounded."""

    PROMPT = b">>> "

    def __init__(self, env: dict[str, str]) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the interpreter, on the pty
            # As a terminal's shell starts it: every signal at its default. A runner started
            # in the background of a script (`cmd &`, `nohup`) has SIGINT ignored, an exec keeps
            # it so, and CPython then never sees Ctrl-C (this test failed 4 of 4 that way).
            default_signals()
            os.execve(sys.executable, [sys.executable, "-q"], env)
        self.out = bytearray()
        self._wait_for(lambda: self.PROMPT in self.out)

    def _wait_for(
        self, done: object, timeout: float = CHILD_TIMEOUT, look_every: float | None = None
    ) -> None:
        """Read output until ``done()``; it is asked again at each output, or every
        ``look_every`` seconds for a condition that shows in no output."""
        give_up = time.monotonic() + timeout
        while not done():  # type: ignore[operator]
            left = give_up - time.monotonic()
            if left <= 0:
                raise TimeoutError(bytes(self.out).decode(errors="replace"))
            wait = left if look_every is None else min(left, look_every)
            if self.fd in select.select([self.fd], [], [], wait)[0]:
                try:
                    data = os.read(self.fd, 4096)
                except OSError:  # EIO: the child has closed the pty
                    data = b""
                if not data:
                    raise EOFError(bytes(self.out).decode(errors="replace"))
                self.out.extend(data)

    def _prompts(self) -> int:
        return self.out.count(self.PROMPT)

    def line(self, text: str) -> None:
        """Type a line and wait for the prompt after it."""
        before = self._prompts()
        os.write(self.fd, text.encode() + b"\r")
        self._wait_for(lambda: self._prompts() > before)

    def ctrl_c_at_prompt(self) -> None:
        """Ctrl-C while the REPL waits for input. The REPL's readline loop looks at signals only
        when its ``select`` is interrupted: one that comes while it draws the prompt waits for
        the next key, with or without lifeguard. So the key is pressed once the main thread is
        in that ``select``, as a person at a terminal always is."""
        before = self._prompts()
        self._wait_for(self._waiting_for_input, look_every=0.01)
        os.write(self.fd, b"\x03")
        self._wait_for(lambda: self._prompts() > before)

    def _waiting_for_input(self) -> bool:
        """Whether the REPL's main thread waits in ``select``/``poll`` (the kernel says)."""
        return any(word in self._wchan() for word in ("poll", "select"))

    def _wchan(self) -> str:
        """Where in the kernel the REPL's main thread waits, if it does."""
        try:
            with open(f"/proc/{self.pid}/wchan") as wchan:
                return wchan.read()
        except OSError:
            return ""

    def ctrl_c_during(self, text: str, marker: str) -> None:
        """Type a line that prints ``marker`` and then sleeps; Ctrl-C once the marker's line has
        shown whole (the terminal echoes ^C where the output stands when the key is pressed,
        and the newline can come in a write of its own: it did, with mlflow imported, with and
        without lifeguard) and the main thread sleeps. A Ctrl-C that lands between the print
        and the sleep's system call is seen only once the sleep is over, with or without
        lifeguard (CPython checks for signals before it sleeps, not as it starts): on a loaded
        machine it did, and the test took a minute longer."""
        before = self._prompts()
        mark = len(self.out)
        line = marker.encode() + b"\r\n"
        os.write(self.fd, text.encode() + b"\r")
        self._wait_for(lambda: line in self.out[mark:].replace(text.encode(), b""))
        self._wait_for(lambda: "nanosleep" in self._wchan(), look_every=0.01)
        os.write(self.fd, b"\x03")
        self._wait_for(lambda: self._prompts() > before)

    def end(self, keys: bytes = b"\x04") -> tuple[str, int]:
        """Press Ctrl-D (or type ``keys``), read to the end, and reap: (output, exit status)."""
        os.write(self.fd, keys)
        try:
            self._wait_for(lambda: False)
        except EOFError:
            pass
        _, status = os.waitpid(self.pid, 0)
        os.close(self.fd)
        return bytes(self.out).decode(errors="replace").replace("\r\n", "\n"), (
            os.waitstatus_to_exitcode(status)
        )


def repl_session(env: dict[str, str], lifeguard_on: bool, plan: list[str]) -> tuple[str, int]:
    repl = Repl(env)
    if lifeguard_on:
        repl.line("import lifeguard; lifeguard.install()")
    repl.line("import mlflow; run = mlflow.start_run(); print('RUN', run.info.run_id)")
    for step in plan:
        if step == "ctrl-c at the prompt":
            repl.ctrl_c_at_prompt()
        elif step == "ctrl-c in time.sleep":
            repl.ctrl_c_during("import time; print('sleep' + 'ing'); time.sleep(60)", "sleeping")
        elif step == "a typo":
            repl.line("undefined_name")
        elif step == "mlflow.log_metric":
            repl.line("mlflow.log_metric('m', 1)")
    ending = plan[-1] if plan and plan[-1].startswith("exit(") else None
    return repl.end(ending.encode() + b"\r" if ending else b"\x04")


def repl_env(store: Store, tmp_path: Path) -> dict[str, str]:
    # The C REPL on every Python (3.13's new one is Python code, with its own frames), a home of
    # the test's own for readline's history file, and readline's echo as a dumb terminal.
    return child_env(store, TERM="dumb", PYTHON_BASIC_REPL="1", HOME=str(tmp_path))


REPL_PLANS = {
    "ctrl-c, typo, ctrl-d": ["ctrl-c at the prompt", "ctrl-c in time.sleep", "a typo"],
    "ctrl-c at the prompt, ctrl-d": ["ctrl-c at the prompt"],
    "ctrl-c in a statement, more, ctrl-d": ["ctrl-c in time.sleep", "mlflow.log_metric"],
    # CPython's REPL remembers that the last statement was interrupted, and then dies of SIGINT
    # at Ctrl-D: with lifeguard too.
    "ctrl-c in a statement, ctrl-d": ["ctrl-c in time.sleep"],
    "a typo, exit(3)": ["a typo", "exit(3)"],
}


@pytest.mark.parametrize("plan", list(REPL_PLANS))
def test_the_repl_ends_as_without_lifeguard(store: Store, tmp_path: Path, plan: str) -> None:
    """What the REPL shows (a Ctrl-C at the prompt or in a statement, a typo) is not how it
    ends: Ctrl-D is a clean exit, FINISHED, and the terminal shows the same text and the same
    exit status as without lifeguard (CPython's own; exit(3) is FAILED with 3)."""
    env = repl_env(store, tmp_path)
    steps = REPL_PLANS[plan]
    without, code_without = repl_session(env, False, steps)
    with_, code_with = repl_session(env, True, steps)
    assert code_with == code_without, with_
    install = ">>> import lifeguard; lifeguard.install()\n"
    assert install in with_
    run_id = run_id_in(with_)
    assert with_.replace(install, "").replace(run_id, "") == without.replace(run_id_in(without), "")
    run = store.run(run_id)
    expected = ("FAILED", "exit code 3") if plan.endswith("exit(3)") else ("FINISHED", None)
    assert run.info.status == expected[0], with_
    if expected[1]:
        assert run.data.tags["lifeguard.reason"] == expected[1]
    assert not shows_lifeguard(with_.replace(install, ""))


# -- asyncio ---------------------------------------------------------------------------------

ASYNCIO_CTRL_C = """
import asyncio, sys
{install}
import mlflow
run = mlflow.start_run()
print("RUN", run.info.run_id, flush=True)

async def main():
    try:
        print('LIFEGUARD-READY {{"run_id": "%s"}}' % run.info.run_id, flush=True)
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        print("cleanup ran", flush=True)
        raise

asyncio.run(main())
"""


@pytest.mark.timeout(900)  # eleven programs that import mlflow: ~10 s each on a quiet machine
def test_asyncio_run_cancels_its_task_on_ctrl_c(store: Store, tmp_path: Path) -> None:
    """asyncio.run installs its own SIGINT handler only if it finds Python's
    default_int_handler: it cancels the main task, whose cleanup runs, and the traceback is
    asyncio's. The same program without lifeguard is the reference; ten tries with it (three
    in a contributor's `tox`: conftest.trials)."""
    results = {}
    for on, tries in ((False, 1), (True, trials(10, 3))):
        program = tmp_path / f"asyncio-{on}.py"
        program.write_text(
            ASYNCIO_CTRL_C.format(install="import lifeguard; lifeguard.install()" if on else "")
        )
        results[on] = [
            run_child(
                [sys.executable, str(program)],
                env=child_env(store),
                send=(signal.SIGINT,),
                timeout=CHILD_TIMEOUT,
            )
            for _ in range(tries)
        ]
    (reference,) = results[False]
    assert "cleanup ran" in reference.stdout
    for result in results[True]:
        assert "cleanup ran" in result.stdout, result.stderr
        assert result.returncode == reference.returncode == -signal.SIGINT
        assert _traceback(result.stderr) == _traceback(reference.stderr)
        run = store.run(run_id_in(result.stdout))
        assert run.info.status == "KILLED"
        assert run.data.tags["lifeguard.signal"] == "SIGINT"


def _traceback(stderr: str) -> str:
    """The traceback without its program file's name (each mode has its own file)."""
    return re.sub(r"asyncio-(True|False)\.py", "PROGRAM", stderr)


ASYNCIO_PHASE = """
import asyncio, os, signal, sys, time
import lifeguard
lifeguard.install()
import mlflow
run = mlflow.start_run()
print("RUN", run.info.run_id, flush=True)

async def serve():
    # The program's own SIGTERM handling while its loop runs: its choice, which stands.
    loop = asyncio.get_running_loop()
    got = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, got.set)
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.wait_for(got.wait(), 60)
    print("the loop handled SIGTERM", flush=True)

asyncio.run(serve())  # closing the loop hands SIGTERM back (SIG_DFL) and the wakeup fd (-1)
print('LIFEGUARD-READY {"run_id": "%s"}' % run.info.run_id, flush=True)
while True:
    mlflow.log_metric("loss", 1.0)
    time.sleep(0.05)
"""


def test_signals_an_asyncio_loop_hands_back_are_lifeguards_again(
    store: Store, tmp_path: Path
) -> None:
    """While the loop runs, its SIGTERM handler is the program's (it runs, and the program goes
    on); once the loop closes, SIGTERM ends the run KILLED and the process dies of it."""
    program = tmp_path / "asyncio-phase.py"
    program.write_text(ASYNCIO_PHASE)
    result = run_child(
        [sys.executable, str(program)],
        env=child_env(store),
        send=(signal.SIGTERM,),
        timeout=CHILD_TIMEOUT,
    )
    assert "the loop handled SIGTERM" in result.stdout, result.stderr
    assert result.returncode == -signal.SIGTERM, result.stderr
    run = store.run(run_id_in(result.stdout))
    assert run.info.status == "KILLED"
    assert run.data.tags["lifeguard.signal"] == "SIGTERM"


WAKEUP_FD = """
import _signal, os, signal, socket, sys
import lifeguard
from lifeguard import sentry

before = signal.set_wakeup_fd(-1)  # nothing set before lifeguard: -1, as in any program
lifeguard.install()
ours, theirs = socket.socketpair()
theirs.setblocking(False)
# The program sets its wakeup fd (as asyncio's add_signal_handler does): the interpreter's own
# function, the fd the interpreter writes to. lifeguard's listener does not use it.
assert signal.set_wakeup_fd is _signal.set_wakeup_fd
assert signal.set_wakeup_fd(theirs.fileno()) == -1
signal.signal(signal.SIGUSR1, lambda *a: None)
signal.raise_signal(signal.SIGUSR1)
ours.settimeout(60)
assert ours.recv(16) == bytes([signal.SIGUSR1]), "the byte did not come"
assert signal.set_wakeup_fd(-1) == theirs.fileno()
# SIGTERM handed back to its default action is lifeguard's again...
signal.signal(signal.SIGTERM, lambda *a: None)
assert signal.signal(signal.SIGTERM, signal.SIG_DFL) is not signal.SIG_DFL
assert signal.getsignal(signal.SIGTERM) != signal.SIG_DFL
# ... while one the program ignores stays ignored.
signal.signal(signal.SIGHUP, signal.SIG_IGN)
assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
lifeguard.uninstall()
assert _signal.signal is sentry.set_handler
assert signal.signal(signal.SIGTERM, signal.SIG_DFL) is not None
assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # uninstalled: the default stays
print("OK", flush=True)
"""


def test_the_wakeup_fd_is_the_programs_and_gets_every_byte(
    tmp_path: Path,
) -> None:
    program = tmp_path / "wakeup.py"
    program.write_text(WAKEUP_FD)
    result = subprocess.run(
        [sys.executable, str(program)], capture_output=True, text=True, timeout=CHILD_TIMEOUT
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "OK\n"


# -- a Jupyter kernel, through jupyter_client --------------------------------------------------


class Kernel:
    """A real IPython kernel, started and driven by jupyter_client as a notebook is: cells run,
    the Stop button (``interrupt_kernel``), shutdown and restart. Every wait is bounded."""

    def __init__(self, env: dict[str, str], stderr: Path) -> None:
        from jupyter_client import KernelManager

        self.manager = KernelManager(kernel_name="python3")
        # jupyter_client's own wait before it escalates to SIGTERM is 5 s, half of it before the
        # SIGTERM: a kernel's exit takes 2-3 s on a loaded 2-core machine, lifeguard or not.
        # The test is about how the kernel ends when it is let end.
        self.manager.shutdown_wait_time = CHILD_TIMEOUT
        self._stderr = stderr.open("w")
        self.manager.start_kernel(env=env, stderr=self._stderr)
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=CHILD_TIMEOUT)

    def run(self, code: str, *, interrupt_at: str | None = None) -> tuple[str, str | None]:
        """Run a cell: (its output, the name of the error it ended with). With
        ``interrupt_at``, press Stop once the cell has printed that."""
        msg_id = self.client.execute(code)
        out: list[str] = []
        error = None
        while True:
            msg = self.client.get_iopub_msg(timeout=CHILD_TIMEOUT)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out.append(content["text"])
                if interrupt_at is not None and interrupt_at in "".join(out):
                    interrupt_at = None
                    self.manager.interrupt_kernel()
            elif kind == "error":
                error = content["ename"]
            elif kind == "status" and content["execution_state"] == "idle":
                return "".join(out), error

    def process(self) -> subprocess.Popen[bytes]:
        return self.manager.provisioner.process  # type: ignore[union-attr,no-any-return]

    def shutdown(self, *, now: bool = False) -> int:
        """Shut the kernel down as a notebook does; its exit status."""
        process = self.process()
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=now)
        self._stderr.close()
        return int(process.wait(CHILD_TIMEOUT))


@pytest.fixture
def jupyter_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Connection files, IPython's profile and history in the test's directory, not the
    developer's home."""
    dirs = {
        "HOME": tmp_path / "home",
        "IPYTHONDIR": tmp_path / "ipython",
        "JUPYTER_RUNTIME_DIR": tmp_path / "jupyter-runtime",
        "JUPYTER_DATA_DIR": tmp_path / "jupyter-data",
        "JUPYTER_CONFIG_DIR": tmp_path / "jupyter-config",
    }
    for name, path in dirs.items():
        path.mkdir()
        monkeypatch.setenv(name, str(path))
    return {name: str(path) for name, path in dirs.items()}


NOTEBOOK_START = "import mlflow\nrun = mlflow.start_run()\nprint('RUN', run.info.run_id)\n"
LOGGING_CELL = (
    "import time\n"
    "for step in range(100000):\n"
    "    mlflow.log_metric('loss', 1.0 / (step + 1), step=step)\n"
    "    if step == 3:\n"
    "        print('logging', flush=True)\n"
    "    time.sleep(0.01)\n"
)


def notebook_session(env: dict[str, str], lifeguard_on: bool, stderr: Path) -> tuple[str, int]:
    """Cell 1 starts a run; cell 2 logs until the Stop button; cell 3 logs again; cell 4 has a
    typo; then a clean shutdown. Returns (the run id, the kernel's exit status)."""
    kernel = Kernel(env, stderr)
    install = "import lifeguard; lifeguard.install()\n" if lifeguard_on else ""
    out, error = kernel.run(install + NOTEBOOK_START)
    assert error is None, out
    run_id = run_id_in(out)
    assert kernel.run(LOGGING_CELL, interrupt_at="logging")[1] == "KeyboardInterrupt"
    assert kernel.run("mlflow.log_metric('after', 1.0); print('logged again')") == (
        "logged again\n",
        None,
    )
    assert kernel.run("undefined_name")[1] == "NameError"
    return run_id, kernel.shutdown()


def test_a_notebook_interrupted_and_mistyped_shuts_down_clean(
    store: Store, tmp_path: Path, jupyter_home: dict[str, str]
) -> None:
    """The Stop button interrupts the cell and the run lives on; a typo is the cell's error.
    Neither is how the kernel ends: a clean shutdown is FINISHED, and the kernel exits as it
    does without lifeguard, with nothing of lifeguard's on its stderr."""
    env = child_env(store, **jupyter_home)
    runs = {on: notebook_session(env, on, tmp_path / f"kernel-{on}.err") for on in (False, True)}
    assert runs[True][1] == runs[False][1] == 0
    run = store.run(runs[True][0])
    assert run.info.status == "FINISHED", run.data.tags
    assert run.data.tags["lifeguard.reason"] == "exit code 0"
    assert "after" in run.data.metrics  # the run stayed open after the interrupt
    assert not shows_lifeguard((tmp_path / "kernel-True.err").read_text())


def test_a_restarted_kernel_ends_its_run_finished(
    store: Store, tmp_path: Path, jupyter_home: dict[str, str]
) -> None:
    """``restart_kernel()`` shuts the kernel down cleanly, then starts another."""
    kernel = Kernel(child_env(store, **jupyter_home), tmp_path / "kernel.err")
    out, error = kernel.run("import lifeguard; lifeguard.install()\n" + NOTEBOOK_START)
    assert error is None, out
    first = kernel.process()
    kernel.manager.restart_kernel()
    assert first.wait(CHILD_TIMEOUT) == 0
    run = store.run(run_id_in(out))
    assert run.info.status == "FINISHED"
    kernel.client.wait_for_ready(timeout=CHILD_TIMEOUT)
    assert kernel.run("print('the new kernel runs')")[0] == "the new kernel runs\n"
    kernel.shutdown()


def test_a_kernel_killed_by_the_notebook_is_killed_with_the_watchdog(
    store: Store, tmp_path: Path, jupyter_home: dict[str, str]
) -> None:
    """``shutdown_kernel(now=True)`` SIGKILLs the kernel: no code of it runs, so only a guardian
    can end its run (the contract's SIGKILL row): KILLED by the watchdog."""
    kernel = Kernel(child_env(store, **jupyter_home), tmp_path / "kernel.err")
    out, error = kernel.run(
        "import lifeguard; lifeguard.install(watchdog=True)\n"
        + NOTEBOOK_START
        + "print('WATCHDOG', lifeguard.watchdog_pid())\n"
    )
    assert error is None, out
    watchdog = int(out.split("WATCHDOG ")[1].split()[0])
    assert kernel.shutdown(now=True) == -signal.SIGKILL
    wait_gone(watchdog)
    run = store.run(run_id_in(out))
    assert run.info.status == "KILLED"
    assert run.data.tags["lifeguard.ended_by"] == "watchdog"
