"""``lifeguard sweep``: decide, for each RUNNING run on a shared server, whether it is an orphan.

The rule: **evidence of life beats identity.** Anyone who can write to a run can write its tags,
and the OS can hide or shift what the sweep reads, so the sweep ends a run only when it has seen
it unchanged, across its own looks, for long enough that a live run would have shown a sign of
life: a new heartbeat, metric, param or tag, a status or end-time change. The first look at a
run, or a look that finds it changed, never ends it.

How long is long enough:

* Every run records its heartbeat interval (``lifeguard.heartbeat.interval``). A run is judged
  lost only once it has stayed unchanged for ``--stale-after`` *and* for ``LIVE_BEATS`` of its
  own intervals, whichever is longer; a run tagged before intervals were recorded waits at least
  ``LEGACY_PATIENCE``.
* Owner tags can only shorten that wait when the owner is *proven* gone: on this very host
  (hostname, boot id and PID namespace all the sweep's own), compared in clock ticks since boot
  (no wall-clock step can fool it), and really absent (``kill(pid, 0)`` says no such process:
  hidden or unreadable is "unknown", never "gone"); see ``owner.py``. Then ``PROOF_BEATS`` of its
  intervals unchanged (at least ``PROOF_FLOOR``) suffice: a run whose tags are wrong but whose
  writer lives would beat in that time.
* A live owner, however quiet, keeps its run.
* Runs without lifeguard tags, and lifeguard runs resumed since by a program without lifeguard
  (RUNNING again with an end time its owner tags do not know), are left alone unless asked with
  ``--include-untagged --older-than D``: then one silent for longer than D by its writer's own
  timestamps, and unchanged for ``--stale-after`` across looks, is ended.

**Staleness never compares two clocks.** A heartbeat carries the writer's clock, which may be
minutes or hours off the sweeper's. The sweep remembers, in a small state file, each run's sign
of life (a digest of everything it can read of the run) and when it first saw it, by its own
clock (``CLOCK_BOOTTIME`` within one boot, so that a wall-clock step cannot fake an age; the wall
clock across reboots). Any skew between writer and sweeper is tolerated.

The end time is the last sign of life (the last heartbeat, else the last metric, else the
start) in the writer's own clock, the one the run's start time and metrics are in; never the
time of the sweep: the run ended when its process did, not when we noticed.

This module decides; ``backends/mlflow/sweep.py`` fetches and writes.
"""

from __future__ import annotations

import os
import time

from lifeguard._log import logger
from lifeguard.names import TAG_HEARTBEAT, TAG_HEARTBEAT_INTERVAL, TAG_RESUMED_END
from lifeguard.owner import Owner, time_namespace_ticks

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = [
    "ALIVE",
    "DEFAULT_STALE_AFTER",
    "END",
    "LEGACY_PATIENCE",
    "LIVE_BEATS",
    "PROOF_BEATS",
    "SKIP",
    "WATCH",
    "Decision",
    "RunFacts",
    "Sightings",
    "check_tracking_uri",
    "decide",
    "parse_duration",
]

# The verdicts. END: ended (or would be, in a dry run). ALIVE: a sign of life, never ended.
# WATCH: no sign of life yet either way: watched across sweeps until it shows one or has been
# unchanged for long enough. SKIP: nothing here can judge it (no heartbeat, no lifeguard tags).
END = "end"
ALIVE = "alive"
WATCH = "watch"
SKIP = "skip"

