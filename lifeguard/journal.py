"""The journal: final statuses that could not be written yet, kept on local disk until they are.

One file per run, ``<run_id>.json``, 0600, in a 0700 directory (:func:`default_dir`). It is a
write-ahead log: the entry is written before the status is sent and removed once the server has
it, so a process killed in the middle, or a server that never answers, loses nothing. The entry
keeps the true end time; ``install()`` and ``lifeguard sweep`` replay it later.

No secrets: tracking URIs are stored without their user-info part, and credentials
(``MLFLOW_TRACKING_TOKEN``, passwords) come from the replaying process's environment only.

Trust only the owner: a replay sends the user's credentials to the URI an entry names and ends
the run it names, so an entry planted by anyone else must never be replayed. Entries are read
only from a directory owned by the current user and not writable by group or others, and only
from regular files owned by the current user with mode 0600, opened without following symlinks
and without blocking (a FIFO), and at most ``MAX_ENTRY_BYTES`` long. Anything else is refused
with one line naming it, set aside (renamed ``.refused``, which never follows a symlink) when the
directory is ours, and never replayed.
"""

from __future__ import annotations

import os
import stat
import sys
import time

from lifeguard._log import logger
from lifeguard.journaldir import (
    MAX_ENTRY_BYTES,
    REPLAY_EVERY,
    REPLAY_STAMP,
    REPLAY_WANTED,
    SUFFIX,
    Untrusted,
    default_dir,
    location,
    not_private,
    read_private,
    replay_due,
    replay_started,
    replay_wanted,
    run_of_temporary,
    untrusted_directory,
    write_whole,
)
from lifeguard.names import TAG_ENDED_BY
from lifeguard.redact import redact_uri

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

    from lifeguard.owner import Owner

__all__ = [
    "ALREADY_ENDED",
    "BUSY",
    "ENDED",
    "FAILED",
    "GONE",
    "HELD",
    "JOURNALED",
    "MAX_ENTRY_BYTES",
    "MISSING",
    "MISSING_BOUND",
    "NOT_SENT",
    "REPLAY_EVERY",
    "REPLAY_STAMP",
    "REPLAY_WANTED",
    "SUFFIX",
    "SUPERSEDED",
    "UNREACHABLE_BOUND",
    "WAITING",
    "Claim",
    "Entry",
    "Journal",
    "JournalError",
    "Untrusted",
    "after_failed_write",
    "default_dir",
    "location",
    "read_private",
    "redact_uri",
    "replay_due",
    "replay_started",
    "replay_wanted",
    "run_missing",
    "untrusted_directory",
]

VERSION = 1
CORRUPT_SUFFIX = ".corrupt"
REFUSED_SUFFIX = ".refused"


# What ending a run from an entry came to: the same strings for every store path.
ENDED = "ended"
ALREADY_ENDED = "already ended"
JOURNALED = "journaled"
FAILED = "failed"  # neither written nor journaled (the journal itself is unusable)
SUPERSEDED = "superseded"  # an entry whose run was resumed since by a live process: dropped
# The store answered that it has no such run (a server re-created on an empty database at the
# same URI, a run deleted for good): this entry's problem alone, never its store's. Kept, and
# moved aside after a bound (lifeguard.aside).
MISSING = "missing"
# Counted by a replay, never sent: the writer still runs here (it may still be finalizing and
# writes the entry itself), or the entry's server already failed once in this replay.
WAITING = "waiting"
NOT_SENT = "not sent"


# How long an entry that can never be written is kept before a replay moves it aside
# (lifeguard.aside): its run missing from a store that answers (known at once; a database
# restored from a backup may bring it back), or its store not answering at all (a server that
# may come back: longer).
MISSING_BOUND = 24 * 3600.0
UNREACHABLE_BOUND = 7 * 24 * 3600.0
# An unfinished entry (its temporary file, see Journal.write) whose writer cannot be checked from
# here (another machine's, on a shared home) is taken for abandoned this long after it was
# written: its writer renames it microseconds after the write.
ABANDONED_AFTER = 60.0


