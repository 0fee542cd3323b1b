"""The sweep attacked as a hostile neighbour would, at random: live programs and dead ones on one
server, random forged and stale owner tags, wall-clock steps of up to 40 days either way,
another user's sweep under hidepid=2, runs resumed by plain MLflow, whole nodes lost. Over every
trial: no live run is ever ended, and every dead lifeguard run is ended within its bound.

A trial, with a seed printed in every failure (LIFEGUARD_TEST_SEED replays one):

* a live lifeguard program on this host with several runs, each left as it is or with one
  owner tag rewritten (the pid to a process that is gone, the start ticks, the start time, the
  host, the boot id);
* a lifeguard program with several runs, SIGKILLed (no guardian) at a random instant, its tags
  rewritten the same ways;
* a requeued job: a lifeguard program SIGKILLed, and a new one that resumes its run (owner tags
  of the dead one until it adopts the run);
* a run that a lifeguard program ended and a plain-MLflow program resumed and logs to;
* a node of its own (UTS and PID namespaces, another hostname), live or lost at random.

Sweeps follow one another at random: this host's sweep (plain, or with its wall clock stepped),
sharing one state, and another user's under hidepid=2, with its own. Each sweep is checked: no
live run ended. The trial ends once every dead run is ended, each no later than the first sweep
that started a full patience after the first sweep that read it dead.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from lifeguard.owner import TAG_BOOT, TAG_HOST, TAG_PID, TAG_START
from tests.conftest import trials
from tests.servers import MlflowServer
from tests.test_sweep_evidence import (
    TAG_TICKS,
    Program,
    dead_pid,
    hidden_sweep,
    home_of_nobody,
    require_hidepid,
    require_root_namespaces,
    stepped_sweep,
    sweep,
    sweep_json,
)

STALE_AFTER = 10.0  # with heartbeats every second: 10 of them
# The longest any run here must be seen unchanged before it can be ended: --stale-after, three
# beats, or the floor for an owner proven gone (sweep.PROOF_FLOOR).
PATIENCE = 10.0
DAY = 86400
FORGERIES = ("none", "none", TAG_PID, TAG_TICKS, TAG_START, TAG_HOST, TAG_BOOT)


def forge(client: MlflowClient, run_id: str, tag: str) -> None:
    """Rewrite one owner tag, as a user's script or a copied run does."""
    value = {
        TAG_PID: lambda: str(dead_pid()),
        TAG_TICKS: lambda: "1",
        TAG_START: lambda: "1000000000.00",
        TAG_HOST: lambda: "copied-from-elsewhere",
        TAG_BOOT: lambda: "00000000-0000-0000-0000-000000000000",
    }.get(tag)
    if value is not None:
        client.set_tag(run_id, tag, value())


class Sweeper:
    """The sweeps of one trial, in random order, each one's times kept."""

    def __init__(self, rng: random.Random, unshare: str, uri: str, root: Path, home: Path) -> None:
        self.rng, self.unshare, self.uri = rng, unshare, uri
        self.journal = root / "journal"
        self.home = home
        self.log: list[tuple[str, float, float]] = []  # (kind, start, end), monotonic

    def once(self) -> tuple[str, dict[str, dict[str, str]]]:
        kind = self.rng.choice(["plain", "stepped", "hidden"])
        args = ("--stale-after", f"{STALE_AFTER:g}s")
        started = time.monotonic()
        if kind == "plain":
            done = sweep(self.uri, self.journal, *args)
        elif kind == "stepped":
            step = self.rng.uniform(-40 * DAY, 40 * DAY)
            kind = f"stepped {step:+.0f}s"
            done = stepped_sweep(self.unshare, self.uri, self.journal, step, *args)
        else:
            done = hidden_sweep(self.unshare, self.uri, self.home, *args)
        self.log.append((kind, started, time.monotonic()))
        return kind, sweep_json(done)


@pytest.fixture
def nobody_home() -> Iterator[Path]:
    with home_of_nobody() as home:
        yield home


@pytest.fixture
def seeds() -> Iterator[list[int]]:
    fixed = os.environ.get("LIFEGUARD_TEST_SEED")
    count = trials(6, 1)
    base = int(fixed) if fixed else random.SystemRandom().randrange(1 << 30)
    yield [base + i for i in range(1 if fixed else count)]


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(3600)
def test_no_live_run_is_ever_ended_and_every_dead_one_is(
    mlflow_server: MlflowServer, tmp_path: Path, nobody_home: Path, seeds: list[int]
) -> None:
    unshare = require_root_namespaces()
    require_hidepid(unshare, nobody_home)
    for seed in seeds:
        trial(seed, unshare, mlflow_server, tmp_path / f"trial-{seed}", nobody_home)


