"""Run another child program as if on another machine whose clock is off.

``python skewed.py PROGRAM.py ARGS...`` with ``SKEW_SECONDS`` (e.g. 3600 or -3600) in the
environment. ``time.time`` and ``time.time_ns`` are shifted before anything is imported, so the
run's start time, its metrics and lifeguard's heartbeats all carry that host's clock, as they
would on a machine whose clock is wrong; monotonic clocks (timeouts) are untouched. The hostname
is another one too: a sweep must judge the run by its heartbeat, as it would a remote host's.
"""

from __future__ import annotations

import os
import runpy
import socket
import sys
import time

offset = float(os.environ.pop("SKEW_SECONDS"))
_time, _time_ns = time.time, time.time_ns
time.time = lambda: _time() + offset
time.time_ns = lambda: _time_ns() + int(offset * 1e9)
socket.gethostname = lambda: f"skewed{offset:+.0f}"

sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
