"""The watchdog sidecar: a small process that ends the program's runs if the program cannot.

``install(watchdog=True)`` starts it. It sleeps in ``select`` on two things that need no
polling: the read end of the channel pipe (EOF when every writer is gone) and a pidfd of the
program (readable the moment it exits, even if forked children still hold the pipe). Idle it
uses no CPU and only an interpreter's memory. Against an http(s) store it ends runs over
MLflow's REST API through requests, as MLflow's client sends them (``rest``), and never imports
mlflow; for other stores, or where MLflow's client would add what REST cannot (plug-ins), mlflow
is imported only if there is work.

When the program dies: if it said ``done``, or never started a run, the watchdog just exits.
Otherwise it ends the program's RUNNING runs, found by their owner tags, with the status the
evidence supports: ``exit <n>`` from the os._exit wrapper, a crash from faulthandler's text,
and otherwise KILLED (SIGKILL, the OOM killer). The end time is the moment of death.

It runs in its own session, so a Ctrl-C or a signal to the job's process group does not reach
it, and it gets credentials only from the environment it inherited.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time

from lifeguard._fds import pipe
from lifeguard.channel import WATCHDOG, Channel, Message, parse_line
from lifeguard.names import GUARDIAN_ENV

TYPE_CHECKING = False
if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

    from lifeguard.guardian import rest
    from lifeguard.journal import Entry, Journal
    from lifeguard.outcome import Outcome
    from lifeguard.owner import Owner

__all__ = ["Evidence", "main", "start"]


def start(deadline: float) -> tuple[Channel, int]:
    """Start the watchdog for this process. Returns the channel and the watchdog's pid."""
    import subprocess

    from lifeguard._fds import pipe

    read_fd, write_fd = pipe()
    started = False
    try:
        launcher = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "lifeguard.guardian.watchdog",
                str(read_fd),
                str(os.getpid()),
                str(deadline),
            ],
            pass_fds=(read_fd,),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            start_new_session=True,
            # The watchdog must not think it is supervised by our own channel.
            env={k: v for k, v in os.environ.items() if k != GUARDIAN_ENV},
        )
        # The launcher forks the watchdog and exits at once (see _detach): read its pid, reap
        # the launcher, and leave no child of ours behind.
        assert launcher.stdout is not None
        pid = int(launcher.stdout.readline() or 0)
        launcher.stdout.close()
        launcher.wait()
        started = True
    finally:
        if not started:
            os.close(read_fd)
            os.close(write_fd)
    # The program keeps a read end too (Channel.held_read_fd): its writes, faulthandler's
    # included, never meet a pipe without a reader, so a killed watchdog can never make a
    # program that takes SIGPIPE's default action die of it.
    return Channel(write_fd, WATCHDOG, held_read_fd=read_fd), pid


def _detach() -> None:
    """Become a grandchild of the program rather than its child. Process managers that clean up
    a dead worker's children (Ray's raylet does) would otherwise kill the watchdog together
    with the very program it is there to stand in for."""
    pid = os.fork()
    if pid:
        sys.stdout.write(f"{pid}\n")
        sys.stdout.flush()
        os._exit(0)
    sys.stdout.close()
    os.close(1)
    os.open(os.devnull, os.O_WRONLY)  # fd 1 again: nothing writes to the program's pipe


