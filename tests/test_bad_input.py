"""Every value is checked where it is given: ``install()``, ``on_preemption()``, the command line.

A bad value is one line that names it and says what is allowed, at once: never a silent
default, never a failure later at exit, never a file or a directory made first. The checks that
are pure are units; where the point is what a process does (a signal it dies of, an exit
status, what a command creates) it is a real process.

* signals have one meaning everywhere: a string is a name, a number or a comma-separated list,
  never its characters (``on_preemption(cb, signals="12")`` hooked SIGHUP and SIGINT);
* every ``LIFEGUARD_*`` variable the package reads is documented, refused empty or malformed at
  ``install()``, and an unknown one is named in a warning;
* the heartbeat is off or at least a second apart;
* ``lifeguard sweep``, ``run`` and ``demo`` refuse bad values with exit 2 before doing anything,
  and ``sweep --json`` prints a JSON document whatever happens;
* ``install()``'s options are typed: a wrong one fails under mypy.
"""

from __future__ import annotations

import collections
import json
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lifeguard import cli
from lifeguard import options as _options
from lifeguard.options import Options, parse_signals
from tests.conftest import REPO, Store, _base_env, lifeguard_cli
from tests.servers import free_port

SIGUSR2, SIGTERM = int(signal.SIGUSR2), int(signal.SIGTERM)
# Read so, these tests also run (and fail as they should) against a lifeguard without them.
VARIABLES: dict[str, object] = getattr(_options, "VARIABLES", {})
TOOLING: tuple[str, ...] = getattr(_options, "TOOLING", ())


