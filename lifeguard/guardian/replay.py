"""Replay the journal in a process of its own, detached (``lifeguard.lastgasp`` starts it).

``python -m lifeguard.guardian.replay``: ``install()``'s replay. Writes every pending status
whose writer is gone and whose store answers, once, as ``replay``, and exits. Its output goes
nowhere: the program that started it must not see it.

``python -m lifeguard.guardian.replay --last-gasp --writer PID --wait-fd FD ... -- RUN_ID ...``:
the replayer a dying program leaves behind for the statuses it could only journal. It:

1. waits for every process behind the inherited pidfds to be gone: the writer (its death
   releases sqlite's lock, and it can no longer write or remove an entry) and its guardians (a
   watchdog, a supervisor), which write what it journaled first;
2. takes the writer's entries among ``RUN_ID ...`` (the ones it left, still journaled by it);
3. writes them, each under the journal's claim (two replays never write one entry at once),
   never over a run adopted since (``owner.adopted_since``), retrying with backoff while the
   store does not answer, for at most ``LIFEGUARD_REPLAY_BOUND`` seconds from its start
   (default 600);
4. exits; whatever is still journaled stays for the next ``install()`` on this machine and
   ``lifeguard sweep``, and it says so in one line.

Both write through the same stores: an http(s) server over REST (``rest``, as the watchdog: no
mlflow import), an absolute sqlite path through the standard library (``sqlitestore``: writing
within a second of the death, which an import of mlflow alone would take longer than on a loaded
machine; and no import of mlflow beside a program that is starting up), anything else through
mlflow. Its one line goes to the program's stderr when that was a file or a
terminal; otherwise (a pipe, which it must not hold open) to ``replayer.log`` in the journal
directory. It runs in a session of its own: the job's Ctrl-C and a closing terminal miss it. It
dies with the job where everything in it dies (Slurm's ``proctrack/cgroup``, a whole-container
kill); ``lifeguard sweep`` is the remedy there.
"""

from __future__ import annotations

import os
import select
import sys
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    import logging
    from collections.abc import Sequence

    from lifeguard.guardian import rest
    from lifeguard.guardian.sqlitestore import SqliteStore
    from lifeguard.guardian.watchdog import _MlflowStore
    from lifeguard.journal import Entry, Journal

    Store = rest.RestStore | SqliteStore | _MlflowStore

__all__ = ["INSTALL_ATTEMPT", "main"]

# Seconds for one attempt of install()'s replay at one entry (a request, a wait on sqlite's
# lock): a store that does not answer within it is given up on for this round. Nobody waits on
# this replay, so it is as patient as MLflow's own client would be (its 20 s sqlite busy wait).
INSTALL_ATTEMPT = 30.0
# One attempt of the last gasp at one entry: a request (connect, send, each read) or a wait on
# sqlite's lock. A server that comes back is seen within this plus the pause between rounds.
ATTEMPT = 5.0
# The pauses between rounds: doubling from the first, never more than the last.
BACKOFF = (0.25, 5.0)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--last-gasp"]:
        return last_gasp(args[1:])
    # Started by install(), detached, it may outlive the program by minutes (a store that does
    # not answer): a pipe of the program's launcher held open here would keep it waiting.
    _close_inherited(keep=())
    return at_install()


