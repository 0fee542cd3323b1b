"""Helpers for tests that run trainers in PID namespaces of their own (``unshare``), as
containers do: whether that works here, and how the host sees a namespace's processes."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

__all__ = ["NS", "host_pid", "namespace_init", "require_unshare"]

# A PID namespace with its own /proc, the hostname shared with the host (as with hostNetwork
# pods and `docker --network host`).
NS = ("--pid", "--fork", "--mount-proc")


def require_unshare() -> str:
    """The unshare(1) binary, after checking that a PID namespace can be made here. Skips
    visibly where it cannot; under CI=true that is a failure: the CI machine must run them."""
    unshare = shutil.which("unshare")
    why = None
    if unshare is None:
        why = "no unshare(1) on this machine"
    else:
        probe = subprocess.run(
            [unshare, *NS, "true"], capture_output=True, text=True, timeout=60, check=False
        )
        if probe.returncode != 0:
            why = f"unshare --pid refused here: {probe.stderr.strip()}"
    if why is not None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{why} (CI=true: these tests must run)")
        pytest.skip(why)
    assert unshare is not None
    return unshare


def namespace_init(unshare_pid: int) -> int:
    """The host pid of the init of the namespace that ``unshare --fork`` (``unshare_pid``)
    made: its only child."""
    with open(f"/proc/{unshare_pid}/task/{unshare_pid}/children") as f:
        return int(f.read().split()[0])


def host_pid(init: int, pid: int) -> int:
    """The host pid of the process that is ``pid`` in the namespace whose init is ``init``."""
    target = os.readlink(f"/proc/{init}/ns/pid")
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{name}/ns/pid") != target:
                continue
            with open(f"/proc/{name}/status") as f:
                nspid = next(line for line in f if line.startswith("NSpid:"))
        except (OSError, StopIteration):
            continue
        if int(nspid.split()[-1]) == pid:
            return int(name)
    raise LookupError(f"no process {pid} in the namespace of {init}")
