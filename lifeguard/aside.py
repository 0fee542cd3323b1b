"""Journal entries that can never be written: how long each has failed, and moving them aside.

A status stays in the journal while its store cannot take it, and every replay tries it again.
Two kinds of entry never land, and would be tried for ever:

- **its run is missing**: the store answers, and has no such run (a server re-created on an
  empty database at the same URI, a run deleted for good). Known at once; the entry is kept for
  :data:`~lifeguard.journal.MISSING_BOUND` (a database restored from a backup brings the run
  back), counted from the first replay that found the run missing;
- **its store does not answer**: a server gone for good. It may come back, so the bound is
  longer (:data:`~lifeguard.journal.UNREACHABLE_BOUND`): the store has failed every attempt for
  that long, counted from its first failure with no success since, and the entry itself is
  that old.

Then a replay moves the entry to ``dead/`` in the journal directory (the same file, the same
0600, in a 0700 directory), adds why to it, and says so in one line. Nothing there is ever
replayed; ``lifeguard sweep`` lists it; moving the file back replays it.

Time is counted on the machine's boot clock (``CLOCK_BOOTTIME``, with the boot id), which no
wall-clock step moves; time across a reboot counts from the first failure after it (the time the
machine was down is not counted). An entry's own age is the only wall-clock figure, and it alone
never moves an entry: the store's span must have reached the bound too.

The records live in ``unwritable.state`` in the journal directory (a private file, read like an
entry, written whole under a lock): one per store that is failing, one per entry whose run is
missing. A replay reads it once and writes it once.
"""

from __future__ import annotations

import os
import sys
import time

from lifeguard._log import logger
from lifeguard.journal import (
    ALREADY_ENDED,
    ENDED,
    FAILED,
    JOURNALED,
    MISSING,
    MISSING_BOUND,
    NOT_SENT,
    SUFFIX,
    SUPERSEDED,
    UNREACHABLE_BOUND,
    Untrusted,
    read_private,
    untrusted_directory,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

    from lifeguard.journal import Entry, Journal

__all__ = ["DEAD", "STATE_NAME", "Failures", "Listed", "moved_aside"]

STATE_NAME = "unwritable.state"
LOCK_NAME = "unwritable.lock"
DEAD = "dead"
STATE_VERSION = 1
# One record per entry whose run is missing: a re-created server's 100,000 entries fit.
MAX_STATE_BYTES = 32 << 20
# Lines a replay says about the entries it moves aside, one each; past these, one line in all.
LINES = 20
# The results that are the store's answer (it is up), and those that are its failure.
_ANSWERED = frozenset({ENDED, ALREADY_ENDED, SUPERSEDED, MISSING})
_FAILED = frozenset({JOURNALED, FAILED, NOT_SENT})

# A span of failure: [boot id, boot clock at the first failure, at the last, seconds counted in
# earlier boots, wall-clock ms of the first failure (shown only), the last error].
Span = list[object]


def _boot_clock() -> tuple[str | None, float]:
    from lifeguard.owner import Owner

    clock = getattr(time, "CLOCK_BOOTTIME", None)
    up = time.clock_gettime(clock) if clock is not None else time.monotonic()
    return Owner.current().boot_id, up


def _failed_again(span: Span | None, boot: str | None, up: float, error: str) -> Span:
    """``span`` with one more failure seen now."""
    if span is None or not _valid(span):
        return [boot, up, up, 0.0, int(time.time() * 1000), error]
    old_boot, first, last, before = span[0], float(span[1]), float(span[2]), float(span[3])  # type: ignore[arg-type]
    if boot is not None and old_boot == boot and up >= last:
        return [boot, first, up, before, span[4], error or span[5]]
    # Another boot (or a clock that went back): the time in between is not counted.
    return [boot, up, up, before + (last - first), span[4], error or span[5]]


def _valid(span: object) -> bool:
    return (
        isinstance(span, list)
        and len(span) == 6
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in span[1:5])
        and isinstance(span[5], str)
    )


def _length(span: Span | None) -> float:
    """Seconds failed, on the boot clock: the earlier boots' and this one's."""
    if span is None or not _valid(span):
        return 0.0
    return float(span[3]) + float(span[2]) - float(span[1])  # type: ignore[arg-type]


