"""The watchdog sidecar: a small process that ends the program's runs if the program cannot.

``install(watchdog=True)`` starts it. It sleeps in ``select`` on two things that need no
polling: the read end of the channel pipe (EOF when every writer is gone) and a pidfd of the
program (readable the moment it exits, even if forked children still hold the pipe). Idle it
uses no CPU and only an interpreter's memory: mlflow is imported only if there is work.

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

from lifeguard.guardian.channel import ENV, WATCHDOG, Channel, Message, parse_line

TYPE_CHECKING = False
if TYPE_CHECKING:
    from lifeguard.outcome import Outcome

__all__ = ["Evidence", "main", "start"]


def start(deadline: float) -> tuple[Channel, int]:
    """Start the watchdog for this process. Returns the channel and the watchdog's pid."""
    import subprocess

    from lifeguard._fds import pipe

    read_fd, write_fd = pipe()
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
            env={k: v for k, v in os.environ.items() if k != ENV},
        )
        # The launcher forks the watchdog and exits at once (see _detach): read its pid, reap
        # the launcher, and leave no child of ours behind.
        assert launcher.stdout is not None
        pid = int(launcher.stdout.readline() or 0)
        launcher.stdout.close()
        launcher.wait()
    finally:
        os.close(read_fd)
    return Channel(write_fd, WATCHDOG), pid


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
        self.uris: dict[int, str] = {}
        self.start_times: dict[int, float] = {}
        self.done: set[int] = set()
        self.exit_codes: dict[int, int] = {}
        self.deferred: dict[int, list[str]] = {}
        self.crash: str | None = None  # signal name from faulthandler's text
        self._partial = b""

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
        if item.verb == "uri":
            self.uris[pid] = item.arg
            self.done.discard(pid)  # a run started after finish(): there is work again
        elif item.verb == "done":
            self.done.add(pid)
        elif item.verb == "exit":
            try:
                self.exit_codes[pid] = int(item.arg)
            except ValueError:
                pass
        elif item.verb == "defer":
            self.deferred.setdefault(pid, []).extend(item.arg.split())

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
        return wait_for_exit(read_fd, pidfd)
    finally:
        if pidfd is not None:
            os.close(pidfd)


def wait_for_exit(read_fd: int, pidfd: int | None) -> tuple[Evidence, float]:
    """Read the channel until the process behind ``pidfd`` exits (no polling: both wake
    select). Without a pidfd, EOF on the channel stands for the exit. Returns the evidence and
    the time of death."""
    evidence = Evidence()
    watched = [read_fd] + ([pidfd] if pidfd is not None else [])
    while True:
        readable, _, _ = select.select(watched, [], [])
        if read_fd in readable:
            data = os.read(read_fd, 65536)
            if data:
                evidence.feed(data)
            elif pidfd is None:
                break  # EOF and no pidfd: every writer is gone, the process with them
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


def finalize_leftovers(
    evidence: Evidence,
    outcomes: dict[int, Outcome],
    *,
    ended_by: str,
    deadline: float,
) -> dict[str, str]:
    """End every run the dead processes left RUNNING. Returns run id -> result."""
    import socket

    from mlflow.tracking import MlflowClient

    from lifeguard.backends.mlflow import runs as mlflow_runs
    from lifeguard.guardian.journal import Journal
    from lifeguard.owner import Owner

    results: dict[str, str] = {}
    journal = Journal()
    journaled = list(journal.entries())
    with mlflow_runs.bounded_http(deadline):
        for pid in evidence.pending():
            outcome = outcomes[pid]
            client = MlflowClient(tracking_uri=evidence.uris[pid])
            # What the process journaled before it died is the truth it knew (the signal and
            # its time, the exit code): written as it is. The rest get what the evidence says.
            for entry in journaled:
                if entry.pid == pid:
                    results[entry.run_id] = mlflow_runs.apply(
                        client, entry, journal=journal, write_ahead=False
                    )
            if pid in evidence.deferred:
                run_ids = evidence.deferred[pid]
            else:
                owner = Owner(socket.gethostname(), pid, evidence.start_times[pid])
                try:
                    run_ids = mlflow_runs.find_running_owned_by(client, owner)
                except Exception as exc:  # noqa: BLE001 - report and go on with the others
                    from lifeguard._log import logger

                    logger().error(
                        "lifeguard %s: cannot search %s for the runs of pid %d: %s; "
                        "`lifeguard sweep` will find them by their owner tags",
                        ended_by,
                        client.tracking_uri,
                        pid,
                        exc,
                    )
                    continue
            for run_id in run_ids:
                if run_id in results:
                    continue
                results[run_id] = mlflow_runs.terminate(
                    client,
                    run_id,
                    outcome,
                    ended_by=ended_by,
                    journal=journal,
                )
    return results


def main(argv: list[str]) -> int:
    read_fd, parent, deadline = int(argv[0]), int(argv[1]), float(argv[2])
    # Our own session already keeps the job's Ctrl-C away; a stray SIGHUP from a closing
    # terminal must not take the guardian down with the program either.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _detach()
    evidence, died_at = watch(read_fd, parent)
    pending = evidence.pending()
    if not pending:
        return 0  # the program finalized itself, or never started a run: nothing to import
    outcomes = {pid: decide(evidence, pid, died_at) for pid in pending}
    finalize_leftovers(evidence, outcomes, ended_by="watchdog", deadline=deadline)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
