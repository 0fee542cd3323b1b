"""The journal: private files, no secrets, corrupt files set aside and never fatal."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from lifeguard.journal import ABANDONED_AFTER, Entry, Journal, JournalError, redact_uri
from lifeguard.owner import Owner
from tests.conftest import CHILD_TIMEOUT, Store, child_env, sweep

OTHER_UID = 65534  # nobody


def entry(run_id: str = "a" * 32, uri: str = "http://127.0.0.1:5000") -> Entry:
    return Entry(run_id, uri, "KILLED", 1_700_000_000_123, {"lifeguard.signal": "SIGTERM"})


def test_files_are_private_and_the_directory_too(tmp_path: Path) -> None:
    journal = Journal(str(tmp_path / "j"))
    umask = os.umask(0o022)  # the usual umask would leave the directory 0755
    try:
        path = Path(journal.write(entry()))
    finally:
        os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


def test_an_existing_loose_directory_is_tightened_only_if_lifeguard_names_it(
    tmp_path: Path,
) -> None:
    """Another one is someone's (a results directory, a home): refused, never changed
    (tests/test_bad_input.py has where it is given)."""
    own = tmp_path / "lifeguard" / "journal"
    own.mkdir(parents=True, mode=0o755)
    Journal(str(own)).write(entry())
    assert stat.S_IMODE(own.stat().st_mode) == 0o700
    loose = tmp_path / "j"
    loose.mkdir(mode=0o755)
    with pytest.raises(JournalError, match="is mode 0755"):
        Journal(str(loose)).write(entry())
    assert stat.S_IMODE(loose.stat().st_mode) == 0o755


@pytest.mark.parametrize(
    ("uri", "redacted"),
    [
        ("https://alice:pa55@mlflow.example/x", "https://mlflow.example/x"),
        ("http://token@127.0.0.1:5000", "http://127.0.0.1:5000"),
        ("http://127.0.0.1:5000", "http://127.0.0.1:5000"),
        ("sqlite:////tmp/mlflow.db", "sqlite:////tmp/mlflow.db"),
        ("databricks", "databricks"),
    ],
)
def test_uris_lose_their_credentials(uri: str, redacted: str) -> None:
    assert redact_uri(uri) == redacted


def test_no_password_reaches_the_file(tmp_path: Path) -> None:
    journal = Journal(str(tmp_path))
    path = Path(journal.write(entry(uri="https://alice:pa55@host/")))
    assert "pa55" not in path.read_text() and "alice" not in path.read_text()


def test_round_trip_keeps_the_true_end_time(tmp_path: Path) -> None:
    journal = Journal(str(tmp_path))
    journal.write(entry())
    [read] = list(journal.entries())
    assert (read.run_id, read.status, read.end_time) == ("a" * 32, "KILLED", 1_700_000_000_123)
    assert read.tags == {"lifeguard.signal": "SIGTERM"}
    journal.remove(read)
    assert list(journal.entries()) == []


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("{not json", "Expecting property name"),
        ('{"version": 99}', "unknown journal format"),
        ("[]", "unknown journal format (a JSON list)"),
        ('{"version": 1, "run_id": "x", "tracking_uri": "u", "status": "RUNNING", '
         '"end_time": 1, "tags": {}}', "not a terminal status"),
        ('{"version": 1, "run_id": "x", "tracking_uri": "u", "status": "FAILED", '
         '"end_time": "soon", "tags": {}}', "end_time"),
    ],
)  # fmt: skip
def test_corrupt_files_are_set_aside_not_fatal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: str, reason: str
) -> None:
    journal = Journal(str(tmp_path))
    journal.write(entry("b" * 32))
    (tmp_path / "x.json").write_text(content)
    (tmp_path / "x.json").chmod(0o600)  # a file of ours, only its content is bad
    assert [e.run_id for e in journal.entries()] == ["b" * 32]
    assert (tmp_path / "x.json.corrupt").exists()
    assert not (tmp_path / "x.json").exists()
    assert "corrupt journal file" in caplog.text and reason in caplog.text


def test_a_file_named_for_another_run_is_corrupt(tmp_path: Path) -> None:
    journal = Journal(str(tmp_path))
    journal.write(entry("c" * 32))
    os.rename(tmp_path / ("c" * 32 + ".json"), tmp_path / ("d" * 32 + ".json"))
    assert list(journal.entries()) == []
    assert (tmp_path / ("d" * 32 + ".json.corrupt")).exists()


def test_bad_run_ids_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a run id"):
        Journal(str(tmp_path)).write(entry("../../etc/passwd"))


def test_a_file_is_private_whatever_the_umask(tmp_path: Path) -> None:
    umask = os.umask(0o277)  # would make a 0600 request 0400
    try:
        path = Path(Journal(str(tmp_path / "j")).write(entry()))
    finally:
        os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [e.run_id for e in Journal(str(tmp_path / "j")).entries()] == ["a" * 32]


# -- trust: only the current user's own private files are ever replayed -------------------------


def needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a file to another uid needs root")


RUN = "e" * 32


def planted_json(run_id: str = RUN) -> str:
    return entry(run_id, uri="http://127.0.0.1:9").to_json()


# Each plants ``content`` as the entry ``<run_id>.json`` in an existing 0700 journal directory,
# in a way the journal must refuse, and returns the path that the refusal must name.
Plant = Callable[[Path, str, str], str]


def plant_other_owner_dir(journal: Path, run_id: str, content: str) -> str:
    needs_root()
    path = journal / f"{run_id}.json"
    path.write_text(content)
    path.chmod(0o600)
    os.chown(journal, OTHER_UID, OTHER_UID)
    return str(journal)


def plant_loose_dir(mode: int) -> Plant:
    def plant(journal: Path, run_id: str, content: str) -> str:
        path = journal / f"{run_id}.json"
        path.write_text(content)
        path.chmod(0o600)
        journal.chmod(mode)
        return str(journal)

    return plant


def plant_fifo(journal: Path, run_id: str, content: str) -> str:
    path = journal / f"{run_id}.json"
    os.mkfifo(path, 0o600)
    return str(path)


def plant_dev_zero(journal: Path, run_id: str, content: str) -> str:
    path = journal / f"{run_id}.json"
    path.symlink_to("/dev/zero")
    return str(path)


def plant_huge(journal: Path, run_id: str, content: str) -> str:
    path = journal / f"{run_id}.json"
    path.write_text(content)
    subprocess.run(["truncate", "-s", "300M", str(path)], check=True, timeout=30)
    path.chmod(0o600)
    return str(path)


def plant_other_owner_file(journal: Path, run_id: str, content: str) -> str:
    needs_root()
    path = journal / f"{run_id}.json"
    path.write_text(content)
    path.chmod(0o600)
    os.chown(path, OTHER_UID, OTHER_UID)
    return str(path)


def plant_loose_file(journal: Path, run_id: str, content: str) -> str:
    path = journal / f"{run_id}.json"
    path.write_text(content)
    path.chmod(0o644)
    return str(path)


PLANTS: dict[str, Plant] = {
    "directory of another uid": plant_other_owner_dir,
    "group-writable directory": plant_loose_dir(0o770),
    "world-writable directory": plant_loose_dir(0o777),
    "FIFO": plant_fifo,
    "symlink to /dev/zero": plant_dev_zero,
    "300 MB sparse file": plant_huge,
    "file of another uid": plant_other_owner_file,
    "file readable by others": plant_loose_file,
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", PLANTS)
def test_only_the_users_own_private_files_are_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    journal_dir = tmp_path / "journal"
    journal_dir.mkdir(mode=0o700)
    named = PLANTS[kind](journal_dir, RUN, planted_json())
    journal = Journal(str(journal_dir))
    started = time.monotonic()
    assert list(journal.entries()) == []  # nothing planted is ever an entry
    assert time.monotonic() - started < 5  # no hang on a FIFO, no 300 MB read
    # Read again, as a sweep does (to replay, then to spare what is still journaled): a
    # refusal is named once per journal, a refused directory included.
    assert list(journal.entries()) == []
    [line] = journal.refused
    what = "directory" if named == str(journal_dir) else "file"
    assert f"refusing journal {what} {named}: it " in line and line in caplog.text
    assert caplog.text.count("refusing journal") == 1
    if named != str(journal_dir):  # a file in our own private directory: set aside
        assert not os.path.lexists(named) and os.path.lexists(named + ".refused")
        assert list(Journal(str(journal_dir)).entries()) == []


def test_a_symlink_is_renamed_never_its_target(tmp_path: Path) -> None:
    target = tmp_path / "mine.txt"
    target.write_text("not a journal entry")
    journal_dir = tmp_path / "journal"
    journal_dir.mkdir(mode=0o700)
    link = journal_dir / ("f" * 32 + ".json")
    link.symlink_to(target)
    assert list(Journal(str(journal_dir)).entries()) == []
    assert target.read_text() == "not a journal entry"
    assert os.path.islink(str(link) + ".refused")


# -- one redaction for URIs and free text -------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "redacted"),
    [
        (
            "API request to http://alice:pa55@h:5000/api/2.0/x failed",
            "API request to http://h:5000/api/2.0/x failed",
        ),
        ("['https://u:p@a.b/c', 'x']", "['https://a.b/c', 'x']"),
        ("denied: Authorization: Bearer abc.DEF-123", "denied: Authorization: Bearer ***"),
        ("Authorization: Basic YWxpY2U6cGE1NQ==", "Authorization: Basic ***"),
        ("https://h/x?token=s3cr3t&run=1", "https://h/x?token=***&run=1"),
        ('{"password": "hunter22"}', '{"password": "***"}'),
        ("nothing to hide at http://h:5000", "nothing to hide at http://h:5000"),
    ],
)
def test_free_text_loses_its_credentials(text: str, redacted: str) -> None:
    from lifeguard.redact import redact

    assert redact(text) == redacted


def test_secret_environment_values_are_masked_anywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    from lifeguard.redact import redact, remember_uri

    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "tok-123456")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "envpw-98765")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://bob:uripw%40x@h")
    remember_uri("http://carol:flagpw-555@h")
    text = redact("got tok-123456, envpw-98765, uripw@x, uripw%40x and flagpw-555 back")
    assert text == "got ***, ***, ***, *** and *** back"


def test_every_lifeguard_log_record_is_redacted(caplog: pytest.LogCaptureFixture) -> None:
    from lifeguard._log import logger

    try:
        raise RuntimeError("cannot reach http://alice:pa55@h/api")
    except RuntimeError as exc:
        logger().error("write to %s failed: %s", "https://u:pw@h", exc, exc_info=True)
    assert "pa55" not in caplog.text and ":pw@" not in caplog.text
    assert "write to https://h failed: cannot reach http://h/api" in caplog.text


# -- when install() replays -------------------------------------------------------------------


def _entry(journal: Journal, run_id: str) -> None:
    journal.write(Entry(run_id, "http://127.0.0.1:9", "KILLED", 1, {}))


def _left(journal: Journal, run_id: str) -> None:
    """A status this process leaves after a write that failed, as a finalizer or a guardian
    leaves one: journaled ahead, then the write fails."""
    from lifeguard.journal import after_failed_write

    entry = Entry(run_id, "http://127.0.0.1:9", "KILLED", 1, {})
    journal.write(entry)
    after_failed_write(journal, entry, "http://127.0.0.1:9", "connection refused")


def test_a_replay_is_due_once_per_interval_or_for_a_status_left_since(tmp_path: Path) -> None:
    """An entry nobody can write for now (its server gone) costs a replay per REPLAY_EVERY, not
    one per program started; a status a process left since, after a failed write, is replayed
    at the next install()."""
    from lifeguard.journal import REPLAY_EVERY, REPLAY_STAMP, REPLAY_WANTED

    journal = Journal(str(tmp_path / "journal"))
    assert not journal.replay_due()  # no directory
    journal.ensure()
    assert not journal.replay_due()  # no entry
    _entry(journal, "a" * 32)
    assert journal.replay_due()  # never replayed
    journal.replay_started()
    stamp = tmp_path / "journal" / REPLAY_STAMP
    assert stat.S_IMODE(stamp.stat().st_mode) == 0o600
    assert not journal.replay_due()  # tried just now, and nothing new since
    _entry(journal, "b" * 32)
    assert not journal.replay_due()  # a write in flight: its writer writes it, or leaves it
    _left(journal, "c" * 32)
    wanted = tmp_path / "journal" / REPLAY_WANTED
    assert stat.S_IMODE(wanted.stat().st_mode) == 0o600
    assert journal.replay_due()  # a status left since the last replay
    journal.replay_started()
    assert not journal.replay_due()
    # The interval is kept on the local clock, in the stamp (an NFS server's clock sets its
    # mtime, and may be minutes off).
    old = time.time() - 5
    stamp.write_text(f"{time.time() - REPLAY_EVERY - 1}\n")
    os.utime(stamp, (old + 1, old + 1))
    os.utime(wanted, (old, old))
    assert journal.replay_due()  # the interval is over
    stamp.write_text(f"{time.time() + 3600}\n")
    os.utime(stamp, (old + 1, old + 1))
    assert journal.replay_due()  # a clock set back is no reason to wait an hour
    stamp.write_text(f"{time.time()}\n")
    skewed = time.time() - 700  # the server's clock, 700 s behind ours
    os.utime(stamp, (skewed, skewed))
    os.utime(wanted, (skewed - 5, skewed - 5))
    assert not journal.replay_due()  # started just now by our clock, nothing left since
    os.utime(wanted, (skewed + 5, skewed + 5))
    assert journal.replay_due()  # left since, by the server's clock
    for path in (tmp_path / "journal").glob("*.json"):
        path.unlink()
    stamp.write_text(f"{time.time() - REPLAY_EVERY - 1}\n")
    assert not journal.replay_due()  # nothing waits


def test_install_s_look_at_the_journal_does_not_grow_with_it(tmp_path: Path) -> None:
    """install() decides whether a replay is due in the same few system calls whatever the
    journal holds: 3,000 entries that cannot be written cost what one does (each file it opens,
    stats or lists is counted; the decision itself is the same)."""

    def calls(entries: int) -> tuple[bool, list[tuple[str, str]]]:
        directory = tmp_path / f"journal-{entries}"
        journal = Journal(str(directory))
        journal.ensure()
        for n in range(entries):
            (directory / f"{n:032x}.json").write_text("{}")
        journal.replay_started()
        seen: list[tuple[str, str]] = []
        real = {name: getattr(os, name) for name in ("open", "lstat", "stat", "listdir", "scandir")}

        def counting(name: str) -> object:
            def call(*args: object, **kwargs: object) -> object:
                seen.append((name, os.path.relpath(str(args[0]), directory) if args else ""))
                return real[name](*args, **kwargs)

            return call

        with pytest.MonkeyPatch.context() as patch:
            for name in real:
                patch.setattr(os, name, counting(name))
            due = journal.replay_due()
        return due, seen

    assert calls(1) == calls(3_000)
    due, seen = calls(1)
    assert not due and len(seen) <= 5, seen


def test_a_planted_stamp_neither_blocks_nor_silences_the_replay(tmp_path: Path) -> None:
    """A FIFO or a symlink where the stamp goes: install() neither blocks on it nor follows
    it; the replay is due (no usable stamp), and the next stamp replaces what was there."""
    from lifeguard.journal import REPLAY_STAMP

    journal = Journal(str(tmp_path / "journal"))
    _entry(journal, "d" * 32)
    stamp = tmp_path / "journal" / REPLAY_STAMP
    os.mkfifo(stamp, 0o600)
    assert journal.replay_due()
    journal.replay_started()  # would block forever opening a FIFO for writing
    assert stamp.is_file() and not journal.replay_due()
    stamp.unlink()
    target = tmp_path / "elsewhere"
    target.write_text(f"{time.time()}\n")
    stamp.symlink_to(target)
    assert journal.replay_due()  # a symlink is not our stamp
    journal.replay_started()
    assert not stamp.is_symlink() and target.read_text().strip() != ""


def test_programs_started_together_start_one_replay(tmp_path: Path) -> None:
    """Fifty jobs of a node starting at once, one stale entry: one replay, not fifty."""
    import sys

    journal = Journal(str(tmp_path / "journal"))
    _entry(journal, "c" * 32)
    code = "import lifeguard; lifeguard.install(); print(lifeguard.journaldir.replay_pid or 0)"
    env = {**os.environ, "LIFEGUARD_JOURNAL_DIR": journal.directory}
    pids = [
        int(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, check=True, timeout=60).stdout)
        for _ in range(3)
    ]  # fmt: skip
    assert pids[0] != 0 and pids[1:] == [0, 0], pids


# -- an entry its writer died before renaming into place --------------------------------------


def _unfinished(directory: Path, written: Entry, pid: int, age: float = 0.0) -> Path:
    """The temporary file Journal.write leaves when its writer dies between the write and the
    rename (a SIGKILL in those microseconds), ``age`` seconds old."""
    path = _private(directory / f"{written.run_id}.json.{pid}.tmp", written.to_json())
    if age:
        then = time.time() - age
        os.utime(path, (then, then))
    return path


def _private(path: Path, text: str) -> Path:
    """A new file of ours, 0600 from its creation, holding ``text``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(text)
    return path