def python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def lifeguard_cold(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m lifeguard ARGS``, started cold: the command's own start is the point."""
    return subprocess.run(
        [sys.executable, "-m", "lifeguard", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=_base_env() if env is None else env,
        cwd=cwd,
    )


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# -- signals: one parser, one meaning -------------------------------------------------------------

FORMS: list[tuple[object, tuple[int, ...]]] = [
    ("12", (SIGUSR2,)),
    ("SIGUSR2", (SIGUSR2,)),
    ("USR2", (SIGUSR2,)),
    ("usr2", (SIGUSR2,)),
    (" usr2 , term ", (SIGUSR2, SIGTERM)),
    (12, (SIGUSR2,)),
    (signal.SIGUSR2, (SIGUSR2,)),
    (["USR2", 15], (SIGUSR2, SIGTERM)),
    (("12",), (SIGUSR2,)),
    # Any sequence or set, as lifeguard.typed.SignalSpec says (they were TypeErrors).
    (range(12, 13), (SIGUSR2,)),
    (collections.deque(["USR2"]), (SIGUSR2,)),
    ({"USR2": 1}.keys(), (SIGUSR2,)),
]


@pytest.mark.parametrize(("value", "expected"), FORMS)
def test_signals_have_one_meaning(value: object, expected: tuple[int, ...]) -> None:
    assert parse_signals(value) == expected
    assert Options.from_kwargs({"signals": value}, environ={}).signals == expected
    if isinstance(value, str):
        env = {"LIFEGUARD_SIGNALS": value}
        assert Options.from_kwargs({}, environ=env).signals == expected


def as_code(value: object) -> str:
    return f"signal.{value.name}" if isinstance(value, signal.Signals) else repr(value)


@pytest.mark.parametrize(
    ("value", "expected"),
    # Written into the child's code: the forms whose repr is code. SIGTERM is refused there.
    [f for f in FORMS if SIGTERM not in f[1] and isinstance(f[0], (str, int, list, tuple))],
)
def test_on_preemption_hooks_the_signals_it_is_given(
    value: object, expected: tuple[int, ...]
) -> None:
    """``signals="12"`` hooked SIGHUP and SIGINT: the process then died of SIGUSR2 and the
    callback never ran. Each signal is raised here: the callback runs, the process goes on."""
    result = python(
        f"""
        import json, signal, lifeguard
        got = []
        lifeguard.on_preemption(got.append, signals={as_code(value)})
        for signum in {expected!r}:
            signal.raise_signal(signum)  # its handler has run when this returns
        print(json.dumps(got))
        """
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == list(expected)


@pytest.mark.parametrize(
    ("value", "error", "says"),
    [
        ("", ValueError, "signals is empty"),
        (" , ", ValueError, "signals is empty"),
        ((), ValueError, "no signal given"),
        ([], ValueError, "no signal given"),
        (12.5, TypeError, "signals must be a signal name or number"),
        (True, TypeError, "True is not a signal"),
        ("SIGNOPE", ValueError, "unknown signal 'SIGNOPE'"),
        ("USR2,NOPE", ValueError, "unknown signal 'NOPE'"),
        ("KILL", ValueError, "SIGKILL cannot be hooked"),
        ("ABRT", ValueError, "SIGABRT cannot be hooked"),
        # Digits that int() takes but are no signal number (superscript two, Arabic-Indic
        # fifteen): ValueErrors from int() that named nothing, or another signal read.
        ("\u00b2", ValueError, "unknown signal '\u00b2'"),
        ("\u0661\u0665", ValueError, "unknown signal '\u0661\u0665'"),
        (b"\x0c", TypeError, "signals must be a signal name or number"),
        (iter(["USR2"]), TypeError, "signals must be a signal name or number"),
        # The stop signals are no warning: before install() SIGTERM was survivable, after it
        # not (tests/test_bad_input.py::test_preemption_... below).
        ("TERM", ValueError, "SIGTERM stops the process, it is no preemption warning"),
        (["USR1", "INT", "HUP"], ValueError, "SIGINT, SIGHUP stops the process"),
    ],
)
def test_on_preemption_refuses_what_would_hook_nothing_or_the_wrong_thing(
    value: object, error: type[Exception], says: str
) -> None:
    import lifeguard

    # Refused before any signal is hooked: safe in the test runner's own process.
    before = signal.getsignal(signal.SIGUSR2), signal.getsignal(signal.SIGUSR1)
    with pytest.raises(error, match=re.escape(says)):
        lifeguard.on_preemption(print, signals=value)  # type: ignore[arg-type]
    assert (signal.getsignal(signal.SIGUSR2), signal.getsignal(signal.SIGUSR1)) == before


def test_a_removed_preemption_callback_gives_the_signal_back() -> None:
    """``remove()`` left the warning handler in place: the process then survived SIGUSR1,
    which without lifeguard kills it. The last callback removed, the signal's handler is the
    one it had before; a callback left for another signal keeps that one hooked."""
    result = python(
        """
        import json, signal, lifeguard
        got = []
        first = lifeguard.on_preemption(got.append, signals="USR1")
        second = lifeguard.on_preemption(got.append, signals=("USR1", "USR2"))
        first.remove()
        signal.raise_signal(signal.SIGUSR1)  # the second callback, still
        second.remove()
        second.remove()  # a second time: nothing
        print(json.dumps(got), flush=True)
        signal.raise_signal(signal.SIGUSR2)  # the default action, as before on_preemption()
        print("survived", flush=True)
        """
    )
    assert result.returncode == -signal.SIGUSR2, result.stderr
    assert result.stdout.splitlines() == ["[10]"]


def test_install_takes_no_signal_only_as_an_empty_list() -> None:
    """``install(signals=())`` is documented (a thread that cannot hook signals); an empty
    string is not a way to say it."""
    assert Options.from_kwargs({"signals": ()}, environ={}).signals == ()
    assert Options.from_kwargs({"signals": []}, environ={}).signals == ()
    with pytest.raises(ValueError, match="option 'signals' is empty"):
        Options.from_kwargs({"signals": ""}, environ={})


# -- empty and malformed variables ------------------------------------------------------------


@pytest.mark.parametrize(
    ("var", "says"),
    [
        ("LIFEGUARD_MLFLOW", "set it to true or false"),
        ("LIFEGUARD_SIGNALS", "set it to signal names or numbers"),
        ("LIFEGUARD_TRACKERS", "default (the default set) or none"),
        ("LIFEGUARD_WATCHDOG", "set it to true or false"),
    ],
)
def test_an_empty_variable_is_refused_not_read_as_false(var: str, says: str) -> None:
    """``LIFEGUARD_MLFLOW=`` silently meant false (after SIGTERM the run stayed RUNNING), and
    ``LIFEGUARD_SIGNALS=`` silently hooked no signal."""
    for blank in ("", " "):
        with pytest.raises(ValueError) as error:
            Options.from_kwargs({}, environ={var: blank})
        message = str(error.value)
        assert message.startswith(f"environment variable {var} is empty; unset it for the default")
        assert says in message and "\n" not in message


def test_an_empty_option_string_is_refused() -> None:
    for name in ("mlflow", "watchdog", "end_attached", "trackers"):
        with pytest.raises(ValueError, match=f"option '{name}'"):
            Options.from_kwargs({name: ""}, environ={})


@pytest.mark.parametrize("kind", ["a file", "under a file"])
def test_a_journal_directory_that_cannot_be_one_is_refused(tmp_path: Path, kind: str) -> None:
    """Accepted before: at exit there was only a DEBUG line, and the safety net was off."""
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    path = file if kind == "a file" else file / "journal"
    for var in ("LIFEGUARD_JOURNAL_DIR", "LIFEGUARD_TURNS_DIR"):
        with pytest.raises(ValueError) as error:
            Options.from_kwargs({}, environ={var: str(path)})
        assert str(error.value).startswith(f"environment variable {var}: {path} ")
        assert "is not a directory" in str(error.value)
    loose = tmp_path / "shared"
    loose.mkdir(mode=0o700)
    loose.chmod(0o777)
    with pytest.raises(ValueError, match="writable by group or others"):
        Options.from_kwargs({}, environ={"LIFEGUARD_JOURNAL_DIR": str(loose)})
    # A directory of one's own, or one that can be made, is fine; nothing is made by the look.
    fine = tmp_path / "a" / "b"
    Options.from_kwargs({}, environ={"LIFEGUARD_JOURNAL_DIR": str(fine)})
    assert not (tmp_path / "a").exists()
    assert file.read_text() == "mine"


def test_run_refuses_a_journal_directory_that_is_a_file(tmp_path: Path) -> None:
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    marker = tmp_path / "started"
    env = {**_base_env(), "LIFEGUARD_JOURNAL_DIR": str(file)}
    result = lifeguard_cold("run", "--", "touch", str(marker), env=env)
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith("lifeguard run: environment variable LIFEGUARD_JOURNAL_DIR: ")
    assert not marker.exists()


# -- the heartbeat ----------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, "0", 1, "1", 1.5, 60, 3600])
def test_a_heartbeat_is_off_or_at_least_a_second(value: object) -> None:
    assert Options.from_kwargs({"heartbeat": value}, environ={}).heartbeat == float(value)  # type: ignore[arg-type]
    env = {"LIFEGUARD_HEARTBEAT": str(value)}
    assert Options.from_kwargs({}, environ=env).heartbeat == float(value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    # "1e-400" is 0 to float(): heartbeats silently off. The Arabic-Indic ten and "1_0" are
    # what float() takes besides decimal numbers.
    "value",
    [0.001, "0.001", 0.5, 0.999, -1, 3601, "nan", "soon", "1e-400", "\u0661\u0660", "1_0"],
)
def test_a_heartbeat_under_a_second_is_refused(value: object) -> None:
    """0.001 was accepted: one idle program sent 60 requests in 6 s to the shared server."""
    allowed = "must be 0 (off) or a number of seconds from 1 to 3600"
    with pytest.raises(ValueError) as error:
        Options.from_kwargs({"heartbeat": value}, environ={})
    assert str(error.value) == f"option 'heartbeat' {allowed}, not {value!r}"
    with pytest.raises(ValueError) as error:
        Options.from_kwargs({}, environ={"LIFEGUARD_HEARTBEAT": str(value)})
    assert str(error.value) == f"environment variable LIFEGUARD_HEARTBEAT {allowed}, not '{value}'"


# -- every LIFEGUARD_* variable the code reads --------------------------------------------------

# A malformed value of each: a variable the package reads and this table lacks fails the walk.
MALFORMED = {
    "LIFEGUARD_SIGNALS": "SIGNOPE",
    "LIFEGUARD_DEADLINE": "soon",
    "LIFEGUARD_MLFLOW": "maybe",
    "LIFEGUARD_END_ATTACHED": "maybe",
    "LIFEGUARD_WATCHDOG": "maybe",
    "LIFEGUARD_BLOCKED_GRACE": "-1",
    "LIFEGUARD_HEARTBEAT": "0.001",
    "LIFEGUARD_TRACKERS": "neptune",
    "LIFEGUARD_JOURNAL_DIR": "{file}",
    "LIFEGUARD_REPLAY_BOUND": "forever",
    "LIFEGUARD_TURNS_DIR": "{file}/turns",
    "LIFEGUARD_GUARDIAN_REST": "maybe",
    "LIFEGUARD_GUARDIAN": "7",
    "LIFEGUARD_AUTOINSTALL": "yes",
    "LIFEGUARD_DEMO_DIR": "relative/dir",
}


def variables_read_by_the_package() -> set[str]:
    """Every ``LIFEGUARD_*`` name in the package's source, and the options' own; but the
    names of the project's own tooling (its tests', its CI's), which the package only knows."""
    names = {f"LIFEGUARD_{name.upper()}" for name in Options.NAMES}
    for path in (REPO / "lifeguard").rglob("*.py"):
        names |= set(re.findall(r"\bLIFEGUARD_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    return {name for name in names if not name.startswith(TOOLING)}


def test_every_variable_is_known_documented_and_given_a_bad_value_here() -> None:
    names = variables_read_by_the_package()
    assert {"LIFEGUARD_REPLAY_BOUND", "LIFEGUARD_GUARDIAN_REST", "LIFEGUARD_SIGNALS"} <= names
    assert sorted(names - set(VARIABLES)) == [], "read by the package, never checked"
    assert sorted(names - set(MALFORMED)) == [], "no malformed value in MALFORMED"
    docs = (REPO / "docs" / "configuration.md").read_text()
    assert sorted(name for name in names if f"`{name}`" not in docs) == []


WALK = """
import json, os, sys, lifeguard
said = {}
for var, value in json.loads(sys.argv[1]).items():
    os.environ[var] = value
    try:
        lifeguard.install()
    except (TypeError, ValueError) as exc:
        said[var] = f"{type(exc).__name__}: {exc}"
    else:
        said[var] = "accepted"
        lifeguard.uninstall()
    del os.environ[var]
print(json.dumps(said))
"""


@pytest.mark.parametrize("kind", ["empty", "malformed"])
def test_install_refuses_every_variable_empty_or_malformed(tmp_path: Path, kind: str) -> None:
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    values = {
        name: "" if kind == "empty" else MALFORMED[name].replace("{file}", str(file))
        for name in sorted(variables_read_by_the_package())
    }
    env = {**_base_env(), "HOME": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", WALK, json.dumps(values)],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    said = json.loads(result.stdout)
    for var, line in said.items():
        assert line.startswith(f"ValueError: environment variable {var}"), (var, line)
        assert "\n" not in line
        if kind == "empty":
            assert "is empty; unset it for the default, or set it to " in line, line
    assert file.read_text() == "mine"


def test_an_unknown_variable_is_named_in_a_warning(tmp_path: Path) -> None:
    """``LIFEGUARD_WATCHDGO=1`` was silently ignored: no watchdog, and nothing said."""
    env = {
        **_base_env(),
        "HOME": str(tmp_path),
        "LIFEGUARD_WATCHDGO": "1",
        "LIFEGUARD_COLOUR": "blue",
        # Known names: lifeguard's own, the project's tooling.
        "LIFEGUARD_AUTOINSTALL": "0",
        "LIFEGUARD_TEST_ANYTHING": "1",
        "LIFEGUARD_SLURM_DIR": "/x",
    }
    result = python(
        "import lifeguard; lifeguard.install(); lifeguard.install(); print('installed')", env
    )
    assert result.returncode == 0 and result.stdout == "installed\n", result.stderr
    # No logging configured: Python shows the message alone, which says whose it is.
    assert result.stderr.splitlines() == [
        "lifeguard: unknown environment variable LIFEGUARD_COLOUR: ignored; lifeguard's "
        "variables are listed in its docs/configuration.md",
        "lifeguard: unknown environment variable LIFEGUARD_WATCHDGO (did you mean "
        "LIFEGUARD_WATCHDOG?): ignored; lifeguard's variables are listed in its "
        "docs/configuration.md",
    ]


# -- the command line -------------------------------------------------------------------------


@pytest.mark.parametrize("dry_run", [True, False])
def test_a_sweep_of_a_missing_sqlite_database_creates_nothing(
    tmp_path: Path, dry_run: bool
) -> None:
    """A mistyped path made the directory and an empty, migrated database, and exited 0."""
    db = tmp_path / "typo" / "mlflow.db"
    args = ["sweep", "--tracking-uri", f"sqlite:///{db}", "--journal-dir", str(tmp_path / "j")]
    result = lifeguard_cold(*args, *(["--dry-run"] if dry_run else []))
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"lifeguard sweep: --tracking-uri 'sqlite:///{db}': no such database file: {db}"
    ]
    assert result.stdout == ""
    assert tree(tmp_path) == []


def test_a_sweep_of_a_missing_relative_sqlite_path_or_file_store(tmp_path: Path) -> None:
    for uri, says in [
        ("sqlite:///typo.db", f"no such database file: {tmp_path / 'typo.db'}"),
        (f"file://{tmp_path}/mlruns", f"no such directory: {tmp_path}/mlruns"),
    ]:
        result = lifeguard_cold("sweep", "--dry-run", "--tracking-uri", uri, cwd=tmp_path)
        assert result.returncode == 2, result.stderr
        assert result.stderr.splitlines() == [f"lifeguard sweep: --tracking-uri {uri!r}: {says}"]
    assert tree(tmp_path) == []


def test_a_sweep_refuses_a_journal_directory_that_is_a_file_before_it_starts(
    store: Store, tmp_path: Path
) -> None:
    """It exited 0 or 1 after the sweep had run."""
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    uri = store.uri
    given = lifeguard_cold("sweep", "--tracking-uri", uri, "--journal-dir", str(file))
    assert given.returncode == 2, given.stderr
    assert given.stderr.splitlines() == [
        f"lifeguard sweep: --journal-dir {file} is not a directory; it must be a directory "
        "of the current user's that only they can use (0700), or a path where one can be made"
    ]
    env = {**_base_env(), "LIFEGUARD_JOURNAL_DIR": str(file / "journal")}
    from_env = lifeguard_cold("sweep", "--tracking-uri", uri, env=env)
    assert from_env.returncode == 2, from_env.stderr
    [line] = from_env.stderr.splitlines()
    assert line.startswith(f"lifeguard sweep: environment variable LIFEGUARD_JOURNAL_DIR: {file}")
    assert file.read_text() == "mine"


def test_sweep_json_is_a_json_document_whatever_happens(tmp_path: Path) -> None:
    """Against a dead server, ``--json`` printed nothing on stdout."""
    dead = f"http://127.0.0.1:{free_port()}"
    failed = lifeguard_cli(
        "sweep", "--json", "--tracking-uri", dead, "--timeout", "2",
        "--journal-dir", str(tmp_path / "journal"),
    )  # fmt: skip
    assert failed.returncode == 1, failed.stderr
    document = json.loads(failed.stdout)
    assert document["tracking_uri"] == dead and document["dry_run"] is False
    assert document["error"].startswith("lifeguard sweep: cannot ")
    assert document["error"] in failed.stderr

    usage = lifeguard_cold("sweep", "--json", "--tracking-uri", dead, "--workers", "0")
    assert usage.returncode == 2
    assert json.loads(usage.stdout) == {
        "error": "lifeguard sweep: error: argument --workers: must be 1 to 256: '0'"
    }
    missing = lifeguard_cold(
        "sweep", "--json", "--dry-run", "--tracking-uri", f"sqlite:///{tmp_path}/nope.db"
    )
    assert missing.returncode == 2
    assert "no such database file" in json.loads(missing.stdout)["error"]
    assert tree(tmp_path) == []


@pytest.mark.parametrize("argv", [["run"], ["run", "--"], ["run", "--deadline", "5"]])
def test_run_with_no_command_shows_runs_own_usage(argv: list[str]) -> None:
    result = lifeguard_cold(*argv)
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert lines[0].startswith("usage: lifeguard run [-h] [--deadline DEADLINE]")
    assert lines[-1] == "lifeguard run: error: no command given"


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (("--stale-after", "1e400"), "--stale-after: a duration must be at most 3650d: '1e400'"),
        (("--stale-after", "nan"), "--stale-after: not a duration: 'nan'"),
        (("--stale-after=-inf",), "--stale-after: a duration must be positive: '-inf'"),
        (("--experiment", " "), None),
    ],
)
def test_sweep_durations_and_names_say_what_is_wrong(
    args: tuple[str, ...], problem: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    if problem is None:  # not argparse's: the sweep's own start, before anything is imported
        assert cli.main(["sweep", "--tracking-uri", "http://127.0.0.1:9", *args]) == 2
        assert capsys.readouterr().err == (
            "lifeguard sweep: --experiment ' ': empty; give an experiment's name or id\n"
        )
        return
    with pytest.raises(SystemExit) as exit_:
        cli.main(["sweep", "--tracking-uri", "http://127.0.0.1:9", *args])
    assert exit_.value.code == 2
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .startswith(f"lifeguard sweep: error: argument {problem}")
    )


@pytest.mark.parametrize(
    ("argv", "env", "says"),
    [
        (["--jobs", "0"], {}, "lifeguard demo: error: argument --jobs: must be 1 to 32: '0'"),
        (["--jobs", "1000"], {}, "lifeguard demo: error: argument --jobs: must be 1 to 32"),
        ([], {"LIFEGUARD_HEARTBEAT": "0.001"}, "lifeguard demo: environment variable "),
    ],
)
def test_the_demo_refuses_bad_values_before_it_starts(
    tmp_path: Path, argv: list[str], env: dict[str, str], says: str
) -> None:
    result = lifeguard_cold("demo", *argv, env={**_base_env(), "TMPDIR": str(tmp_path), **env})
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1].startswith(says)
    assert tree(tmp_path) == []  # no demo directory made


# -- typed options ----------------------------------------------------------------------------

TYPED_RIGHT = """
import signal

import lifeguard

lifeguard.install(deadline=5, signals="usr2,term", watchdog=True, trackers=["wandb"])
lifeguard.install(signals=signal.SIGUSR2, heartbeat=0)
lifeguard.install(signals=())
lifeguard.install(trackers={"wandb"}, signals=range(10, 13))
lifeguard.register(print, ranks=[0, 1])
ranks: lifeguard.Ranks = "zero"
options: lifeguard.InstallOptions = {"deadline": 3.0, "mlflow": False}
lifeguard.install(**options)
handle: lifeguard.Handle = lifeguard.register(lambda outcome: None)
warning: lifeguard.PreemptionHandle = lifeguard.on_preemption(print, signals=12)
warning.remove()
reports: list[lifeguard.Report] = lifeguard.finish()
"""

TYPED_WRONG = {
    "lifeguard.install(deadlin=5)": 'Unexpected keyword argument "deadlin" for "install"',
    'lifeguard.install(watchdog="yes")': 'Argument "watchdog" to "install" has incompatible type',
    "lifeguard.on_preemption(print, signals=1.5)": (
        'Argument "signals" to "on_preemption" has incompatible type "float"'
    ),
    "lifeguard.on_preemption(print).unregister()": (
        '"PreemptionHandle" has no attribute "unregister"'
    ),
    "lifeguard.register(print).remove()": '"Handle" has no attribute "remove"',
    'lifeguard.register(print, ranks="every")': (
        'Argument "ranks" to "register" has incompatible type "Literal[\'every\']"'
    ),
}


def mypy(tmp_path: Path, name: str, source: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / name).write_text(source)
    (tmp_path / "mypy.ini").write_text("[mypy]\nstrict = True\n")
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", "mypy.ini",
         "--cache-dir", str(tmp_path / "cache"), name],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip


@pytest.mark.slow
def test_a_wrong_option_fails_under_mypy(tmp_path: Path) -> None:
    """``install(**options: object)`` checked nothing statically, and the handle types were
    not exported. The right program passes, so that the wrong one fails for its errors only."""
    right = mypy(tmp_path, "right.py", TYPED_RIGHT)
    assert right.returncode == 0, right.stdout + right.stderr
    wrong = mypy(tmp_path, "wrong.py", "import lifeguard\n\n" + "\n".join(TYPED_WRONG) + "\n")
    assert wrong.returncode == 1, wrong.stdout + wrong.stderr
    errors = [line for line in wrong.stdout.splitlines() if ": error: " in line]
    for number, (line, says) in enumerate(TYPED_WRONG.items(), start=3):
        assert any(e.startswith(f"wrong.py:{number}: error: {says}") for e in errors), (
            line,
            errors,
        )
    assert len(errors) == len(TYPED_WRONG), errors


def test_the_types_are_there_at_run_time_too() -> None:
    import lifeguard
    from lifeguard.finalizers import Handle, Report
    from lifeguard.preemption import PreemptionHandle

    assert lifeguard.Handle is Handle and lifeguard.Report is Report
    assert lifeguard.PreemptionHandle is PreemptionHandle
    assert set(lifeguard.InstallOptions.__annotations__) == set(Options.NAMES)
    for name in lifeguard.__all__:
        assert getattr(lifeguard, name) is not None


# -- smaller edges ----------------------------------------------------------------------------


def test_a_second_install_names_the_options_it_ignores_and_the_signals_by_name() -> None:
    result = python(
        """
        import lifeguard
        lifeguard.install(signals="TERM,HUP", deadline=5)
        lifeguard.install(signals="USR2", deadline=5)
        """
    )
    assert result.returncode == 0
    assert result.stderr.splitlines() == [
        "lifeguard.install() was already called with signals=(SIGTERM, SIGHUP); keeping that "
        "and ignoring signals=(SIGUSR2) (call lifeguard.uninstall() first to change options)"
    ]


def test_finish_leaves_lifeguard_installed_for_the_runs_after_it() -> None:
    """What the README says: installed from install() until uninstall() or the process's end;
    finish() re-arms it for the runs started after it."""
    result = python(
        """
        import lifeguard
        lifeguard.install()
        lifeguard.finish()
        print(lifeguard.is_installed())
        lifeguard.uninstall()
        print(lifeguard.is_installed())
        """
    )
    assert result.stdout.split() == ["True", "False"], result.stderr
    readme = (REPO / "README.md").read_text()
    assert "`True` from `install()` until `uninstall()`" in readme


# -- what a newcomer's second review found --------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        # "1 or 0" is what a variable may say; a program's 1 was refused in those words.
        ("mlflow", 1, "option 'mlflow' must be True or False, not 1"),
        ("watchdog", 0, "option 'watchdog' must be True or False, not 0"),
        # An int too long to show (int() refuses to make a string of 5,000 digits): the error
        # was about that, and named no option; one of 400 digits was shown whole.
        ("deadline", lambda: 10**5000,
         "option 'deadline' must be a number of seconds greater than 0 and at most 3600, "
         "not an int of about 5000 digits"),
        ("deadline", 10**400, "option 'deadline' must be a number of seconds greater than 0 "
         "and at most 3600, not 1000000000000000000000000000000000000000...0000000000"),
    ],
)  # fmt: skip
def test_a_bad_value_is_named_in_a_short_line(option: str, value: object, says: str) -> None:
    value = value() if callable(value) else value
    with pytest.raises(ValueError) as error:
        Options.from_kwargs({option: value}, environ={})
    assert str(error.value) == says