class Evidence:
    """What the program told its guardian before it died, per process."""

    def __init__(self) -> None:
        # Every store a process announced, in order: a process that moved from one tracking
        # URI to another has runs on each, and each run is ended on its own store.
        self.uris: dict[int, list[str]] = {}
        self.start_times: dict[int, float] = {}
        self.done: set[int] = set()
        self.exit_codes: dict[int, int] = {}
        # pid -> [(store or None if the program did not say, run id)]
        self.deferred: dict[int, list[tuple[str | None, str]]] = {}
        self.crash: str | None = None  # signal name from faulthandler's text
        # pid -> the identity the process announced (``owner``): its boot and PID namespace,
        # without which its pid and start time could be another container's process.
        self.owners: dict[int, Owner] = {}
        # pid -> store -> the experiments its runs were created in; a store in ``anywhere``
        # had a run whose experiment was not said (searched in every experiment).
        self.experiments: dict[int, dict[str, set[str]]] = {}
        self.anywhere: dict[int, set[str]] = {}
        self._partial = b""
        self._warmed = False
        from lifeguard.guardian.standin import Beats

        # The program's heartbeats: the guardian beats for it while they are late.
        self.beats = Beats()

    def feed(self, data: bytes) -> None:
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        for raw in lines:
            self.take(parse_line(raw.decode("utf-8", "replace")))

    def take(self, item: Message | str | None) -> None:
        if isinstance(item, str):
            self.crash = item
            return
        if item is None:
            return
        pid = item.pid
        self.start_times.setdefault(pid, item.start_time)
        if item.verb == "owner":
            self._add_owner(item)
        elif item.verb == "uri":
            self._add_uri(pid, item.arg)
            self.done.discard(pid)  # a run started after finish(): there is work again
        elif item.verb == "exp":
            uri, _, experiment = item.arg.partition(" ")
            if not experiment or experiment == "?" or " " in experiment:
                self.anywhere.setdefault(pid, set()).add(uri)
            else:
                self.experiments.setdefault(pid, {}).setdefault(uri, set()).add(experiment)
        elif item.verb == "done":
            self.done.add(pid)
            self.beats.forget(pid)
        elif item.verb == "beat":
            self.beats.take(pid, item.arg)
        elif item.verb == "exit":
            try:
                self.exit_codes[pid] = int(item.arg)
            except ValueError:
                pass
        elif item.verb == "defer":
            self.deferred.setdefault(pid, []).extend((None, r) for r in item.arg.split())
        elif item.verb == "defer-at":
            uri, _, run_ids = item.arg.partition(" ")
            self._add_uri(pid, uri)
            self.deferred.setdefault(pid, []).extend((uri, r) for r in run_ids.split())

    def _add_owner(self, item: Message) -> None:
        from lifeguard.owner import Owner

        parts = item.arg.split(" ")
        if len(parts) == 3:
            parts.append("-")  # a lifeguard from before start ticks were announced
        if len(parts) != 4 or not parts[2]:
            return
        boot, ns, host, ticks = (None if part == "-" else part for part in parts)
        try:
            start_ticks = None if ticks is None else int(ticks)
        except ValueError:
            return
        if host is not None:
            self.owners.setdefault(
                item.pid, Owner(host, item.pid, item.start_time, boot, ns, start_ticks)
            )

    def owner(self, pid: int) -> Owner:
        """The full identity of ``pid`` as it announced it. A process that announced none (a
        lifeguard from before ``owner`` lines) is taken to share this guardian's host, boot
        and PID namespace: the watchdog is forked from its program, the supervisor starts its
        child; both are where their program is."""
        from lifeguard.owner import Owner

        announced = self.owners.get(pid)
        if announced is not None:
            return announced
        here = Owner.current()
        return Owner(here.host, pid, self.start_times[pid], here.boot_id, here.pid_ns)

    def experiments_of(self, pid: int, uri: str) -> list[str] | None:
        """The experiments to search in ``uri`` for ``pid``'s runs: the ones it announced, or
        None (every experiment) if any of its runs there came without one, or it said none."""
        if uri in self.anywhere.get(pid, ()):
            return None
        known = self.experiments.get(pid, {}).get(uri)
        return sorted(known) if known else None

    def _add_uri(self, pid: int, uri: str) -> None:
        uris = self.uris.setdefault(pid, [])
        if uri and uri not in uris:
            uris.append(uri)
        if not self._warmed and uri.startswith(("http://", "https://")):
            # Pay the REST path's imports now, while the program lives, not after its death.
            self._warmed = True
            from lifeguard.guardian import rest

            if rest.unsupported(uri) is None:
                rest.warm()

    def drain(self, read_fd: int) -> None:
        """Read what is left in the pipe without blocking: the process is dead, so all it wrote
        is there, but heirs (forked children) may hold the write end open for long after."""
        os.set_blocking(read_fd, False)
        try:
            while data := os.read(read_fd, 65536):
                self.feed(data)
        except OSError:  # BlockingIOError included: nothing more for now
            pass

    def pending(self) -> list[int]:
        """Processes that started runs and did not report them finished."""
        return [pid for pid in self.uris if pid not in self.done or pid in self.deferred]