class JournalError(RuntimeError):
    """The journal directory is unusable (wrong owner, not a directory)."""


class Entry:
    """One run's pending final status, and who journaled it.

    ``writer`` is the journaling process's full identity (host, boot id, PID namespace, pid,
    start time: ``owner.Owner``), so that a replay anywhere can tell whether that process still
    runs: a bare pid is another process in every other PID namespace (pid 1 exists in each).
    ``pid`` stays in the file for readers of the first format; entries written before
    ``writer`` existed have only ``pid``."""

    __slots__ = (
        "run_id",
        "tracking_uri",
        "status",
        "end_time",
        "tags",
        "path",
        "pid",
        "writer",
        "journaled_at",
    )

    def __init__(
        self,
        run_id: str,
        tracking_uri: str,
        status: str,
        end_time: int,
        tags: dict[str, str],
        path: str | None = None,
        pid: int | None = None,
        writer: Owner | None = None,
    ) -> None:
        self.run_id = run_id
        self.tracking_uri = tracking_uri
        self.status = status
        self.end_time = end_time
        self.tags = tags
        self.path = path
        # The process whose ending this is: a guardian looks for the entries of the one it
        # watched. Written as the journaling process's own identity unless set.
        self.pid = pid if pid is not None or writer is None else writer.pid
        self.writer = writer
        # When it was journaled (epoch ms, the writer's clock), as read back from the file: how
        # old an entry is that cannot be written (lifeguard.aside). None until written.
        self.journaled_at: int | None = None

    def to_json(self) -> str:
        import json  # lazily: json pulls in re, and install() only lists the directory

        from lifeguard.owner import Owner

        writer = self.writer
        if writer is None and self.pid in (None, os.getpid()):
            writer = Owner.current()
        return json.dumps(
            {
                "version": VERSION,
                "run_id": self.run_id,
                "tracking_uri": redact_uri(self.tracking_uri),
                "status": self.status,
                "end_time": self.end_time,
                "tags": self.tags,
                "journaled_at": int(time.time() * 1000),
                "pid": self.pid if self.pid is not None else os.getpid(),
                "writer": writer.fields() if writer is not None else None,
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str, path: str) -> Entry:
        import json

        from lifeguard.owner import Owner

        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"unknown journal format (a JSON {type(data).__name__})")
        if data.get("version") != VERSION:
            raise ValueError(f"unknown journal format (version {data.get('version')!r})")
        tags = data.get("tags", {})
        if not isinstance(tags, dict) or not all(isinstance(v, str) for v in tags.values()):
            raise ValueError("tags must be a mapping of strings")
        # JSON carries lone surrogates (a file name that is not UTF-8, in an entry journaled
        # before Outcome escaped them); no store takes them, and one would fail the write.
        from lifeguard.outcome import utf8

        tags = {utf8(key): utf8(value) for key, value in tags.items()}
        for key, kind in (("run_id", str), ("tracking_uri", str), ("status", str)):
            if not isinstance(data.get(key), kind):
                raise ValueError(f"field {key!r} is missing or not a {kind.__name__}")
        end_time = data.get("end_time")
        if not isinstance(end_time, int) or isinstance(end_time, bool):
            raise ValueError("field 'end_time' is missing or not an integer")
        if data["status"] not in ("FINISHED", "FAILED", "KILLED"):
            raise ValueError(f"status {data['status']!r} is not a terminal status")
        pid = data.get("pid")
        if not isinstance(pid, int) or isinstance(pid, bool):
            pid = None
        # Absent (the first format) or damaged: the entry is still a status to land, only its
        # writer cannot be checked anywhere ("elsewhere").
        writer = Owner.from_fields(data.get("writer"))
        if writer is not None and pid is not None and writer.pid != pid:
            writer = None  # the two disagree: trust neither more than the other
        entry = cls(
            data["run_id"], data["tracking_uri"], data["status"], end_time, tags, path, pid, writer
        )
        journaled_at = data.get("journaled_at")
        if isinstance(journaled_at, int) and not isinstance(journaled_at, bool):
            entry.journaled_at = journaled_at
        return entry

    def written_by(self, who: str) -> Entry:
        """This entry as ``who`` writes it (``lifeguard.ended_by``: ``watchdog``,
        ``supervisor``, ``replay``, ``sweep``): the process journaled its ending as its own,
        and the tag must name whoever really wrote the status. Same file: removed on success."""
        tags = {**self.tags, TAG_ENDED_BY: who}
        entry = Entry(
            self.run_id,
            self.tracking_uri,
            self.status,
            self.end_time,
            tags,
            self.path,
            self.pid,
            self.writer,
        )
        entry.journaled_at = self.journaled_at
        return entry

    def writer_alive(self) -> bool | None:
        """Whether the process that journaled this entry still runs: True/False where that can
        be checked from here (this PID namespace, or one nested in it), None where it cannot
        (another container, another machine, an entry of the first format, which has a bare
        pid only). The replaying process itself is never "alive" here: its entries are its
        own to write."""
        from lifeguard.owner import Owner

        if self.writer is None:
            return None
        if self.writer.same_process(Owner.current()):
            return False
        return self.writer.is_alive()

    def __repr__(self) -> str:
        return f"Entry({self.run_id}, {self.status}, end_time={self.end_time})"