def test_trackers_take_any_sequence_or_set() -> None:
    for value in (collections.deque(["wandb"]), {"wandb"}, ("wandb",)):
        assert Options.from_kwargs({"trackers": value}, environ={}).trackers == ("wandb",)
    with pytest.raises(TypeError, match="must be tracker names, not bytes"):
        Options.from_kwargs({"trackers": b"wandb"}, environ={})


def test_ranks_are_never_none_of_them() -> None:
    """``ranks=[]`` was accepted: a finalizer that never runs, on any rank."""
    from lifeguard.finalizers import Registry

    registry = Registry()
    for empty in ([], (), set(), frozenset(), range(0)):
        with pytest.raises(ValueError, match="ranks is empty: the finalizer would never run"):
            registry.add(print, "f", empty)
    for bad in ([0, -1], [True], b"\x00", "every"):
        with pytest.raises(ValueError, match="ranks must be"):
            registry.add(print, "f", bad)
    assert registry.add(print, "f", collections.deque([0, 2])).ranks == {0, 2}
    assert registry.add(print, "f", range(2)).ranks == {0, 1}


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("relative/journal", "is not an absolute path; give one that starts with /"),
        ("~/journal", "is not an absolute path (~ is not expanded here)"),
        (" /tmp/journal", "has white space at an end"),
        ("/tmp/journal\n", "has white space at an end"),
    ],
)
def test_a_journal_directory_must_be_an_absolute_path(value: str, says: str) -> None:
    """A relative one was taken from wherever the process was at its first write: a program
    that chdir'd journaled elsewhere than install() had checked, or nowhere (from /proc)."""
    for var in ("LIFEGUARD_JOURNAL_DIR", "LIFEGUARD_TURNS_DIR"):
        with pytest.raises(ValueError) as error:
            Options.from_kwargs({}, environ={var: value})
        assert str(error.value).startswith(f"environment variable {var}: {value!r} {says}")


