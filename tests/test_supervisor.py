"""`lifeguard run -- CMD` and `python -m lifeguard script.py`: the exact exit status, always."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lifeguard import demo
from tests.conftest import Scenario, Store, child_env
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
    """In-process, `raise SystemExit(4)` is invisible on 3.11; the supervisor's waitpid is not."""
    result = scenario.run("--path", "return", "--bare-exit", str(code), launcher=SCRIPT)
    assert result.returncode == code
    [run_id] = result.ready["run_ids"]
    run = store.run(run_id)
    assert run.info.status == status
    assert run.data.tags["lifeguard.exit_code"] == str(code)
    assert run.data.tags["lifeguard.ended_by"] == "supervisor"


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
    # stdin stays open: the program must be ended by the forwarded signal, not by EOF.
    result = scenario.run(
        "--path", "SIGTERM", send=(sig,), launcher=RUN, close_stdin_after_signals=False
    )
    assert result.returncode == -sig
    [run_id] = result.ready["run_ids"]
    run = store.run(run_id)
    assert run.info.status == "KILLED"
    assert run.data.tags["lifeguard.signal"] == signal.Signals(sig).name
    assert run.data.tags["lifeguard.ended_by"] == ended_by


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