class Journal:
    def __init__(self, directory: str | None = None) -> None:
        self.directory, self._private_root = (directory, None) if directory else location()
        # One line per file (or the directory) that entries() refused since this was made.
        self.refused: list[str] = []
        # Why the last entry could not be written, if it could not (see keep).
        self.unusable: str | None = None

    # -- the directory ---------------------------------------------------------------------

    def ensure(self) -> str:
        """Create the directory 0700, or check an existing one is ours and private."""
        if self._private_root is not None:
            # A directory in a place everyone can write (/tmp): made 0700 by us, or refused,
            # before anything is created in it.
            try:
                os.mkdir(self._private_root, 0o700)
            except FileExistsError:
                pass
            why = untrusted_directory(self._private_root)
            if why is not None:
                raise JournalError(f"{self._private_root} {why}")
        existed = os.path.lexists(self.directory)
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        st = os.lstat(self.directory)
        if not stat.S_ISDIR(st.st_mode):
            raise JournalError(f"journal path {self.directory} is not a directory")
        if st.st_uid != os.getuid():
            raise JournalError(
                f"journal directory {self.directory} belongs to uid {st.st_uid}, not to us "
                f"(uid {os.getuid()}); refusing to write statuses there"
            )
        mode = stat.S_IMODE(st.st_mode)
        if mode != 0o700:
            why = not_private(self.directory, mode) if existed else None
            if why is not None:
                raise JournalError(f"journal directory {self.directory} {why}")
            os.chmod(self.directory, 0o700)  # makedirs honours the umask; tighten it
        return self.directory

    def replay_due(self) -> bool:
        """Whether ``install()`` should start a replay (``journaldir.replay_due``): in a constant
        number of system calls, whatever the journal holds."""
        return replay_due(self.directory)

    def replay_started(self) -> None:
        """Stamp the start of a replay (``journaldir.replay_started``). Raises OSError."""
        replay_started(self.directory)

    # -- entries ------------------------------------------------------------------------------

    def _path(self, run_id: str) -> str:
        if not _is_run_id(run_id):
            raise ValueError(f"not a run id: {run_id!r}")
        return os.path.join(self.directory, run_id + SUFFIX)

    def write(self, entry: Entry) -> str:
        """Atomically write (or replace) the entry for ``entry.run_id``."""
        self.ensure()
        path = self._path(entry.run_id)
        _note_kept(path)
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        write_whole(fd, tmp, entry.to_json().encode())
        os.replace(tmp, path)
        entry.path = path
        return path

    def remove(self, entry: Entry) -> None:
        path = entry.path or self._path(entry.run_id)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        # getattr: half made (another thread importing it), it has nothing kept yet.
        note_gone = getattr(sys.modules.get("lifeguard.lastgasp"), "note_gone", None)
        if note_gone is not None:
            note_gone(path)

    def claim(self, entry: Entry, wait: float = 0.0) -> Claim:
        """Hold ``entry``'s file while its status is written, so that two replays never write
        the same entry at once (see :class:`Claim`)."""
        return Claim(entry.path or self._path(entry.run_id), wait)

    def entries(self, run_ids: Iterable[str] | None = None) -> Iterator[Entry]:
        """Every trusted, readable entry (only those of ``run_ids``, if given: read by name,
        never listed, whatever else the journal holds). A file that is not the current user's
        private regular file is refused (see the module's docstring); a corrupt one is
        reported, set aside (renamed ``.corrupt``) and skipped: neither stops the others from
        being replayed. In a directory that is not private, nothing is read at all."""
        why = untrusted_directory(self.directory)
        if why is not None:
            self._refuse(
                f"refusing journal directory {self.directory}: it {why}; nothing in it is replayed"
            )
            return
        if run_ids is not None:
            names = sorted({run_id + SUFFIX for run_id in run_ids if _is_run_id(run_id)})
        else:
            try:
                names = sorted(self._put_in_place(os.listdir(self.directory)))
            except FileNotFoundError:
                return
        for name in names:
            if name.endswith(SUFFIX):
                entry = self._entry_at(os.path.join(self.directory, name), name[: -len(SUFFIX)])
                if entry is not None:
                    yield entry

    def _entry_at(self, path: str, run_id: str) -> Entry | None:
        """The entry in ``path``, which must be ``run_id``'s; None if it is gone (replayed by
        another process meanwhile), refused (not the user's private file) or corrupt (set
        aside), each said in one line."""
        try:
            entry = Entry.from_json(read_private(path).decode("utf-8"), path)
            if entry.run_id != run_id:
                raise ValueError(f"holds run {entry.run_id!r}, not the run its name says")
        except FileNotFoundError:
            return None
        except Untrusted as exc:
            self._refuse_file(path, str(exc))
            return None
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            self.set_aside(path, exc)
            return None
        return entry

    def _put_in_place(self, names: list[str]) -> set[str]:
        """``names``, with the entries their writers wrote but died before renaming into place
        (a SIGKILL in the microseconds between write() and rename(), see write): each is renamed
        into place now, as its writer would have done, unless a later entry for the run is there
        already. Only once its writer is known to be dead (or, where that cannot be known from
        here, ABANDONED_AFTER after it was written): a live writer renames it itself."""
        listed = set(names)
        for name in names:
            run_id = run_of_temporary(name)
            if run_id is None:
                continue
            temporary = os.path.join(self.directory, name)
            try:
                written = os.lstat(temporary)
            except FileNotFoundError:
                continue  # renamed by its writer, or by another replay, meanwhile
            age = time.time() - written.st_mtime
            if written.st_size == 0 and age < ABANDONED_AFTER:
                continue  # its writer may be about to write it
            entry = self._entry_at(temporary, run_id)
            if entry is None or not _abandoned(entry, age):
                continue
            path = self._path(run_id)
            with Claim(path, CLAIM_WAIT) as claim:
                if claim.state == BUSY:
                    continue  # a replay is writing the run's entry now: see it next time
                try:
                    if claim.state == HELD and os.lstat(path).st_mtime > written.st_mtime:
                        os.unlink(temporary)  # a later entry for the run stands
                    else:
                        os.replace(temporary, path)
                        logger().warning(
                            "journal entry %s was left unfinished by a process that died; "
                            "put in place as %s",
                            temporary,
                            path,
                        )
                except FileNotFoundError:
                    continue
            listed.add(run_id + SUFFIX)
        return listed

    def keep(self, entry: Entry) -> bool:
        """Write ``entry``; whether it was written. A journal that cannot take it (a full disk, a
        read-only home) is no news yet: the store write may still land the status. Only when
        that fails too does :func:`after_failed_write` say the status is lost for now, once."""
        try:
            self.write(entry)
        except (OSError, JournalError, ValueError) as exc:
            self.unusable = _first_line(exc)
            logger().debug("cannot journal run %s: %s", entry.run_id, exc)
            return False
        return True

    def _refuse_file(self, path: str, why: str) -> None:
        # The directory is ours and private: renaming the entry (never what a symlink points
        # to: rename acts on the link) is safe, and takes it out of every later replay.
        aside = path + REFUSED_SUFFIX
        try:
            os.replace(path, aside)
        except OSError:
            where = "left in place"
        else:
            where = f"set aside as {aside}"
        self._refuse(f"refusing journal file {path}: it {why}; {where}, not replayed")

    def _refuse(self, line: str) -> None:
        # Once per journal: a sweep reads it twice (to replay, then to spare what is still
        # journaled), and a directory refused stays refused; one line names it.
        if line in self.refused:
            return
        self.refused.append(line)
        logger().error("%s", line)

    def set_aside(self, path: str, reason: BaseException) -> None:
        aside = path + CORRUPT_SUFFIX
        logger().error("corrupt journal file %s (%s); set aside as %s", path, reason, aside)
        try:
            os.replace(path, aside)
        except OSError as exc:
            logger().error("could not set %s aside: %s", path, exc)


