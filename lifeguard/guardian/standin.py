"""A guardian beats for its program while the program cannot.

A program's heartbeat is a Python thread: it stalls while the main thread holds the GIL in a
long C call (a C extension's loop, a huge ``json.loads``), and a sweep that saw no beat for
several intervals would end a live run. The program tells its watchdog each time it beats
(``beat`` on the channel: its interval and its runs on an http(s) store); when a beat is late by
half an interval and the program still lives, the watchdog writes the heartbeat tag itself,
over REST, once per interval, until the program's own beats come back. It never imports mlflow,
and it costs nothing while the program beats on time: no request, one pipe line per beat.

Only http(s) stores: a remote server is where the sweep judges runs by their heartbeats; a
sqlite or file store is on the program's own host, where the sweep sees the process itself.
"""

from __future__ import annotations

import time

from lifeguard.names import TAG_HEARTBEAT

__all__ = ["LATE", "Beats"]

# A beat later than this many intervals after the previous one is late: the guardian stands in.
LATE = 1.5
# Seconds a stand-in beat may take (the program's own beat is the one that matters).
BUDGET = 10.0


class _Program:
    __slots__ = ("cycle", "interval", "runs", "last", "next_standin")

    def __init__(self) -> None:
        self.cycle = ""
        self.interval = 0.0
        self.runs: dict[str, list[str]] = {}  # store -> run ids
        self.last = 0.0  # monotonic time of the program's last beat
        self.next_standin = 0.0


class Beats:
    """What each process said of its beats, and when the guardian should stand in."""

    def __init__(self) -> None:
        self._programs: dict[int, _Program] = {}
        self._failing = False

    def take(self, pid: int, arg: str) -> None:
        """``<cycle> <interval> <store> <run id>...``: one line per store and beat (a new
        cycle replaces the last one's runs)."""
        parts = arg.split()
        if len(parts) < 3:
            return
        cycle, interval_text, uri, run_ids = parts[0], parts[1], parts[2], parts[3:]
        try:
            interval = float(interval_text)
        except ValueError:
            return
        if not interval > 0:
            return
        program = self._programs.setdefault(pid, _Program())
        if program.cycle != cycle:
            program.cycle, program.runs = cycle, {}
        # "-": this beat had no run on an http(s) store (its runs ended, say): none to beat.
        if uri.startswith(("http://", "https://")) and run_ids:
            program.runs.setdefault(uri, []).extend(run_ids)
        program.interval = interval
        program.last = time.monotonic()
        program.next_standin = program.last + LATE * interval

    def forget(self, pid: int) -> None:
        """``pid`` finalized (``done``): nothing of it to beat for."""
        self._programs.pop(pid, None)

    def timeout(self) -> float | None:
        """Seconds until the next stand-in is due, or None (no beats heard)."""
        if not self._programs:
            return None
        due = min(p.next_standin for p in self._programs.values())
        return max(0.0, due - time.monotonic())

    def stand_in(self) -> int:
        """Beat for every process whose own beat is late. Returns how many runs were beaten."""
        now = time.monotonic()
        beaten = 0
        for program in self._programs.values():
            if now < program.next_standin:
                continue
            program.next_standin = now + program.interval
            for uri, run_ids in program.runs.items():
                beaten += self._beat(uri, run_ids)
        return beaten

    def _beat(self, uri: str, run_ids: list[str]) -> int:
        from lifeguard._log import logger
        from lifeguard.guardian import rest

        stamp = str(int(time.time() * 1000))
        beaten = 0
        try:
            if rest.unsupported(uri) is not None:
                return 0
            store = rest.RestStore(uri, rest.Budget(BUDGET))
            for run_id in run_ids:
                body: dict[str, object] = {"run_id": run_id, "key": TAG_HEARTBEAT, "value": stamp}
                store.call("POST", "runs/set-tag", body)
                beaten += 1
        except Exception as exc:  # noqa: BLE001 - a stand-in beat is best effort
            if not self._failing:
                logger().warning("watchdog: could not beat for its program: %s", exc)
            self._failing = True
        else:
            self._failing = False
        return beaten
