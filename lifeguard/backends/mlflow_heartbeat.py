"""The heartbeat: a tag ``lifeguard.heartbeat`` (epoch ms) refreshed on this process's runs.

It is how ``lifeguard sweep`` tells a live run on another machine from an orphan whose node was
lost: no process is left there to say anything, but the beats stop. The first beat is free (the
run context provider writes it at ``start_run``); after that a daemon thread writes one tag per
run per interval. It never blocks training and never raises into the program: a failed beat is
logged once and simply tried again next interval. It stops when the process finalizes.

Default interval: 60 s. At one small request per run per minute the server hardly notices even
thousands of runs, and the default ``--stale-after`` of 15 minutes leaves room for 14 missed
beats (a server restart, a network blip) before a run is judged lost.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from lifeguard._log import logger

__all__ = ["DEFAULT_INTERVAL", "TAG_HEARTBEAT", "Heartbeat", "now_ms"]

TAG_HEARTBEAT = "lifeguard.heartbeat"
DEFAULT_INTERVAL = 60.0


def now_ms() -> int:
    return int(time.time() * 1000)


class Heartbeat:
    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._failing = False

    def ensure_started(self) -> None:
        if self.interval <= 0 or self._stop.is_set():
            return
        if self._thread is not None and self._pid == os.getpid():
            return
        # A forked child starts its own thread for its own runs.
        self._pid = os.getpid()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lifeguard-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.beat()

    def beat(self) -> int:
        """Refresh the heartbeat of every run this process owns. Returns how many."""
        fluent = sys.modules.get("mlflow.tracking.fluent")
        if fluent is None:
            return 0
        from mlflow.tracking import MlflowClient

        from lifeguard.backends.mlflow import owned_active_runs
        from lifeguard.backends.mlflow_context import runs_created_outside_fluent
        from lifeguard.owner import Owner

        beaten = 0
        try:
            client = MlflowClient()
            stamp = str(now_ms())
            run_ids = owned_active_runs(fluent)
            # Runs on no active-run stack (Lightning's MLFlowLogger): one search per beat,
            # only in a process that created such runs.
            run_ids += runs_created_outside_fluent(client, Owner.current(), run_ids)
            for run_id in run_ids:
                if self._stop.is_set():
                    break
                client.set_tag(run_id, TAG_HEARTBEAT, stamp)
                beaten += 1
        except Exception as exc:  # noqa: BLE001 - a heartbeat must never hurt the program
            if not self._failing:
                logger().warning("lifeguard: heartbeat failed (will retry): %s", exc)
            self._failing = True
        else:
            if self._failing:
                logger().info("lifeguard: heartbeat recovered")
            self._failing = False
        return beaten