# A run is judged lost only after this many of its own heartbeat intervals without a change,
# whatever --stale-after says: a live run shows a sign of life within one, and a beat or two
# may be late or lost (a server restart, a busy host).
LIVE_BEATS = 3.0
# ... and when its owner is proven gone on this host: a run whose owner tags are wrong (copied,
# edited) but whose writer lives would still beat within that time.
PROOF_BEATS = 2.0
# At least this long, whatever the interval: a second look a moment after the first proves
# nothing, even for a run that beats every second.
PROOF_FLOOR = 10.0
# --stale-after's default: three beats at the default interval (60 s). A lost node's runs are then
# ended about 3 minutes after their last beat, plus up to two periods of a `--every` service.
DEFAULT_STALE_AFTER = 180.0
# Runs that record no interval (tagged by an earlier lifeguard, whose default --stale-after was
# 15 minutes): at least that long.
LEGACY_PATIENCE = 900.0
# The longest interval a run's tag is believed: the heartbeat option's own maximum.
MAX_INTERVAL = 3600.0
# The latest time (ms since the epoch) a heartbeat tag is believed to hold.
MAX_TIME_MS = 100_000_000_000_000

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
        # ASCII, and no underscores: float() takes "1_0" and digits of other scripts too.
        if not value.isascii() or "_" in value:
            raise ValueError
        seconds = float(value) * unit
    except ValueError:
        raise ValueError(f"not a duration: {text!r} (use e.g. 90s, 15m, 2h, 1d)") from None
    if seconds != seconds:  # nan
        raise ValueError(f"not a duration: {text!r} (use e.g. 90s, 15m, 2h, 1d)")
    if seconds == 0 and value.split("e")[0].strip("+-0.") != "":  # "1e-400": 0 as a float
        raise ValueError(f"a duration too small to tell from 0: {text!r}")
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
    if scheme in _SCHEMES and "://" not in uri:  # file:/PATH: a scheme, one slash short
        return f"write the {scheme} URI with its slashes, e.g. {scheme}:///PATH or {scheme}://HOST"
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
    """What the sweep knows of one RUNNING run: everything it can read of it, since any change
    to any of it is a sign of life."""

    __slots__ = (
        "run_id",
        "experiment_id",
        "start_time",
        "tags",
        "last_metric_time",
        "end_time",
        "params",
        "metrics",
        "status",
    )

    def __init__(
        self,
        run_id: str,
        experiment_id: str,
        start_time: int,
        tags: dict[str, str],
        last_metric_time: int | None = None,
        *,
        end_time: int | None = None,
        params: dict[str, str] | None = None,
        metrics: Iterable[tuple[str, int, int, float]] = (),
        status: str = "RUNNING",
    ) -> None:
        self.run_id = run_id
        self.experiment_id = experiment_id
        self.start_time = start_time
        self.tags = tags
        # Each metric's latest (key, timestamp, step, value), as the server reports it.
        self.metrics = tuple(sorted(metrics))
        if last_metric_time is None and self.metrics:
            last_metric_time = max(m[1] for m in self.metrics)
        self.last_metric_time = last_metric_time
        self.end_time = end_time
        self.params = params or {}
        self.status = status

    def heartbeat(self) -> int | None:
        """The last heartbeat's time (ms since the epoch, the writer's clock, however wrong),
        if the tag holds one within MAX_TIME_MS of 1970 (a tag of 30 nines stopped the whole
        sweep with an OverflowError)."""
        text = self.tags.get(TAG_HEARTBEAT)
        if not text or len(text) > 20 or not (text.isascii() and text.lstrip("-").isdigit()):
            return None
        value = int(text)
        return value if abs(value) <= MAX_TIME_MS else None

    def heartbeat_interval(self) -> float | None:
        """Seconds between this run's heartbeats as its owner recorded them (0: heartbeats
        off); None when not recorded or not a number (an earlier lifeguard, a damaged tag)."""
        try:
            interval = float(self.tags[TAG_HEARTBEAT_INTERVAL])
        except (KeyError, ValueError):
            return None
        if not interval >= 0:  # nan, negative
            return None
        return min(interval, MAX_INTERVAL)

    def resumed_without_lifeguard(self) -> bool:
        """RUNNING with an end time: the run was ended and resumed since. Its owner tags name
        the process that resumed it only if that process recorded this very end time when it
        took the run over (heartbeat.py); otherwise a program without lifeguard resumed it, and
        the tags name someone who no longer holds it."""
        if self.end_time is None:
            return False
        return self.tags.get(TAG_RESUMED_END) != str(self.end_time)

    def last_sign_of_life(self) -> int:
        candidates = [self.start_time, self.heartbeat(), self.last_metric_time]
        return max(t for t in candidates if t is not None)

    def sign(self) -> str:
        """A digest of everything that changes while a run lives: its tags (the heartbeat among
        them), params, each metric's latest value, status and end time."""
        import hashlib
        import json

        data = [
            self.status,
            self.end_time,
            self.last_metric_time,
            sorted(self.tags.items()),
            sorted(self.params.items()),
            [list(m) for m in self.metrics],
        ]
        text = json.dumps(data, separators=(",", ":"), default=str)
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]


