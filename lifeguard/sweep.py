"""``lifeguard sweep``: decide, for each RUNNING run on a shared server, whether it is an orphan.

Safety first: a run is ended only on positive evidence that nothing is left to end it.

* Owner on this host: ended when that process is gone (no such pid, or the pid now belongs to a
  process with another start time). A live owner, however quiet, keeps its run.
* Owner on another host: nothing here can see that process, so only its heartbeat speaks. A
  heartbeat older than ``--stale-after`` means the node is lost; a fresh one, or none at all
  (heartbeats turned off), leaves the run alone.
* No lifeguard tags (runs from before lifeguard): left alone, unless asked with
  ``--include-untagged --older-than D``; then a run whose last sign of life (start, last metric)
  is older than D is ended.

The end time is the last sign of life (the last heartbeat, else the last metric, else the
start), never the time of the sweep: the run ended when its process did, not when we noticed.

This module decides; ``backends/mlflow/sweep.py`` fetches and writes.
"""

from __future__ import annotations

import socket

from lifeguard.owner import Owner

__all__ = ["ALIVE", "END", "SKIP", "Decision", "RunFacts", "decide", "parse_duration"]

END = "end"
ALIVE = "alive"
SKIP = "skip"

TAG_HEARTBEAT = "lifeguard.heartbeat"
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``2h``, ``1d`` -> seconds."""
    value = text.strip().lower()
    unit = 1
    if value and value[-1] in _UNITS:
        unit = _UNITS[value[-1]]
        value = value[:-1]
    try:
        seconds = float(value) * unit
    except ValueError:
        raise ValueError(f"not a duration: {text!r} (use e.g. 90s, 15m, 2h, 1d)") from None
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"a duration must be positive: {text!r}")
    return seconds


class RunFacts:
    """What the sweep knows of one RUNNING run."""

    __slots__ = ("run_id", "experiment_id", "start_time", "tags", "last_metric_time")

    def __init__(
        self,
        run_id: str,
        experiment_id: str,
        start_time: int,
        tags: dict[str, str],
        last_metric_time: int | None = None,
    ) -> None:
        self.run_id = run_id
        self.experiment_id = experiment_id
        self.start_time = start_time
        self.tags = tags
        self.last_metric_time = last_metric_time

    def heartbeat(self) -> int | None:
        try:
            return int(self.tags[TAG_HEARTBEAT])
        except (KeyError, ValueError):
            return None

    def last_sign_of_life(self) -> int:
        candidates = [self.start_time, self.heartbeat(), self.last_metric_time]
        return max(t for t in candidates if t is not None)


class Decision:
    __slots__ = ("run_id", "experiment_id", "verdict", "reason", "end_time")

    def __init__(
        self,
        facts: RunFacts,
        verdict: str,
        reason: str,
        end_time: int | None = None,
    ) -> None:
        self.run_id = facts.run_id
        self.experiment_id = facts.experiment_id
        self.verdict = verdict
        self.reason = reason
        self.end_time = end_time

    def as_dict(self) -> dict[str, object]:
        return {
            "run_id": self.run_id,
            "experiment_id": self.experiment_id,
            "verdict": self.verdict,
            "reason": self.reason,
            "end_time": self.end_time,
        }

    def __repr__(self) -> str:
        return f"Decision({self.run_id}, {self.verdict}, {self.reason!r})"


def decide(
    facts: RunFacts,
    *,
    now_ms: int,
    stale_after: float,
    include_untagged: bool = False,
    older_than: float | None = None,
    host: str | None = None,
) -> Decision:
    here = host or socket.gethostname()
    owner = Owner.from_tags(facts.tags)
    if owner is None:
        if not include_untagged or older_than is None:
            return Decision(facts, SKIP, "no lifeguard tags (use --include-untagged)")
        last = facts.last_sign_of_life()
        age = (now_ms - last) / 1000
        if age <= older_than:
            return Decision(facts, SKIP, f"untagged, active {age:.0f}s ago")
        return Decision(facts, END, f"untagged, silent for {age:.0f}s", end_time=last)
    if owner.host == here:
        if owner.is_alive():
            return Decision(facts, ALIVE, f"owner pid {owner.pid} is alive on this host")
        return Decision(
            facts,
            END,
            f"owner pid {owner.pid} on {here} is gone",
            end_time=facts.last_sign_of_life(),
        )
    if facts.heartbeat() is None:
        return Decision(facts, SKIP, f"owner on {owner.host}, no heartbeat to judge by")
    # A metric logged after the last beat is a sign of life too (a stuck heartbeat thread).
    last = facts.last_sign_of_life()
    age = (now_ms - last) / 1000
    if age <= stale_after:
        return Decision(facts, ALIVE, f"owner on {owner.host}, alive {age:.0f}s ago")
    return Decision(
        facts, END, f"owner on {owner.host} lost: last heartbeat {age:.0f}s ago", end_time=last
    )
