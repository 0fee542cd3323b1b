"""One bad entry blocks nothing else; an entry that can never be written is moved aside.

* A journal entry whose run is not in its store (the server re-created on an empty database at
  the same URI) is that entry's problem alone: every replay (install()'s, the last gasp's, the
  sweep's), over sqlite, REST and the mlflow path, writes the other entries of the same
  healthy store, and keeps this one, saying so.
* Once past its bound (a run missing for a day; a store failing every attempt for a week, the
  entry that old too), a replay moves the entry to ``dead/`` with one line, and the sweep lists
  it. The bound is counted on the boot clock: an entry whose wall-clock age is a month is not
  moved aside on that alone.

Real stores (sqlite in tmp_path, the worker's `mlflow server`), real replay processes. What a
bound's passing needs, a day or a week of earlier replays, is planted in ``unwritable.state``
as those replays would have left it.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from lifeguard.journal import Entry, Journal
from lifeguard.owner import Owner
from tests.conftest import CHILD_TIMEOUT, Store, _base_env, lifeguard_cli
from tests.servers import MlflowServer

DAY = 86400.0
# A run id no store has: sorted before every real one (uuid4 hex), so that it is tried first.
MISSING = "0" * 32
UNREACHABLE = "http://127.0.0.1:9"  # the discard port: nothing listens, the connect is refused


def gone_writer() -> Owner:
    """A writer that no longer runs: this process's pid, as a process that had it before."""
    here = Owner.current()
    return Owner(here.host, here.pid, here.start_time - 1000, here.boot_id, here.pid_ns)


def journal_entries(journal: Path) -> list[str]:
    return sorted(p.stem for p in journal.glob("*.json"))


def write(journal: Path, run_id: str, uri: str, *, writer: Owner | None = None) -> None:
    entry = Entry(run_id, uri, "KILLED", 1_000, {"lifeguard.reason": "killed by SIGTERM"},
                  writer=writer or gone_writer())  # fmt: skip
    Journal(str(journal)).write(entry)


def journaled_ago(journal: Path, run_id: str, seconds: float) -> None:
    """As if ``run_id``'s entry had been journaled ``seconds`` ago (by the wall clock)."""
    path = journal / f"{run_id}.json"
    data = json.loads(path.read_text())
    data["journaled_at"] = int((time.time() - seconds) * 1000)
    path.write_text(json.dumps(data))


def plant_state(
    journal: Path,
    *,
    stores: dict[str, float] | None = None,
    missing: dict[str, float] | None = None,
) -> None:
    """``unwritable.state`` as earlier replays of this boot left it: each store failing, each
    run missing, since that many seconds ago on the boot clock."""
    boot = Owner.current().boot_id
    up = time.clock_gettime(time.CLOCK_BOOTTIME)
    wall = int(time.time() * 1000)

    def span(seconds: float, error: str) -> list[object]:
        return [boot, up - seconds, up - 1, 0.0, wall - int(seconds * 1000), error]

    data = {
        "version": 1,
        "stores": {u: span(s, "runs/get: ConnectionRefused") for u, s in (stores or {}).items()},
        "missing": {run: span(s, "no such run") for run, s in (missing or {}).items()},
    }
    path = journal / "unwritable.state"
    path.write_text(json.dumps(data))
    path.chmod(0o600)