def test_a_sweep_refuses_a_relative_journal_directory(tmp_path: Path) -> None:
    db = tmp_path / "mlflow.db"
    db.touch()
    result = lifeguard_cold(
        "sweep", "--dry-run", "--tracking-uri", f"sqlite:///{db}", "--journal-dir", "j",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "lifeguard sweep: --journal-dir 'j' is not an absolute path; give one that starts with /"
    ]
    assert tree(tmp_path) == ["mlflow.db"]


def _other_programs_database(path: Path) -> None:
    import sqlite3

    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE users (name TEXT)")
        db.execute("INSERT INTO users VALUES ('ada')")


@pytest.mark.parametrize("kind", ["another program's database", "an empty file", "not sqlite"])
@pytest.mark.parametrize("dry_run", [True, False])
def test_a_sweep_never_makes_an_mlflow_store_of_a_file(
    tmp_path: Path, kind: str, dry_run: bool
) -> None:
    """MLflow creates and migrates its tables in whatever database it opens: a dry run made
    another program's database (or an empty file) an MLflow store of 65 tables, and said
    "nothing written"."""
    db = tmp_path / "app.db"
    if kind == "another program's database":
        _other_programs_database(db)
        says = "a database without MLflow's tables, not an MLflow store"
    elif kind == "an empty file":
        db.touch()
        says = "an empty database, not an MLflow store"
    else:
        db.write_bytes(b"this is a text file, not a database\n" * 100)
        says = "cannot be read as a database (file is not a database)"
    before = db.read_bytes()
    args = ["sweep", "--tracking-uri", f"sqlite:///{db}", "--journal-dir", str(tmp_path / "j")]
    result = lifeguard_cold(*args, *(["--dry-run"] if dry_run else []))
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"lifeguard sweep: --tracking-uri 'sqlite:///{db}': {says}: {db}"
    ]
    assert db.read_bytes() == before
    assert tree(tmp_path) == ["app.db"]


