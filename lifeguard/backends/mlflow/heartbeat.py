"""The heartbeat: a tag ``lifeguard.heartbeat`` (epoch ms) refreshed on this process's runs.

It is how ``lifeguard sweep`` tells a live run on another machine from an orphan whose node was
lost: no process is left there to say anything, but the beats stop. The first beat is free (the
run context provider writes it at ``start_run``); after that a daemon thread writes one tag per
run per interval. It never blocks training and never raises into the program: a failed beat is
logged once and simply tried again next interval. It stops when the process finalizes.

Default interval: 60 s. At one small request per run per minute the server hardly notices even
thousands of runs, and the default ``--stale-after`` of 15 minutes leaves room for 14 missed
beats (a server restart, a network blip) before a run is judged lost.

Ownership moves on resume: a run this process resumed (``start_run(run_id=...)``) still carries
the owner tags of the process that created it, which a sweep would find dead. The thread looks at
the active-run stacks every second (memory only) and, when such a run appears, writes this
process's owner tags onto it at once, with a beat. It is started by ``install()``, not at the
first new run, so that a program that only resumes is covered too.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from lifeguard._log import logger
from lifeguard.backends.mlflow import active
from lifeguard.names import (
    TAG_ENDED_BY,
    TAG_HEARTBEAT,
    TAG_HEARTBEAT_INTERVAL,
    TAG_RESUMED_END,
)
from lifeguard.sentry import take_no_signals

TYPE_CHECKING = False
if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

    from lifeguard.backends.mlflow.stores import Store

__all__ = ["DEFAULT_INTERVAL", "Heartbeat", "heartbeat", "now_ms", "start_for"]

DEFAULT_INTERVAL = 60.0
# How often the thread looks for resumed runs to adopt (in memory: a few dict lookups).
ADOPT_EVERY = 1.0
# Run ids per ``beat`` line to a watchdog: 33 bytes each, well inside an atomic pipe write.
BEAT_LINE_RUNS = 100


def now_ms() -> int:
    return int(time.time() * 1000)


class Heartbeat:
    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._failing = False
        # Runs whose owner tags this process has written (resumed runs it adopted).
        self._adopted: set[str] = set()
        self._cycle = 0  # beats told to a watchdog
        # Held while telling the watchdog: what stop() tells it comes after any beat's line.
        self._telling = threading.Lock()

    def ensure_started(self) -> None:
        """Start the thread. With heartbeats off (interval 0) it only adopts the runs this
        process resumes (see adopt): an earlier owner's journaled ending must not be written
        over a run that lives on here."""
        if self._stop.is_set():
            return
        if self._thread is not None and self._pid == os.getpid():
            return
        # A forked child starts its own thread for its own runs.
        self._pid = os.getpid()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lifeguard-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """No beat from now on (the process is finalizing), and none for this process from its
        watchdog either: the silence that follows is not a stall for it to beat through, and a
        beat of its would land after the runs' end time."""
        self._stop.set()
        if self._cycle:  # a watchdog was told of beats
            self._tell_watchdog({})

    def rearm(self) -> None:
        """After ``lifeguard.finish()``: runs started later get beats again."""
        self._stop.set()  # the old thread, if any, ends at its next wake-up
        self._stop = threading.Event()
        self._thread = None

    def _run(self) -> None:
        take_no_signals()
        last = time.monotonic()
        while not self._stop.wait(min(ADOPT_EVERY, self.interval or ADOPT_EVERY)):
            # The interval is read at each wake-up: the program's own install(heartbeat=...) may
            # shorten it after `lifeguard run` started this thread with the default.
            if self.interval > 0 and time.monotonic() >= last + self.interval:
                last = time.monotonic()
                self.beat()
            elif self._resumed_runs():
                self.beat() if self.interval > 0 else self.adopt()

    def _resumed_runs(self) -> list[object]:
        """Active runs this process would end whose owner tags name another process. Memory
        only; and nothing at all until a run is on a stack, which also means mlflow is fully
        imported (this thread must never import it while the program does)."""
        fluent = sys.modules.get("mlflow.tracking.fluent")
        if fluent is None:
            return []
        from lifeguard.owner import Owner

        try:
            entries = active.active_runs(fluent)
            if not entries:
                return []
            mine = set(active.owned_active_runs(fluent))
        except Exception:  # noqa: BLE001 - MLflow's internals moved: adopt nothing
            return []
        me = Owner.current()
        resumed = []
        for _, run in entries:
            run_id = run.info.run_id  # type: ignore[attr-defined]
            if run_id not in mine or run_id in self._adopted:
                continue
            owner = Owner.from_tags(dict(run.data.tags))  # type: ignore[attr-defined]
            if owner is None or not owner.same_process(me):
                resumed.append(run)
        return resumed

    def beat(self) -> int:
        """Refresh the heartbeat of every run this process owns. Returns how many."""
        fluent = sys.modules.get("mlflow.tracking.fluent")
        if fluent is None:
            return 0
        from mlflow.tracking import MlflowClient

        from lifeguard.backends.mlflow import stores
        from lifeguard.backends.mlflow.active import owned_active_runs, runs_created_outside_fluent
        from lifeguard.owner import Owner

        beaten = 0
        try:
            client = MlflowClient()
            clients: dict[str, MlflowClient] = {}

            def client_of(run_id: str) -> MlflowClient:
                # Each run beats in its own store, whatever the tracking URI is now.
                store = store_of.get(run_id)
                if store is None:
                    return client
                uri = store.client_uri()
                if uri not in clients:
                    clients[uri] = MlflowClient(tracking_uri=uri)
                return clients[uri]

            self._adopt(client)
            store_of = stores.of_active_runs(fluent)
            stamp = str(now_ms())
            fluent_runs = owned_active_runs(fluent)
            run_ids = list(fluent_runs)
            # Runs on no active-run stack (Lightning's MLFlowLogger): one search per beat,
            # only in a process that created such runs.
            run_ids += runs_created_outside_fluent(client, Owner.current(), run_ids)
            by_store: dict[str, list[str]] = {}
            signals = sys.modules.get("lifeguard.signals")
            for run_id in run_ids:
                # After the stamp: a signal noticed since may carry an earlier time, its runs'
                # end time, and no beat may say the run lived past its end.
                if self._stop.is_set() or (signals is not None and signals.ending_noticed()):
                    break
                run_client = client_of(run_id)
                if run_id in fluent_runs:
                    _revive_if_swept(run_client, run_id)
                run_client.set_tag(run_id, TAG_HEARTBEAT, stamp)
                by_store.setdefault(run_client.tracking_uri, []).append(run_id)
                beaten += 1
            self._tell_watchdog(by_store)
        except Exception as exc:  # noqa: BLE001 - a heartbeat must never hurt the program
            if not self._failing:
                logger().warning("heartbeat failed (will retry): %s", exc)
            self._failing = True
        else:
            if self._failing:
                logger().info("heartbeat recovered")
            self._failing = False
        return beaten

    def adopt(self) -> None:
        """Heartbeats off: only take over the runs this process resumed (their owner tags), so
        that an earlier owner's ending, journaled and replayed by a later ``install()``, is not
        written over a run that lives on here (the replay leaves a run alone once its owner
        tags name another live process: owner.adopted_since). No beat is stamped."""
        if sys.modules.get("mlflow.tracking.fluent") is None:
            return
        from mlflow.tracking import MlflowClient

        try:
            self._adopt(MlflowClient())
        except Exception as exc:  # noqa: BLE001 - as a beat: never hurt the program
            if not self._failing:
                logger().warning("adopting a resumed run failed (will retry): %s", exc)
            self._failing = True
        else:
            self._failing = False

    def _adopt(self, client: MlflowClient) -> None:
        """Write this process's owner tags on the runs it resumed, and mark them its own."""
        resumed = self._resumed_runs()
        if not resumed:
            return
        from mlflow.entities import RunTag

        from lifeguard.backends.mlflow import stores
        from lifeguard.owner import Owner

        # With the owner: a preemption warning that came before the resume.
        tags = {
            **Owner.current().tags(),
            TAG_HEARTBEAT_INTERVAL: f"{self.interval:g}",
            **active.extra_tags(),
        }
        owner_tags = [RunTag(k, v) for k, v in tags.items()]
        for run in resumed:
            run_id = run.info.run_id  # type: ignore[attr-defined]
            # Resumed where the program points now: that is the store it resumed in. The
            # guardian hears of it too: a program that only resumes runs never announced a
            # store at start_run.
            store = stores.current()
            stores.note_resumed(run_id, store)
            _announce(store, getattr(run.info, "experiment_id", None))  # type: ignore[attr-defined]
            client.log_batch(run_id, tags=owner_tags)
            _resume_again(client, run_id)
            _claim_resume(client, run_id)
            self._adopted.add(run_id)
            logger().debug("adopted resumed run %s", run_id)

    def _tell_watchdog(self, by_store: dict[str, list[str]]) -> None:
        """Tell a watchdog which runs just beat, so that it can beat for them while this
        thread cannot (guardian/standin.py): one line per http(s) store, a few run ids each
        (a pipe write is atomic only up to PIPE_BUF), or one that says there are none."""
        from lifeguard.channel import WATCHDOG
        from lifeguard.lifecycle import current
        from lifeguard.redact import redact_uri

        lifecycle = current()
        channel = lifecycle.channel if lifecycle is not None else None
        if channel is None or channel.role != WATCHDOG:
            return
        # Bounded: a lock a forked child inherited held is never released in it.
        if not self._telling.acquire(timeout=1.0):
            return
        try:
            if self._stop.is_set():
                by_store = {}  # stopped meanwhile: "no runs", after this beat's line if any
            self._cycle += 1
            head = f"{self._cycle} {self.interval:g}"
            lines = []
            for uri, run_ids in by_store.items():
                if not uri.startswith(("http://", "https://")):
                    continue
                for start in range(0, len(run_ids), BEAT_LINE_RUNS):
                    chunk = " ".join(run_ids[start : start + BEAT_LINE_RUNS])
                    lines.append(f"{head} {redact_uri(uri)} {chunk}")
            for line in lines or [f"{head} -"]:
                channel.send("beat", line)
        finally:
            self._telling.release()


