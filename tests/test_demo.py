"""`lifeguard demo`, as the README tells a new user to run it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lifeguard import demo

pytestmark = pytest.mark.slow


def test_demo_tells_the_truth_on_every_path() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    result = subprocess.run(
        [sys.executable, "-m", "lifeguard", "demo", "--jobs", "3"],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "<- wrong" not in result.stdout
    table = result.stdout
    for description, _ in [*demo.PATHS.values(), *demo.DEATHS.values()]:
        assert description in table
    sigkill = next(line for line in table.splitlines() if line.startswith("SIGKILL (OOM"))
    assert sigkill.split()[-4:] == ["RUNNING", "KILLED", "137", "(SIGKILL)"]