def _owner_of(process: subprocess.Popen[bytes]) -> Owner:
    owner = Owner.of_pid(process.pid)
    assert owner is not None
    return owner


def test_an_entry_whose_writer_died_before_the_rename_is_put_in_place(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    journal = Journal(str(tmp_path))
    journal.ensure()
    writer = subprocess.Popen(["true"])
    owner = _owner_of(writer)
    writer.wait(timeout=60)
    left = entry("e" * 32)
    left.writer, left.pid = owner, owner.pid
    temporary = _unfinished(tmp_path, left, owner.pid)
    assert journal.replay_due(), "install() would not replay it"
    [read] = list(journal.entries())
    assert (read.run_id, read.status, read.end_time) == ("e" * 32, "KILLED", 1_700_000_000_123)
    assert not temporary.exists() and (tmp_path / ("e" * 32 + ".json")).exists()
    assert "left unfinished by a process that died" in caplog.text


def test_an_entry_its_writer_is_still_renaming_is_left_to_it(tmp_path: Path) -> None:
    journal = Journal(str(tmp_path))
    journal.ensure()
    with subprocess.Popen(["cat"], stdin=subprocess.PIPE) as writer:
        left = entry("f" * 32)
        left.writer, left.pid = _owner_of(writer), writer.pid
        temporary = _unfinished(tmp_path, left, writer.pid, age=3600)
        assert list(journal.entries()) == []
        assert temporary.exists()
        writer.stdin.close()  # type: ignore[union-attr]


def test_an_entry_from_elsewhere_is_put_in_place_once_it_is_old(tmp_path: Path) -> None:
    """A writer that cannot be checked from here (another machine's, on a shared home; the
    first format's bare pid): its entry is abandoned ABANDONED_AFTER after it was written."""
    journal = Journal(str(tmp_path))
    journal.ensure()
    left = entry("1" * 32)
    left.pid = 4242  # a pid alone: its writer cannot be checked
    temporary = _unfinished(tmp_path, left, 4242)
    assert list(journal.entries()) == []
    assert temporary.exists()
    os.utime(temporary, (time.time() - ABANDONED_AFTER - 1,) * 2)
    assert [e.run_id for e in journal.entries()] == ["1" * 32]
    assert not temporary.exists()


def test_a_later_entry_for_the_run_stands(tmp_path: Path) -> None:
    journal = Journal(str(tmp_path))
    journal.ensure()
    left = entry("2" * 32)
    left.pid = 4242
    temporary = _unfinished(tmp_path, left, 4242, age=2 * ABANDONED_AFTER)
    later = Entry("2" * 32, "http://127.0.0.1:5000", "FAILED", 1_700_000_009_000, {})
    journal.write(later)
    [read] = list(journal.entries())
    assert (read.status, read.end_time) == ("FAILED", 1_700_000_009_000)
    assert not temporary.exists()


def test_an_empty_unfinished_entry_is_set_aside_once_abandoned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Killed between the open and the write: nothing to put in place, and one line says so."""
    journal = Journal(str(tmp_path))
    journal.ensure()
    temporary = tmp_path / ("3" * 32 + ".json.4242.tmp")
    temporary.touch(0o600)
    assert list(journal.entries()) == [] and temporary.exists()
    os.utime(temporary, (time.time() - ABANDONED_AFTER - 1,) * 2)
    assert list(journal.entries()) == []
    assert not temporary.exists() and Path(f"{temporary}.corrupt").exists()
    assert "corrupt journal file" in caplog.text


@pytest.mark.timeout(300)
def test_a_status_killed_between_its_write_and_rename_is_still_written(store: Store) -> None:
    """A process SIGKILLed after writing its entry's temporary file and before the rename: the
    next replay (here the sweep's) writes the status it was journaling, not the sweep's own."""
    program = textwrap.dedent(
        """
        import os, signal, sys
        import lifeguard, mlflow
        lifeguard.install()
        print(mlflow.start_run().info.run_id, flush=True)
        rename = os.replace
        def replace(source, target, *args, **kwargs):
            if str(source).endswith(".tmp") and str(target).endswith(".json"):
                os.kill(os.getpid(), signal.SIGKILL)  # the instant between write and rename
            return rename(source, target, *args, **kwargs)
        os.replace = replace
        sys.exit(3)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", program],
        env=child_env(store),
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    run_id = done.stdout.strip()
    journal = store.path.parent / "journal"
    [left] = journal.iterdir()
    assert left.name.startswith(f"{run_id}.json.") and left.name.endswith(".tmp")
    sweep(store)
    run = store.run(run_id)
    assert run.info.status == "FAILED", run.data.tags
    assert run.data.tags["lifeguard.exit_code"] == "3"
    assert run.info.end_time is not None
    assert not any(p.name.endswith((".json", ".tmp")) for p in journal.iterdir())


@pytest.mark.parametrize("pid", [2**31, -1, 0, 10**30])
def test_a_writer_no_system_call_can_check_is_unknown_not_fatal(tmp_path: Path, pid: int) -> None:
    """A damaged entry's writer pid (2**31: OverflowError in kill(); -1 and 0: process groups,
    "alive" for ever) is no writer: the entry is a status to land, its writer unknown."""
    import json

    journal = Journal(str(tmp_path))
    journal.ensure()
    damaged = json.loads(entry("4" * 32).to_json())
    damaged["pid"] = damaged["writer"]["pid"] = pid
    _private(tmp_path / ("4" * 32 + ".json"), json.dumps(damaged))
    [read] = list(journal.entries())
    assert read.writer is None and read.writer_alive() is None


@pytest.mark.parametrize("what", ["an entry", "the replay's stamp"])
def test_a_write_that_fails_leaves_no_file_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, what: str
) -> None:
    """helper-15, on a full file system (ENOSPC) or a read-only one: each failed write left an
    empty ``.tmp`` file, which a later replay set aside as "corrupt" for a status written after
    all. The failure (a mock of ``os.write`` here: a unit) still raises; nothing stays."""
    import errno

    from lifeguard import journaldir

    directory = tmp_path / "journal"
    journal = Journal(str(directory))
    journal.ensure()

    def full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError, match="No space left"):
        if what == "an entry":
            journal.write(entry())
        else:
            journaldir.replay_started(str(directory))
    monkeypatch.undo()
    assert sorted(p.name for p in directory.iterdir()) == []
