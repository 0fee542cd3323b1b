"""A container entrypoint that installs lifeguard with its watchdog and then ``exec``s the real
trainer, as a launcher script does: ``python exec_entrypoint.py PROGRAM ARGS...`` runs
``os.execv(sys.executable, [sys.executable, PROGRAM, ARGS...])`` after ``install()``."""

from __future__ import annotations

import os
import sys

import lifeguard

lifeguard.install(watchdog=True)
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
