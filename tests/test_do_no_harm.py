"""Do no harm (issue 12), in-process: the program's own choices stand.

The exit status of ``sys.exit(x)`` is CPython's, whatever ``x`` is; a bad option fails at
``install()``, never at exit; and what docs/configuration.md promises about options and the
README about the API is true.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import lifeguard
from lifeguard import demo
from lifeguard import options as _options
from lifeguard.options import Options, parse_signals
from lifeguard.outcome import Outcome, exit_code_of
from tests.conftest import CHILD_TIMEOUT, REPO, Store, child_env, trials

# The documented upper bound for every option in seconds.
MAX_SECONDS: float = getattr(_options, "MAX_SECONDS", 3600.0)

# -- 1. the exit status is the one the process really exits with ----------------------------

# Python source for the codes to check, each against the real interpreter: the C long range and
# its overflow, the & 0xFF of POSIX, bool, an int subclass, and objects that are not ints.
EXIT_CODES = [
    "0",
    "3",
    "255",
    "256",
    "257",
    "-1",
    "-256",
    "2**31",
    "2**31 - 1",
    "2**32 + 3",
    "2**63 - 1",
    "2**63",
    "-2**63",
    "-2**63 - 1",
    "-2**64",
    "10**30",
    "True",
    "False",
    "None",
    "'fatal'",
    "3.0",
    "[]",
    "type('I', (int,), {})(260)",
    "type('Idx', (), {'__index__': lambda self: 3})()",
]


def real_exit_status(source: str) -> int:
    result = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.exit({source})"],
        capture_output=True,
        timeout=60,
    )
    return result.returncode


def test_exit_code_of_matches_the_interpreter() -> None:
    """Derived from the interpreter itself, not from a table written by hand."""
    for source in EXIT_CODES:
        code = eval(source)
        assert exit_code_of(code) == real_exit_status(source), source


def guarded_exit(store: Store, exit_source: str, prelude: str = "") -> tuple[int, str, str]:
    """A program that installs lifeguard, starts a run and calls ``sys.exit(<exit_source>)``.
    Returns (exit status, run status, stderr)."""
    code = prelude + textwrap.dedent(
        f"""
        import sys
        import lifeguard
        lifeguard.install()
        import mlflow
        run = mlflow.start_run()
        print(run.info.run_id, flush=True)
        sys.exit({exit_source})
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=child_env(store),
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT,
    )
    run_id = result.stdout.split()[0] if result.stdout.split() else ""
    assert run_id, result.stderr
    return result.returncode, store.status(run_id), result.stderr


@pytest.mark.parametrize(
    ("source", "returncode", "status"),
    [("256", 0, "FINISHED"), ("-1", 255, "FAILED"), ("2**63", 255, "FAILED")],
)
def test_status_follows_the_real_exit_status(
    store: Store, source: str, returncode: int, status: str
) -> None:
    assert real_exit_status(source) == returncode
    got_returncode, got_status, stderr = guarded_exit(store, source)
    assert (got_returncode, got_status) == (returncode, status), stderr


# -- 2. sys.exit(obj) whose __str__ raises --------------------------------------------------

UNPRINTABLE = """
class Unprintable:
    def __str__(self):
        raise ValueError("no text for you")
    __repr__ = __str__
"""


def test_exit_with_an_unprintable_object_still_raises_system_exit(store: Store) -> None:
    code = UNPRINTABLE + textwrap.dedent(
        """
        import sys
        {install}
        try:
            sys.exit(Unprintable())
        except BaseException as exc:
            print(type(exc).__name__, type(exc.code).__name__ if hasattr(exc, "code") else "")
            raise
        """
    )
    env = child_env(store)
    runs = {}
    for label, install in (("raw", ""), ("guarded", "import lifeguard; lifeguard.install()")):
        runs[label] = subprocess.run(
            [sys.executable, "-c", code.replace("{install}", install)],
            env=env,
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT,
        )
    raw, guarded = runs["raw"], runs["guarded"]
    assert raw.stdout == "SystemExit Unprintable\n"
    assert (guarded.returncode, guarded.stdout) == (raw.returncode, raw.stdout), guarded.stderr
    assert guarded.stderr == raw.stderr


def test_unprintable_exit_code_ends_the_run_failed_with_a_reason(store: Store) -> None:
    returncode, status, stderr = guarded_exit(store, "Unprintable()", prelude=UNPRINTABLE)
    assert (returncode, status) == (1, "FAILED"), stderr
    outcome = Outcome.exited(eval_unprintable())
    assert outcome.reason == "exit code 1: <unprintable Unprintable object>"
    assert outcome.tags()["lifeguard.exit_code"] == "1"


