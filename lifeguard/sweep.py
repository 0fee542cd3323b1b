"""``lifeguard sweep``: decide, for each RUNNING run on a shared server, whether it is an orphan.

Safety first: a run is ended only on evidence the sweep can check itself.

* Owner verifiably on this host -- same hostname, same boot id, same PID namespace (see
  ``owner.py``): ended when that process is gone (no such pid, or the pid now belongs to a
  process with another start time). A live owner, however quiet, keeps its run.
* Owner in a PID namespace nested in the sweep's, on this host and boot (a container, swept from
  the host's namespace): its processes are in sight here, so it is checked the same way.
* Any other owner -- another machine, a container whose namespace is not in sight, another
  boot, or a run tagged without boot id and PID namespace by an earlier lifeguard: nothing here
  can see that process, so only its heartbeat speaks, judged on the sweeper's own clock
  (below). None at all (heartbeats turned off) leaves the run alone.
* No lifeguard tags (runs from before lifeguard): left alone, unless asked with
  ``--include-untagged --older-than D``; then a run whose last sign of life (start, last metric)
  is older than D is ended (by the writer's timestamps: D is meant in days, beyond any skew).

**Staleness never compares two clocks.** A heartbeat carries the writer's clock, which may be
minutes or hours off the sweeper's. So the sweep does not ask how old a beat is; it remembers,
in a small state file, each run's sign of life (the heartbeat value and the last metric's
timestamp) and when it first saw that value, by its own clock (``CLOCK_BOOTTIME`` within one
boot, so that a wall-clock step cannot fake an age; the wall clock across reboots). A run is
ended when its sign of life has not changed for ``--stale-after`` between sweeps. Any skew
between writer and sweeper is tolerated; the cost is that a lost run is ended by the first sweep
at least ``--stale-after`` after the first sweep that saw its last beat (two sweeps at least).
``--stale-after`` must exceed the writers' heartbeat interval (default 60 s vs 15 min).

The end time is the last sign of life (the last heartbeat, else the last metric, else the
start) in the writer's own clock, the one the run's start time and metrics are in; never the
time of the sweep: the run ended when its process did, not when we noticed.

This module decides; ``backends/mlflow/sweep.py`` fetches and writes.
"""

from __future__ import annotations

import os
import time

from lifeguard._log import logger
from lifeguard.names import TAG_HEARTBEAT
from lifeguard.owner import Owner

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = [
    "ALIVE",
    "END",
    "SKIP",
    "Decision",
    "RunFacts",
    "Sightings",
    "check_tracking_uri",
    "decide",
    "parse_duration",
]

END = "end"
ALIVE = "alive"
SKIP = "skip"

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# Ten years: beyond it a duration is a typo, and far beyond it float arithmetic stops meaning
# anything (--stale-after 1e300).
MAX_DURATION = 3650 * 86400.0


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
    if seconds != seconds:  # nan
        raise ValueError(f"not a duration: {text!r} (use e.g. 90s, 15m, 2h, 1d)")
    if seconds > MAX_DURATION:  # 1e400 too: float() made it inf, a number too large
        raise ValueError(f"a duration must be at most 3650d: {text!r}")
    if not seconds > 0:
        raise ValueError(f"a duration must be positive: {text!r}")
    return seconds


# Schemes MLflow's tracking stores answer to (plus any plug-in's, from its entry points).
_SCHEMES = {"http", "https", "databricks", "databricks-uc", "uc", "file", "sqlite",
            "postgresql", "mysql", "mssql"}  # fmt: skip


