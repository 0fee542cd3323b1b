"""`lifeguard sweep` against a real `mlflow server`: orphans ended, live and untagged runs never
touched, a dry run writes nothing, and a server that dies mid-sweep loses nothing."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from lifeguard import demo
from lifeguard.sweep import END, RunFacts, decide, parse_duration
from tests.conftest import CHILDREN, Store, child_env, lifeguard_cli
from tests.servers import FaultProxy, MlflowServer

HOUR_MS = 3_600_000


# -- the decisions, as units ----------------------------------------------------------------


def facts(tags: dict[str, str], start: int = 1_000, metric: int | None = None) -> RunFacts:
    return RunFacts("r", "0", start, tags, metric)


def owner_tags(
    host: str, pid: int, start: float, beat: int | None, interval: float | None = 60
) -> dict[str, str]:
    tags = {
        "lifeguard.owner.host": host,
        "lifeguard.owner.pid": str(pid),
        "lifeguard.owner.start_time": f"{start:.2f}",
    }
    if beat is not None:
        tags["lifeguard.heartbeat"] = str(beat)
    if interval is not None:
        tags["lifeguard.heartbeat.interval"] = f"{interval:g}"
    return tags


def gone_here() -> dict[str, str]:
    """Owner tags of a process of this host and namespace that is gone: our pid, started one
    tick before us (the process that had the pid before)."""
    from lifeguard.owner import Owner

    me = Owner.current()
    assert me.start_ticks is not None
    earlier = Owner(me.host, me.pid, me.start_time - 3600, me.boot_id, me.pid_ns,
                    me.start_ticks - 1)  # fmt: skip
    return {**earlier.tags(), "lifeguard.heartbeat": "5000", "lifeguard.heartbeat.interval": "60"}


def test_a_live_owner_on_this_host_is_never_ended() -> None:
    from lifeguard.owner import Owner

    me = Owner.current()
    # Even with a heartbeat a day old and unchanged for a day: the process is alive.
    d = decide(facts({**me.tags(), "lifeguard.heartbeat": "0"}), now_ms=24 * HOUR_MS,
               stale_after=60, quiet_for=86400)  # fmt: skip
    assert d.verdict == "alive"


def test_a_first_look_never_ends_a_run() -> None:
    """Whatever the tags say (an owner proven gone here, a heartbeat a day old), a run seen for
    the first time, or changed since the last look, shows life: it is never ended."""
    cases = [gone_here(), owner_tags("far", 1, 1.0, 1_000), owner_tags("far", 1, 1.0, None)]
    for tags in cases:
        d = decide(facts(tags), now_ms=24 * HOUR_MS, stale_after=1, quiet_for=0)
        assert d.verdict != END, d


def test_an_owner_proven_gone_here_ends_its_run_after_two_of_its_beats() -> None:
    tags = gone_here()
    early = decide(facts(tags), now_ms=10_000, stale_after=900, quiet_for=60)
    assert early.verdict == "watch" and "is gone" in early.reason
    d = decide(facts(tags), now_ms=10_000, stale_after=900, quiet_for=120)
    assert d.verdict == END and d.end_time == 5_000  # the last sign of life
    # A run that beats twice a second still waits out the floor (10 s): a look a moment after
    # another proves nothing.
    fast = {**tags, "lifeguard.heartbeat.interval": "0.5"}
    assert decide(facts(fast), now_ms=10_000, stale_after=900, quiet_for=9).verdict == "watch"
    assert decide(facts(fast), now_ms=10_000, stale_after=900, quiet_for=10).verdict == END


def test_other_hosts_are_judged_by_their_heartbeat() -> None:
    fresh = decide(facts(owner_tags("far", 1, 1.0, 9_000)), now_ms=10_000, stale_after=60)
    young = decide(facts(owner_tags("far", 1, 1.0, 1_000)), now_ms=10_000, stale_after=200,
                   quiet_for=199)  # fmt: skip
    stale = decide(facts(owner_tags("far", 1, 1.0, 1_000)), now_ms=10_000, stale_after=200,
                   quiet_for=200)  # fmt: skip
    silent = decide(facts(owner_tags("far", 1, 1.0, None)), now_ms=HOUR_MS, stale_after=60,
                    quiet_for=3600)  # fmt: skip
    off = decide(facts(owner_tags("far", 1, 1.0, 1_000, interval=0)), now_ms=HOUR_MS,
                 stale_after=60, quiet_for=3600)  # fmt: skip
    verdicts = (fresh.verdict, young.verdict, stale.verdict, silent.verdict, off.verdict)
    assert verdicts == ("alive", "watch", END, "skip", "skip")
    assert stale.end_time == 1_000  # the last heartbeat, not the sweep's time


def test_no_run_is_judged_before_several_of_its_own_intervals() -> None:
    """--stale-after shorter than the heartbeat: the run's own interval decides (three beats);
    a run that records no interval (an earlier lifeguard) waits the former default, 15 min."""
    tags = owner_tags("far", 1, 1.0, 1_000, interval=60)
    held = decide(facts(tags), now_ms=HOUR_MS, stale_after=1, quiet_for=179)
    assert held.verdict == "watch" and held.patience == 180
    assert decide(facts(tags), now_ms=HOUR_MS, stale_after=1, quiet_for=180).verdict == END
    legacy = owner_tags("far", 1, 1.0, 1_000, interval=None)
    assert decide(facts(legacy), now_ms=HOUR_MS, stale_after=1, quiet_for=899).verdict == "watch"
    assert decide(facts(legacy), now_ms=HOUR_MS, stale_after=1, quiet_for=900).verdict == END
    for damaged in ("nan", "-5", "soon"):
        tags = {**legacy, "lifeguard.heartbeat.interval": damaged}
        assert decide(facts(tags), now_ms=HOUR_MS, stale_after=1, quiet_for=899).verdict != END


def test_a_run_resumed_without_lifeguard_is_not_its_old_owners() -> None:
    """RUNNING with an end time its owner tags do not know: ended by its lifeguard owner, then
    resumed by a plain MLflow program. The tags name a process that no longer holds it."""
    resumed = RunFacts("r", "0", 1_000, gone_here(), end_time=8_000)
    d = decide(resumed, now_ms=HOUR_MS, stale_after=60, quiet_for=86400)
    assert d.verdict == "skip" and "without lifeguard" in d.reason
    # Resumed under lifeguard: the new owner recorded that end time when it took the run over.
    claimed = RunFacts("r", "0", 1_000, {**gone_here(), "lifeguard.owner.resumed_end": "8000"},
                       end_time=8_000)  # fmt: skip
    assert decide(claimed, now_ms=HOUR_MS, stale_after=60, quiet_for=86400).verdict == END
    # On request, as an untagged run: silent long enough by its own clock, and unchanged here.
    opted = decide(resumed, now_ms=HOUR_MS, stale_after=60, quiet_for=61,
                   include_untagged=True, older_than=60)  # fmt: skip
    assert opted.verdict == END


def test_every_change_to_a_run_is_a_sign_of_life() -> None:
    base = RunFacts("r", "0", 1, {"a": "1"}, params={"p": "1"}, metrics=[("m", 5, 0, 1.0)])
    changed = [
        RunFacts("r", "0", 1, {"a": "2"}, params={"p": "1"}, metrics=[("m", 5, 0, 1.0)]),
        RunFacts("r", "0", 1, {"a": "1", "b": ""}, params={"p": "1"}, metrics=[("m", 5, 0, 1.0)]),
        RunFacts("r", "0", 1, {"a": "1"}, params={"p": "1", "q": "2"}, metrics=[("m", 5, 0, 1.0)]),
        RunFacts("r", "0", 1, {"a": "1"}, params={"p": "1"}, metrics=[("m", 6, 0, 1.0)]),
        RunFacts("r", "0", 1, {"a": "1"}, params={"p": "1"}, metrics=[("m", 5, 1, 1.0)]),
        RunFacts("r", "0", 1, {"a": "1"}, params={"p": "1"}, metrics=[("m", 5, 0, 2.0)]),
        RunFacts("r", "0", 1, {"a": "1"}, params={"p": "1"},
                 metrics=[("m", 5, 0, 1.0), ("n", 1, 0, 0.0)]),
        RunFacts("r", "0", 1, {"a": "1"}, params={"p": "1"}, metrics=[("m", 5, 0, 1.0)],
                 end_time=9),
    ]  # fmt: skip
    signs = {base.sign(), *(c.sign() for c in changed)}
    assert len(signs) == len(changed) + 1
    same = RunFacts("r", "0", 1, {"a": "1"}, params={"p": "1"}, metrics=[("m", 5, 0, 1.0)])
    assert same.sign() == base.sign()


def test_the_writers_clock_is_never_compared_with_the_sweepers() -> None:
    # A beat an hour "old" or an hour "in the future" says nothing: only how long the sweeper
    # has seen it unchanged does.
    for beat in (-HOUR_MS, 2 * HOUR_MS):
        d = decide(facts(owner_tags("far", 1, 1.0, beat)), now_ms=HOUR_MS, stale_after=60)
        assert d.verdict == "alive", d


@pytest.mark.parametrize(
    "mismatch",
    [
        "no boot id or namespace (an earlier lifeguard)",
        "no start ticks (an earlier lifeguard)",
        "another PID namespace",
        "another boot",
    ],
)
def test_same_hostname_is_not_same_host(mismatch: str) -> None:
    """A container sharing the host's hostname (pid 1 in its own PID namespace), a reboot, an
    older tag: the pid cannot be checked from here, so only the heartbeat can end the run."""
    from lifeguard.owner import Owner

    me = Owner.current()
    boot, ns, ticks = me.boot_id, me.pid_ns, me.start_ticks
    if mismatch.startswith("no boot"):
        boot = ns = None
    elif mismatch.startswith("no start ticks"):
        ticks = None
    elif mismatch == "another PID namespace":
        ns = "4026539999"
    else:
        boot = "00000000-0000-0000-0000-000000000000"
    tags = {**Owner(me.host, 1, 1.0, boot, ns, ticks).tags(), "lifeguard.heartbeat": "1000",
            "lifeguard.heartbeat.interval": "10"}  # fmt: skip
    young = decide(facts(tags), now_ms=HOUR_MS, stale_after=60, quiet_for=30)
    assert young.verdict == "watch" and "gone" not in young.reason
    old = decide(facts(tags), now_ms=HOUR_MS, stale_after=60, quiet_for=61)
    assert old.verdict == END and "lost" in old.reason


def test_sightings_measure_on_the_sweepers_clock(tmp_path: Path) -> None:
    from lifeguard.sweep import Sightings

    journal = str(tmp_path / "journal")
    run = facts(owner_tags("far", 1, 1.0, 5_000))
    first = Sightings(journal, "http://u:pw@h").load()
    assert first.quiet_for(run) == 0.0
    first.save(["0"])
    assert "pw" not in (tmp_path / "journal" / "sweep.state").read_text()
    assert stat.S_IMODE((tmp_path / "journal" / "sweep.state").stat().st_mode) == 0o600

    later = Sightings(journal, "http://u:pw@h").load()
    assert later.up is not None and first.up is not None
    later.up = first.up + 100  # 100 s later, on the boot clock; the wall clock says nothing
    later.wall_ms = first.wall_ms - HOUR_MS
    assert later.quiet_for(run) == pytest.approx(100)
    # A new beat, or a new metric after the last beat, restarts the count.
    assert later.quiet_for(facts(owner_tags("far", 1, 1.0, 6_000))) == 0.0
    assert later.quiet_for(facts(owner_tags("far", 1, 1.0, 5_000), metric=7_000)) == 0.0
    # Another server's runs are another matter.
    assert Sightings(journal, "http://elsewhere").load().quiet_for(run) == 0.0


def test_sightings_forget_runs_no_longer_running(tmp_path: Path) -> None:
    from lifeguard.sweep import Sightings

    journal = str(tmp_path / "journal")
    a, b = RunFacts("a", "0", 1, owner_tags("far", 1, 1.0, 5)), RunFacts("b", "1", 1, {})
    first = Sightings(journal, "http://h").load()
    first.quiet_for(a), first.quiet_for(b)
    first.save(["0", "1"])
    second = Sightings(journal, "http://h").load()
    second.quiet_for(a)
    second.save(["0"])  # b's experiment was not swept: b is kept
    third = Sightings(journal, "http://h").load()
    third.save(["0", "1"])  # neither seen RUNNING: both forgotten
    text = (tmp_path / "journal" / "sweep.state").read_text()
    assert json.loads(text)["servers"]["http://h"] == {}


def test_untagged_runs_need_an_explicit_opt_in() -> None:
    old = facts({}, start=1_000)
    assert decide(old, now_ms=HOUR_MS, stale_after=60, quiet_for=61).verdict == "skip"
    first = decide(old, now_ms=HOUR_MS, stale_after=60, include_untagged=True, older_than=60)
    assert first.verdict == "watch"  # silent by its own clock, but not yet watched here
    opted = decide(old, now_ms=HOUR_MS, stale_after=60, quiet_for=61, include_untagged=True,
                   older_than=60)  # fmt: skip
    assert opted.verdict == END and opted.end_time == 1_000
    young = facts({}, start=HOUR_MS - 1_000)
    kept = decide(young, now_ms=HOUR_MS, stale_after=60, include_untagged=True, older_than=60)
    assert kept.verdict == "skip"


@pytest.mark.parametrize(("text", "seconds"), [("90", 90), ("90s", 90), ("15m", 900),
                                               ("2h", 7200), ("1d", 86400)])  # fmt: skip
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "soon", "-5m", "0", "inf"])
def test_bad_durations_are_named(text: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


# -- against a real server ----------------------------------------------------------------------


@pytest.fixture
def server(mlflow_server: MlflowServer) -> MlflowServer:
    """The session's server (conftest.mlflow_server). A sweep of it may also end orphans other
    tests left there; these tests assert only on their own runs."""
    return mlflow_server


def run_sweep(
    uri: str, *args: str, journal: Path, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return lifeguard_cli(
        "sweep", "--tracking-uri", uri, "--json", "--timeout", "5", "--journal-dir", str(journal),
        *args, env=env, timeout=timeout,
    )  # fmt: skip


class Program:
    """A program under lifeguard (no watchdog) with one run on the server, held at stdin.
    ``prefix`` runs it (default: this Python); ``env`` adds to its environment."""

    def __init__(
        self, store: Store, uri: str, prefix: Sequence[str] = (sys.executable,), **env: str
    ) -> None:
        self.proc = subprocess.Popen(
            [*prefix, str(CHILDREN / "program.py"), "--path", "SIGTERM"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=child_env(store, MLFLOW_TRACKING_URI=uri, **env), start_new_session=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith(demo.READY), self.proc.stderr.read() if self.proc.stderr else ""
        [self.run_id] = json.loads(line[len(demo.READY) :])["run_ids"]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(60)

    def finish(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        return self.proc.wait(60)

    def output(self) -> tuple[str, str]:
        """stdout after the ready line, and stderr (once the program has ended)."""
        assert self.proc.stdout is not None and self.proc.stderr is not None
        return self.proc.stdout.read(), self.proc.stderr.read()


@pytest.mark.slow
@pytest.mark.timeout(600)  # a dozen sweeps, each a Python that imports mlflow, on a busy machine
def test_sweep_ends_orphans_and_nothing_else(
    server: MlflowServer, store: Store, tmp_path: Path
) -> None:
    client = MlflowClient(tracking_uri=server.uri)
    exp = client.create_experiment("shared")
    now = int(time.time() * 1000)
    here = socket.gethostname()

    # Heartbeats every second, as every run here records: the sweep waits several of them.
    dead = Program(store, server.uri, LIFEGUARD_HEARTBEAT="1")
    alive = Program(store, server.uri, LIFEGUARD_HEARTBEAT="1")
    killed_at = int(time.time() * 1000)
    dead.kill()  # SIGKILL, no watchdog: nothing in the process could end its run
    lost = client.create_run(exp, start_time=now - 2 * HOUR_MS,
                             tags=owner_tags("lost-node", 4242, 1.0, now - HOUR_MS, 1))  # fmt: skip
    far = client.create_run(exp, tags=owner_tags("busy-node", 4242, 1.0, now, 1))
    silent = client.create_run(exp, tags=owner_tags("quiet-node", 7, 1.0, None))
    old_untagged = client.create_run(exp, start_time=now - 3 * 24 * HOUR_MS)
    new_untagged = client.create_run(exp)
    ids = {
        "dead": dead.run_id, "alive": alive.run_id, "lost": lost.info.run_id,
        "far": far.info.run_id, "silent": silent.info.run_id,
        "old_untagged": old_untagged.info.run_id, "new_untagged": new_untagged.info.run_id,
    }  # fmt: skip

    def statuses() -> dict[str, str]:
        return {name: client.get_run(run_id).info.status for name, run_id in ids.items()}

    proxy = FaultProxy(server.port)
    journal = tmp_path / "journal"
    stale = ("--stale-after", "3s")

    def beat_far() -> None:  # a live writer elsewhere: its heartbeat moves between sweeps
        client.set_tag(far.info.run_id, "lifeguard.heartbeat", str(int(time.time() * 1000)))

    try:
        # A dry run decides and writes nothing to the server. Runs are judged by how long this
        # sweeper has seen them unchanged: the first sighting ends nothing, not even the run of
        # an owner proven gone here.
        dry = run_sweep(proxy.uri, "--dry-run", *stale, journal=journal)
        assert dry.returncode == 0, dry.stderr
        verdicts = {d["run_id"]: d["verdict"] for d in json.loads(dry.stdout)["decisions"]}
        assert verdicts[ids["dead"]] == verdicts[ids["alive"]] == "alive"
        assert verdicts[ids["far"]] == verdicts[ids["lost"]] == "alive"
        assert verdicts[ids["silent"]] == verdicts[ids["old_untagged"]] == "skip"
        assert set(statuses().values()) == {"RUNNING"}
        assert not journal.exists()  # a dry run writes nothing anywhere, its own state included

        # A real sweep records what it saw, and on a first look ends nothing.
        beat_far()
        first = run_sweep(proxy.uri, *stale, journal=journal)
        assert first.returncode == 0, first.stderr
        assert set(statuses().values()) == {"RUNNING"}

        # Sweep after sweep, the lost run's heartbeat stays put: after 3 s it is judged lost,
        # and the dead owner's after 10 s, while the beating one never is.
        deadline = time.monotonic() + 180
        while verdicts[ids["lost"]] != "end" or verdicts[ids["dead"]] != "end":
            assert time.monotonic() < deadline, f"never judged lost: {verdicts}"
            beat_far()
            dry = run_sweep(proxy.uri, "--dry-run", *stale, journal=journal)
            assert dry.returncode == 0, dry.stderr
            verdicts = {d["run_id"]: d["verdict"] for d in json.loads(dry.stdout)["decisions"]}
            assert verdicts[ids["far"]] == "alive"
        assert set(statuses().values()) == {"RUNNING"}

        # The server dies after the reads and one write: the sweep fails, loudly, part-way.
        proxy.requests, proxy.fail_after = 0, 3
        beat_far()
        broken = run_sweep(proxy.uri, *stale, journal=journal)
        assert broken.returncode == 1
        assert "could not be ended" in broken.stderr
        after_broken = statuses()
        assert list(after_broken.values()).count("KILLED") <= 1

        # Back up: the next sweep finishes the job, with the same decisions.
        proxy.mode, proxy.fail_after = "pass", None
        beat_far()
        second = run_sweep(proxy.uri, *stale, journal=journal)
        assert second.returncode == 0, second.stderr
        assert statuses() == {
            "dead": "KILLED", "alive": "RUNNING", "lost": "KILLED", "far": "RUNNING",
            "silent": "RUNNING", "old_untagged": "RUNNING", "new_untagged": "RUNNING",
        }  # fmt: skip

        # End times are the last sign of life, never the sweep's own time.
        dead_run = client.get_run(ids["dead"])
        assert dead_run.info.start_time <= dead_run.info.end_time <= killed_at
        if after_broken["dead"] == "KILLED" and "lifeguard.ended_by" not in dead_run.data.tags:
            # Ended by the broken sweep: the status went in, the server died before the reason
            # tags (the status first: a sweep cut short never leaves a RUNNING run that says
            # "swept"), and the sweep said so.
            assert "its reason tags could not be written" in broken.stderr, broken.stderr
        else:
            assert dead_run.data.tags["lifeguard.ended_by"] == "sweep"
            assert (
                f"pid {dead_run.data.tags['lifeguard.owner.pid']} on {here} is gone"
                in (dead_run.data.tags["lifeguard.reason"])
            )
        assert client.get_run(ids["lost"]).info.end_time == now - HOUR_MS

        # Untagged runs only on request, and only the old one.
        beat_far()
        opted = run_sweep(proxy.uri, "--include-untagged", "--older-than", "1d", *stale,
                          journal=journal)  # fmt: skip
        assert opted.returncode == 0, opted.stderr
        assert client.get_run(ids["old_untagged"]).info.status == "KILLED"
        assert client.get_run(ids["old_untagged"]).info.end_time == now - 3 * 24 * HOUR_MS
        assert client.get_run(ids["new_untagged"]).info.status == "RUNNING"
    finally:
        proxy.close()
        assert alive.finish() == 0
    assert client.get_run(ids["alive"]).info.status == "FINISHED"


def test_sweep_options_are_checked() -> None:
    bad = subprocess.run(
        [sys.executable, "-m", "lifeguard", "sweep", "--tracking-uri", "http://127.0.0.1:9",
         "--include-untagged"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "--older-than" in bad.stderr
    stale = subprocess.run(
        [sys.executable, "-m", "lifeguard", "sweep", "--tracking-uri", "x", "--stale-after", "x"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert stale.returncode == 2 and "not a duration" in stale.stderr


def test_sweep_takes_the_server_from_the_environment(server: MlflowServer) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    missing = subprocess.run(
        [sys.executable, "-m", "lifeguard", "sweep", "--dry-run"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert missing.returncode == 2 and "MLFLOW_TRACKING_URI" in missing.stderr
    env["MLFLOW_TRACKING_URI"] = server.uri
    found = subprocess.run(
        [sys.executable, "-m", "lifeguard", "sweep", "--dry-run", "--json"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert found.returncode == 0, found.stderr
    assert json.loads(found.stdout)["tracking_uri"] == server.uri


def test_sightings_in_a_directory_not_ours_count_for_nothing(tmp_path: Path) -> None:
    """Planted sightings could make a live run look silent for days: they are never read."""
    from lifeguard.sweep import Sightings

    journal = tmp_path / "journal"
    run = facts(owner_tags("far", 1, 1.0, 5_000))
    mine = Sightings(str(journal), "http://h").load()
    # "First seen" two hours ago on both clocks. (Not at boot, up = 0.0: the boot clock then
    # says the machine's uptime, under an hour on a machine just started.)
    mine.read_wall_ms -= 7_200_000
    mine.read_up = (mine.read_up or 0.0) - 7200.0
    mine.quiet_for(run)
    mine.save(["0"])
    assert Sightings(str(journal), "http://h").load().quiet_for(run) > 3600  # trusted: read
    journal.chmod(0o777)
    planted = Sightings(str(journal), "http://h").load()
    assert planted.untrusted and planted.quiet_for(run) == 0.0


# -- tags and state that anyone may have damaged ------------------------------------------------


@pytest.mark.parametrize(
    "pid", ["2147483648", "9" * 30, "-1", "0", "\u0661\u0662\u0663", "", "4194305", " 12"]
)
def test_a_pid_tag_no_system_call_takes_is_no_owner(pid: str) -> None:
    """A pid of 2**31 raised OverflowError in kill() and stopped the whole sweep; "١٢٣" was read
    as pid 123, another process; -1 and 0 name process groups. None of them is an owner."""
    from lifeguard.owner import Owner

    tags = owner_tags("far", 1, 1.0, 1_000)
    tags["lifeguard.owner.pid"] = pid
    assert Owner.from_tags(tags) is None
    decision = decide(facts(tags), now_ms=HOUR_MS, stale_after=1, quiet_for=86400)
    assert decision.verdict == "skip", decision


@pytest.mark.parametrize("start", ["nan", "1e999", "-inf"])
def test_a_start_time_that_is_no_time_is_no_owner(start: str) -> None:
    from lifeguard.owner import Owner

    tags = {**owner_tags("far", 1, 1.0, 1_000), "lifeguard.owner.start_time": start}
    assert Owner.from_tags(tags) is None


@pytest.mark.parametrize("beat", ["9" * 400, "9" * 30, "-5", "1e3", "\u0661"])
def test_a_heartbeat_tag_of_any_size_is_judged_never_raised(beat: str) -> None:
    """400 nines stopped the whole sweep (OverflowError dividing the age); now it is no
    heartbeat, and the run is judged by its other times."""
    tags = {"lifeguard.heartbeat": beat}
    decision = decide(facts(tags), now_ms=HOUR_MS, stale_after=1, quiet_for=86400,
                      include_untagged=True, older_than=60)  # fmt: skip
    assert decision.verdict == END and decision.end_time == 1_000, decision


@pytest.mark.parametrize("shape", [[], "x", 7, None])
def test_sweep_state_damaged_for_one_server_is_forgotten_for_it_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, shape: object
) -> None:
    from lifeguard.sweep import Sightings

    tmp_path.chmod(0o700)
    state = tmp_path / "sweep.state"
    other = {"r2": {"sign": "s", "wall": 1, "exp": "0"}}
    state.write_text(json.dumps({"version": 1, "servers": {"here": shape, "there": other}}))
    state.chmod(0o600)
    sightings = Sightings(str(tmp_path), "here").load()
    assert sightings.quiet_for(facts({})) == 0.0
    assert "watching every run afresh" in caplog.text
    assert Sightings(str(tmp_path), "there").load()._data["there"] == other


def test_a_store_that_cannot_be_opened_is_one_line(tmp_path: Path) -> None:
    """A file that is no database: a usage error at the start, exit 2 with one line naming the
    store, and valid JSON with --json, never a traceback (tests/test_bad_input.py has the
    other files that are no MLflow store)."""
    bogus = tmp_path / "notes.db"
    bogus.write_text("not a database " * 100)
    uri = f"sqlite:///{bogus}"
    says = f"--tracking-uri '{uri}': cannot be read as a database (file is not a database)"
    done = lifeguard_cli("sweep", "--tracking-uri", uri, "--journal-dir", str(tmp_path / "j"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.splitlines() == [f"lifeguard sweep: {says}: {bogus}"], done.stderr
    done = lifeguard_cli("sweep", "--tracking-uri", uri, "--json",
                         "--journal-dir", str(tmp_path / "j"))  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert says in json.loads(done.stdout)["error"]


@pytest.mark.parametrize("where", ["sqlite", "rest"])
def test_a_run_its_owner_ended_meanwhile_keeps_its_status(
    where: str, store: Store, mlflow_server: MlflowServer
) -> None:
    """The sweep read the run RUNNING and judged it lost; its owner, alive after all, ended it
    FINISHED before the sweep wrote. The owner's status stands, without the sweep's tags."""
    from lifeguard.backends.mlflow.sweep import _end
    from lifeguard.sweep import Decision

    client = store.client if where == "sqlite" else MlflowClient(mlflow_server.uri)
    run = client.create_run(client.create_experiment(f"meanwhile-{time.time_ns()}"))
    run_id = run.info.run_id
    judged = Decision(facts({}), END, "owner lost", end_time=run.info.start_time)
    judged.run_id = run_id
    client.set_terminated(run_id, "FINISHED")
    assert _end(client, judged) == (False, None)
    after = client.get_run(run_id)
    assert after.info.status == "FINISHED"
    assert "lifeguard.ended_by" not in after.data.tags
    running = client.create_run(run.info.experiment_id).info.run_id
    judged.run_id = running
    assert _end(client, judged) == (True, None)
    assert client.get_run(running).info.status == "KILLED"
    assert client.get_run(running).data.tags["lifeguard.ended_by"] == "sweep"


def test_an_experiment_the_server_does_not_have_is_a_usage_error(store: Store) -> None:
    done = lifeguard_cli("sweep", "--tracking-uri", store.uri, "--experiment", "no-such-exp",
                         env=child_env(store))  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "lifeguard sweep: --experiment 'no-such-exp': no experiment of that name or id"
    )