def at_install() -> int:
    """Write every pending status whose writer is gone, as the last gasp writes (:class:`_Stores`:
    sqlite and REST without importing mlflow, which would cost seconds of CPU beside the program
    starting up), each under the journal's claim, as ``replay``. Each attempt may take
    :data:`INSTALL_ATTEMPT`, the whole replay as long as its entries need: only a store that
    failed is given up on, for this round. 1 if any is left pending."""
    from lifeguard.backends.mlflow.heartbeat import ADOPT_EVERY
    from lifeguard.journal import CLAIM_WAIT, GONE, JOURNALED, Journal

    # The program that started this replay may be about to resume one of these very runs (a
    # requeued job's next attempt): its heartbeat rewrites the owner tags within ADOPT_EVERY of
    # the resume, and the write then leaves the run alone (SUPERSEDED). Give it two of those
    # first; nobody waits on this process.
    time.sleep(2 * ADOPT_EVERY)
    # Reads only the user's own private entries (journal.py): a planted one is refused, never
    # sent anywhere with the user's credentials.
    journal = Journal()
    stores = _Stores(attempt=INSTALL_ATTEMPT)
    dead: set[str] = set()  # stores that failed once: not asked again in this replay
    pending = False
    try:
        for entry in journal.entries():
            if entry.writer_alive() is True:
                continue  # it may still be finalizing: it writes this itself, or its guardian
            if entry.tracking_uri in dead:
                pending = True
                continue
            with journal.claim(entry, wait=CLAIM_WAIT) as claim:
                if claim.state == GONE or claim.entry is None:
                    continue  # written by another replay, or being written by one now
                if claim.entry.writer_alive() is True:
                    continue  # journaled again since the listing, by a process still running
                try:
                    entry_now = claim.entry.written_by("replay")
                    result, _ = stores.apply(entry_now, journal, give_up=float("inf"))
                except ImportError:
                    result = JOURNALED  # a store only mlflow can write, and no mlflow here
                except Exception:  # noqa: BLE001 - this entry's own: the others still go
                    pending = True  # it stays journaled, for the next replay or the sweep
                    continue
            if result == JOURNALED:
                dead.add(entry.tracking_uri)
                pending = True
    finally:
        stores.close()
    return 1 if pending or journal.refused else 0


# -- the last gasp --------------------------------------------------------------------------


def last_gasp(args: Sequence[str]) -> int:
    started = time.monotonic()
    writer, wait_fds, run_ids = _parse(args)
    _close_inherited(keep=wait_fds)
    from lifeguard.journal import Journal
    from lifeguard.lastgasp import BOUND_ENV, DEFAULT_BOUND

    journal = Journal()
    log = _logger(journal.directory)
    bound = _bound(os.environ.get(BOUND_ENV), DEFAULT_BOUND)
    give_up = started + bound
    if not _wait_for_exits(writer, wait_fds, give_up):
        _say(
            log,
            f"lifeguard: pid {writer} still ran after the replayer's bound of {bound:g} s; "
            f"its journaled statuses stay in {journal.directory} for the next "
            "lifeguard.install() on this machine or `lifeguard sweep`",
        )
        return 1
    wanted = set(run_ids)
    # Only what this writer left: another process's entries are its own replayer's, or
    # install()'s and the sweep's, which check that their writer is gone.
    pending = [e for e in journal.entries() if e.run_id in wanted and e.pid == writer]
    if not pending:
        return 0  # written meanwhile (by a guardian): nothing imported, nothing to say
    return _replay(pending, journal, writer, give_up, bound, log)


def _parse(args: Sequence[str]) -> tuple[int, list[int], list[str]]:
    writer, fds, run_ids = 0, [], []
    i = 0
    while i < len(args):
        if args[i] == "--writer":
            writer = int(args[i + 1])
            i += 2
        elif args[i] == "--wait-fd":
            fds.append(int(args[i + 1]))
            i += 2
        elif args[i] == "--":
            run_ids = list(args[i + 1 :])
            break
        else:
            raise SystemExit(f"lifeguard replay: unknown argument {args[i]!r}")
    return writer, fds, run_ids