def check_tracking_uri(uri: str) -> str | None:
    """What is wrong with ``uri`` as a tracking server to sweep, in a few words; None if
    nothing. Checked before anything is imported or asked, so that a typo is one line, not a
    traceback, and never a directory created where a bare word was taken for a path."""
    from urllib.parse import urlsplit

    if not uri or uri != uri.strip() or any(c.isspace() or ord(c) < 32 for c in uri):
        return "not a URI (empty, or holds spaces or control characters)"
    if uri in ("databricks", "databricks-uc", "uc"):
        return None
    try:
        parts = urlsplit(uri)
        port = parts.port
    except ValueError as exc:
        return f"not a URI ({exc})"
    scheme = parts.scheme.lower()
    if not scheme or "://" not in uri:
        return "not a URI: give a scheme, e.g. http://HOST:PORT, sqlite:///PATH, file:///PATH"
    base = scheme.split("+", 1)[0]
    if base not in _SCHEMES and base not in _plugin_schemes():
        return (
            f"unknown scheme {parts.scheme!r} (use http(s)://HOST[:PORT], databricks, "
            "sqlite:///PATH, postgresql://..., mysql://..., file:///PATH)"
        )
    if base in ("http", "https") and (not parts.hostname or port == 0):
        return "an http(s) URI needs a host (http://HOST[:PORT])"
    if base in ("file", "sqlite") and not parts.path:
        return f"a {base} URI needs a path ({base}:///PATH)"
    return None


def _plugin_schemes() -> set[str]:
    from importlib.metadata import entry_points

    try:
        return {ep.name for ep in entry_points(group="mlflow.tracking_store")}
    except Exception:  # noqa: BLE001 - a broken plug-in's metadata: only the built-ins
        return set()


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

    def sign(self) -> str:
        """What changes while the run lives: its heartbeat and its last metric, as written."""
        return f"{self.tags.get(TAG_HEARTBEAT, '')}|{self.last_metric_time}"


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
    quiet_for: float = 0.0,
    include_untagged: bool = False,
    older_than: float | None = None,
) -> Decision:
    """``quiet_for``: seconds, by the sweeper's clock, that this run's sign of life has been
    seen unchanged (:meth:`Sightings.quiet_for`); ``now_ms`` is used for untagged runs only."""
    owner = Owner.from_tags(facts.tags)
    if owner is None:
        if not include_untagged or older_than is None:
            return Decision(facts, SKIP, "no lifeguard tags (use --include-untagged)")
        last = facts.last_sign_of_life()
        age = (now_ms - last) / 1000
        if age <= older_than:
            return Decision(facts, SKIP, f"untagged, active {age:.0f}s ago")
        return Decision(facts, END, f"untagged, silent for {age:.0f}s", end_time=last)
    elsewhere = owner.not_local_because()
    if elsewhere is None:
        if owner.is_alive():
            return Decision(facts, ALIVE, f"owner pid {owner.pid} is alive on this host")
        return Decision(
            facts,
            END,
            f"owner pid {owner.pid} on {owner.host} is gone",
            end_time=facts.last_sign_of_life(),
        )
    # A PID namespace nested in the sweep's (a container of this host, swept from the host's
    # namespace) is in sight: its owner's pid can be checked after all (Owner.is_alive).
    alive = owner.is_alive()
    if alive is True:
        return Decision(facts, ALIVE, f"owner pid {owner.pid} {elsewhere}, alive (in sight here)")
    if alive is False:
        return Decision(
            facts,
            END,
            f"owner {elsewhere} lost: pid {owner.pid} is gone from its namespace (in sight here)",
            end_time=facts.last_sign_of_life(),
        )
    if facts.heartbeat() is None:
        return Decision(facts, SKIP, f"owner {elsewhere}, no heartbeat to judge by")
    # A metric logged after the last beat is a sign of life too (a stuck heartbeat thread):
    # both are in the sign whose changes quiet_for follows.
    if quiet_for < stale_after:
        return Decision(
            facts,
            ALIVE,
            f"owner {elsewhere}; heartbeat unchanged for {quiet_for:.0f}s of {stale_after:.0f}s",
        )
    return Decision(
        facts,
        END,
        f"owner {elsewhere} lost: heartbeat unchanged for {quiet_for:.0f}s",
        end_time=facts.last_sign_of_life(),
    )