def eval_unprintable() -> object:
    namespace: dict[str, object] = {}
    exec(textwrap.dedent(UNPRINTABLE), namespace)
    return namespace["Unprintable"]()  # type: ignore[operator]


def test_unprintable_exception_keeps_the_excepthook_quiet() -> None:
    outcome = Outcome.raised(type("Odd", (Exception,), {"__str__": _raise})())
    assert outcome.reason.endswith("Odd: <unprintable Odd object>")


def _raise(self: object) -> str:
    raise RuntimeError("no")


# An uncaught KeyboardInterrupt makes CPython die of SIGINT once finalized, but every exec() of a
# string at exit resets the flag that says so (3.10 to 3.13): a finalizer that execs (an import
# defining an enum or a dataclass, SQLAlchemy generating code in a store write) made the program
# exit 1. "exec" is the finalizer's work; "import" is lifeguard's own excepthook importing its
# modules for the first time (it made `install(); raise KeyboardInterrupt` exit 1 on 3.11).
CTRL_C_PROGRAMS = {
    "exec": "lifeguard.register(lambda outcome: exec('pass'), name='execs')",
    "import": "pass",
}


@pytest.mark.parametrize("work", list(CTRL_C_PROGRAMS))
def test_an_uncaught_keyboard_interrupt_still_dies_of_sigint(work: str) -> None:
    work_line = CTRL_C_PROGRAMS[work]
    code = f"import lifeguard\nlifeguard.install()\n{work_line}\nraise KeyboardInterrupt\n"
    for program in ("raise KeyboardInterrupt", code):  # without lifeguard, then with it
        result = subprocess.run(
            [sys.executable, "-c", program],
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT,
            # A runner that ignores SIGINT passes that on; a terminal's program has Python's.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        assert result.returncode == -signal.SIGINT, (program, result.stderr)
        assert result.stderr.rstrip().endswith("KeyboardInterrupt")


# A program that never imports threading (lifeguard's own threads are started without it).
NO_THREADING = """
import os, sys
{install}
assert "threading" not in sys.modules, "the test needs a program without threading"
print('LIFEGUARD-READY {{"pid": %d}}' % os.getpid(), flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize(
    "lifeguard_lines",
    [
        "import lifeguard; lifeguard.install()",
        # A finalizer: the ender imports threading (before 3.13 that made the ender its main).
        "import lifeguard; lifeguard.install(); lifeguard.register(lambda outcome: None)",
    ],
    ids=["installed", "with a finalizer"],
)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_program_without_threading_dies_of_the_signal(
    tmp_path: Path, sig: int, lifeguard_lines: str
) -> None:
    """Once, the ender took itself for the main thread where the program never imported
    threading, could not reset the signal's handler from there, and the process exited 143
    (129) instead."""
    codes = []
    for lines in ("", lifeguard_lines):  # without lifeguard, then with
        result = demo.run_child(
            [sys.executable, "-c", NO_THREADING.format(install=lines)],
            env={**os.environ, "LIFEGUARD_JOURNAL_DIR": str(tmp_path / "journal")},
            send=(sig,),
            timeout=CHILD_TIMEOUT,
        )
        codes.append(result.returncode)
    assert codes == [-sig, -sig]


# -- 3. numeric options: refused at install() when no timer can take them ------------------


@pytest.mark.parametrize("name", ["deadline", "heartbeat", "blocked_grace"])
@pytest.mark.parametrize("value", ["1e12", "3601", "nan", "inf", "-inf", "-1", "1e400"])
def test_seconds_out_of_range_are_refused_with_the_range(name: str, value: str) -> None:
    var = "LIFEGUARD_" + name.upper()
    with pytest.raises(ValueError, match=rf"{var}.*{int(MAX_SECONDS)}") as env_error:
        Options.from_kwargs({}, environ={var: value})
    assert "seconds" in str(env_error.value)
    with pytest.raises(ValueError, match=rf"option '{name}'.*{int(MAX_SECONDS)}"):
        Options.from_kwargs({name: float(value)}, environ={})


@pytest.mark.parametrize(("name", "zero"), [("deadline", False), ("heartbeat", True)])
def test_seconds_in_range_are_accepted(name: str, zero: bool) -> None:
    assert getattr(Options.from_kwargs({name: MAX_SECONDS}, environ={}), name) == MAX_SECONDS
    # A heartbeat is at least a second apart (tests/test_bad_input.py), a deadline may be short.
    assert getattr(Options.from_kwargs({name: "1.5"}, environ={}), name) == 1.5
    if zero:
        assert getattr(Options.from_kwargs({name: 0}, environ={}), name) == 0
    else:
        with pytest.raises(ValueError, match="greater than 0"):
            Options.from_kwargs({name: 0}, environ={})


def test_huge_deadline_fails_at_install_not_at_exit(store: Store) -> None:
    """Before: accepted, then OverflowError in the SIGTERM handler, exit 1 and FINISHED."""
    code = "import lifeguard; lifeguard.install(); print('installed')"
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=child_env(store, LIFEGUARD_DEADLINE="1e12"),
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT,
    )
    assert result.returncode == 1
    assert "installed" not in result.stdout
    assert "ValueError: environment variable LIFEGUARD_DEADLINE" in result.stderr
    assert "at most 3600" in result.stderr


@pytest.mark.parametrize(
    ("option", "argv"),
    [
        ("--deadline", ["run", "--deadline", "1e12", "--", "true"]),
        # MLflow's HTTP timeout: 1e12 overflows the socket timeout.
        ("--timeout", ["sweep", "--tracking-uri", "sqlite:///{tmp}/x.db", "--timeout", "1e12"]),
    ],
)
def test_command_line_seconds_use_the_same_range(
    tmp_path: Path, option: str, argv: list[str]
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lifeguard", *(a.replace("{tmp}", str(tmp_path)) for a in argv)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert f"{option} must be a number of seconds greater than 0 and at most 3600" in result.stderr
    assert not (tmp_path / "x.db").exists()


@pytest.mark.parametrize("var", ["LIFEGUARD_DEADLINE", "LIFEGUARD_HEARTBEAT"])
def test_run_refuses_a_bad_variable_before_starting(store: Store, tmp_path: Path, var: str) -> None:
    """Under `lifeguard run` the program's install() would only report it and run unguarded."""
    marker = tmp_path / "started"
    result = subprocess.run(
        [sys.executable, "-m", "lifeguard", "run", "--", "touch", str(marker)],
        env=child_env(store, **{var: "1e12"}),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.startswith(f"lifeguard run: environment variable {var} must be")
    assert not marker.exists()


# -- 4. signals by number, as docs/configuration.md says -------------------------------------


@pytest.mark.parametrize(
    "value", ["15", " 15 ", "SIGTERM", "TERM", "term", "sigterm", 15, [15], ["15"], ("TERM",)]
)
def test_signals_by_name_or_number(value: object) -> None:
    assert parse_signals(value) == (15,)


def test_signal_list_mixes_names_and_numbers() -> None:
    assert Options.from_kwargs({}, environ={"LIFEGUARD_SIGNALS": "15,HUP,2"}).signals == (15, 1, 2)
    assert Options.from_kwargs({"signals": "15,1"}, environ={}).signals == (15, 1)


@pytest.mark.parametrize("value", ["SIGKILL", "9", "KILL", "STOP", "19", 9])
def test_unhookable_signals_are_refused(value: object) -> None:
    with pytest.raises(ValueError, match="cannot be hooked"):
        parse_signals(value)


@pytest.mark.parametrize("value", ["SIGNOPE", "999", "-3", "TERM15", "1.5"])
def test_unknown_signals_list_what_is_accepted(value: str) -> None:
    with pytest.raises(ValueError) as error:
        parse_signals(value, "environment variable LIFEGUARD_SIGNALS")
    message = str(error.value)
    assert message.startswith("environment variable LIFEGUARD_SIGNALS")
    assert "SIGTERM" in message and "names or numbers" in message


def test_signal_number_from_the_environment_is_hooked(store: Store) -> None:
    code = textwrap.dedent(
        """
        import signal
        import lifeguard
        lifeguard.install()
        from lifeguard import api
        print(api.current().options.signals, signal.getsignal(signal.SIGUSR1) is not None)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=child_env(store, LIFEGUARD_SIGNALS="10,TERM"),
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "(10, 15) True"


# -- 5. uninstall() is what the second-install warning says, and the API is documented -------


def test_uninstall_then_install_takes_the_new_options() -> None:
    code = textwrap.dedent(
        """
        import lifeguard
        from lifeguard import api
        lifeguard.install(deadline=5)
        lifeguard.install(deadline=7)              # warns: keeps 5
        kept = api.current().options.deadline
        lifeguard.uninstall()
        print(lifeguard.is_installed())
        lifeguard.install(deadline=7)              # the warning's advice: now 7, no warning
        print(kept, api.current().options.deadline, lifeguard.is_installed())
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "5.0", "7.0", "True"]
    assert result.stderr.count("already called") == 1
    assert "lifeguard.uninstall()" in result.stderr


def test_install_starts_no_python_thread_and_a_program_may_end_at_once() -> None:
    """lifeguard's listener is a thread of lifeguard._ears's, started from C: install() starts no
    Python thread. One that has not run yet when the program ends has no thread state in
    CPython 3.10 to 3.12, and the interpreter then frees memory the thread writes: the process
    died of SIGSEGV, 1 in about 300 on 3.10, when it ended just after install(). Here programs
    end at once after install(), after uninstall() and install() again, or with a signal of
    their own handled in between; each exits as it would without lifeguard."""
    spy = textwrap.dedent(
        """
        import _thread, os, signal, sys, lifeguard
        started = []
        start = _thread.start_new_thread
        def spy(function, args, *rest):
            started.append(function)
            return start(function, args, *rest)
        _thread.start_new_thread = spy
        lifeguard.install()
        lifeguard.uninstall()
        lifeguard.install()
        print("started", len(started), flush=True)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", spy], capture_output=True, text=True, timeout=CHILD_TIMEOUT
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["started", "0"], result.stderr
    endings = [
        "lifeguard.install()",
        "lifeguard.install(); lifeguard.uninstall(); lifeguard.install()",
        "signal.signal(signal.SIGUSR1, lambda *a: None); lifeguard.install(); "
        "os.kill(os.getpid(), signal.SIGUSR1)",
        "lifeguard.install(); sys.exit(3)",
    ]
    codes = [0, 0, 0, 3]
    procs = []
    for trial in range(trials(300, 40)):
        ending = trial % len(endings)
        code = f"import os, signal, sys, lifeguard; {endings[ending]}"
        procs.append(
            (ending, subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE))
        )
        if len(procs) >= 8:
            ending, proc = procs.pop(0)
            _, err = proc.communicate(timeout=CHILD_TIMEOUT)
            assert (proc.returncode, err) == (codes[ending], b""), endings[ending]
    for ending, proc in procs:
        _, err = proc.communicate(timeout=CHILD_TIMEOUT)
        assert (proc.returncode, err) == (codes[ending], b""), endings[ending]


# A program's start, then a real SIGTERM sent from inside at its argv[1]-th call once
# sys.setprofile(fire) (while a call makes the lifecycle: its imports, about a thousand calls).
UNDER_FIRE = """
import os, signal, sys, lifeguard
lifeguard.install()
calls, at = [0], int(sys.argv[1])
def fire(frame, event, arg):
    if event == "call":
        calls[0] += 1
        if calls[0] == at:
            os.kill(os.getpid(), signal.SIGTERM)
"""

MADE_UNDER_FIRE = (
    UNDER_FIRE
    + """
def finalizer(outcome):
    os.write(1, b"finalized %d\\n" % outcome.signum)
sys.setprofile(fire)
lifeguard.register(finalizer)
sys.setprofile(None)
if calls[0] < at:  # not sent yet: now, the finalizer registered
    os.write(1, b"registered, then the signal\\n")
    os.kill(os.getpid(), signal.SIGTERM)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
signal.sigwait({signal.SIGUSR1})  # never comes: a main thread stuck in C, as in training
"""
)


def test_a_signal_while_the_lifecycle_is_being_made_still_ends_the_process_by_it() -> None:
    """install() loads no lifecycle; the first event makes it (lifeguard.sentry). A SIGTERM that
    lands at a random call while register() makes it, or just after, is still the process's
    end: the listener, waiting for the making to be done, acts on it, and the process dies of
    SIGTERM, with nothing printed; a signal sent once register() returned runs the finalizer.
    (Making it from the handler the signal interrupted an import with, here __future__'s, broke
    that import: the program's register() raised ImportError.)"""
    rng = random.Random(20261205)
    for _ in range(trials(300, 40)):
        at = rng.randint(1, 1500)
        result = subprocess.run(
            [sys.executable, "-c", MADE_UNDER_FIRE, str(at)],
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT,
        )
        assert result.returncode == -signal.SIGTERM, (at, result.returncode, result.stderr)
        assert result.stderr == "", (at, result.stderr)
        if result.stdout.startswith("registered, then the signal"):
            assert result.stdout == "registered, then the signal\nfinalized 15\n", at


UNINSTALLED_UNDER_FIRE = (
    UNDER_FIRE
    + """
sys.setprofile(fire)
lifeguard.uninstall()  # makes the lifecycle first (about a thousand calls), then unhooks
sys.setprofile(None)
if calls[0] < at:
    os.kill(os.getpid(), signal.SIGTERM)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
signal.sigwait({signal.SIGUSR1})
"""
)


def test_a_signal_while_uninstall_runs_still_ends_the_process_by_it() -> None:
    """A SIGTERM at a random call of uninstall(), which makes the lifecycle before it unhooks:
    the main thread's handler, interrupting the making's imports, leaves the signal to the
    listener, and uninstall() may finish first. The signal came while lifeguard's handler was in
    place, whose default action it stands for: the process dies of it (it lived on, 1 in 150)."""
    rng = random.Random(20261206)
    for _ in range(trials(200, 30)):
        at = rng.randint(1, 1500)
        result = subprocess.run(
            [sys.executable, "-c", UNINSTALLED_UNDER_FIRE, str(at)],
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT,
        )
        assert result.returncode == -signal.SIGTERM, (at, result.returncode, result.stderr)
        assert result.stderr == "", (at, result.stderr)


LETS_GO = """
import os, sys
{at_top}
class Big:
    def __del__(self):
        print("freed", flush=True)
def main():
    {in_main}
    big = Big()
    written = open(sys.argv[1], "w")
    written.write("written in main\\n")
main()
print("after main:", os.path.getsize(sys.argv[1]), flush=True)
never_closed = open(sys.argv[2], "w")
never_closed.write("flushed at the end\\n")
"""


@pytest.mark.parametrize("where", ["at the top", "in main()"])
def test_install_lets_go_of_what_the_program_lets_go_of(where: str, tmp_path: Path) -> None:
    """install() keeps the program's top level in view; it held the frame of the function that
    called it, and, for as long as the process lived, the __main__ module's globals: a file the
    program wrote at the top level and never closed lost its buffer (0 bytes instead of 19), and
    a local of main() outlived main(). Run with and without install(): the same output and the
    same files."""
    results = []
    for installed in (False, True):
        line = "import lifeguard; lifeguard.install()" if installed else "pass"
        code = LETS_GO.format(
            at_top=line if where == "at the top" else "",
            in_main=line if where == "in main()" else "pass",
        )
        first, second = tmp_path / f"first-{installed}", tmp_path / f"second-{installed}"
        result = subprocess.run(
            [sys.executable, "-c", code, str(first), str(second)],
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT,
            env={k: v for k, v in os.environ.items() if not k.startswith("LIFEGUARD_")},
        )
        results.append((result.returncode, result.stdout, result.stderr, second.read_text()))
    assert results[0] == (0, "freed\nafter main: 16\n", "", "flushed at the end\n")
    assert results[1] == results[0]


def test_readme_documents_every_exported_name() -> None:
    readme = (REPO / "README.md").read_text()
    section = readme.split("\n## API\n", 1)
    assert len(section) == 2, "README has no '## API' section"
    table = section[1].split("\n## ", 1)[0]
    # A row's first cell may name several: `Handle`, `PreemptionHandle`, ...
    first_cells = re.findall(r"^\|([^|]*)\|", table, flags=re.MULTILINE)
    documented = {
        name for cell in first_cells for name in re.findall(r"`(?:lifeguard\.)?(\w+)", cell)
    }
    exported = set(lifeguard.__all__) - {"__version__"}
    assert exported <= documented, sorted(exported - documented)


def test_lifeguard_s_own_fds_leave_the_program_s_numbers_alone() -> None:
    """The signal listener's pipe (and a watchdog's channel) sit at high fd numbers: the
    program's first open() gets the fd it gets under plain python."""
    code = (
        "import os, lifeguard; lifeguard.install(watchdog=True); "
        "print(os.open(os.devnull, os.O_RDONLY))"
    )
    plain = subprocess.run(
        [sys.executable, "-c", code.replace("lifeguard.install(watchdog=True)", "None")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    guarded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert plain.stdout == guarded.stdout == "3\n", guarded.stderr
