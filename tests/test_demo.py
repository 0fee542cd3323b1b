"""`lifeguard demo`, as the README tells a new user to run it; and nothing it starts outlives it."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lifeguard import demo

pytestmark = pytest.mark.slow

# The demo takes ~20 s on a quiet 2-core machine (about 40 s of CPU); sharing the cores with the
# rest of the suite, or another job, makes that several times longer. The subprocess timeout
# stays under the test's, so that a hang fails with the demo's output rather than a bare timeout.
DEMO_TIMEOUT = 150.0
# From the demo's death to nothing of it left: the reaper's scan and the kernel's kills.
GONE_TIMEOUT = 15.0


def demo_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "LIFEGUARD_"))}


# What keeps MLflow's telemetry off without a word from the demo (mlflow/telemetry/utils.py): a
# user who runs the demo by hand has none of them.
TELEMETRY_OFF = (
    "PYTEST_CURRENT_TEST", "CI", "GITHUB_ACTIONS", "CIRCLECI", "GITLAB_CI", "JENKINS_URL",
    "TRAVIS", "TF_BUILD", "BITBUCKET_BUILD_NUMBER", "CODEBUILD_BUILD_ARN", "BUILDKITE",
    "TEAMCITY_VERSION", "CLOUD_RUN_EXECUTION", "RUNBOT_HOST_URL", "RUNBOT_BUILD_NAME",
    "RUNBOT_WORKER_ID", "DO_NOT_TRACK",
)  # fmt: skip


@pytest.mark.timeout(DEMO_TIMEOUT + 30)
def test_demo_tells_the_truth_on_every_path(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """... and writes nothing outside its own directory: run as a user runs it, with MLflow's
    telemetry on unless the demo turns it off, it wrote ~/.config/mlflow/telemetry.json."""
    # In force, not only written: pytest-timeout's own reading of this item (the marker wins
    # over pyproject's 120 s and over -o timeout=...).
    from pytest_timeout import _get_item_settings  # type: ignore[import-untyped]

    assert _get_item_settings(request.node).timeout == DEMO_TIMEOUT + 30
    cmd = [sys.executable, "-m", "lifeguard", "demo", "--jobs", "3"]
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in demo_env().items() if k not in TELEMETRY_OFF}
    env["HOME"] = str(home)
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=DEMO_TIMEOUT, env=env)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the demo took over {DEMO_TIMEOUT}s:\n{exc.stdout!r}\n{exc.stderr!r}")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "<- wrong" not in result.stdout
    table = result.stdout
    for description, _ in [*demo.PATHS.values(), *demo.DEATHS.values()]:
        assert description in table
    sigkill = next(line for line in table.splitlines() if line.startswith("SIGKILL (OOM"))
    assert sigkill.split()[-4:] == ["RUNNING", "KILLED", "137", "(SIGKILL)"]
    directory = re.search(r"sqlite:///(\S+)/mlflow\.db", table)
    assert directory is not None and not os.path.exists(directory.group(1))
    assert sorted(str(p.relative_to(home)) for p in home.rglob("*")) == []


# -- nothing outlives the demo ------------------------------------------------------------------


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start time) of a live process, or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1]), int(fields[19])


def _descendants(root: int) -> dict[int, int]:
    """pid -> start time of every live descendant of ``root``."""
    parents: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (stat := _stat(int(name))) is not None and stat[0] != "Z":
            parents.setdefault(stat[1], []).append(int(name))
            starts[int(name)] = stat[2]
    found: dict[int, int] = {}
    todo = [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            found[child] = starts[child]
            todo.append(child)
    return found


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _alive(pids: dict[int, int]) -> list[str]:
    """The ones still running: same pid, same start time, not a zombie."""
    left = []
    for pid, start in pids.items():
        stat = _stat(pid)
        if stat is not None and stat[0] != "Z" and stat[2] == start:
            left.append(f"{pid}: {_cmdline(pid)}")
    return left


def _read_lines(stream: object, lines: queue.Queue[str]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        lines.put(line)
    lines.put("")


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=["SIGKILL", "SIGTERM", "Ctrl-C"]
)
def test_nothing_of_the_demo_outlives_it(tmp_path: Path, sig: int) -> None:
    errors = tmp_path / "stderr"
    with open(errors, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lifeguard", "demo"],
            stdout=subprocess.PIPE, stderr=stderr, text=True, env=demo_env(),
            # A terminal's dispositions (an xdist worker may ignore SIGINT), as run_child gives.
            preexec_fn=demo._child_preexec(None),
        )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True).start()
    try:
        first = lines.get(timeout=60)
        match = re.search(r"sqlite:///(\S+)/mlflow\.db", first)
        assert match, first
        directory = match.group(1)
        deadline = time.monotonic() + 120
        while True:  # until the demo says its server is up: then it runs everything at once
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line, f"the demo ended early: {errors.read_text()}"
            if "mlflow server is up" in line:
                break
        tree = _descendants(proc.pid)
        commands = [_cmdline(pid) for pid in tree]
        # The test means something only if the whole cast is there at the kill.
        assert any("lifeguard.demo --zygote" in c for c in commands), commands
        assert any("lifeguard.demo --reaper" in c for c in commands), commands
        assert any("uvicorn" in c for c in commands), commands
        os.kill(proc.pid, sig)
        assert proc.wait(30) == -sig
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + GONE_TIMEOUT
    while True:
        # Also any process started after the snapshot: the marker is in every environment.
        left = _alive(tree) + [f"{pid}: {_cmdline(pid)}" for pid in demo._marked(directory)]
        if not left and not os.path.exists(directory):
            break
        assert time.monotonic() < deadline, (
            f"{GONE_TIMEOUT}s after the demo's death: {left}, dir {os.path.exists(directory)}"
        )
        time.sleep(0.05)  # polling a condition with a deadline; nothing to be told by


# -- the runner: hermetic children that die with their parent --------------------------------


def test_children_start_with_default_signal_dispositions() -> None:
    """Whatever the runner inherited (nohup ignores SIGHUP; a runner may block signals)."""
    code = (
        "import json, signal; print('LIFEGUARD-READY', json.dumps({"
        "'ignored': [s.name for s in signal.Signals"
        " if s not in (signal.SIGKILL, signal.SIGSTOP)"
        " and signal.getsignal(s) is signal.SIG_IGN],"
        "'blocked': [s.name for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])],"
        "'sigint': str(signal.getsignal(signal.SIGINT))}), flush=True)"
    )
    saved = {s: signal.getsignal(s) for s in (signal.SIGHUP, signal.SIGUSR1)}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM, signal.SIGQUIT])
    try:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        result = demo.run_child([sys.executable, "-c", code], timeout=60)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for s, handler in saved.items():
            signal.signal(s, handler)
    tested = {s.name for s in demo.TESTED_SIGNALS}
    assert tested.isdisjoint(result.ready["ignored"]), result.ready  # type: ignore[arg-type]
    assert tested.isdisjoint(result.ready["blocked"]), result.ready  # type: ignore[arg-type]
    assert result.ready["sigint"] == str(signal.default_int_handler)


def test_children_die_with_their_parent(tmp_path: Path) -> None:
    """A runner killed outright (a pytest worker SIGKILLed) leaves no child of run_child."""
    child = (
        "import os, json, time; "
        "print('LIFEGUARD-READY', json.dumps({'pid': os.getpid()}), flush=True); time.sleep(600)"
    )
    runner = (
        "import json, sys\n"
        "from lifeguard.demo import run_child\n"
        f"run_child([sys.executable, '-c', {child!r}], timeout=300,\n"
        "          after_ready=lambda ready: print(json.dumps(ready), flush=True))\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", runner], stdout=subprocess.PIPE, text=True, env=demo_env()
    )
    try:
        assert proc.stdout is not None
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True).start()
        grandchild = int(json.loads(lines.get(timeout=60))["pid"])
        proc.kill()
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert demo.wait_gone(grandchild, GONE_TIMEOUT), f"{grandchild} outlived its parent"