def _resume_again(client: MlflowClient, run_id: str) -> None:
    """Set RUNNING again a run this process resumed that was found ended with an end time from
    before this process started: the ending of the process that ran it before (its journal
    entry, written by a replay, a watchdog or a sweep) landed between the resume and the owner
    tags above, and "never overwrite" would then keep it over this process's own ending. Had it
    landed before the resume, MLflow's resume would have set RUNNING over it the same way. An
    ending dated after this process started (the program, or someone, ended the run since) is
    left alone. Called after the owner tags are written: a writer that reads the run from now
    on sees it adopted and leaves it alone (``owner.adopted_since``)."""
    from lifeguard.owner import own_start_time

    info = client.get_run(run_id).info
    started_ms = own_start_time() * 1000
    if (
        info.status != "RUNNING"
        and info.lifecycle_stage != "deleted"
        and info.end_time is not None
        and info.end_time < started_ms
    ):
        client.update_run(run_id, status="RUNNING")  # as MLflow's resume: end_time kept
        logger().info(
            "run %s, resumed here, had been ended %s by the process before it; it is RUNNING again",
            run_id,
            info.status,
        )


def _claim_resume(client: MlflowClient, run_id: str) -> None:
    """Record the end time the run has now that this process holds it (MLflow's resume keeps
    the previous one): the sweep tells a run resumed under lifeguard, whose owner tags are its
    holder's, from one resumed since by a program without lifeguard (``TAG_RESUMED_END``)."""
    end_time = client.get_run(run_id).info.end_time
    if end_time is not None:
        client.set_tag(run_id, TAG_RESUMED_END, str(end_time))