def test_a_sweep_of_a_directory_says_so(tmp_path: Path) -> None:
    result = lifeguard_cold("sweep", "--dry-run", "--tracking-uri", f"sqlite:///{tmp_path}")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"lifeguard sweep: --tracking-uri 'sqlite:///{tmp_path}': a directory, not a database "
        f"file: {tmp_path}"
    ]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        # Each sweep is a round of requests to the shared server: 1e-300 sent ~140 a second.
        (("--every", "0.5s"), "argument --every: must be at least 1s: '0.5s'"),
        (("--every", "1e-300"), "argument --every: must be at least 1s: '1e-300'"),
        # No abbreviations: `--js` stood for --json, `--tracking` for --tracking-uri.
        (("--js",), "unrecognized arguments: --js"),
        # Digits of other scripts, underscores, and a number that is 0 to a float.
        (("--stale-after", "1_0"), "not a duration: '1_0' (use e.g. 90s, 15m, 2h, 1d)"),
        (("--stale-after", "1e-400"),
         "argument --stale-after: a duration too small to tell from 0: '1e-400'"),
    ],
)  # fmt: skip
def test_sweep_refuses_these_at_its_start(tmp_path: Path, args: tuple[str, ...], says: str) -> None:
    db = tmp_path / "mlflow.db"
    db.touch()
    result = lifeguard_cold("sweep", "--dry-run", "--tracking-uri", f"sqlite:///{db}", *args)
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1].endswith(says), result.stderr
    assert tree(tmp_path) == ["mlflow.db"]


