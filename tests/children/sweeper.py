"""``lifeguard ARGS`` on a host whose wall clock was stepped since it booted.

``SWEEPER_STEP_SECONDS`` (e.g. 3456000 for 40 days, or -5 for an NTP correction) shifts
``time.time`` and ``time.time_ns`` before anything is imported; the caller bind-mounts a
``/proc/stat`` whose boot time moved by the same step, as the kernel's does (it derives it from
the wall clock). The clocks since boot (monotonic, CLOCK_BOOTTIME, a process's start ticks) are
untouched, as they are by a real step.
"""

from __future__ import annotations

import os
import sys
import time

step = float(os.environ.pop("SWEEPER_STEP_SECONDS"))
_time, _time_ns = time.time, time.time_ns
time.time = lambda: _time() + step
time.time_ns = lambda: _time_ns() + int(step * 1e9)

from lifeguard.cli import main  # noqa: E402 - after the clock is stepped

sys.exit(main(sys.argv[1:]))
