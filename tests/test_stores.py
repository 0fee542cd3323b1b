"""Every run ends in the store it was started in (issue 13, items 7 and 8).

A relative sqlite URI means another file once the program changes directory, or from the
watchdog's own cwd; a program may switch its tracking URI after starting a run. Real children,
real sqlite stores, real watchdogs; each test fails on code that used the current (or the
watchdog's single) URI for every run.
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
import textwrap
from pathlib import Path

import pytest

from lifeguard.demo import ChildResult, run_child
from tests.conftest import CHILD_TIMEOUT, Store, child_env, lifeguard_cli, wait_gone

pytestmark = pytest.mark.slow


def store_at(template_db: Path, path: Path) -> Store:
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(template_db, path)
    return Store(path)


def run(
    code: str, env: dict[str, str], *, send: tuple[int, ...], install: dict[str, object]
) -> ChildResult:
    env = {**env, "TEST_INSTALL": json.dumps(install)}
    program = (
        "import json, os, signal, sys, threading\n"
        # Where the program (and the watchdog it starts) begins: a stray store would show here.
        "os.chdir(os.environ['TEST_START'])\n"
        "import lifeguard\n"
        "lifeguard.install(**json.loads(os.environ['TEST_INSTALL']))\n"
        "import mlflow\n"
        "from lifeguard import demo\n" + textwrap.dedent(code)
    )
    return run_child([sys.executable, "-c", program], env=env, send=send, timeout=CHILD_TIMEOUT)


RELATIVE_THEN_CHDIR = """
os.chdir(sys.argv[1] if len(sys.argv) > 1 else os.environ["TEST_FIRST"])
mlflow.set_tracking_uri("sqlite:///mlflow.db")
run = mlflow.start_run()
os.chdir(os.environ["TEST_SECOND"])
demo.announce(run_ids=[run.info.run_id], watchdog=lifeguard.watchdog_pid())
threading.Event().wait()
"""


@pytest.mark.parametrize(
    ("sig", "watchdog"),
    [(signal.SIGTERM, False), (signal.SIGKILL, True)],
    ids=["sigterm-in-process", "sigkill-watchdog"],
)
def test_a_relative_sqlite_uri_is_the_store_of_the_directory_the_run_started_in(
    tmp_path: Path, template_db: Path, store: Store, sig: int, watchdog: bool
) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    real = store_at(template_db, first / "mlflow.db")
    second.mkdir()
    (tmp_path / "start").mkdir()
    env = child_env(
        store, TEST_FIRST=str(first), TEST_SECOND=str(second), TEST_START=str(tmp_path / "start")
    )
    result = run(RELATIVE_THEN_CHDIR, env, send=(sig,), install={"watchdog": watchdog})
    assert result.returncode == -sig, result.stderr
    [run_id] = result.ready["run_ids"]  # type: ignore[misc]
    if watchdog:
        wait_gone(int(result.ready["watchdog"]))  # type: ignore[call-overload]
    assert real.status(run_id) == "KILLED", result.stderr
    # No stray empty store where the program, or the watchdog, happened to be.
    assert not (second / "mlflow.db").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".db") == ["mlflow.db"]
    assert list((tmp_path / "start").iterdir()) == []


TWO_STORES = """
first = mlflow.start_run()
mlflow.set_tracking_uri(os.environ["TEST_SECOND_URI"])
# A second run, on the second store, in a thread of its own (its own active-run stack).
second = []
worker = threading.Thread(target=lambda: second.append(mlflow.start_run()))
worker.start(); worker.join()
demo.announce(
    run_ids=[first.info.run_id, second[0].info.run_id], watchdog=lifeguard.watchdog_pid()
)
threading.Event().wait()
"""


@pytest.mark.parametrize(
    ("sig", "watchdog"),
    [(signal.SIGTERM, False), (signal.SIGKILL, True)],
    ids=["sigterm-in-process", "sigkill-watchdog"],
)
def test_each_run_ends_in_its_own_store_after_the_uri_changed(
    tmp_path: Path, template_db: Path, store: Store, sig: int, watchdog: bool
) -> None:
    other = store_at(template_db, tmp_path / "other" / "mlflow.db")
    env = child_env(store, TEST_SECOND_URI=other.uri, TEST_START=str(tmp_path))
    result = run(TWO_STORES, env, send=(sig,), install={"watchdog": watchdog})
    assert result.returncode == -sig, result.stderr
    first, second = result.ready["run_ids"]  # type: ignore[misc]
    if watchdog:
        wait_gone(int(result.ready["watchdog"]))  # type: ignore[call-overload]
    assert store.status(first) == "KILLED", result.stderr
    assert other.status(second) == "KILLED", result.stderr
    # Nothing left in the journal: both statuses were confirmed in their own stores.
    journal = store.path.parent / "journal"
    assert not journal.exists() or list(journal.glob("*.json")) == []


def test_the_journal_names_each_run_s_own_store(
    tmp_path: Path, template_db: Path, store: Store
) -> None:
    """A status not yet written is journaled with the absolute URI of the run's own store,
    so that the replay writes it there from any directory. A finalizer of the program's own
    blocks, and a second SIGTERM ends the process before the MLflow finalizer ran."""
    first, second = tmp_path / "first", tmp_path / "second"
    real = store_at(template_db, first / "mlflow.db")
    second.mkdir()
    (tmp_path / "start").mkdir()
    env = child_env(
        store, TEST_FIRST=str(first), TEST_SECOND=str(second), TEST_START=str(tmp_path / "start")
    )
    code = RELATIVE_THEN_CHDIR.replace(
        "demo.announce(",
        "def block(outcome):\n"
        # Past the repeat window: a second SIGTERM within it is the same stop.
        "    import time; time.sleep(1.0)\n"
        "    os.write(1, b'FINALIZING\\n')\n"
        "    threading.Event().wait()\n"
        "lifeguard.register(block)\n"
        "demo.announce(",
    )
    env["TEST_INSTALL"] = json.dumps({"deadline": 600.0})
    # No last-gasp replayer: the entry is replayed below, by a sweep in another directory.
    env["LIFEGUARD_REPLAY_BOUND"] = "0"
    program = (
        "import json, os, signal, sys, threading\n"
        # Where the program (and the watchdog it starts) begins: a stray store would show here.
        "os.chdir(os.environ['TEST_START'])\n"
        "import lifeguard\n"
        "lifeguard.install(**json.loads(os.environ['TEST_INSTALL']))\n"
        "import mlflow\n"
        "from lifeguard import demo\n" + textwrap.dedent(code)
    )
    result = run_child(
        [sys.executable, "-c", program],
        env=env,
        send=(signal.SIGTERM,),
        on_line={"FINALIZING": signal.SIGTERM},
        timeout=CHILD_TIMEOUT,
    )
    assert result.returncode == -signal.SIGTERM, result.stderr
    [run_id] = result.ready["run_ids"]  # type: ignore[misc]
    assert real.status(run_id) == "RUNNING"
    [entry] = (store.path.parent / "journal").glob("*.json")
    assert json.loads(entry.read_text())["tracking_uri"] == real.uri
    sweep = lifeguard_cli("sweep", "--tracking-uri", real.uri, env=child_env(store), cwd=second)
    assert sweep.returncode == 0, sweep.stdout + sweep.stderr
    assert real.status(run_id) == "KILLED"
    assert not (second / "mlflow.db").exists()


ENDS_MANY_RUNS = """
count = int(os.environ["TEST_RUNS"])
outer = mlflow.start_run()  # open all along: its store must still be known at the end
for _ in range(count):
    with mlflow.start_run(nested=True):
        pass
