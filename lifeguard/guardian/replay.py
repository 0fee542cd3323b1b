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
    from collections.abc import Callable, Sequence

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
    failed is given up on, for this round; an entry whose run is missing stops nothing else.
    An entry that can never be written is moved aside once past its bound (``lifeguard.aside``),
    said in ``replayer.log``. 1 if any is left pending."""
    from lifeguard.aside import Failures, Listed
    from lifeguard.backends.mlflow.heartbeat import ADOPT_EVERY
    from lifeguard.journal import CLAIM_WAIT, GONE, HELD, JOURNALED, MISSING, NOT_SENT, Journal

    # The program that started this replay may be about to resume one of these very runs (a
    # requeued job's next attempt): its heartbeat rewrites the owner tags within ADOPT_EVERY of
    # the resume, and the write then leaves the run alone (SUPERSEDED). Give it two of those
    # first; nobody waits on this process.
    time.sleep(2 * ADOPT_EVERY)
    # Reads only the user's own private entries (journal.py): a planted one is refused, never
    # sent anywhere with the user's credentials.
    journal = Journal()
    # Its output goes nowhere: what it refuses and what it moves aside go to replayer.log.
    log = _logger(journal.directory)
    failures = Failures(journal, say=lambda line: _tell(log, line)).load()
    listed = Listed()
    stores = _Stores(attempt=INSTALL_ATTEMPT)
    dead: set[str] = set()  # stores that failed once: not asked again in this replay
    alive = _WritersAlive()
    pending = False
    try:
        for entry in map(listed.add, journal.entries()):
            if alive(entry):
                continue  # it may still be finalizing: it writes this itself, or its guardian
            if entry.tracking_uri in dead:
                why = failures.due(entry, NOT_SENT)
                if why is None or not failures.take_aside(entry, why):
                    pending = True
                continue
            moved = False
            with journal.claim(entry, wait=CLAIM_WAIT) as claim:
                if claim.state == GONE or claim.entry is None:
                    continue  # written by another replay, or being written by one now
                if alive(claim.entry):
                    continue  # journaled again since the listing, by a process still running
                try:
                    entry_now = claim.entry.written_by("replay")
                    result, error = stores.apply(entry_now, journal, give_up=float("inf"))
                except ImportError:
                    result, error = JOURNALED, "a store only mlflow can write, and no mlflow here"
                except Exception:  # noqa: BLE001 - this entry's own: the others still go
                    pending = True  # it stays journaled, for the next replay or the sweep
                    continue
                failures.saw(claim.entry, result, error)
                why = failures.due(claim.entry, result)
                if why is not None and claim.state == HELD:
                    moved = failures.move_aside(claim.entry, why)
            if result == JOURNALED:
                dead.add(entry.tracking_uri)  # the store failed; a missing run is no such sign
            if result in (JOURNALED, MISSING) and not moved:
                pending = True
    finally:
        stores.close()
        failures.save(listed)
        failures.say_the_rest()
    return 1 if pending or journal.refused else 0


class _WritersAlive:
    """``Entry.writer_alive() is True``, asked once per writer: a journal of 100,000 entries
    from a few dead processes reads /proc a few times, not 100,000."""

    def __init__(self) -> None:
        self.known: dict[str, bool] = {}

    def __call__(self, entry: Entry) -> bool:
        writer = entry.writer
        if writer is None:
            return False
        key = repr(tuple(writer.fields().values()))
        alive = self.known.get(key)
        if alive is None:
            alive = self.known[key] = entry.writer_alive() is True
        return alive


# -- the last gasp --------------------------------------------------------------------------


def last_gasp(args: Sequence[str]) -> int:
    started = time.monotonic()
    writer, wait_fds, run_ids = _parse(args)
    _close_inherited(keep=wait_fds)
    from lifeguard.journaldir import SUFFIX, default_dir
    from lifeguard.lastgasp import BOUND_ENV, DEFAULT_BOUND

    # This process only waits (for the writer, then between rounds), for up to its bound, and
    # holds no more than waiting needs: each round of writes runs in a child of its own, which
    # imports what the stores need (an HTTP client, sqlite3) and is gone with it (_Rounds).
    directory = default_dir()
    bound = _bound(os.environ.get(BOUND_ENV), DEFAULT_BOUND)
    give_up = started + bound
    if not _wait_for_exits(writer, wait_fds, give_up):
        _say(
            _logger(directory),
            f"pid {writer}, or a guardian of its that holds its statuses, still ran after the "
            f"replayer's bound of {bound:g} s; "
            f"its journaled statuses stay in {directory} for the next "
            "lifeguard.install() on this machine or `lifeguard sweep`",
        )
        return 1
    # Only what this writer left, looked up by name: the journal's other entries, however
    # many, are not read here (another process's are its own replayer's, or install()'s and
    # the sweep's, which check that their writer is gone).
    pending = [
        run_id
        for run_id in run_ids
        if "/" not in run_id
        and not run_id.startswith(".")
        and os.path.lexists(os.path.join(directory, run_id + SUFFIX))
    ]
    if not pending:
        return 0  # written meanwhile (by a guardian): nothing imported, nothing to say
    return _Rounds(directory, writer, give_up, bound).run(pending)


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
    # The logger's name says whose line it is: the program that left it has ended.
    if stream is not sys.stderr:
        _out.setFormatter(
            logging.Formatter("%(asctime)s %(name)s: %(message)s", "%Y-%m-%dT%H:%M:%S%z")
        )
    else:
        _out.setFormatter(logging.Formatter("%(name)s: %(message)s"))
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


class _Rounds:
    """The last gasp's rounds of writes, with backoff between them, until its entries are
    written or its bound is reached. Each round runs in a forked child that reports back on a
    pipe and exits: the replayer that waits through an outage keeps about 10 MiB, where one
    that had made a request itself would keep the HTTP client's modules (twice that). A
    store that only mlflow can write is the exception: its import costs seconds of CPU, so
    once a round needed it, the rounds run in this process."""

    def __init__(self, directory: str, writer: int, give_up: float, bound: float) -> None:
        self.directory = directory
        self.writer = writer
        self.give_up = give_up
        self.bound = bound
        self.apart = True
        # Every result, in order: recorded once, at the end (lifeguard.aside).
        self.seen: list[tuple[str, str, str, str]] = []
        self.stores: dict[str, str] = {}  # run id -> its store, redacted
        self.missing: list[str] = []  # run ids whose store has no such run

    def run(self, pending: list[str]) -> int:
        pause = BACKOFF[0]
        last_error = ""
        while True:
            if self.apart:
                report = self._apart(pending)
            else:
                report = _round(pending, self.writer, self.give_up)
            self.apart = self.apart and not report.mlflow
            self.seen.extend(report.seen)
            self.stores.update(report.stores)
            self.missing += [r for r in report.missing if r not in self.missing]
            last_error = report.error or last_error
            pending = report.left
            if not pending:
                break
            left = self.give_up - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(pause, left))
            pause = min(pause * 2, BACKOFF[1])
        if self.apart:  # the records and the lines too: this process never grows
            self._forked(lambda: self._finish(pending, last_error))
        else:
            self._finish(pending, last_error)
        return 1 if pending or self.missing else 0

    def _finish(self, pending: list[str], last_error: str) -> bytes:
        """Record what the rounds saw, and say what is left, in one line each."""
        self._record()
        if not pending and not self.missing:
            return b""
        log = _logger(self.directory)
        if self.missing:
            named = ", ".join(sorted({self.stores.get(r, "?") for r in self.missing}))
            _say(
                log,
                f"{len(self.missing)} run status(es) journaled by pid {self.writer} "
                f"are for runs that {named} does not have (run {self.missing[0]}); they stay in "
                f"{self.directory} and are moved aside after {_hours()} by the next "
                "lifeguard.install() on this machine or `lifeguard sweep`",
            )
        if pending:
            named = ", ".join(sorted({self.stores.get(r, "?") for r in pending}))
            why = f": {last_error}" if last_error else ""
            _say(
                log,
                f"{len(pending)} run status(es) journaled by pid {self.writer} could "
                f"not be written to {named} within the replayer's bound of {self.bound:g} "
                f"s{why}; they stay in {self.directory} for the next lifeguard.install() on "
                "this machine or `lifeguard sweep`",
            )
        return b""

    def _apart(self, pending: list[str]) -> _Report:
        """One round in a forked child. A child that dies without a report wrote what it
        wrote: the entries still there are tried again."""
        import marshal  # built in: nothing to load (json would bring re and enum along)

        data = self._forked(
            lambda: marshal.dumps(_round(pending, self.writer, self.give_up).dump())
        )
        try:
            return _Report.load(marshal.loads(data))
        except (EOFError, ValueError, TypeError):
            return _Report(left=pending, error="a round of writes ended without a report")

    @staticmethod
    def _forked(work: Callable[[], bytes]) -> bytes:
        """What ``work`` returns, run in a forked child, which is gone once it has (with all
        it imported). Empty if the child died first."""
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: the work, its answer, gone
            code = 1
            try:
                os.close(read_fd)
                data = memoryview(work())
                while data:
                    data = data[os.write(write_fd, data) :]
                code = 0
            finally:
                try:
                    sys.stderr.flush()
                finally:
                    os._exit(code)
        os.close(write_fd)
        chunks = []
        try:
            while chunk := os.read(read_fd, 1 << 16):
                chunks.append(chunk)
        finally:
            os.close(read_fd)
            os.waitpid(pid, 0)
        return b"".join(chunks)

    def _record(self) -> None:
        """What the rounds saw, added to the journal's failure records (lifeguard.aside) once:
        when a store started failing, which runs it does not have."""
        if not self.seen:
            return
        from lifeguard.aside import Failures
        from lifeguard.journal import Journal

        failures = Failures(Journal(self.directory)).load()
        for run_id, uri, result, error in self.seen:
            failures.observe(run_id, uri, result, error)
        failures.save()


class _Report:
    """What one round came to."""

    def __init__(
        self,
        left: list[str],
        error: str = "",
        stores: dict[str, str] | None = None,
        missing: list[str] | None = None,
        seen: list[tuple[str, str, str, str]] | None = None,
        mlflow: bool = False,
    ) -> None:
        self.left = left  # run ids to try again
        self.error = error  # the last failure's cause
        self.stores = stores or {}
        self.missing = missing or []
        self.seen = seen or []
        self.mlflow = mlflow  # mlflow was imported: later rounds run in the replayer itself

    def dump(
        self,
    ) -> tuple[list[str], str, dict[str, str], list[str], list[tuple[str, str, str, str]], bool]:
        return (self.left, self.error, self.stores, self.missing, self.seen, self.mlflow)

    @classmethod
    def load(cls, data: object) -> _Report:
        if not isinstance(data, tuple) or len(data) != 6:
            raise ValueError("not a round's report")
        left, error, stores, missing, seen, mlflow = data
        return cls(list(left), str(error), dict(stores), list(missing), list(seen), bool(mlflow))


def _round(run_ids: list[str], writer: int, give_up: float) -> _Report:
    """One attempt at each of ``run_ids``' entries still journaled by ``writer``, each under its
    claim; a store that fails is not asked again in this round, a run it does not have stops
    nothing else."""
    from lifeguard.journal import ENDED, GONE, HELD, MISSING, Journal
    from lifeguard.redact import redact_uri

    journal = Journal()
    if _out is None:
        _logger(journal.directory)
    stores = _Stores()
    report = _Report(left=[], mlflow=False)
    dead: set[str] = set()  # stores that failed this round: not asked again in it
    try:
        # Read by name; a file planted in an entry's place is refused (named, set aside).
        for entry in journal.entries(run_ids):
            if entry.pid != writer:
                continue  # journaled again since, by a later process: its own now
            report.stores[entry.run_id] = redact_uri(entry.tracking_uri)
            if entry.tracking_uri in dead or time.monotonic() >= give_up:
                report.left.append(entry.run_id)
                continue
            with journal.claim(entry, wait=0.0) as claim:
                if claim.state == GONE:
                    continue  # written by another replay (install()'s, the sweep's)
                if claim.state != HELD or claim.entry is None:
                    report.left.append(entry.run_id)  # another replay is at it: next round
                    continue
                current = claim.entry
                if current.pid != writer:
                    continue  # journaled again since, by a later process: its own now
                try:
                    result, error = stores.apply(current, journal, give_up)
                except Exception as exc:  # noqa: BLE001 - this entry's own: the others still go
                    result, error = "failed", f"{type(exc).__name__}: {exc}"
            report.seen.append((current.run_id, current.tracking_uri, result, error))
            if result == ENDED or result in _DONE:
                continue
            if result == MISSING:
                # The store answered: asking again in five seconds would not change it. The
                # entry stays journaled, for install()'s replay and the sweep to move aside.
                report.missing.append(current.run_id)
                continue
            report.left.append(current.run_id)
            dead.add(current.tracking_uri)
            report.error = error or report.error
    finally:
        stores.close()
    report.mlflow = "mlflow" in sys.modules
    return report


def _hours() -> str:
    from lifeguard.journal import MISSING_BOUND

    return f"{MISSING_BOUND / 3600:g} hours"


_DONE = frozenset({"already ended", "superseded"})


def _shown(uri: str) -> str:
    from lifeguard.redact import redact_uri

    return redact_uri(uri)


def _tell(log: logging.Logger, line: str) -> None:
    """A line shown where the replayer speaks, though its failed attempts are not."""
    import logging

    if _out is None:
        log.warning("%s", line)
        return
    level = _out.level
    _out.setLevel(logging.WARNING)
    try:
        log.warning("%s", line)
    finally:
        _out.setLevel(level)


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
