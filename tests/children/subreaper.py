"""Run a command and count the processes it leaves behind: ``python subreaper.py CMD ARGS...``.

This process becomes a child subreaper (``PR_SET_CHILD_SUBREAPER``): every process the command
starts that outlives its own parent (a detached replayer, a watchdog after its double fork) is
re-parented to it instead of to init. It runs the command with its own stdio, watches /proc for
adopted children (their command lines, read while they live), reaps every one of them, and then
prints ``SUBREAPER {"status": <the command's wait status>, "adopted": [<command lines>]}``.
Every wait is bounded (``SUBREAPER_TIMEOUT``, default 60 s): what is still alive then is
reported as such and killed.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time

PR_SET_CHILD_SUBREAPER = 36


def children_of(pid: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()
        if int(fields[1]) == pid:
            found.append(int(name))
    return found


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def main() -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    timeout = float(os.environ.get("SUBREAPER_TIMEOUT", "60"))
    proc = subprocess.Popen(sys.argv[1:])
    me = os.getpid()
    seen: dict[int, str] = {}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            for pid in children_of(me):
                if pid != proc.pid and not seen.get(pid):
                    seen[pid] = cmdline(pid)
            stop.wait(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    status = proc.wait()
    give_up = time.monotonic() + timeout
    alive = []
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break  # nothing left: every adopted process was reaped
        if pid == 0:
            if time.monotonic() >= give_up:
                alive = children_of(me)
                for left in alive:
                    seen.setdefault(left, cmdline(left))
                    os.kill(left, signal.SIGKILL)
                give_up = float("inf")
            time.sleep(0.01)
            continue
        seen.setdefault(pid, "")
    stop.set()
    watcher.join()
    report = {"status": status, "adopted": list(seen.values()), "still_alive": len(alive)}
    sys.stdout.flush()
    os.write(1, f"SUBREAPER {json.dumps(report)}\n".encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