def replay(journal: Path, kind: str = "sqlite") -> subprocess.CompletedProcess[str]:
    """install()'s replay, as install() starts it: its output goes nowhere (/dev/null), what
    it has to say to replayer.log."""
    env = replayer_env(journal, kind)
    return subprocess.run(
        [sys.executable, "-m", "lifeguard.guardian.replay"], env=env, timeout=CHILD_TIMEOUT,
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def said(journal: Path) -> list[str]:
    log = journal / "replayer.log"
    return log.read_text().splitlines() if log.exists() else []


# -- a missing run blocks nothing -------------------------------------------------------------


@pytest.fixture
def two_stores(tmp_path: Path, template_db: Path, mlflow_server: MlflowServer) -> dict[str, str]:
    """kind -> tracking URI: a sqlite store of this test's, and the worker's server (over REST,
    or through mlflow's client: ``LIFEGUARD_GUARDIAN_REST=0`` in the replayer's environment)."""
    shutil.copy(template_db, tmp_path / "mlflow.db")
    sqlite = f"sqlite:///{tmp_path / 'mlflow.db'}"
    return {"sqlite": sqlite, "rest": mlflow_server.uri, "mlflow": mlflow_server.uri}


def replayer_env(journal: Path, kind: str) -> dict[str, str]:
    env = {**_base_env(), "LIFEGUARD_JOURNAL_DIR": str(journal)}
    if kind == "mlflow":
        env["LIFEGUARD_GUARDIAN_REST"] = "0"  # the store through mlflow's own client
    return env


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["sqlite", "rest", "mlflow"])
def test_install_s_replay_writes_past_a_run_the_store_does_not_have(
    two_stores: dict[str, str], tmp_path: Path, kind: str
) -> None:
    """The store lost one run (re-created, restored without it); two others wait in the journal
    with it. The missing run's entry, tried first, does not stop the others: both are KILLED,
    and it stays, for its bound."""
    uri = two_stores[kind]
    client = MlflowClient(tracking_uri=uri)
    runs = [client.create_run("0").info.run_id for _ in range(2)]
    journal = tmp_path / "journal"
    for run_id in [MISSING, *runs]:
        write(journal, run_id, uri)
    done = replay(journal, kind)
    assert done.returncode == 1, said(journal)  # one entry left: the missing run's
    assert [client.get_run(r).info.status for r in runs] == ["KILLED", "KILLED"]
    assert [client.get_run(r).data.tags["lifeguard.ended_by"] for r in runs] == ["replay"] * 2
    assert journal_entries(journal) == [MISSING]
    assert not (journal / "dead").exists()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["sqlite", "rest", "mlflow"])