def trial(seed: int, unshare: str, server: MlflowServer, root: Path, home: Path) -> None:
    rng = random.Random(seed)
    root.mkdir()
    client = MlflowClient(tracking_uri=server.uri)
    say = f"seed {seed}"
    node = [unshare, "--uts", "--pid", "--fork", "--mount-proc", "--kill-child", "sh", "-c",
            'hostname lost-node && exec "$@"', "sh"]  # fmt: skip
    programs: list[Program] = []
    live: dict[str, str] = {}  # run id -> what it is
    dead: dict[str, tuple[str, Program]] = {}
    try:
        keeper = Program(server.uri, "--runs", "3")
        programs.append(keeper)
        for run_id in keeper.run_ids:
            tag = rng.choice(FORGERIES)
            forge(client, run_id, tag)
            live[run_id] = f"live here, {tag} forged"
        victim = Program(server.uri, "--runs", "3")
        programs.append(victim)
        for run_id in victim.run_ids:
            tag = rng.choice(FORGERIES)
            forge(client, run_id, tag)
            dead[run_id] = (f"killed here, {tag} forged", victim)
        requeued = Program(server.uri)
        programs.append(requeued)
        requeued.kill()
        successor = Program(server.uri, "--resume", requeued.run_id)
        programs.append(successor)
        live[requeued.run_id] = "resumed by a requeued lifeguard job"
        train = Program(server.uri)
        assert train.finish() == 0, say
        evaluate = Program(server.uri, "--plain", "--resume", train.run_id, "--metric")
        programs.append(evaluate)
        live[train.run_id] = "resumed by a plain-MLflow program"
        far = Program(server.uri, prefix=node)
        programs.append(far)
        far_lost = rng.random() < 0.5
        if far_lost:
            dead[far.run_id] = ("a node lost whole", far)
        else:
            live[far.run_id] = "live on a node of its own"

        sweeper = Sweeper(rng, unshare, server.uri, root, home)
        kill_after = rng.randrange(0, 3)  # sweeps before the deaths: the deaths at random
        died: dict[str, float] = {}
        deadline = time.monotonic() + 900
        while True:
            if len(sweeper.log) == kill_after:
                for run_id, (_, program) in dead.items():
                    if program.proc.poll() is None:
                        program.kill()
                    died.setdefault(run_id, time.monotonic())
            kind, decisions = sweeper.once()
            for run_id, what in live.items():
                status = client.get_run(run_id).info.status
                assert status == "RUNNING", (say, kind, what, decisions.get(run_id))
            ended = {r for r in dead if client.get_run(r).info.status != "RUNNING"}
            for run_id in ended:
                run = client.get_run(run_id)
                what = dead[run_id][0]
                assert run.info.status == "KILLED", (say, what, run.info.status)
                assert run.data.tags.get("lifeguard.ended_by") == "sweep", (say, what)
            if died and ended == set(dead):
                break
            assert time.monotonic() < deadline, (say, "never ended", set(dead) - ended)
            check_bounds(sweeper, died, set(dead) - ended, dead, say)
    finally:
        for program in programs:
            if program.proc.poll() is None:
                program.kill()
    # The live programs' own endings stand: the sweep said nothing of them.
    for run_id, what in live.items():
        tags = client.get_run(run_id).data.tags
        assert tags.get("lifeguard.ended_by") != "sweep", (say, what)


def check_bounds(
    sweeper: Sweeper,
    died: dict[str, float],
    pending: set[str],
    dead: dict[str, tuple[str, Program]],
    say: str,
) -> None:
    """Each dead run is ended by the first sweep of this host (which keeps its sightings) that
    started PATIENCE after the end of the first of its sweeps that started after the death.
    (Another user's hidepid sweep keeps sightings of its own; it may end it first.)"""
    host = [(start, end) for kind, start, end in sweeper.log if kind != "hidden"]
    for run_id in pending & set(died):
        after = [(start, end) for start, end in host if start >= died[run_id]]
        if after and host[-1][0] >= after[0][1] + PATIENCE:
            raise AssertionError((say, dead[run_id][0], "not ended within its bound", sweeper.log))


def test_forge_writes_what_it_says(mlflow_server: MlflowServer) -> None:
    """The forgeries really land (a trial that forged nothing would prove nothing)."""
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    run_id = client.create_run("0").info.run_id
    for tag in FORGERIES[2:]:
        forge(client, run_id, tag)
    tags = client.get_run(run_id).data.tags
    assert set(FORGERIES[2:]) <= set(tags)
    assert int(tags[TAG_PID]) > 0 and not Path(f"/proc/{tags[TAG_PID]}").exists()