def watch(read_fd: int, parent: int) -> tuple[Evidence, float]:
    """Block until the parent is gone; return what it said and the time of death."""
    try:
        pidfd: int | None = os.pidfd_open(parent)
    except (AttributeError, OSError):  # no pidfd (old kernel) or parent already gone
        pidfd = None
    try:
        return wait_for_exit(read_fd, pidfd, stand_down=True)
    finally:
        if pidfd is not None:
            os.close(pidfd)


class SignalWake:
    """A guardian's signal handlers (the supervisor's and PID 1's: forwarding, reaping orphans)
    are Python's: CPython runs them between bytecodes. A signal that lands after its last check
    and before ``select()``'s system call would wait for the next channel message or the
    program's exit: a scancel's SIGTERM, never forwarded, and the program's graceful stop lost.
    CPython's C handler writes each signal's number to the wakeup fd at delivery, whichever
    thread takes it; that fd is in the select, so the select returns and the handlers run."""

    def __init__(self) -> None:
        self.read_fd, self._write_fd = pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self._write_fd, False)  # the C handler must never block
        self._previous = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)

    def close(self) -> None:
        signal.set_wakeup_fd(self._previous)
        os.close(self._write_fd)
        os.close(self.read_fd)


def wait_for_exit(
    read_fd: int, pidfd: int | None, wake_fd: int | None = None, *, stand_down: bool = False
) -> tuple[Evidence, float]:
    """Read the channel until the process behind ``pidfd`` exits (no polling: both wake
    select). Without a pidfd, EOF on the channel stands for the exit. ``wake_fd`` (a signal
    wakeup fd, non-blocking) only wakes the select, so that the caller's signal handlers run at
    once. ``stand_down`` (the sidecar): EOF with nothing pending ends the watch at once, the
    process alive (its ``uninstall()`` said done and closed the pipe). Returns the evidence and
    the time of death."""
    evidence = Evidence()
    watched = [read_fd] + [fd for fd in (pidfd, wake_fd) if fd is not None]
    while True:
        # No timeout unless the program beats: then the next moment its beat would be late.
        readable, _, _ = select.select(watched, [], [], evidence.beats.timeout())
        if not readable:
            evidence.beats.stand_in()
            continue
        if wake_fd is not None and wake_fd in readable:
            try:
                while os.read(wake_fd, 512):
                    pass
            except BlockingIOError:
                pass  # drained: the handlers run as this frame goes on
        if read_fd in readable:
            data = os.read(read_fd, 65536)
            if data:
                evidence.feed(data)
            elif pidfd is None:
                break  # EOF and no pidfd: every writer is gone, the process with them
            elif stand_down and not evidence.pending():
                break  # closed by a process that is done, or never started a run: nothing left
            else:
                # EOF while the process lives: it exec'd (the pipe is close-on-exec), or it
                # closed the channel. Its runs may still be in use: wait for the real exit.
                watched.remove(read_fd)
        if pidfd is not None and pidfd in readable:
            break
    died_at = time.time()
    evidence.drain(read_fd)
    return evidence, died_at


def decide(evidence: Evidence, pid: int, died_at: float) -> Outcome:
    from lifeguard.outcome import Outcome

    if pid in evidence.exit_codes:
        return Outcome.exited(evidence.exit_codes[pid], at=died_at)
    if evidence.crash is not None:
        return Outcome.signalled(getattr(signal, evidence.crash), at=died_at)
    return Outcome.lost(
        "died without running its exit hooks (SIGKILL, the OOM killer, or a hang cut short)",
        at=died_at,
    )


