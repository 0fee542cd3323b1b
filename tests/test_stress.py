"""A signal at any instant (issue 11): a small, fixed-seed run of scripts/stress.py.

36 randomized trials (12 in a contributor's `tox`: conftest.trials): 28 (8) on sqlite stores
(watchdog off and on) and 8 (4) on a real `mlflow server`,
each a real child looping over an MLflow workload, signalled (SIGTERM, SIGINT, SIGHUP, or SIGTERM
twice) at a random instant. Every trial must be right: death by the signal, a prompt exit, every
open run KILLED with an end time between the signal and the exit (from the journal, after a
replay, for a second SIGTERM), and stderr as without lifeguard. The harness logic lives in the
script; this only picks the trials and asserts.
"""

from __future__ import annotations

import importlib.util
import io
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import trials as n_trials
from tests.servers import MlflowServer

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "stress.py"
SEED = 11


def load_stress() -> ModuleType:
    spec = importlib.util.spec_from_file_location("lifeguard_stress", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def server(mlflow_server: MlflowServer) -> MlflowServer:
    """The session's server (conftest.mlflow_server): this module's tests read only their runs."""
    return mlflow_server


# Each trial costs ~2-4 s of CPU (a child importing mlflow, a sweep replay for a quarter of them),
# and a trial that hits a finalization deadline adds 10 s of wall time. 2 jobs on a loaded
# 2-core machine: this bounds the worst case, it is not the expected time (~2-4 minutes).
@pytest.mark.long
@pytest.mark.timeout(1200)
def test_a_signal_at_any_instant(tmp_path: Path, server: MlflowServer) -> None:
    stress = load_stress()
    trials = stress.plan(n_trials(28, 8), SEED, ("sqlite",), (False, True)) + stress.plan(
        n_trials(8, 4), SEED + 1, ("server",), (False, True)
    )
    results = stress.run_trials(trials, jobs=2, root=tmp_path, server_uri=server.uri)
    out = io.StringIO()
    wrong = stress.report(results, out)
    print(out.getvalue())
    assert len(results) == len(trials)
    assert wrong == 0, f"{wrong} of {len(trials)} trials wrong:\n{out.getvalue()}"
    # Every exit the harness timed has the moment lifeguard's finalizers were done, within it;
    # but a second SIGTERM exits at once, finalizers done or not.
    timed = [r for r in results if r.exit_seconds is not None]
    assert timed
    for r in timed:
        if r.trial.signal != "SIGTERMx2":
            assert r.finalized_seconds is not None, r.trial.spec
        if r.finalized_seconds is not None:
            assert r.finalized_seconds <= r.exit_seconds, r.trial.spec


# What CPython printed in two trials of a 1,000-trial run (paths shortened): the endings the
# harness must judge as the program's own, not as lifeguard's.
DROPPED_IN_WEAKREF_CALLBACK = """\
Exception ignored in: <function _get_module_lock.<locals>.cb at 0x7ffbe44de660>
Traceback (most recent call last):
  File "<frozen importlib._bootstrap>", line 198, in cb
  File "lifeguard/signals.py", line 417, in _chain
    previous(signum, frame)
KeyboardInterrupt: 
"""  # noqa: W291 - CPython prints that trailing space
RAISED_IN_FDOPEN_CLEANUP = """\
Traceback (most recent call last):
  File "mlflow/store/artifact/local_artifact_repo.py", line 139, in _write_to_destination_path
    temp_file = os.fdopen(temp_file_descriptor, "wb")
  File "<frozen os>", line 1031, in fdopen
  File "lifeguard/signals.py", line 417, in _chain
    previous(signum, frame)
KeyboardInterrupt

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "tests/children/stress_program.py", line 205, in <module>
    main()
  File "mlflow/store/artifact/local_artifact_repo.py", line 147, in _write_to_destination_path
    os.close(temp_file_descriptor)
OSError: [Errno 9] Bad file descriptor
"""
SQLALCHEMY_CLOSING_CURSOR = """\
Error closing cursor
Traceback (most recent call last):
  File "sqlalchemy/engine/cursor.py", line 1315, in fetchall
    rows = dbapi_cursor.fetchall()
  File "lifeguard/signals.py", line 473, in _chain
    previous(signum, frame)
KeyboardInterrupt

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "sqlalchemy/engine/base.py", line 2210, in _safe_close_cursor
    cursor.close()
sqlite3.ProgrammingError: Cannot operate on a closed database.
"""
PLAIN_CTRL_C = """\
Traceback (most recent call last):
  File "tests/children/stress_program.py", line 205, in <module>
    main()
KeyboardInterrupt
"""


def test_the_harness_tells_the_programs_own_endings_apart() -> None:
    stress = load_stress()
    assert stress.dropped_keyboard_interrupt(DROPPED_IN_WEAKREF_CALLBACK)
    assert not stress.dropped_keyboard_interrupt(PLAIN_CTRL_C)
    assert not stress.dropped_keyboard_interrupt(RAISED_IN_FDOPEN_CLEANUP)
    assert stress.raised_in_cleanup(RAISED_IN_FDOPEN_CLEANUP)
    assert not stress.raised_in_cleanup(PLAIN_CTRL_C)
    assert not stress.raised_in_cleanup(DROPPED_IN_WEAKREF_CALLBACK)
    # An exception raised in lifeguard's code while Ctrl-C unwinds is not the program's.
    ours = f'  File "{stress.REPO / "lifeguard" / "signals.py"}", line 1, in handler\n'
    in_lifeguard = RAISED_IN_FDOPEN_CLEANUP.replace("OSError:", ours + "OSError:")
    assert not stress.raised_in_cleanup(in_lifeguard)
    # A KeyboardInterrupt dropped in a callback of lifeguard's own is not CPython's doing for
    # the program; lifeguard's signal handler in the report is (it raised it, as Python's).
    finalizer = stress.REPO / "lifeguard" / "backends" / "mlflow" / "held.py"
    callback = f'  File "{finalizer}", line 1, in release\n'
    ours_dropped = DROPPED_IN_WEAKREF_CALLBACK.replace(
        "Traceback (most recent call last):\n", "Traceback (most recent call last):\n" + callback
    )
    assert not stress.dropped_keyboard_interrupt(ours_dropped)
    handler = stress.REPO / "lifeguard" / "signals.py"
    with_handler = DROPPED_IN_WEAKREF_CALLBACK.replace(
        'File "lifeguard/signals.py"', f'File "{handler}"'
    )
    assert stress.dropped_keyboard_interrupt(with_handler)
    assert stress.without_dropped_reports(with_handler).strip() == ""
    # SQLAlchemy's own log line and traceback for the cursor it could not close, then the
    # program's Ctrl-C traceback: as without lifeguard.
    assert stress.check_stderr(SQLALCHEMY_CLOSING_CURSOR + PLAIN_CTRL_C, "SIGINT") == []
    assert stress.check_stderr(SQLALCHEMY_CLOSING_CURSOR + PLAIN_CTRL_C, "SIGTERM") != []
    assert (
        stress.check_stderr(
            SQLALCHEMY_CLOSING_CURSOR.replace("Error closing cursor", "Other") + PLAIN_CTRL_C,
            "SIGINT",
        )
        != []
    )
