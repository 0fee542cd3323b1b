"""Habits of real programs that lifeguard must keep working: a caught exit followed by the
script's own ``raise SystemExit(main())``, faulthandler's stack dump on SIGTERM, a PID-1
entrypoint that reaps its background jobs, a crash message that quotes a credential. Each test
runs a real child process on a real sqlite MLflow store, without and with lifeguard where the
comparison matters; each was a defect found by attacking issues 23-25's changes."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lifeguard.demo import run_child
from tests.conftest import CHILD_TIMEOUT, Store, child_env, lifeguard_cli
from tests.namespaces import NS, require_unshare

pytestmark = pytest.mark.slow

INSTALL = "import lifeguard; lifeguard.install()"


def write(path: Path, code: str, install: str | None) -> Path:
    path.write_text(textwrap.dedent(code).replace("{install}", install or ""))
    return path


def lifeguard_tags(store: Store, run_id: str) -> dict[str, str]:
    tags = store.run(run_id).data.tags
    return {k: v for k, v in tags.items() if k.startswith("lifeguard.") and ".owner." not in k}


# -- 1. a caught exit, then an exit the hooks cannot see ------------------------------------------

CAUGHT_THEN_RAISED = """
import json, sys
{install}
import mlflow
run = mlflow.start_run()
print("LIFEGUARD-READY " + json.dumps({"run_id": run.info.run_id}), flush=True)
try:
    sys.exit(2)  # argparse's error exit, say, caught: the program falls back to defaults
except SystemExit:
    print("carried on", flush=True)

def main():
    return 0

