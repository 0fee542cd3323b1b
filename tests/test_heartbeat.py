"""The heartbeat: refreshed on the process's own runs, never raising, stopped at the end."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest

from lifeguard.backends.mlflow.heartbeat import Heartbeat
from lifeguard.names import TAG_HEARTBEAT
from tests.conftest import CHILD_TIMEOUT, Scenario, Store, child_env


def test_beat_refreshes_own_runs_and_survives_a_dead_server(
    store: Store, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO, logger="lifeguard")
    mlflow.set_tracking_uri(store.uri)
    run = mlflow.start_run()
    try:
        beat = Heartbeat(60.0)
        before = int(time.time() * 1000)
        assert beat.beat() == 1
        assert int(store.run(run.info.run_id).data.tags[TAG_HEARTBEAT]) >= before

        # The run's store goes away (a unit: the write raises as a dead server's would).
        # Switching the tracking URI would not do: each run beats in its own store.
        from mlflow.tracking import MlflowClient

        def dead(*args: object, **kwargs: object) -> None:
            raise ConnectionError("Connection refused")

        with monkeypatch.context() as patch:
            patch.setattr(MlflowClient, "set_tag", dead)
            assert beat.beat() == 0  # no exception reaches the caller
            assert beat.beat() == 0
        assert caplog.text.count("heartbeat failed") == 1  # logged once, not every beat

        assert beat.beat() == 1
        assert "heartbeat recovered" in caplog.text
    finally:
        mlflow.set_tracking_uri(store.uri)
        mlflow.end_run()


def test_beat_finds_runs_created_outside_start_run(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning's MLFlowLogger resolves context tags, then calls MlflowClient.create_run: the
    run is on no active-run stack, so the beat finds it by its owner tags."""
    from lifeguard.backends.mlflow import active
    from lifeguard.owner import Owner

    mlflow.set_tracking_uri(store.uri)
    run = store.client.create_run("0", tags=Owner.current().tags())
    other = store.client.create_run("0", tags={**Owner.current().tags(), "x": "ended"})
    store.client.set_terminated(other.info.run_id, "FINISHED")
    beat = Heartbeat(60.0)
    assert beat.beat() == 0  # not searched for: nothing said such runs exist
    monkeypatch.setattr(active, "_created_outside_fluent", os.getpid())
    before = int(time.time() * 1000)
    assert beat.beat() == 1  # the RUNNING one only
    assert int(store.run(run.info.run_id).data.tags[TAG_HEARTBEAT]) >= before
    assert TAG_HEARTBEAT not in store.run(other.info.run_id).data.tags


@pytest.mark.slow
def test_heartbeat_runs_while_training_and_stops_at_the_end(
    scenario: Scenario, store: Store
) -> None:
    env = child_env(store, LIFEGUARD_HEARTBEAT="1")  # the shortest interval allowed
    seen: list[int] = []

    def watch_beats(ready: dict[str, object]) -> None:
        # Waits for the beat thread's effect on the store (bounded: the runner's timeout).
        result_run = None
        while len(set(seen)) < 3:
            result_run = store.client.search_runs(
                [store.client.get_experiment_by_name("Default").experiment_id]
            )
            if result_run:
                seen.append(int(result_run[0].data.tags[TAG_HEARTBEAT]))

    result = scenario.run("--path", "SIGTERM", send=(signal.SIGTERM,), env=env,
                          after_ready=watch_beats)  # fmt: skip
    assert result.returncode == -signal.SIGTERM
    [run_id] = result.ready["run_ids"]
    run = store.run(run_id)
    assert run.info.status == "KILLED"
    assert len(set(seen)) >= 3  # the first beat at start_run, then the thread's
    assert int(run.data.tags[TAG_HEARTBEAT]) <= run.info.end_time  # none after the end


UNDER_RUN = """
import sys, mlflow, lifeguard
lifeguard.install(heartbeat=1)  # over the install made at start by `lifeguard run`
run = mlflow.start_run()
print(run.info.run_id, flush=True)
sys.stdin.readline()
"""


def test_the_programs_own_heartbeat_holds_under_lifeguard_run(store: Store, tmp_path: Path) -> None:
    """`lifeguard run` installs at start with the default heartbeat (60 s); the program's own
    install(heartbeat=1) replaces it. The beat thread already running kept its first beat 60 s
    away: the run said it beat every second and did not, for a minute."""
    program = tmp_path / "prog.py"
    program.write_text(UNDER_RUN)
    proc = subprocess.Popen(
        [sys.executable, "-m", "lifeguard", "run", "--", sys.executable, str(program)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(store),
        cwd=tmp_path,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        run_id = proc.stdout.readline().strip()
        assert run_id, proc.stderr
        beats: set[str] = set()
        give_up = time.monotonic() + 30  # three beats take 3 s; 30 s is for a loaded machine
        while len(beats) < 3 and time.monotonic() < give_up:
            beat = store.run(run_id).data.tags.get(TAG_HEARTBEAT)
            if beat is not None:
                beats.add(beat)
            time.sleep(0.2)  # polling the store, not waiting for an event
        assert len(beats) >= 3, beats
        proc.stdin.close()
        assert proc.wait(CHILD_TIMEOUT) == 0
        assert store.status(run_id) == "FINISHED"
    finally:
        proc.kill()
        proc.wait(CHILD_TIMEOUT)