def _duration(seconds: float) -> str:
    if seconds >= 2 * 86400:
        return f"{seconds / 86400:.0f} days"
    if seconds >= 2 * 3600:
        return f"{seconds / 3600:.0f} hours"
    return f"{seconds / 60:.0f} minutes"


class Failures:
    """What one replay learns about entries that do not land, and what it moves aside.

    Use: :meth:`load`, then for each entry tried :meth:`saw` its result (or ``NOT_SENT``) and
    :meth:`due` whether to move it aside (:meth:`move_aside`, under the entry's claim); then
    :meth:`save` once, and :meth:`say_the_rest`."""

    def __init__(self, journal: Journal, say: Callable[[str], None] | None = None) -> None:
        self.journal = journal
        # Where its lines go: lifeguard's log by default (a sweep's stderr); a replayer's own.
        self.say = say or _warn
        self.directory = journal.directory
        self.boot, self.up = _boot_clock()
        self.wall = time.time()
        self.stores: dict[str, Span] = {}
        self.missing: dict[str, Span] = {}
        self._events: list[tuple[str, str, str]] = []
        # What this replay moved aside: one dict per entry (the sweep's report).
        self.moved: list[dict[str, object]] = []
        self._said = 0
        self._untrusted = False
        self._failing: dict[str, float] = {}  # uri -> seconds failed, as of its last event

    # -- the records -------------------------------------------------------------------------

    def load(self) -> Failures:
        if untrusted_directory(self.directory) is not None:
            self._untrusted = True  # the journal refuses it too, and says why
            return self
        self.stores, self.missing = self._read()
        return self

    def _read(self) -> tuple[dict[str, Span], dict[str, Span]]:
        import json

        try:
            path = os.path.join(self.directory, STATE_NAME)
            data = json.loads(read_private(path, MAX_STATE_BYTES))
            if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
                raise ValueError("unknown format")
            stores, missing = data.get("stores"), data.get("missing")
            if not isinstance(stores, dict) or not isinstance(missing, dict):
                raise ValueError("unknown format")
        except FileNotFoundError:
            return {}, {}
        except (Untrusted, OSError, ValueError, UnicodeDecodeError) as exc:
            # Forgetting only delays: what failed is counted afresh from now.
            logger().error(
                "ignoring %s (it %s); failures are counted afresh",
                os.path.join(self.directory, STATE_NAME),
                exc,
            )
            return {}, {}
        return (
            {k: v for k, v in stores.items() if _valid(v)},
            {k: v for k, v in missing.items() if _valid(v)},
        )

    def saw(self, entry: Entry, result: str, error: str = "") -> None:
        """The result of trying ``entry`` (``NOT_SENT``: its store had failed already)."""
        self.observe(entry.run_id, entry.tracking_uri, result, error)

    def observe(self, run_id: str, uri: str, result: str, error: str = "") -> None:
        """:meth:`saw`, by the entry's run id and store."""
        from lifeguard.redact import redact

        # Kept in a file and shown in lines: a server's error text may quote a credential.
        error = redact(error.strip().splitlines()[0][:300]) if error.strip() else ""
        if result == MISSING and not error:
            error = "no such run"
        if result in _ANSWERED:
            self._event("answered", uri)
        elif result in _FAILED and result != NOT_SENT:
            self._event("failed", uri, error)
        if result == MISSING:
            self._event("missing", run_id, error)
        elif result in (ENDED, ALREADY_ENDED, SUPERSEDED):
            self._event("settled", run_id)

    def _event(self, kind: str, key: str, error: str = "") -> None:
        self._events.append((kind, key, error))
        _apply(self.stores, self.missing, kind, key, error, self.boot, self.up)
        self._failing.pop(key, None)

    def _store_failing(self, uri: str) -> float:
        """How long ``uri`` has failed (asked once per entry of a dead store: kept)."""
        failing = self._failing.get(uri)
        if failing is None:
            failing = self._failing[uri] = _length(self.stores.get(uri))
        return failing

    def due(self, entry: Entry, result: str) -> str | None:
        """Why ``entry``, which just came to ``result``, is to be moved aside now; None to keep
        it."""
        if self._untrusted:
            return None
        if result == MISSING:
            span = self.missing.get(entry.run_id)
            if _length(span) < MISSING_BOUND:
                return None
            return (
                f"its run has not been in the store at {_shown(entry.tracking_uri)} for "
                f"{_duration(_length(span))} ({_error(span)})"
            )
        if result not in _FAILED:
            return None
        failing = self._store_failing(entry.tracking_uri)
        if failing < UNREACHABLE_BOUND:
            return None
        since = entry.journaled_at if entry.journaled_at is not None else entry.end_time
        if self.wall - since / 1000 < UNREACHABLE_BOUND:
            return None
        span = self.stores.get(entry.tracking_uri)
        return (
            f"the store at {_shown(entry.tracking_uri)} has failed every attempt for "
            f"{_duration(failing)} ({_error(span)})"
        )

    def save(self, listed: Listed | None = None) -> None:
        """Add what this replay saw to ``unwritable.state``, under its lock (another replay may
        save meanwhile). ``listed``: the journal's entries, when this replay listed it whole:
        records of entries gone, and of stores with no entry left, are dropped."""
        import json

        path = os.path.join(self.directory, STATE_NAME)
        if self._untrusted:
            return
        if not self.stores and not self.missing and not os.path.lexists(path):
            return  # nothing is failing, nothing to forget: no file is created
        lock = _lock(self.directory)
        try:
            stores, missing = self._read()
            for kind, key, error in self._events:
                _apply(stores, missing, kind, key, error, self.boot, self.up)
            if listed is not None:
                missing = {k: v for k, v in missing.items() if k in listed.runs}
                stores = {k: v for k, v in stores.items() if k in listed.uris}
            if not stores and not missing:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
                return
            text = json.dumps(
                {"version": STATE_VERSION, "stores": stores, "missing": missing}, sort_keys=True
            )
            _write_private(path, text.encode())
        except OSError as exc:
            logger().debug("could not record failures in %s: %s", self.directory, exc)
        finally:
            if lock != -1:
                os.close(lock)

    # -- moving aside --------------------------------------------------------------------------

    def take_aside(self, entry: Entry, why: str) -> bool:
        """:meth:`move_aside` for an entry not held yet: under its claim, as it is on disk now
        (journaled again since by another process, it is that process's, and stays)."""
        from lifeguard.journal import HELD

        with self.journal.claim(entry, wait=0.0) as claim:
            if claim.state != HELD or claim.entry is None or claim.entry.pid != entry.pid:
                return False
            return self.move_aside(claim.entry, why)

    def move_aside(self, entry: Entry, why: str) -> bool:
        """Move ``entry`` (held under its claim) to ``dead/``, with ``why`` added to it, and say
        so in one line. Whether it was moved."""
        if entry.path is None:
            return False
        dead = os.path.join(self.directory, DEAD)
        try:
            os.mkdir(dead, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            logger().debug("cannot create %s: %s", dead, exc)
            return False
        refused = untrusted_directory(dead)
        if refused is not None:
            logger().error("not moving journal entries to %s: it %s", dead, refused)
            return False
        target = _free_name(dead, entry.run_id)
        try:
            os.rename(entry.path, target)  # the same file: its owner and 0600 go with it
        except OSError as exc:
            logger().debug("could not move %s aside: %s", entry.path, exc)
            return False
        _annotate(target, why)
        # getattr: half made (another thread importing it), it has nothing kept yet.
        note_gone = getattr(sys.modules.get("lifeguard.lastgasp"), "note_gone", None)
        if note_gone is not None:
            note_gone(entry.path)
        self._event("settled", entry.run_id)
        self.moved.append(
            {
                "run_id": entry.run_id,
                "tracking_uri": _shown(entry.tracking_uri),
                "status": entry.status,
                "end_time": entry.end_time,
                "why": why,
                "path": target,
            }
        )
        self._said += 1
        if self._said <= LINES:
            self.say(
                f"the {entry.status} status of run {entry.run_id} can never be "
                f"written: {why}; its journal entry is moved aside to {target}"
            )
        return True

    def say_the_rest(self) -> None:
        """One line for the entries moved aside past the first :data:`LINES`."""
        if self._said > LINES:
            self.say(
                f"{self._said - LINES} more journal entries that can never be "
                f"written were moved aside to {os.path.join(self.directory, DEAD)} "
                "(`lifeguard sweep` lists them)"
            )


def _warn(line: str) -> None:
    logger().warning("%s", line)


class Listed:
    """The run ids and stores of a whole listing of the journal (names only: 100,000 entries
    are a few MiB here, where the entries themselves would be tens)."""

    def __init__(self) -> None:
        self.runs: set[str] = set()
        self.uris: set[str] = set()

    def add(self, entry: Entry) -> Entry:
        self.runs.add(entry.run_id)
        self.uris.add(entry.tracking_uri)
        return entry


def _apply(
    stores: dict[str, Span],
    missing: dict[str, Span],
    kind: str,
    key: str,
    error: str,
    boot: str | None,
    up: float,
) -> None:
    if kind == "answered":
        stores.pop(key, None)
    elif kind == "failed":
        stores[key] = _failed_again(stores.get(key), boot, up, error)
    elif kind == "missing":
        missing[key] = _failed_again(missing.get(key), boot, up, error)
    elif kind == "settled":
        missing.pop(key, None)


def _error(span: Span | None) -> str:
    text = span[5] if span is not None and _valid(span) else ""
    return str(text) or "no answer"


def _shown(uri: str) -> str:
    from lifeguard.redact import redact_uri

    return redact_uri(uri)


def _free_name(directory: str, run_id: str) -> str:
    """``dead/<run>.json``, or ``<run>.N.json`` if a run was moved aside there before."""
    target = os.path.join(directory, run_id + SUFFIX)
    n = 1
    while os.path.lexists(target):
        target = os.path.join(directory, f"{run_id}.{n}{SUFFIX}")
        n += 1
    return target


def _annotate(path: str, why: str) -> None:
    """Add why (and when) to an entry moved aside: whoever finds it there can read it."""
    import json

    try:
        data = json.loads(read_private(path))
        if isinstance(data, dict):
            data["moved_aside"] = {"at": int(time.time() * 1000), "why": why}
            _write_private(path, json.dumps(data, sort_keys=True).encode())
    except (OSError, Untrusted, ValueError, UnicodeDecodeError) as exc:
        logger().debug("could not note why %s was moved aside: %s", path, exc)


def _write_private(path: str, data: bytes) -> None:
    """Replace ``path`` atomically with ``data``, 0600, never through a symlink. Raises
    OSError."""
    tmp = f"{path}.{os.getpid()}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(tmp, flags, 0o600)
    try:
        os.fchmod(fd, 0o600)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _lock(directory: str) -> int:
    """An exclusive ``flock`` for the read-modify-write of the state file (-1 if none can be
    had: then the last writer wins, which only delays a move aside)."""
    import fcntl

    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(os.path.join(directory, LOCK_NAME), flags, 0o600)
    except OSError:
        return -1
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        os.close(fd)
        return -1
    return fd


def moved_aside(journal: Journal, limit: int = 100) -> tuple[int, list[dict[str, object]]]:
    """(how many entries are in ``dead/``, the first ``limit`` of them, by name: run id, store,
    status, end time, why, path). What ``lifeguard sweep`` reports."""
    import json

    dead = os.path.join(journal.directory, DEAD)
    if untrusted_directory(dead) is not None:
        return 0, []
    try:
        names = sorted(n for n in os.listdir(dead) if n.endswith(SUFFIX))
    except FileNotFoundError:
        return 0, []
    found: list[dict[str, object]] = []
    for name in names[:limit]:
        path = os.path.join(dead, name)
        try:
            data = json.loads(read_private(path))
        except (OSError, Untrusted, ValueError, UnicodeDecodeError):
            continue
        if not isinstance(data, dict):
            continue
        aside = data.get("moved_aside")
        found.append(
            {
                "run_id": data.get("run_id"),
                "tracking_uri": data.get("tracking_uri"),
                "status": data.get("status"),
                "end_time": data.get("end_time"),
                "why": aside.get("why") if isinstance(aside, dict) else None,
                "path": path,
            }
        )
    return len(names), found
