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
from lifeguard.options import parse_signals
from lifeguard.sentry import take_no_signals

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from types import FrameType

    from lifeguard.typed import SignalSpec

__all__ = ["TAG_WARNING", "PreemptionHandle", "on_preemption"]

TAG_WARNING = "lifeguard.preemption_warning"

# The signals that stop the process, not warn it: lifeguard ends the runs KILLED on them
# (install()'s default signals). A warning handler on one made it survivable, or not, by whether
# on_preemption() came before install() or after.
_STOPS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})

# The callbacks, each with the signals it was given for, oldest first.
_callbacks: list[tuple[Callable[[int], object], frozenset[int]]] = []
# The handler each hooked signal had before, put back once no callback is left for it.
_previous: dict[int, object] = {}


class PreemptionHandle:
    """What :func:`lifeguard.on_preemption` returns: ``.remove()`` stops calling the callback,
    and a signal no callback is left for gets back the handler it had before (its default
    action, say: without a callback, a warning is no longer caught)."""

    def __init__(self, callback: Callable[[int], object], signals: frozenset[int]) -> None:
        self.callback = callback
        self.signals = signals

    def remove(self) -> None:
        """Main thread only, as on_preemption()."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionHandle.remove() must be called from the main thread")
        entry = (self.callback, self.signals)
        if entry not in _callbacks:
            return
        _callbacks.remove(entry)
        for signum in self.signals:
            if any(signum in signums for _, signums in _callbacks) or signum not in _previous:
                continue
            previous = _previous.pop(signum)
            # Only where the warning handler is still the one in place: one set since is theirs.
            if signal.getsignal(signum) is _on_warning:
                signal.signal(signum, previous)  # type: ignore[arg-type]


def on_preemption(
    callback: Callable[[int], object], *, signals: SignalSpec = ("SIGUSR1",)
) -> PreemptionHandle:
    """Call ``callback(signum)`` when a preemption warning arrives. Main thread only.
    ``signals`` as install() takes them (lifeguard.options.parse_signals), at least one."""
    if not callable(callback):
        raise TypeError(f"callback must be callable, not {type(callback).__name__}")
    signums = parse_signals(signals, "signals")
    stops = [signal.Signals(s).name for s in signums if s in _STOPS]
    if stops:
        raise ValueError(
            f"signals: {', '.join(stops)} stops the process, it is no preemption warning "
            "(lifeguard ends the runs KILLED on it); give the signal sent before the stop, "
            "such as SIGUSR1 (Slurm's --signal=USR1@90), and register() a finalizer for what "
            "must be done at the stop itself"
        )
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("lifeguard.on_preemption() must be called from the main thread")
    # Imported here, not in the signal handler (the main thread may be importing when the
    # warning comes). Memory only: mlflow is not imported.
    from lifeguard.backends.mlflow import active  # noqa: F401

    for signum in signums:
        if signum not in _previous:
            _previous[signum] = signal.signal(signum, _on_warning)
    hooked = frozenset(signums)
    _callbacks.append((callback, hooked))
    return PreemptionHandle(callback, hooked)


def _on_warning(signum: int, frame: FrameType | None) -> None:
    from lifeguard.backends.mlflow import active

    stamp = int(time.time() * 1000)
    # The runs this process starts or resumes later are tagged too (with their owner tags).
    active.tag_new_runs(TAG_WARNING, _tag_value(signum, stamp))
    for callback, signums in list(_callbacks):
        if signum not in signums:
            continue
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