class Decision:
    __slots__ = ("run_id", "experiment_id", "verdict", "reason", "end_time", "patience")

    def __init__(
        self,
        facts: RunFacts,
        verdict: str,
        reason: str,
        end_time: int | None = None,
        patience: float | None = None,
    ) -> None:
        self.run_id = facts.run_id
        self.experiment_id = facts.experiment_id
        self.verdict = verdict
        self.reason = reason
        self.end_time = end_time
        # Seconds unchanged this run needs before it can be judged lost (None: never, here).
        self.patience = patience

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


def patience(facts: RunFacts, stale_after: float) -> float:
    """Seconds a run must be seen unchanged before it is judged lost by its silence alone."""
    interval = facts.heartbeat_interval()
    if interval is None:
        return max(stale_after, LEGACY_PATIENCE)
    return max(stale_after, LIVE_BEATS * interval)


def proof_patience(facts: RunFacts, stale_after: float) -> float:
    """... when its owner is proven gone on this host."""
    interval = facts.heartbeat_interval()
    longest = patience(facts, stale_after)
    if not interval:  # heartbeats off, or not recorded: nothing says how soon it would change
        return longest
    return min(longest, max(PROOF_FLOOR, PROOF_BEATS * interval))


def decide(
    facts: RunFacts,
    *,
    now_ms: int,
    stale_after: float,
    quiet_for: float = 0.0,
    include_untagged: bool = False,
    older_than: float | None = None,
) -> Decision:
    """``quiet_for``: seconds, by the sweeper's clock, that this run has been seen unchanged
    (:meth:`Sightings.quiet_for`; 0 when this is the first look or it changed since the last);
    ``now_ms`` is used for untagged runs only."""
    owner = Owner.from_tags(facts.tags)
    if owner is None or facts.resumed_without_lifeguard():
        what = (
            "no lifeguard tags"
            if owner is None
            else "resumed by a program without lifeguard since its owner ended it"
        )
        if not include_untagged or older_than is None:
            return Decision(facts, SKIP, f"{what} (use --include-untagged)")
        last = facts.last_sign_of_life()
        age = (now_ms - last) / 1000
        if age <= older_than:
            return Decision(facts, SKIP, f"{what}, active {age:.0f}s ago")
        if quiet_for < stale_after:
            return Decision(
                facts,
                WATCH,
                f"{what}, silent for {age:.0f}s; unchanged here for {quiet_for:.0f}s of "
                f"{stale_after:.0f}s",
                patience=stale_after,
            )
        return Decision(facts, END, f"{what}, silent for {age:.0f}s", end_time=last)

    alive = owner.is_alive()
    elsewhere = owner.not_local_because()
    if alive is True:
        where = "on this host" if elsewhere is None else "in a PID namespace nested in this one"
        return Decision(facts, ALIVE, f"owner pid {owner.pid} is alive {where}")
    elsewhere = elsewhere or f"pid {owner.pid} on {owner.host}, out of sight"
    if alive is None and (facts.heartbeat() is None or facts.heartbeat_interval() == 0):
        return Decision(facts, SKIP, f"owner {elsewhere}, no heartbeat to judge by")
    if quiet_for <= 0:
        return Decision(
            facts, ALIVE, "changed since the last look (or first seen now): a sign of life"
        )
    if alive is False:
        need = proof_patience(facts, stale_after)
        gone = f"owner pid {owner.pid} on {owner.host} is gone"
        if quiet_for < need:
            return Decision(
                facts,
                WATCH,
                f"{gone}; unchanged for {quiet_for:.0f}s of {need:.0f}s",
                patience=need,
            )
        return Decision(
            facts,
            END,
            f"{gone}, and the run unchanged for {quiet_for:.0f}s",
            end_time=facts.last_sign_of_life(),
            patience=need,
        )
    need = patience(facts, stale_after)
    if quiet_for < need:
        return Decision(
            facts,
            WATCH,
            f"owner {elsewhere}; unchanged for {quiet_for:.0f}s of {need:.0f}s",
            patience=need,
        )
    return Decision(
        facts,
        END,
        f"owner {elsewhere} lost: unchanged for {quiet_for:.0f}s",
        end_time=facts.last_sign_of_life(),
        patience=need,
    )