# -- what the sweeper saw, by its own clock ---------------------------------------------------

STATE_NAME = "sweep.state"
STATE_VERSION = 1
MAX_STATE_BYTES = 16 * 1024 * 1024  # ~100k runs


def _uptime() -> float | None:
    clock = getattr(time, "CLOCK_BOOTTIME", None)
    return time.clock_gettime(clock) if clock is not None else None


class Sightings:
    """Each remote run's sign of life and when this sweeper first saw it, kept between sweeps in
    ``<journal dir>/sweep.state`` (one private file of the user, read like a journal entry),
    per tracking server."""

    def __init__(self, directory: str, server: str) -> None:
        from lifeguard.redact import redact_uri

        self.directory = directory
        self.path = os.path.join(directory, STATE_NAME)
        self.server = redact_uri(server)
        self.boot_id = Owner.current().boot_id
        self.wall_ms = int(time.time() * 1000)
        self.up = _uptime()
        self._data: dict[str, dict[str, dict[str, object]]] = {}
        self._seen: dict[str, dict[str, object]] = {}
        # In a directory that is not private, nothing is read or written: every remote run is
        # seen for the first time, so none is ended (the journal refuses that directory too).
        self.untrusted = False

    def load(self) -> Sightings:
        from lifeguard.journal import Untrusted, read_private, untrusted_directory

        why = untrusted_directory(self.directory)
        if why is not None:
            logger().error(
                "refusing sweep state in %s: it %s; no remote run can be judged lost",
                self.directory,
                why,
            )
            self.untrusted = True
            return self
        try:
            import json

            data = json.loads(read_private(self.path, MAX_STATE_BYTES))
            if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
                raise ValueError("unknown format")
            servers = data["servers"]
            if not isinstance(servers, dict):
                raise ValueError("unknown format")
            self._data = servers
        except FileNotFoundError:
            pass
        except (Untrusted, OSError, ValueError, KeyError) as exc:
            # Forgetting only delays: no remote run is ended before it has been watched anew.
            logger().error(
                "ignoring sweep state %s (it %s); watching every run afresh",
                self.path,
                exc,
            )
        return self

    def quiet_for(self, facts: RunFacts) -> float:
        """Seconds this sweeper has seen ``facts``' sign of life unchanged (0 when it is new)."""
        sign = facts.sign()
        prev = self._data.get(self.server, {}).get(facts.run_id)
        if not isinstance(prev, dict) or prev.get("sign") != sign:
            prev = {"sign": sign, "wall": self.wall_ms, "boot": self.boot_id, "up": self.up}
        prev["exp"] = facts.experiment_id
        self._seen[facts.run_id] = prev
        up, boot, wall = prev.get("up"), prev.get("boot"), prev.get("wall")
        if boot == self.boot_id and isinstance(up, float) and self.up is not None:
            return max(0.0, self.up - up)
        if isinstance(wall, int):
            return max(0.0, (self.wall_ms - wall) / 1000)
        return 0.0

    def save(self, swept_experiments: Iterable[str]) -> None:
        """Keep what this sweep saw, and what it did not look at (other experiments); forget
        runs it looked for and did not find RUNNING."""
        import json

        from lifeguard.journal import Journal

        if self.untrusted:
            return
        swept = set(swept_experiments)
        kept = {
            run_id: seen
            for run_id, seen in self._data.get(self.server, {}).items()
            if isinstance(seen, dict) and seen.get("exp") not in swept
        }
        kept.update(self._seen)
        self._data[self.server] = kept
        text = json.dumps({"version": STATE_VERSION, "servers": self._data}, sort_keys=True)
        Journal(self.directory).ensure()
        tmp = f"{self.path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)
            view = memoryview(text.encode())
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(tmp, self.path)  # replaces a planted symlink itself, never its target