def test_sweep_checks_the_environment_as_install_does(tmp_path: Path) -> None:
    """A bad LIFEGUARD_* value or a misspelt name was ignored by the sweep, which reads the
    journal directory and starts replayers that read the others."""
    db = tmp_path / "mlflow.db"
    db.touch()
    args = ("sweep", "--dry-run", "--tracking-uri", f"sqlite:///{db}")
    bad = lifeguard_cold(*args, env=dict(_base_env(), LIFEGUARD_REPLAY_BOUND="abc"))
    assert bad.returncode == 2
    assert bad.stderr.splitlines() == [
        "lifeguard sweep: environment variable LIFEGUARD_REPLAY_BOUND must be a number of "
        "seconds from 0 (off) to 3600, not 'abc'"
    ]
    journal = tmp_path / "j"
    env = dict(_base_env(), LIFEGUARD_JOURNAL_DIRS=str(journal))
    misspelt = lifeguard_cold(*args, "--journal-dir", str(journal), env=env)
    assert (
        "lifeguard: unknown environment variable LIFEGUARD_JOURNAL_DIRS (did you mean "
        "LIFEGUARD_JOURNAL_DIR?)" in misspelt.stderr
    ), misspelt.stderr


def test_run_refuses_an_empty_command() -> None:
    result = lifeguard_cold("run", "--", "")
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == "lifeguard run: error: the command is empty: ''"