def test_the_last_gasp_writes_past_a_run_the_store_does_not_have(
    two_stores: dict[str, str], tmp_path: Path, kind: str
) -> None:
    """A dying program's replayer, given three runs of its writer: the missing one is tried
    first, the two others are written in the same round, and the replayer is done at once (it
    does not wait out its bound on an answer that will not change), saying so in one line."""
    uri = two_stores[kind]
    client = MlflowClient(tracking_uri=uri)
    runs = [client.create_run("0").info.run_id for _ in range(2)]
    journal = tmp_path / "journal"
    writer = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                              stdin=subprocess.PIPE)  # fmt: skip
    here = Owner.current()
    identity = Owner(here.host, writer.pid, time.time(), here.boot_id, here.pid_ns)
    for run_id in [MISSING, *runs]:
        write(journal, run_id, uri, writer=identity)
    pidfd = os.pidfd_open(writer.pid)
    env = {**replayer_env(journal, kind), "LIFEGUARD_REPLAY_BOUND": "120"}
    replayer = subprocess.Popen(
        [sys.executable, "-m", "lifeguard.guardian.replay", "--last-gasp", "--writer",
         str(writer.pid), "--wait-fd", str(pidfd), "--", MISSING, *runs],
        env=env, pass_fds=[pidfd], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    os.close(pidfd)
    assert writer.stdin is not None
    writer.stdin.close()  # the writer dies: the replayer's turn
    writer.wait(30)
    started = time.monotonic()
    assert replayer.wait(CHILD_TIMEOUT) == 1  # something stays: the missing run's entry
    assert time.monotonic() - started < 60, "it waited on the missing run"
    assert [client.get_run(r).info.status for r in runs] == ["KILLED", "KILLED"]
    assert journal_entries(journal) == [MISSING]
    [line] = said(journal)
    assert f"run {MISSING}" in line and "does not have" in line and "moved aside" in line


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["sqlite", "rest"])
def test_the_sweep_writes_past_a_run_the_store_does_not_have(
    two_stores: dict[str, str], tmp_path: Path, kind: str
) -> None:
    """`lifeguard sweep` replays the journal through mlflow's client: the two runs it has are
    KILLED as ``replay`` (never ``skip``ped as journaled), the sweep exits 0, and it reports
    the missing one, in text and in --json."""
    uri = two_stores[kind]
    client = MlflowClient(tracking_uri=uri)
    runs = [client.create_run("0").info.run_id for _ in range(2)]
    journal = tmp_path / "journal"
    for run_id in [MISSING, *runs]:
        write(journal, run_id, uri)
    env = {**_base_env(), "LIFEGUARD_JOURNAL_DIR": str(journal)}
    done = lifeguard_cli("sweep", "--tracking-uri", uri, "--json", "--timeout", "10", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["journal"]["ended"] == 2 and report["journal"]["missing"] == 1, report
    assert [client.get_run(r).info.status for r in runs] == ["KILLED", "KILLED"]
    assert not [d for d in report["decisions"] if d["run_id"] in runs]
    assert f"run {MISSING} is not in the store" in done.stderr
    assert "1 journaled status(es) are for runs" in done.stderr
    assert journal_entries(journal) == [MISSING]


# -- moved aside after a bound -------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_a_run_missing_for_a_day_is_moved_aside_with_one_line(store: Store, tmp_path: Path) -> None:
    """A run its store has not had for more than a day (by earlier replays of this boot): the
    next replay moves its entry to dead/, same file, 0600, in a 0700 directory, with why, and
    says so in one line naming the run and the store. One missing for an hour stays."""
    journal = tmp_path / "journal"
    recent = "1" * 32
    write(journal, MISSING, store.uri)
    write(journal, recent, store.uri)
    plant_state(journal, missing={MISSING: DAY + 60, recent: 3600})
    done = replay(journal)
    assert done.returncode == 1, said(journal)  # the recent one stays
    assert journal_entries(journal) == [recent]
    dead = journal / "dead"
    moved = dead / f"{MISSING}.json"
    assert stat.S_IMODE(dead.stat().st_mode) == 0o700
    assert stat.S_IMODE(moved.stat().st_mode) == 0o600
    data = json.loads(moved.read_text())
    assert data["status"] == "KILLED" and "not been in the store" in data["moved_aside"]["why"]
    [line] = said(journal)
    assert f"run {MISSING} can never be written" in line and store.uri in line
    assert str(moved) in line
    # Moved aside is out of every replay: the next one neither reads it nor says it again.
    replay(journal)
    assert said(journal) == [line]
    assert moved.exists()


@pytest.mark.timeout(300)
def test_a_store_that_fails_for_a_week_has_its_entries_moved_aside_and_no_newer_one(
    tmp_path: Path,
) -> None:
    """A server gone for good: every attempt has failed for eight days (earlier replays). The
    entries journaled before that are moved aside, one line each; one journaled an hour ago
    (the server was up then, unseen) stays; so does a store that failed for a day, whatever
    its entries' wall-clock age (a month: a clock step, or a machine that was off)."""
    journal = tmp_path / "journal"
    other = "http://127.0.0.1:7"  # the echo port: nothing listens here either
    old, fresh, stepped = "a" * 32, "b" * 32, "c" * 32
    write(journal, old, UNREACHABLE)
    write(journal, fresh, UNREACHABLE)
    write(journal, stepped, other)
    journaled_ago(journal, old, 8 * DAY)
    journaled_ago(journal, fresh, 3600)
    journaled_ago(journal, stepped, 30 * DAY)
    plant_state(journal, stores={UNREACHABLE: 8 * DAY, other: DAY})
    done = replay(journal)
    assert done.returncode == 1, said(journal)
    assert journal_entries(journal) == [fresh, stepped]
    assert [p.stem for p in (journal / "dead").glob("*.json")] == [old]
    [line] = said(journal)
    assert f"run {old} can never be written" in line and "failed every attempt for 8 days" in line


@pytest.mark.timeout(300)
def test_a_store_that_answers_again_starts_its_count_afresh(store: Store, tmp_path: Path) -> None:
    """A store that failed for eight days answers now: its record is dropped with the entry
    written, and nothing of it is moved aside."""
    journal = tmp_path / "journal"
    run_id = store.client.create_run("0").info.run_id
    write(journal, run_id, store.uri)
    journaled_ago(journal, run_id, 8 * DAY)
    plant_state(journal, stores={store.uri: 8 * DAY})
    done = replay(journal)
    assert done.returncode == 0, said(journal)
    assert store.status(run_id) == "KILLED"
    assert not (journal / "dead").exists()
    assert not (journal / "unwritable.state").exists()


@pytest.mark.timeout(300)
def test_the_sweep_lists_what_was_moved_aside(store: Store, tmp_path: Path) -> None:
    """What a replay moved aside is in the sweep's report, in --json (run, store, why) and in
    its text, with where it is; the sweep moves its own store's entries past their bound too."""
    journal = tmp_path / "journal"
    write(journal, MISSING, store.uri)
    plant_state(journal, missing={MISSING: DAY + 60})
    env = {**_base_env(), "LIFEGUARD_JOURNAL_DIR": str(journal)}
    done = lifeguard_cli("sweep", "--tracking-uri", store.uri, "--json", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    aside = json.loads(done.stdout)["moved_aside"]
    assert aside["count"] == 1 and aside["by_this_sweep"] == [MISSING], aside
    [listed] = aside["entries"]
    assert listed["run_id"] == MISSING and listed["tracking_uri"] == store.uri
    assert "not been in the store" in listed["why"]
    assert f"run {MISSING} can never be written" in done.stderr
    text = lifeguard_cli("sweep", "--tracking-uri", store.uri, env=env)
    assert text.returncode == 0, text.stdout + text.stderr
    assert f"1 journaled status(es) that can never be written are in {journal / 'dead'}" in (
        text.stderr
    )
    assert f"run {MISSING}" in text.stderr


# -- units: the boot clock ------------------------------------------------------------------


def test_a_span_counts_the_boot_clock_and_not_the_time_between_boots() -> None:
    from lifeguard.aside import _failed_again, _length

    span = _failed_again(None, "boot-a", 100.0, "refused")
    span = _failed_again(span, "boot-a", 3700.0, "")
    assert _length(span) == 3600.0 and span[5] == "refused"
    # A reboot: the hour before it is kept, the time the machine was off is not counted.
    span = _failed_again(span, "boot-b", 50.0, "timed out")
    span = _failed_again(span, "boot-b", 1850.0, "")
    assert _length(span) == 5400.0 and span[5] == "timed out"
    # A boot clock that went back in the same boot (never, but): nothing is counted for it.
    span = _failed_again(span, "boot-b", 10.0, "")
    assert _length(span) == 5400.0


def test_no_credential_reaches_the_failure_records(tmp_path: Path) -> None:
    """A server's error text may quote a URI with its password: the records keep it redacted,
    in a private file."""
    from lifeguard.aside import STATE_NAME, Failures

    journal = Journal(str(tmp_path / "journal"))
    journal.ensure()
    failures = Failures(journal).load()
    failures.observe("a" * 32, "http://h:5000", "journaled", "cannot reach http://u:s3cret@h:5000/")
    failures.save()
    state = tmp_path / "journal" / STATE_NAME
    assert "s3cret" not in state.read_text() and "http://h:5000" in state.read_text()
    assert stat.S_IMODE(state.stat().st_mode) == 0o600