# -- what the sweeper saw, by its own clock ---------------------------------------------------

STATE_NAME = "sweep.state"
STATE_VERSION = 1
MAX_STATE_BYTES = 16 * 1024 * 1024  # ~100k runs


def _clock_identity(boot_id: str | None) -> str | None:
    """What CLOCK_BOOTTIME readings must share to be compared: the boot, and the boot-time
    offset of the time namespace (``unshare --time``), which shifts every reading by it."""
    offset = time_namespace_ticks()
    return boot_id if boot_id is None or not offset else f"{boot_id}+{offset}"


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
        # CLOCK_BOOTTIME is comparable only within one boot and one time namespace offset.
        self.boot_id = _clock_identity(Owner.current().boot_id)
        # When this sweep began reading the server: the "now" every age is measured to. A sign
        # first seen in this sweep is stamped when the reading ended (finished_reading), so an
        # age is never longer than the run was really seen unchanged: from the end of the read
        # that first saw it to the start of the read that sees it again.
        self.wall_ms = self.read_wall_ms = int(time.time() * 1000)
        self.up = self.read_up = _uptime()
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
            # A server's sightings in any other shape (a list, a string) are forgotten: its runs
            # are watched afresh, as after any damage; the other servers' stand.
            self._data = {uri: seen for uri, seen in servers.items() if isinstance(seen, dict)}
            if self.server in servers and self.server not in self._data:
                shape = type(servers[self.server]).__name__
                raise ValueError(f"holds a {shape} where this server's sightings should be")
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

    def finished_reading(self) -> None:
        """The server has been read: signs first seen in this sweep are stamped now."""
        self.read_wall_ms = int(time.time() * 1000)
        self.read_up = _uptime()

    def quiet_for(self, facts: RunFacts) -> float:
        """Seconds this sweeper has seen ``facts``' sign of life unchanged (0 when it is new)."""
        sign = facts.sign()
        prev = self._data.get(self.server, {}).get(facts.run_id)
        if not isinstance(prev, dict) or prev.get("sign") != sign:
            self._seen[facts.run_id] = {
                "sign": sign,
                "wall": self.read_wall_ms,
                "boot": self.boot_id,
                "up": self.read_up,
                "exp": facts.experiment_id,
            }
            return 0.0
        prev["exp"] = facts.experiment_id
        self._seen[facts.run_id] = prev
        up, boot, wall = prev.get("up"), prev.get("boot"), prev.get("wall")
        if boot == self.boot_id and isinstance(up, float) and self.up is not None:
            return max(0.0, self.up - up)
        if isinstance(wall, int) and 0 <= wall <= MAX_TIME_MS:
            return max(0.0, (self.wall_ms - wall) / 1000)
        return 0.0

    def save(self, swept_experiments: Iterable[str]) -> None:
        """Keep what this sweep saw, and what it did not look at (other experiments); forget
        runs it looked for and did not find RUNNING."""
        import json

        from lifeguard.journal import Journal
        from lifeguard.journaldir import write_whole

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
        write_whole(fd, tmp, text.encode())
        os.replace(tmp, self.path)  # replaces a planted symlink itself, never its target