def _abandoned(entry: Entry, age: float) -> bool:
    """Whether the writer of an unfinished ``entry``, written ``age`` seconds ago, died without
    renaming it into place."""
    from lifeguard.owner import Owner

    if entry.writer is not None and entry.writer.same_process(Owner.current()):
        return False  # this process's own write, in another thread: alive, by definition
    alive = entry.writer_alive()
    return not alive and (alive is not None or age >= ABANDONED_AFTER)


def _is_run_id(name: str) -> bool:
    """Whether ``name`` can name an entry file in the directory (and nothing elsewhere)."""
    return bool(name) and "/" not in name and not name.startswith(".")


def _note_kept(path: str) -> None:
    """Tell the last gasp (``lifeguard.lastgasp``) that this process journaled ``path``: if the
    entry is still there when the process ends, a replayer is left behind to write it. Imported
    here, at the first entry, not at install(): a process that journals nothing never loads
    it, and one that does has it loaded well before its death, where nothing may be imported."""
    from lifeguard import lastgasp

    lastgasp.note_kept(path)


# What a claim on an entry found (Claim.state).
HELD = "held"  # the entry is ours to write until the claim is released
GONE = "gone"  # no entry any more: someone wrote it meanwhile (or it was set aside)
BUSY = "busy"  # another replay holds it, still after the wait
# How long a replay (install()'s, the sweep's) waits for an entry another one is writing: one
# attempt of a last-gasp replayer (lifeguard.guardian.replay.ATTEMPT, 5 s), and some.
CLAIM_WAIT = 10.0