from lifeguard.backends.mlflow import stores
kept = len(stores._by_stamp)
mlflow.set_tracking_uri(os.environ["TEST_SECOND_URI"])
demo.announce(run_ids=[outer.info.run_id], kept=kept)
threading.Event().wait()
"""


@pytest.mark.timeout(600)
def test_bookkeeping_does_not_grow_with_the_runs_ended(
    tmp_path: Path, template_db: Path, store: Store
) -> None:
    """A process that starts and ends 100 runs keeps the store of the runs still open (and of
    the latest few started), not one record per run it ever ended; the run open all along still
    ends in its own store, after the program switched to another one."""
    other = store_at(template_db, tmp_path / "other" / "mlflow.db")
    env = child_env(store, TEST_SECOND_URI=other.uri, TEST_START=str(tmp_path), TEST_RUNS="100")
    result = run(ENDS_MANY_RUNS, env, send=(signal.SIGTERM,), install={})
    assert result.returncode == -signal.SIGTERM, result.stderr
    # The open run's and at most twice the latest few (stores.RECENT, 16): not one per run.
    assert int(result.ready["kept"]) <= 32, result.ready  # type: ignore[call-overload]
    [outer] = result.ready["run_ids"]  # type: ignore[misc]
    assert store.status(outer) == "KILLED", result.stderr
