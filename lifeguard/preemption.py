"""Preemption warnings: a signal that says "you will be stopped soon", not "stop now".

Slurm's ``--signal=USR1@90`` sends SIGUSR1 90 s before the end of a job's time; other schedulers
have their own. The program wants to checkpoint, not to die. ``on_preemption(callback)`` hooks
such signals (SIGUSR1 by default): each time one arrives the callbacks run in the main thread,
and the process's runs are tagged ``lifeguard.preemption_warning`` (the signal and the time),
from a background thread so that a slow server never delays the program. A run started or
resumed after the warning is tagged too (at ``start_run``, with the owner tags): under Slurm the
warning often comes while the program is still loading, before it has any run. The run is not ended
and the process does not exit; the SIGTERM that follows ends the run KILLED as usual.

The callbacks run inside a Python signal handler, in the main thread, between two bytecodes
of whatever it was doing: keep them short and set a flag that the training loop acts on (a
``print`` may even meet a stdout that is half-way through a flush).
"""

from __future__ import annotations

import signal
import threading
import time

from lifeguard._log import logger
from lifeguard._threads import take_no_signals
from lifeguard.options import parse_signals

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from types import FrameType

    from lifeguard.typed import SignalSpec

__all__ = ["TAG_WARNING", "PreemptionHandle", "on_preemption"]

TAG_WARNING = "lifeguard.preemption_warning"

_callbacks: list[Callable[[int], object]] = []
_previous: dict[int, object] = {}


class PreemptionHandle:
    """What :func:`lifeguard.on_preemption` returns: ``.remove()`` stops calling the callback."""

    def __init__(self, callback: Callable[[int], object]) -> None:
        self.callback = callback

    def remove(self) -> None:
        try:
            _callbacks.remove(self.callback)
        except ValueError:
            pass


def on_preemption(
    callback: Callable[[int], object], *, signals: SignalSpec = ("SIGUSR1",)
) -> PreemptionHandle:
    """Call ``callback(signum)`` when a preemption warning arrives. Main thread only.
    ``signals`` as install() takes them (lifeguard.options.parse_signals), at least one."""
    if not callable(callback):
        raise TypeError(f"callback must be callable, not {type(callback).__name__}")
    signums = parse_signals(signals, "signals")
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("lifeguard.on_preemption() must be called from the main thread")
    # Imported here, not in the signal handler (the main thread may be importing when the
    # warning comes). Memory only: mlflow is not imported.
    from lifeguard.backends.mlflow import active  # noqa: F401

    for signum in signums:
        if signum not in _previous:
            _previous[signum] = signal.signal(signum, _on_warning)
    _callbacks.append(callback)
    return PreemptionHandle(callback)


def _on_warning(signum: int, frame: FrameType | None) -> None:
    from lifeguard.backends.mlflow import active

    stamp = int(time.time() * 1000)
    # The runs this process starts or resumes later are tagged too (with their owner tags).
    active.tag_new_runs(TAG_WARNING, _tag_value(signum, stamp))
    for callback in list(_callbacks):
        try:
            callback(signum)
        except Exception as exc:  # noqa: BLE001 - a checkpoint that fails must not kill the job
            logger().error("preemption callback %r raised: %s", callback, exc)
    previous = _previous.get(signum)
    if callable(previous):
        previous(signum, frame)
    threading.Thread(
        target=_tag_runs, args=(signum, stamp), name="lifeguard-preemption", daemon=True
    ).start()


def _tag_value(signum: int, stamp: int) -> str:
    return f"{signal.Signals(signum).name} at {stamp}"


def _tag_runs(signum: int, stamp: int) -> None:
    import sys

    take_no_signals()
    fluent = sys.modules.get("mlflow.tracking.fluent")
    if fluent is None:
        return
    try:
        from mlflow.tracking import MlflowClient

        from lifeguard.backends.mlflow.active import owned_active_runs

        client = MlflowClient()
        value = _tag_value(signum, stamp)
        for run_id in owned_active_runs(fluent):
            client.set_tag(run_id, TAG_WARNING, value)
    except Exception as exc:  # noqa: BLE001 - a warning tag is worth a log line, not a crash
        logger().warning("could not tag the preemption warning: %s", exc)