class Claim:
    """An exclusive hold on one journal entry while its status is written: ``with
    journal.claim(entry, wait) as claim:``. Every replay (install()'s, the last gasp's,
    ``lifeguard sweep``'s) claims an entry before writing it, so two of them never write the
    same one at once; one after the other, the second finds it gone, or ended.

    An ``flock`` on the entry file itself: no other file to create or trust, and released by
    the kernel when its holder dies, even by SIGKILL. Held for one attempt, not a replayer's
    whole life: a sweep that comes meanwhile waits for that attempt, then finds the entry
    written, or writes it itself. Over NFS an flock is a lock on the server; a server that does
    not answer hangs reading the entry just as surely."""

    def __init__(self, path: str, wait: float) -> None:
        self.path = path
        self.wait = wait
        self.state = BUSY
        # The entry as it is on disk under the claim (it may have been replaced since it was
        # listed: a later process journaled the same run).
        self.entry: Entry | None = None
        self._fd = -1

    def __enter__(self) -> Claim:
        import fcntl

        give_up = time.monotonic() + self.wait
        while True:
            flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
            try:
                fd = os.open(self.path, flags)
            except FileNotFoundError:
                self.state = GONE
                return self
            except OSError:  # a symlink or worse: the next listing refuses it
                return self
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                if time.monotonic() >= give_up:
                    return self
                time.sleep(0.02)
                continue
            try:
                held, now = os.fstat(fd), os.lstat(self.path)
            except FileNotFoundError:  # written and removed while we waited
                os.close(fd)
                self.state = GONE
                return self
            if (held.st_dev, held.st_ino) != (now.st_dev, now.st_ino):
                os.close(fd)  # replaced while we waited: claim the entry there now
                continue
            self._fd = fd
            try:
                text = read_private(self.path).decode("utf-8")
                self.entry = Entry.from_json(text, self.path)
            except FileNotFoundError:
                self.state = GONE
                return self
            except (OSError, Untrusted, ValueError, UnicodeDecodeError):
                return self  # the next listing refuses it or sets it aside, saying why
            self.state = HELD
            return self

    def __exit__(self, *exc: object) -> None:
        if self._fd != -1:
            os.close(self._fd)  # releases the flock
            self._fd = -1


