"""The journal: private files, no secrets, corrupt files set aside and never fatal."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from lifeguard.guardian.journal import Entry, Journal, redact_uri


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


def test_an_existing_loose_directory_is_tightened(tmp_path: Path) -> None:
    loose = tmp_path / "j"
    loose.mkdir(mode=0o755)
    Journal(str(loose)).write(entry())
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700


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