def _revive_if_swept(client: MlflowClient, run_id: str) -> None:
    """A run of this live process that a sweep ended is RUNNING again. A sweep judges by
    silence; a process whose beats could not land for a while (a network partition, a main
    thread that held the GIL for minutes) was silent but alive, and its own ending must be the
    one that stays. Costs one read per run per beat."""
    run = client.get_run(run_id)
    info = run.info
    if info.status == "RUNNING" or info.lifecycle_stage == "deleted":
        return
    if run.data.tags.get(TAG_ENDED_BY) != "sweep":
        return  # ended by the program, the user or a guardian: theirs to say
    client.update_run(run_id, status="RUNNING")  # as MLflow's resume: end_time kept
    if info.end_time is not None:
        client.set_tag(run_id, TAG_RESUMED_END, str(info.end_time))
    # The sweep's account of an ending that did not happen; the process's own ending writes
    # these again. Without them, a later ending by someone else is not taken for the sweep's.
    for key in (TAG_ENDED_BY, "lifeguard.outcome", "lifeguard.reason"):
        try:
            client.delete_tag(run_id, key)
        except Exception:  # noqa: BLE001 - already gone (another beat, another writer)
            pass
    logger().warning(
        "run %s was ended %s by `lifeguard sweep` while this process was alive (its heartbeat "
        "could not land for a while); it is RUNNING again",
        run_id,
        info.status,
    )


def _announce(store: Store, experiment_id: str | None) -> None:
    from lifeguard.lifecycle import current

    lifecycle = current()
    if lifecycle is not None and lifecycle.channel is not None:
        lifecycle.channel.send_uri(store.absolute, experiment_id)


# The process's heartbeat: started when lifeguard is installed and mlflow loaded (whichever comes
# last), stopped by the MLflow finalizer.
heartbeat = Heartbeat(0.0)


def start_for(interval: float) -> None:
    """Beat every ``interval`` seconds; 0: no beats, but resumed runs are still adopted."""
    if interval > 0:
        heartbeat.interval = interval
    heartbeat.ensure_started()