def after_failed_write(journal: Journal | None, entry: Entry, where: str, error: object) -> str:
    """A store write of ``entry`` failed: journal it unless it came from the journal, and say
    so, in one line that says what happens next. Returns the result both store paths (mlflow's
    and the REST one) report for it."""
    if journal is not None and entry.path is None:
        journal.keep(entry)
    if entry.path:
        next_step = f"kept in the journal ({entry.path})"
        if _journaled_here(entry.path):
            # A status this process leaves: the next install() on this journal replays it at
            # once (journaldir.replay_due), not at the next ten-minute round.
            replay_wanted(os.path.dirname(entry.path))
    else:
        why = journal.unusable if journal is not None and journal.unusable else "no journal"
        next_step = (
            f"and it could not be journaled ({why}): the run stays RUNNING until "
            "`lifeguard sweep` ends it"
        )
    logger().warning(
        "could not end run %s as %s at %s: %s; %s",
        entry.run_id,
        entry.status,
        where,
        _first_line(error),
        next_step,
    )
    return JOURNALED if entry.path else FAILED


def run_missing(journal: Journal | None, entry: Entry, where: str, error: object) -> str:
    """The store at ``where`` answered that it has no run ``entry.run_id`` (MISSING): a server
    re-created on an empty database at the same URI, a run deleted for good. The entry's own
    problem: it is kept (journaled if it was not), said in one line, and moved aside by a
    replay once the run has been missing for :data:`MISSING_BOUND` (``lifeguard.aside``); it
    never stops another entry, nor another run of the same store."""
    if journal is not None and entry.path is None:
        journal.keep(entry)
    kept = f"kept in the journal ({entry.path})" if entry.path else "not journaled"
    logger().warning(
        "run %s is not in the store at %s (%s): its %s status cannot be written "
        "there; %s, and moved aside if the run is still missing after %s",
        entry.run_id,
        where,
        _first_line(error),
        entry.status,
        kept,
        _hours(MISSING_BOUND),
    )
    return MISSING


def _hours(seconds: float) -> str:
    hours = seconds / 3600
    return f"{hours:g} hours" if hours < 48 else f"{hours / 24:g} days"


def _journaled_here(path: str) -> bool:
    """Whether this process wrote the entry at ``path`` (rather than read it: a replay)."""
    journaled_here = getattr(sys.modules.get("lifeguard.lastgasp"), "journaled_here", None)
    return journaled_here is not None and bool(journaled_here(path))


def _first_line(error: object) -> str:
    """One line of an error's text: a server's answer can be a whole HTML page."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