class _MlflowStore:
    """One store through mlflow's client (``runs``): every scheme, every plug-in."""

    def __init__(self, uri: str) -> None:
        from lifeguard.backends.mlflow import runs

        self.runs = runs
        self._client: MlflowClient | None = None
        self.tracking_uri = uri

    @property
    def client(self) -> MlflowClient:
        """Made at first use, where a failure is the store's failure: a sqlite store opens its
        database and checks its schema right away, and a locked one raises there."""
        if self._client is None:
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(tracking_uri=self.tracking_uri)
        return self._client

    def apply(self, entry: Entry, *, journal: Journal, write_ahead: bool) -> str:
        try:
            client = self.client
        except Exception as exc:  # noqa: BLE001 - the store cannot be opened now: journal it
            from lifeguard.journal import after_failed_write

            return after_failed_write(journal, entry, self.tracking_uri, exc)
        return str(self.runs.apply(client, entry, journal=journal, write_ahead=write_ahead))

    def terminate(
        self,
        run_id: str,
        outcome: Outcome,
        *,
        ended_by: str,
        journal: Journal,
        seen_running: bool = False,
    ) -> str:
        try:
            client = self.client
        except Exception as exc:  # noqa: BLE001 - the store cannot be opened now: journal it
            from lifeguard.journal import Entry, after_failed_write
            from lifeguard.names import TAG_ENDED_BY

            tags = {**outcome.tags(), TAG_ENDED_BY: ended_by}
            entry = Entry(
                run_id, self.tracking_uri, outcome.status.value, int(outcome.time * 1000), tags
            )
            return after_failed_write(journal, entry, self.tracking_uri, exc)
        # runs.terminate reads the status itself: seen_running only saves a request over REST.
        return str(self.runs.terminate(client, run_id, outcome, ended_by=ended_by, journal=journal))

    def find_running_owned_by(
        self, owner: Owner, experiment_ids: list[str] | None = None
    ) -> list[str]:
        return list(self.runs.find_running_owned_by(self.client, owner, experiment_ids))

    def adopted_since(self, entry: Entry) -> bool:
        """Whether a live process resumed the run since ``entry``; raises when the store cannot
        say (unopened, or the read failed): the entry must then wait, not be written."""
        return bool(self.runs._resumed_since(self.client, entry))

    def apply_journaled(self, entry: Entry, *, journal: Journal, ended_by: str | None) -> str:
        """Write an entry the dead process journaled, as ``ended_by`` (None: as the entry
        says); SUPERSEDED if its run was adopted since; JOURNALED, kept, if the store cannot
        say; MISSING, kept, if it has no such run."""
        from lifeguard.journal import SUPERSEDED, after_failed_write, run_missing

        try:
            adopted = self.adopted_since(entry)
        except Exception as exc:  # noqa: BLE001 - any failure to read the store: keep it
            if self.runs.no_such_run(exc):  # the store answered: this entry's own problem
                return run_missing(journal, entry, self.tracking_uri, exc)
            return after_failed_write(journal, entry, self.tracking_uri, exc)
        if adopted:
            journal.remove(entry)
            return SUPERSEDED
        if ended_by is not None:
            entry = entry.written_by(ended_by)
        return self.apply(entry, journal=journal, write_ahead=False)

    def has_run(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
        except MlflowException as exc:
            if getattr(exc, "error_code", "") == "RESOURCE_DOES_NOT_EXIST":
                return False
            raise
        return True


class _Stores:
    """The store for each URI, made once: over REST where that can stand in for MLflow's
    client (see ``rest.unsupported``), through mlflow otherwise, which is imported only then."""

    def __init__(self, deadline: float) -> None:
        import contextlib

        from lifeguard.guardian import rest

        self.rest = rest
        self.budget = rest.Budget(deadline)
        self.deadline = deadline
        self.made: dict[str, rest.RestStore | _MlflowStore] = {}
        self.exits = contextlib.ExitStack()
        self.bounded = False

    def get(self, uri: str) -> rest.RestStore | _MlflowStore:
        store = self.made.get(uri)
        if store is not None:
            return store
        why = self.rest.unsupported(uri)
        if why is None:
            store = self.rest.RestStore(uri, self.budget)
        else:
            from lifeguard._log import logger
            from lifeguard.redact import redact_uri

            logger().debug("ending runs at %s through mlflow: %s", redact_uri(uri), why)
            if not self.bounded:
                from lifeguard.backends.mlflow import runs as mlflow_runs

                self.exits.enter_context(mlflow_runs.bounded_http(self.deadline))
                self.bounded = True
            store = _MlflowStore(uri)
        self.made[uri] = store
        return store

    def slow(self, uri: str) -> bool:
        """Whether ``uri`` takes the mlflow path (an import of seconds before the first
        request), rather than REST."""
        return self.rest.unsupported(uri) is not None

    def close(self) -> None:
        self.exits.close()


def finalize_leftovers(
    evidence: Evidence,
    outcomes: dict[int, Outcome],
    *,
    ended_by: str,
    deadline: float,
    in_turn: bool = True,
) -> dict[str, str]:
    """End every run the dead processes in ``outcomes`` left RUNNING, each on the store it was
    created in. Returns run id -> result. ``in_turn``: in turns with the host's other guardians
    (see turns.py), the deadline starting once the turn is ours; the supervisor does not wait
    for one, as the job's exit waits on it, and a launcher's SIGKILL after its grace period
    would find nothing journaled yet.

    A process is known by its full identity (``Evidence.owner``): its runs are the RUNNING runs
    whose owner tags name exactly it, and its journal entries those whose writer is exactly it.
    A process with the same pid and start second in another container is another process."""
    import contextlib

    from lifeguard.guardian.turns import turn
    from lifeguard.journal import Journal

    results: dict[str, str] = {}
    journal = Journal()
    with turn() if in_turn else contextlib.nullcontext():
        journaled = list(journal.entries())
        stores = _Stores(deadline)
        try:
            for pid, outcome in outcomes.items():
                owner = evidence.owner(pid)
                # Stores over REST first: a few requests each, while the mlflow path's first
                # store costs an import of seconds, which would eat their deadline.
                fast_first = sorted(journaled, key=lambda e: stores.slow(e.tracking_uri))
                # What the process journaled before it died is the truth it knew (the signal and
                # its time, the exit code): written as it is, to the store the entry names,
                # unless a requeued job resumed the run while we waited our turn (its live
                # owner ends it with the truth; this ending is history). The rest get what the
                # evidence says.
                for entry in fast_first:
                    if entry.writer is None or not entry.writer.same_process(owner):
                        continue  # another process's: a replay decides about it
                    store = stores.get(entry.tracking_uri)
                    results[entry.run_id] = store.apply_journaled(
                        entry, journal=journal, ended_by=ended_by
                    )
                uris = sorted(evidence.uris.get(pid, []), key=stores.slow)
                if pid in evidence.deferred:
                    work = _deferred_work(stores, uris, evidence.deferred[pid])
                    _end_all(work, outcome, results, ended_by=ended_by, journal=journal)
                    continue
                for uri in uris:
                    # Each store's runs ended before the next store is even opened.
                    store = stores.get(uri)
                    experiments = evidence.experiments_of(pid, uri)
                    found = _search(store, owner, experiments, stores.budget, ended_by)
                    work = [(store, run_id, True) for run_id in found]
                    _end_all(work, outcome, results, ended_by=ended_by, journal=journal)
        finally:
            stores.close()
    return results


def _end_all(
    work: list[tuple[rest.RestStore | _MlflowStore, str, bool]],
    outcome: Outcome,
    results: dict[str, str],
    *,
    ended_by: str,
    journal: Journal,
) -> None:
    for store, run_id, seen_running in work:
        if run_id in results:
            continue
        results[run_id] = store.terminate(
            run_id, outcome, ended_by=ended_by, journal=journal, seen_running=seen_running
        )


def dead_or_unknown(evidence: Evidence, pids: list[int]) -> tuple[list[int], list[int]]:
    """Of processes other than the one a guardian watched die, those verifiably dead (their
    runs are the guardian's to end) and the rest: alive, or not checkable from here (another
    PID namespace), left to themselves, the journal and the sweep's heartbeat check."""
    dead: list[int] = []
    left: list[int] = []
    for pid in pids:
        (dead if evidence.owner(pid).is_alive() is False else left).append(pid)
    return dead, left


# Between two tries of a search that failed (a sqlite store locked by someone else, a server
# restarting): until the deadline, since nothing can be journaled before the runs are known.
SEARCH_RETRY = 0.25


def _search(
    store: rest.RestStore | _MlflowStore,
    owner: Owner,
    experiments: list[str] | None,
    budget: rest.Budget,
    ended_by: str,
) -> list[str]:
    """The RUNNING runs ``owner`` left in ``store`` (in ``experiments``, None: all), tried again
    until the deadline."""
    while True:
        try:
            return store.find_running_owned_by(owner, experiments)
        except Exception as exc:  # noqa: BLE001 - report and go on with the other stores
            if budget.left() > 2 * SEARCH_RETRY:
                time.sleep(SEARCH_RETRY)
                continue
            from lifeguard._log import logger

            logger().error(
                "lifeguard %s: cannot search %s for the runs of pid %d: %s; "
                "`lifeguard sweep` will find them by their owner tags",
                ended_by,
                store.tracking_uri,
                owner.pid,
                exc,
            )
            return []


def _deferred_work(
    stores: _Stores, uris: list[str], deferred: list[tuple[str | None, str]]
) -> list[tuple[rest.RestStore | _MlflowStore, str, bool]]:
    """(store, run id, seen running) for runs handed over. A run handed over without its store
    is looked up in each store the process announced; the first that has it ends it. Where no
    store could be asked, the first that failed gets it, and journals it."""
    work: list[tuple[rest.RestStore | _MlflowStore, str, bool]] = []
    for uri, run_id in deferred:
        if uri is not None:
            work.append((stores.get(uri), run_id, False))
            continue
        if len(uris) == 1:
            work.append((stores.get(uris[0]), run_id, False))
            continue
        fallback = None
        for candidate in uris:
            store = stores.get(candidate)
            try:
                if store.has_run(run_id):
                    work.append((store, run_id, False))
                    break
            except Exception:  # noqa: BLE001 - this store cannot say; try the others
                fallback = fallback or store
        else:
            if fallback is not None:
                work.append((fallback, run_id, False))
    return work


def _let_go_of_the_programs_stderr() -> bool:
    """At the watchdog's start: the program's stderr is not the watchdog's to hold where a
    reader waits on it. A pipe held open here (``| tee``, ``subprocess.run(capture_output=True)``)
    would keep its reader from the end of file for as long as the runs take to end, and for
    ever from a watchdog that was stopped (SIGSTOP) before it could let go at the death. A file
    or a terminal, which nobody waits on, stays. Returns whether it let go: what the watchdog
    has to say then goes to the journal directory's log, as the replayer's does."""
    from lifeguard._fds import a_reader_waits_on

    if not a_reader_waits_on(2):
        return False
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)
    return True


def main(argv: list[str]) -> int:
    read_fd, parent, deadline = int(argv[0]), int(argv[1]), float(argv[2])
    # Our own session already keeps the job's Ctrl-C away; a stray SIGHUP from a closing
    # terminal must not take the guardian down with the program either.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _detach()
    let_go = _let_go_of_the_programs_stderr()
    evidence, died_at = watch(read_fd, parent)
    pending = evidence.pending()
    if not pending:
        return 0  # the program finalized itself, or never started a run: nothing to import
    if let_go:
        from lifeguard.guardian.logfile import log_to_the_journal_directory

        log_to_the_journal_directory()
    # The program is dead (its pidfd said so). Anyone else who wrote to the channel (none
    # should: a forked child closes it) is ended only if verifiably dead too.
    others, _ = dead_or_unknown(evidence, [pid for pid in pending if pid != parent])
    outcomes = {pid: decide(evidence, pid, died_at) for pid in pending if pid == parent}
    outcomes.update({pid: decide(evidence, pid, died_at) for pid in others})
    finalize_leftovers(evidence, outcomes, ended_by="watchdog", deadline=deadline)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