raise SystemExit(main())  # the usual last line of a script: exits 0
"""


def test_a_caught_exit_then_raise_systemexit_0_is_finished_not_failed(
    store: Store, tmp_path: Path
) -> None:
    """A script catches a ``sys.exit(2)`` at its top level (argparse's error exit, caught to
    fall back to defaults) and ends, as scripts do, with ``raise SystemExit(main())``: exit 0.

    FINISHED and exit 0, as without lifeguard: the caught exit did not leave the top level (the
    module's frame ran on from where it stood at the call), so it is not the program's ending.
    It was taken for it (FAILED, ``exit code 2``) while the check was "no frame returned": the
    top-level frame ended at a raise no hook sees."""
    results = {}
    for on in (False, True):
        program = write(tmp_path / f"caught-{on}.py", CAUGHT_THEN_RAISED, INSTALL if on else None)
        results[on] = run_child(
            [sys.executable, str(program)], env=child_env(store), timeout=CHILD_TIMEOUT
        )
    off, on_ = results[False], results[True]
    assert off.returncode == on_.returncode == 0
    assert off.stdout.splitlines()[1:] == on_.stdout.splitlines()[1:] == ["carried on"]
    assert store.status(str(off.ready["run_id"])) == "FINISHED"
    run_id = str(on_.ready["run_id"])
    assert store.status(run_id) == "FINISHED", lifeguard_tags(store, run_id)


# -- 2. faulthandler's dump on SIGTERM -----------------------------------------------------------

FAULTHANDLER_SIGTERM = """
import faulthandler, json, signal, sys, time
{install}
# "Dump every stack when the job is killed": registered after install(), with chain=True, as
# docs/limitations.md says (one registered before is replaced: faulthandler sets its handler
# below Python's signal module, where install() cannot see it).
faulthandler.register(signal.SIGTERM, chain=True)
import mlflow
run = mlflow.start_run()
print("LIFEGUARD-READY " + json.dumps({"run_id": run.info.run_id}), flush=True)
time.sleep(60)
"""


def test_faulthandler_registered_for_sigterm_after_install_dumps_the_stacks_and_chains(
    store: Store, tmp_path: Path
) -> None:
    """``faulthandler.register(SIGTERM, chain=True)`` after ``install()`` (research code does
    this to see where a job was when Slurm's time limit killed it), then SIGTERM: the stacks
    are dumped to stderr as without lifeguard, the process dies of SIGTERM, and the run is
    KILLED: faulthandler's handler calls lifeguard's."""
    results = {}
    for on in (False, True):
        program = write(tmp_path / f"fh-{on}.py", FAULTHANDLER_SIGTERM, INSTALL if on else None)
        results[on] = run_child(
            [sys.executable, str(program)],
            env=child_env(store),
            send=(signal.SIGTERM,),
            timeout=CHILD_TIMEOUT,
        )
    off, on_ = results[False], results[True]
    assert off.returncode == on_.returncode == -signal.SIGTERM
    assert "most recent call first" in off.stderr, off.stderr
    assert "most recent call first" in on_.stderr, f"no stack dump with lifeguard: {on_.stderr!r}"
    run_id = str(on_.ready["run_id"])
    assert store.status(run_id) == "KILLED", lifeguard_tags(store, run_id)
    assert lifeguard_tags(store, run_id)["lifeguard.signal"] == "SIGTERM"


# -- 3. PID 1 with watchdog=True: os.wait() still sees the orphans -------------------------------

PID1_WAITS_FOR_ORPHANS = """
import os, subprocess, sys
sys.path.insert(0, {repo!r})
{install}
# An entrypoint that starts a job in the background through a shell (a data syncer, a
# "worker &" in a launch script) and, as PID 1, waits for every process it adopted.
subprocess.run(["sh", "-c", "sleep 0.5 & exit 0"], check=True)
reaped = 0
while True:
    try:
        os.wait()
    except ChildProcessError:
        break
    reaped += 1
print("REAPED", reaped, flush=True)
"""


def test_pid1_with_watchdog_still_reaps_the_orphans_it_adopted(tmp_path: Path) -> None:
    """A container entrypoint, ``python entry.py`` as PID 1, starts a background job through a
    shell and waits with ``os.wait()`` until nothing is left (what an init-like entrypoint
    does: the orphan is PID 1's child).

    Without lifeguard ``os.wait()`` returns the orphan once it exits (REAPED 1), so the program
    waits for the background job. With ``install(watchdog=True)`` the program forks away from
    PID 1 (guardian/init.py) and is made a child subreaper: its descendants' orphans are still
    its own, and ``os.wait()`` reaps them as it did as PID 1 (it saw REAPED 0 before, and the
    kernel killed the job with the namespace)."""
    unshare = require_unshare()
    repo = str(Path(__file__).parent.parent)
    out = {}
    for on in (False, True):
        install = "import lifeguard; lifeguard.install(watchdog=True)" if on else ""
        program = tmp_path / f"entry-{on}.py"
        program.write_text(
            textwrap.dedent(PID1_WAITS_FOR_ORPHANS)
            .replace("{repo!r}", repr(repo))
            .replace("{install}", install)
        )
        done = subprocess.run(
            [unshare, *NS, sys.executable, str(program)],
            env={**os.environ, "LIFEGUARD_JOURNAL_DIR": str(tmp_path / "journal")},
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT,
        )
        assert done.returncode == 0, done.stderr
        out[on] = done.stdout
    assert out[False] == "REAPED 1\n"
    assert out[True] == out[False]


# -- 4. credentials copied into the run's tags and the journal -------------------------------------

SECRET_TOKEN = "tok-9f8e7d6c5b4a3210"
SECRET_PASSWORD = "hunter2-pass"

CRASH_WITH_SECRET = f"""
import json, os, sys
{{install}}
import mlflow
run = mlflow.start_run()
print("LIFEGUARD-READY " + json.dumps({{"run_id": run.info.run_id}}), flush=True)
sys.stdin.readline()
uri = "https://alice:{SECRET_PASSWORD}@mlflow.internal"
raise RuntimeError(f"login to {{uri}} refused with token " + os.environ["MLFLOW_TRACKING_TOKEN"])
"""


def test_a_crash_message_with_credentials_is_redacted_in_tags_and_journal(
    store: Store, tmp_path: Path
) -> None:
    """A program crashes with an error whose message holds a URI with a password and the value
    of ``MLFLOW_TRACKING_TOKEN`` (a failed login that names what it tried). The traceback on the
    program's own stderr is the program's business, as without lifeguard.

    What lifeguard stores, the run's ``lifeguard.reason`` tag (on the tracking server, for
    everyone who can read the experiment) and the journal entry on disk, has them masked
    (lifeguard/redact.py): "no credential is ever written". They were copied verbatim. Here the
    store is held locked by another writer so that
    the status is journaled (``LIFEGUARD_REPLAY_BOUND=0``: no replayer), then the lock is
    released and the test's own replay writes it, as ``lifeguard sweep`` would."""
    program = write(tmp_path / "secret.py", CRASH_WITH_SECRET, INSTALL)
    env = child_env(
        store,
        MLFLOW_TRACKING_TOKEN=SECRET_TOKEN,
        LIFEGUARD_DEADLINE="2",
        LIFEGUARD_REPLAY_BOUND="0",
    )
    holder: dict[str, sqlite3.Connection] = {}

    def lock_the_store(ready: dict[str, object]) -> None:
        conn = sqlite3.connect(store.path, timeout=0, isolation_level=None)
        conn.execute("BEGIN EXCLUSIVE")  # another writer: lifeguard's write fails in time
        holder["conn"] = conn

    try:
        result = run_child(
            [sys.executable, str(program)],
            env=env,
            after_ready=lock_the_store,
            timeout=CHILD_TIMEOUT,
        )
    finally:
        if "conn" in holder:
            holder["conn"].execute("ROLLBACK")
            holder["conn"].close()
    assert result.returncode == 1
    run_id = str(result.ready["run_id"])
    entry = Path(env["LIFEGUARD_JOURNAL_DIR"]) / f"{run_id}.json"
    assert entry.exists(), result.stderr
    text = entry.read_text()
    # Now land it, as the sweep would, and look at what the server got.
    done = lifeguard_cli(
        "sweep", "--tracking-uri", store.uri,
        env=child_env(store, MLFLOW_TRACKING_TOKEN=SECRET_TOKEN),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert store.status(run_id) == "FAILED"
    reason = lifeguard_tags(store, run_id)["lifeguard.reason"]
    for secret in (SECRET_TOKEN, SECRET_PASSWORD):
        assert secret not in text, f"journal entry on disk holds a credential: {text}"
        assert secret not in reason, f"run tag on the tracking server holds it: {reason!r}"
    json.loads(text)  # (the entry itself is well formed)