def _close_inherited(keep: Sequence[int]) -> None:
    """Close every fd the dying program passed on but the pidfds: a pipe of its launcher held
    open here would keep the launcher waiting for its end of file for the whole bound."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = 1 << 20 if soft == resource.RLIM_INFINITY else int(soft)  # close_range(2): O(open fds)
    low = 3
    for fd in sorted(keep):
        if fd >= low:
            os.closerange(low, fd)
            low = fd + 1
    os.closerange(low, top)


def _bound(raw: str | None, default: float) -> float:
    from lifeguard.options import parse_seconds

    if raw is None:
        return default
    try:
        return parse_seconds(raw, "LIFEGUARD_REPLAY_BOUND", zero=True)
    except (TypeError, ValueError):
        return default  # install() refuses such a value; one set after it, here, is ignored


# The handler that writes lifeguard's lines where this replayer speaks (see _logger).
_out: logging.Handler | None = None


def _logger(directory: str) -> logging.Logger:
    """lifeguard's logger, redacted, to the program's stderr when the replayer was given it,
    else appended to ``replayer.log`` in the journal directory: the refusals of planted journal
    files (errors) always; a failed attempt (a warning) never, for it is tried again; the final
    line (see :func:`_say`)."""
    import logging

    from lifeguard._log import logger

    global _out
    logging.raiseExceptions = False  # a closed terminal must not turn one line into a traceback
    log = logger()
    from lifeguard.guardian.logfile import LOG_NAME, FileLog

    stream = FileLog(os.path.join(directory, LOG_NAME)) if _stderr_is_devnull() else sys.stderr
    _out = logging.StreamHandler(stream)
    if stream is not sys.stderr:
        _out.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%Y-%m-%dT%H:%M:%S%z"))
    else:
        _out.setFormatter(logging.Formatter("%(message)s"))
    _out.setLevel(logging.ERROR)
    log.addHandler(_out)
    log.propagate = False
    log.setLevel(logging.WARNING)
    return log


def _wait_for_exits(writer: int, fds: Sequence[int], give_up: float) -> bool:
    """Whether every process behind ``fds`` (pidfds: readable once it exits) is gone before
    ``give_up``. Without a pidfd (an old kernel), the writer's pid is polled."""
    waiting = list(fds)
    while waiting:
        left = give_up - time.monotonic()
        if left <= 0:
            return False
        ready, _, _ = select.select(waiting, [], [], left)
        waiting = [fd for fd in waiting if fd not in ready]
    if fds:
        return True
    while _alive(writer):
        if time.monotonic() >= give_up:
            return False
        time.sleep(0.05)
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _replay(
    pending: list[Entry],
    journal: Journal,
    writer: int,
    give_up: float,
    bound: float,
    log: logging.Logger,
) -> int:
    from lifeguard.journal import ENDED, GONE, HELD

    stores = _Stores()
    pause = BACKOFF[0]
    last_error = ""
    try:
        while True:
            dead: set[str] = set()  # stores that failed this round: not asked again in it
            still: list[Entry] = []
            for entry in pending:
                if entry.tracking_uri in dead or time.monotonic() >= give_up:
                    still.append(entry)
                    continue
                with journal.claim(entry, wait=0.0) as claim:
                    if claim.state == GONE:
                        continue  # written by another replay (install()'s, the sweep's)
                    if claim.state != HELD or claim.entry is None:
                        still.append(entry)  # another replay is at it now: see next round
                        continue
                    current = claim.entry
                    if current.pid != writer:
                        continue  # journaled again since, by a later process: its own now
                    result, error = stores.apply(current, journal, give_up)
                if result == ENDED or result in _DONE:
                    continue
                still.append(current)
                dead.add(current.tracking_uri)
                last_error = error or last_error
            pending = still
            if not pending:
                return 0
            left = give_up - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(pause, left))
            pause = min(pause * 2, BACKOFF[1])
    finally:
        stores.close()
    stores_named = ", ".join(sorted({_shown(e.tracking_uri) for e in pending}))
    why = f": {last_error}" if last_error else ""
    _say(
        log,
        f"lifeguard: {len(pending)} run status(es) journaled by pid {writer} could not be "
        f"written to {stores_named} within the replayer's bound of {bound:g} s{why}; they stay "
        f"in {journal.directory} for the next lifeguard.install() on this machine or "
        "`lifeguard sweep`",
    )
    return 1


_DONE = frozenset({"already ended", "superseded"})


def _shown(uri: str) -> str:
    from lifeguard.redact import redact_uri

    return redact_uri(uri)


def _say(log: logging.Logger, line: str) -> None:
    """The one line the last gasp says when it leaves statuses behind."""
    import logging

    if _out is not None:
        _out.setLevel(logging.WARNING)
    log.warning("%s", line)


