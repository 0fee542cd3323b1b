"""A patient init for a PID namespace: it waits for a ``go`` line on stdin, starts the command
given after ``--`` as its child (pid 2 of the namespace, in every namespace started this way),
then waits for every process of the namespace to end (orphans are reparented to it: a watchdog
sidecar, a supervisor's leftovers) before it exits with the command's status.

Why a patient one: when a namespace's init exits, the kernel kills everything left in it. An
init that exits with its first child (tini, ``sh -c``) would take a watchdog down before it did
its work; this one lets the tests see what a watchdog does in a container whose PID 1 outlives
the trainer (Kubernetes' pause container with ``shareProcessNamespace``, systemd, ...).
"""

from __future__ import annotations

import os
import subprocess
import sys

WAITING = "ns-init waiting for go"

command = sys.argv[sys.argv.index("--") + 1 :]
# Said before the wait, so that a test sends "go" only to inits that are all waiting: then both
# namespaces' trainers start in the same instant, however late one init started.
print(WAITING, flush=True)
sys.stdin.readline()  # "go"
child = subprocess.Popen(command)  # inherits stdin: the rest is the program's
status = None
while True:
    try:
        pid, wait_status = os.wait()
    except ChildProcessError:
        break
    if pid == child.pid:
        status = os.waitstatus_to_exitcode(wait_status)
if status is None:
    status = 1
sys.exit(status if status >= 0 else 128 - status)