@pytest.mark.parametrize(("given", "expected"), [((), 20.0), (("--deadline", "5"), 5.0)])
def test_run_gives_its_own_clean_up_the_programs_deadline(
    monkeypatch: pytest.MonkeyPatch, given: tuple[str, ...], expected: float
) -> None:
    """``LIFEGUARD_DEADLINE=20 lifeguard run``: the program had 20 s, the supervisor's clean-up
    after it 10, as its help said whatever the variable said."""
    from lifeguard.guardian import supervisor

    seen: list[float | None] = []
    monkeypatch.setattr(supervisor, "supervise", lambda cmd, deadline: seen.append(deadline) or 0)
    monkeypatch.setenv("LIFEGUARD_DEADLINE", "20")
    assert cli.main(["run", *given, "--", "true"]) == 0
    assert seen == [expected]


def test_none_is_no_tracker_only_alone() -> None:
    """``trackers="none,wandb"`` quietly became wandb alone."""
    assert Options.from_kwargs({"trackers": "none"}, environ={}).trackers == ()
    for value in ("none,wandb", ["wandb", "None"]):
        with pytest.raises(ValueError, match="none \\(no tracker\\) given together with others"):
            Options.from_kwargs({"trackers": value}, environ={})


def test_a_variable_in_small_letters_is_told_the_one_in_capitals(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("WARNING", logger="lifeguard"):
        assert _options.warn_unknown_variables({"LIFEGUARD_deadline": "5"}) == [
            "LIFEGUARD_deadline"
        ]
    assert "(did you mean LIFEGUARD_DEADLINE?)" in caplog.text


@pytest.mark.parametrize("mode", [0o755, 0o555, 0o2755, 0o750])
def test_an_existing_directory_is_never_made_private_behind_its_owners_back(
    tmp_path: Path, mode: int
) -> None:
    """helper-15: an existing directory named as the journal's (a shared results directory, a
    home, /proc as root) was chmod'ed 0700 at the first run ending, setgid bit dropped, without a
    word. It is refused where it is given now, and the journal never changes its mode."""
    from lifeguard.journal import Journal, JournalError

    shared = tmp_path / "results"
    shared.mkdir()
    shared.chmod(mode)
    says = f"{shared} is mode {mode:04o}: lifeguard keeps statuses private (0700)"
    try:
        with pytest.raises(ValueError) as error:
            Options.from_kwargs({}, environ={"LIFEGUARD_JOURNAL_DIR": str(shared)})
        assert says in str(error.value)
        with pytest.raises(JournalError, match=re.escape(says)):
            Journal(str(shared)).ensure()
        result = lifeguard_cold(
            "sweep", "--dry-run", "--tracking-uri", "sqlite:////nonexistent/mlflow.db",
            "--journal-dir", str(shared),
        )  # fmt: skip
        assert result.returncode == 2
        assert says in result.stderr
        assert shared.stat().st_mode & 0o7777 == mode
    finally:
        shared.chmod(0o755)


def test_a_directory_lifeguard_names_itself_is_still_tightened(tmp_path: Path) -> None:
    """``~/.cache/lifeguard/journal`` made 0755 by an older lifeguard, or under a loose umask."""
    from lifeguard.journal import Journal

    own = tmp_path / "cache" / "lifeguard" / "journal"
    own.mkdir(parents=True)
    own.chmod(0o755)
    Journal(str(own)).ensure()
    assert own.stat().st_mode & 0o7777 == 0o700