def _stderr_is_devnull() -> bool:
    try:
        mine, null = os.fstat(2), os.stat(os.devnull)
    except OSError:
        return True
    return (mine.st_dev, mine.st_ino, mine.st_rdev) == (null.st_dev, null.st_ino, null.st_rdev)


class _Stores:
    """The store for each URI, made once: REST for an http(s) server, the standard library's
    sqlite3 for an absolute sqlite path, mlflow for anything else (imported only then)."""

    def __init__(self, attempt: float = ATTEMPT) -> None:
        import contextlib

        self.attempt = attempt  # the longest one attempt at one entry may take
        self.made: dict[str, Store] = {}
        self._exits = contextlib.ExitStack()
        self._bounded = False

    def get(self, uri: str) -> Store:
        store = self.made.get(uri)
        if store is None:
            store = self.made[uri] = self._make(uri)
        return store

    def _make(self, uri: str) -> Store:
        from lifeguard.guardian import rest, sqlitestore

        if rest.unsupported(uri) is None:
            return rest.RestStore(uri, rest.Budget(self.attempt))
        if sqlitestore.unsupported(uri) is None:
            store = sqlitestore.SqliteStore(uri)
            try:
                store.check()
            except sqlitestore.SchemaError:
                return self._mlflow(uri)
            except Exception:  # noqa: BLE001 - locked or unreadable now: its write says so
                pass
            return store
        return self._mlflow(uri)

    def _mlflow(self, uri: str) -> _MlflowStore:
        from lifeguard.backends.mlflow import runs
        from lifeguard.guardian.watchdog import _MlflowStore

        if not self._bounded:
            # This process's own environment: every attempt bounded, no retries of MLflow's.
            self._exits.enter_context(runs.bounded_http(self.attempt))
            self._bounded = True
        return _MlflowStore(uri)

    def apply(self, entry: Entry, journal: Journal, give_up: float) -> tuple[str, str]:
        """(the result of one attempt at ``entry``, the error if it failed). The entry is
        written as it stands (install()'s replay has made it ``replay``'s; the last gasp keeps
        the dead writer's ``ended_by``), through the store's own ``apply_journaled``, as the
        watchdog writes what it finds journaled: never over a run adopted since, and not at
        all while the run cannot be read."""
        from lifeguard.guardian import rest
        from lifeguard.guardian.sqlitestore import SchemaError, SqliteStore
        from lifeguard.journal import JOURNALED

        attempt = max(0.2, min(self.attempt, give_up - time.monotonic()))
        store = self.get(entry.tracking_uri)
        errors = _Errors(store.tracking_uri)
        with errors:
            if isinstance(store, SqliteStore):
                store.busy = attempt
                try:
                    result = store.apply(entry, journal=journal)
                    return (result, errors.last) if result == JOURNALED else (result, "")
                except SchemaError:
                    store = self.made[entry.tracking_uri] = self._mlflow(entry.tracking_uri)
            if isinstance(store, rest.RestStore):
                store.budget = rest.Budget(attempt)
            result = store.apply_journaled(entry, journal=journal, ended_by=None)
        return (result, errors.last) if result == JOURNALED else (result, "")

    def close(self) -> None:
        self._exits.close()


class _Errors:
    """Catches the line a failed write logs (``journal.after_failed_write``, a warning, which
    the stderr handler does not show: the replayer tries again), to name the cause in the final
    line."""

    def __init__(self, where: str) -> None:
        self.where = f" at {where}: "
        self.last = ""
        self._handler: logging.Handler | None = None

    def __enter__(self) -> _Errors:
        import logging

        from lifeguard._log import logger

        errors = self

        class Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                message = record.getMessage()
                cause = message.partition(errors.where)[2].partition("; kept in the journal")[0]
                errors.last = cause or message

        self._handler = Keep(logging.WARNING)
        logger().addHandler(self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        from lifeguard._log import logger

        if self._handler is not None:
            logger().removeHandler(self._handler)


if __name__ == "__main__":
    sys.exit(main())
