"""How lifeguard behaves next to the things real programs do: their own signal handlers, broken
finalizers, impatient operators, nested and threaded runs, forked workers, explicit teardown."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import CHILD_TIMEOUT, Scenario, Store, child_env, wait_blocked, wait_gone

pytestmark = pytest.mark.slow


def test_user_sigterm_handler_that_exits_still_runs(scenario: Scenario, store: Store) -> None:
    """A handler installed before lifeguard (as Ray's is) runs; its exit code is kept, and the
    run says the truth: a signal stopped it."""
    result = scenario.run("--path", "SIGTERM", "--user-sigterm", "exit7", send=(signal.SIGTERM,))
    assert "USER-HANDLER" in result.stdout
    assert result.returncode == 7
    [run_id] = result.ready["run_ids"]
    assert store.status(run_id) == "KILLED"
    assert store.run(run_id).data.tags["lifeguard.signal"] == "SIGTERM"
    assert scenario.calls() == [(result.ready["pid"], "KILLED")]


def test_user_sigterm_handler_that_returns_keeps_the_program_alive(
    scenario: Scenario, store: Store
) -> None:
    """The program handled SIGTERM and lived on (then main returned on stdin EOF): nothing was
    finalized at the signal, and the run ends by how the program really ended."""
    result = scenario.run("--path", "SIGTERM", "--user-sigterm", "return", send=(signal.SIGTERM,))
    assert "USER-HANDLER" in result.stdout
    assert result.returncode == 0
    [run_id] = result.ready["run_ids"]
    assert store.status(run_id) == "FINISHED"
    assert scenario.calls() == [(result.ready["pid"], "FINISHED")]


def test_finalizer_that_raises_is_logged_and_others_run(scenario: Scenario, store: Store) -> None:
    result = scenario.run("--path", "sys.exit(3)", "--raising-finalizer")
    assert result.returncode == 3
    assert "finalizer 'explode' raised RuntimeError: finalizer exploded on purpose" in result.stderr
    [run_id] = result.ready["run_ids"]
    assert store.status(run_id) == "FAILED"
    assert scenario.calls() == [(result.ready["pid"], "FAILED")]


def test_hanging_finalizer_is_cut_off_at_the_deadline(scenario: Scenario, store: Store) -> None:
    result = scenario.run(
        "--path", "SIGTERM", "--hanging-finalizer", "--deadline", "3", send=(signal.SIGTERM,)
    )
    assert result.returncode == -signal.SIGTERM
    assert "finalizer 'hang' did not finish" in result.stderr
    [run_id] = result.ready["run_ids"]
    assert store.status(run_id) == "KILLED"
    assert scenario.calls() == [(result.ready["pid"], "KILLED")]


def test_second_signal_during_finalization_ends_at_once(scenario: Scenario, store: Store) -> None:
    """The blocking finalizer would hold the process for the whole 600 s deadline; the second
    SIGTERM, sent when it reports FINALIZING, must end the process at once by SIGTERM."""
    result = scenario.run(
        "--path",
        "SIGINT",
        "--blocking-finalizer",
        "--deadline",
        "600",
        send=(signal.SIGINT,),
        on_line={"FINALIZING": signal.SIGTERM},
        # No last-gasp replayer: what the second signal left is looked at here, not written.
        env=child_env(store, LIFEGUARD_REPLAY_BOUND="0"),
    )
    assert "FINALIZING" in result.stdout
    assert result.returncode == -signal.SIGTERM
    # The blocking finalizer was registered last, so it ran first: MLflow's never got to run.
    [run_id] = result.ready["run_ids"]
    assert store.status(run_id) == "RUNNING"
    assert scenario.calls() == []


@pytest.mark.parametrize("runs", ["nested", "thread"])
def test_every_run_of_the_process_is_ended(scenario: Scenario, store: Store, runs: str) -> None:
    before = int(time.time() * 1000)
    result = scenario.run("--path", "SIGTERM", "--runs", runs, send=(signal.SIGTERM,))
    assert result.returncode == -signal.SIGTERM
    run_ids = result.ready["run_ids"]
    assert len(run_ids) == 2
    for run_id in run_ids:
        info = store.run(run_id).info
        assert info.status == "KILLED"
        assert info.end_time is not None and info.end_time >= before
    assert scenario.calls() == [(result.ready["pid"], "KILLED")]


def test_forked_children_never_run_the_parents_finalizers(scenario: Scenario, store: Store) -> None:
    """Ctrl-C in a terminal sends SIGINT to the whole process group, DataLoader workers included."""
    result = scenario.run(
        "--path", "SIGINT", "--fork", send=(signal.SIGINT,), to_group=True,
        after_ready=lambda ready: wait_blocked(int(ready["pid"]), "pipe_read"),  # type: ignore[call-overload]
    )  # fmt: skip
    assert result.returncode == -signal.SIGINT
    [run_id] = result.ready["run_ids"]
    assert store.status(run_id) == "KILLED"
    assert scenario.calls() == [(result.ready["pid"], "KILLED")]
    for pid in result.ready["children"]:
        # The children got the same SIGINT; they must be gone, not left running.
        wait_gone(pid)


def test_finish_then_exit_runs_finalizers_once(scenario: Scenario, store: Store) -> None:
    result = scenario.run("--path", "sys.exit(3)", "--finish-first")
    assert result.returncode == 3
    [run_id] = result.ready["run_ids"]
    assert store.status(run_id) == "FINISHED"  # ended by finish(), not overwritten at exit
    assert scenario.calls() == [(result.ready["pid"], "FINISHED")]


def test_run_ended_by_with_block_is_not_overwritten(scenario: Scenario, store: Store) -> None:
    result = scenario.run("--path", "exception", "--with-block")
    assert result.returncode == 1
    done, current = result.ready["run_ids"]
    assert store.status(done) == "FINISHED"
    assert "lifeguard.ended_by" not in store.run(done).data.tags
    assert store.status(current) == "FAILED"


def test_run_ended_by_the_user_is_not_overwritten(scenario: Scenario, store: Store) -> None:
    result = scenario.run("--path", "SIGTERM", "--user-ended", send=(signal.SIGTERM,))
    assert result.returncode == -signal.SIGTERM
    [run_id] = result.ready["run_ids"]
    assert store.status(run_id) == "FAILED"
    assert "lifeguard.ended_by" not in store.run(run_id).data.tags


@pytest.mark.parametrize(
    ("path", "status", "code"),
    [("sys.exit(3)", "FAILED", 3), ("exception", "FAILED", 1), ("return", "FINISHED", 0)],
)
def test_a_del_that_ends_the_run_comes_after_the_truth(
    scenario: Scenario, store: Store, path: str, status: str, code: int
) -> None:
    """HuggingFace's MLflowCallback ends its run in __del__. SystemExit unwinds the stack before
    atexit, so without lifeguard holding the frames the __del__ would say FINISHED first."""
    result = scenario.run("--path", path, "--ended-by-del")
    assert result.returncode == code, result.stderr[-2000:]
    [run_id] = result.ready["run_ids"]
    assert store.status(run_id) == status
    if path != "return":  # a clean return ends it through the __del__: FINISHED, the truth
        assert store.run(run_id).data.tags["lifeguard.ended_by"] == "process"


@pytest.mark.parametrize("end_attached", [False, True])
def test_attached_run_left_alone_unless_asked(
    scenario: Scenario, store: Store, end_attached: bool
) -> None:
    parent = store.client.create_run(store.client.get_experiment_by_name("Default").experiment_id)
    run_id = parent.info.run_id
    env = child_env(store, MLFLOW_RUN_ID=run_id, MLFLOW_RUN_ID_EXPECTED=run_id)
    args = ["--path", "SIGTERM", "--attach"] + (["--end-attached"] if end_attached else [])
    result = scenario.run(*args, send=(signal.SIGTERM,), env=env)
    assert result.returncode == -signal.SIGTERM
    assert result.ready["run_ids"] == [run_id]
    assert store.status(run_id) == ("KILLED" if end_attached else "RUNNING")
    assert scenario.calls() == [(result.ready["pid"], "KILLED")]


@pytest.mark.parametrize("again", ["finish()", "uninstall(); lifeguard.install()"])
def test_an_attached_run_stays_attached_after_install_again(
    store: Store, tmp_path: Path, again: str
) -> None:
    """MLflow takes MLFLOW_RUN_ID out of the environment when start_run() attaches to it. An
    install() after that (finish()'s re-arm, uninstall() then install()) used to find no
    attached run, and the exit ended it FAILED: the run of the parent that launched the
    program, which lifeguard must leave alone unless asked. Left alone, MLflow's own exit hook
    ends it, as without lifeguard: FINISHED, with no tag of lifeguard's."""
    parent = store.client.create_run(store.client.get_experiment_by_name("Default").experiment_id)
    run_id = parent.info.run_id
    code = f"""
import sys, mlflow, lifeguard
lifeguard.install()
run = mlflow.start_run()
assert run.info.run_id == {run_id!r}, run.info.run_id
lifeguard.{again}
sys.exit(4)
"""
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT,
        env=child_env(store, MLFLOW_RUN_ID=run_id),
        cwd=tmp_path,
    )
    assert result.returncode == 4, result.stderr
    assert store.status(run_id) == "FINISHED", result.stderr
    assert not [t for t in store.run(run_id).data.tags if t.startswith("lifeguard.")], result.stderr


def test_async_metrics_are_flushed_before_the_run_ends(scenario: Scenario, store: Store) -> None:
    # A signal gives the flush a tenth of the deadline: 12 s here, room for 200 metrics on a
    # heavily loaded machine (3 s was not, at a load average of 8). That the share is bounded
    # is test_signal_anywhere.py's test_async_metrics_get_a_bounded_share.
    result = scenario.run(
        "--path", "SIGTERM", "--async-metrics", "200", "--deadline", "120", send=(signal.SIGTERM,)
    )  # fmt: skip
    assert result.returncode == -signal.SIGTERM
    [run_id] = result.ready["run_ids"]
    assert store.status(run_id) == "KILLED"
    history = store.client.get_metric_history(run_id, "async_loss")
    assert sorted(m.step for m in history) == list(range(200)), result.stderr


def test_first_sigterm_while_finalizing_a_crash_waits_then_kills(
    scenario: Scenario, store: Store
) -> None:
    """torchrun SIGTERMs the surviving ranks after one fails. A rank already finalizing its own
    crash must not drop everything: its finalizers finish (within the deadline), the run says
    why it really ended, and then the process dies of the SIGTERM."""
    result = scenario.run(
        "--path", "exception", "--blocking-finalizer", "--deadline", "2",
        on_line={"FINALIZING": signal.SIGTERM},
        # No last-gasp replayer: on 3.12 the journal the process left is looked at below.
        env=child_env(store, LIFEGUARD_REPLAY_BOUND="0"),
    )  # fmt: skip
    assert "FINALIZING" in result.stdout
    assert result.returncode == -signal.SIGTERM
    [run_id] = result.ready["run_ids"]
    if sys.version_info[:2] == (3, 12):
        # 3.12 refuses new threads in atexit: the finalizers run inline, newest first, and the
        # blocking one never returns. The SIGTERM still ends the process at the deadline, and
        # the run's FAILED is in the journal (written before any finalizer ran) for the next
        # install() or sweep, which the finalizers after it never got to write.
        entry = json.loads((store.path.parent / "journal" / f"{run_id}.json").read_text())
        assert entry["status"] == "FAILED"
        assert entry["tags"]["lifeguard.exception"] == "RuntimeError"
        assert store.status(run_id) == "RUNNING"
        assert scenario.calls() == []
        return
    assert store.status(run_id) == "FAILED"
    assert store.run(run_id).data.tags["lifeguard.exception"] == "RuntimeError"
    assert scenario.calls() == [(result.ready["pid"], "FAILED")]


def test_preemption_warning_tags_and_goes_on_then_sigterm_ends(
    scenario: Scenario, store: Store
) -> None:
    """Slurm's --signal=USR1@90: checkpoint and carry on; the SIGTERM later ends the run."""
    lived_on: list[str] = []

    def warn(ready: dict[str, object]) -> None:
        [run_id] = ready["run_ids"]  # type: ignore[misc]
        pid = int(ready["pid"])  # type: ignore[call-overload]
        # Sent once the program waits in its read of stdin: sent sooner, it can land just before
        # the read's system call, and then its handler runs only when stdin closes, after this.
        wait_blocked(pid, "pipe_read")
        os.kill(pid, signal.SIGUSR1)
        # The tag is written from a background thread: wait for it on the server (bounded).
        deadline = time.monotonic() + 60
        while "lifeguard.preemption_warning" not in store.run(run_id).data.tags:
            assert time.monotonic() < deadline, "no preemption tag"
            time.sleep(0.05)
        lived_on.append(store.status(run_id))

    result = scenario.run("--path", "SIGTERM", "--preemption", send=(signal.SIGTERM,),
                          after_ready=warn)  # fmt: skip
    assert f"CHECKPOINT {int(signal.SIGUSR1)}" in result.stdout
    assert lived_on == ["RUNNING"]  # warned, not ended
    assert result.returncode == -signal.SIGTERM
    [run_id] = result.ready["run_ids"]
    run = store.run(run_id)
    assert run.info.status == "KILLED"
    assert run.data.tags["lifeguard.preemption_warning"].startswith("SIGUSR1 at ")
