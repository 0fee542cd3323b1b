"""lifeguard: every experiment-tracking run ends with the truth.

Call :func:`install` at the top of the program. When the process ends, however it ends, every
registered finalizer runs once with an :class:`Outcome`, and the MLflow runs this process started
are ended FINISHED, FAILED or KILLED with their true end time.

This module is deliberately tiny: the implementation is imported on first use, so that
``import lifeguard`` stays cheap and never pulls in mlflow, psutil or torch.
"""

__version__ = "0.1.0"

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

    from typing_extensions import Unpack

    from lifeguard.finalizers import Handle, Report
    from lifeguard.hooks import ProcessHooks
    from lifeguard.outcome import Outcome, OutcomeKind, Status
    from lifeguard.preemption import PreemptionHandle
    from lifeguard.sentry import Posts
    from lifeguard.typed import InstallOptions, Ranks, SignalSpec

__all__ = [
    "Handle",
    "InstallOptions",
    "Outcome",
    "OutcomeKind",
    "PreemptionHandle",
    "Ranks",
    "Report",
    "SignalSpec",
    "Status",
    "__version__",
    "finish",
    "install",
    "is_installed",
    "on_preemption",
    "register",
    "track",
    "uninstall",
    "watchdog_pid",
]


def install(**options: "Unpack[InstallOptions]") -> None:
    """Hook the process so that every finalizer runs once, with the truth, however it ends.

    Idempotent. Options (each also settable by an environment variable; both are listed, with
    what they accept, in docs/configuration.md):
    ``signals`` (default SIGINT, SIGTERM, SIGHUP), ``deadline`` (seconds for all finalizers,
    default 10), ``mlflow`` (end MLflow runs, default True), ``end_attached`` (also end runs
    attached through MLFLOW_RUN_ID, default False), ``trackers`` (the other trackers to end
    when the program uses them, default tensorboard, wandb, swanlab, trackio), and the guardian
    options ``watchdog``, ``heartbeat``. ``blocked_grace`` is accepted and has no effect.

    Raises TypeError/ValueError naming a bad option or ``LIFEGUARD_*`` variable, and
    RuntimeError when called outside the main thread with signals to hook (pass ``signals=()``
    there). Warns (logging) about a ``LIFEGUARD_*`` variable it does not know.
    """
    import os

    if options or any(name.startswith("LIFEGUARD_") for name in os.environ):
        from lifeguard import api

        api.install(**options)
        return
    from lifeguard import sentry

    if sentry.current() is not None:
        from lifeguard import api

        api.install()  # installed already: api.install() says whether it differs
        return
    # Nothing to check, the common case: the posts are armed with the defaults, and nothing
    # else is loaded (lifeguard.sentry). The rest of api.install()'s steps, in the same order.
    if TYPE_CHECKING:
        import signal as _signal
    else:
        import _signal  # not signal: it loads enum and functools (lifeguard/signals.py)
    from lifeguard import journaldir

    signals = (_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP)
    posts = sentry.arm(signals, _make, _DEFAULT_WORK)
    sentry.see_the_program()
    if posts.has_work():
        from lifeguard import api
        from lifeguard.settings import Options

        api.made_at_install(Options())
    journaldir.replay_if_due()


# The defaults' modules whose presence means a built-in finalizer has work: MLflow's and the
# default trackers' (lifeguard.names.MODULES). Written out: install() with nothing to check loads
# neither lifeguard.settings nor lifeguard.names for them (tests/test_units.py checks they agree,
# and that the signals above are settings.DEFAULT_SIGNALS).
_DEFAULT_WORK = (
    "mlflow.tracking.fluent",
    "torch.utils.tensorboard.writer",
    "tensorboardX.writer",
    "wandb",
    "swanlab",
    "trackio",
)


def _make(posts: "Posts") -> "ProcessHooks":
    """The lifecycle of posts armed with the defaults, made when the first event needs it."""
    from lifeguard import api
    from lifeguard.settings import Options

    return api.make(posts, Options())


def uninstall() -> None:
    """Restore every hook that :func:`install` changed."""
    from lifeguard import api

    api.uninstall()


def register(
    finalizer: "Callable[[Outcome], object]", *, name: str | None = None, ranks: "Ranks" = "all"
) -> "Handle":
    """Register ``finalizer(outcome)`` to run at most once when the process ends.

    Finalizers run newest first (like atexit). ``ranks`` is ``"all"`` (default), ``"zero"``
    (rank 0 of a distributed job only), a rank, or a set of ranks; the rank is read when the
    finalizer would run (see ``lifeguard.distributed``). Returns a handle with
    ``.unregister()``.
    """
    from lifeguard import api

    return api.register(finalizer, name=name, ranks=ranks)


def track(
    obj: object, *, method: str | None = None, name: str | None = None, ranks: "Ranks" = "all"
) -> "Handle":
    """End any tracker object when the process ends: register a finalizer that calls its
    ``finish``, ``close`` or ``end`` (or ``method``), passing ``exit_code``, ``status``,
    ``outcome`` or ``reason`` if the method takes a parameter of that name. TypeError if the
    object has no such method. Returns the handle, as :func:`register` does."""
    from lifeguard import api

    return api.track(obj, method=method, name=name, ranks=ranks)


def finish(exit_code: int = 0, *, outcome: "Outcome | None" = None) -> "list[Report]":
    """Run every finalizer now, e.g. on rank 0 when training is done. The exit hooks then have
    nothing left to do. Returns one report per finalizer."""
    from lifeguard import api

    return api.finish(exit_code, outcome=outcome)


def watchdog_pid() -> int | None:
    """The pid of this process's watchdog sidecar, if ``install(watchdog=True)`` started one."""
    from lifeguard import api

    lifecycle = api.current()
    return lifecycle.guardian_pid if lifecycle is not None else None


def on_preemption(
    callback: "Callable[[int], object]", *, signals: "SignalSpec" = ("SIGUSR1",)
) -> "PreemptionHandle":
    """Call ``callback(signum)`` on a preemption warning (Slurm's ``--signal=USR1@90``): the
    run is tagged, not ended, and the process goes on. ``signals`` as :func:`install` takes
    them ("USR2", "12", 12, "usr1,usr2", a list), at least one. Returns a handle with
    ``.remove()``."""
    from lifeguard import preemption

    return preemption.on_preemption(callback, signals=signals)


def is_installed() -> bool:
    """Whether :func:`install` is in effect in this process: from ``install()`` until
    ``uninstall()`` or the process's end. :func:`finish` leaves it installed, for the runs
    started after it; a forked child has nothing installed."""
    from lifeguard import api

    return api.is_installed()


def __getattr__(name: str) -> object:
    # PEP 562: the data types are loaded on first access, not at import.
    if name in ("Outcome", "OutcomeKind", "Status"):
        from lifeguard import outcome

        return getattr(outcome, name)
    if name in ("Handle", "Report"):
        from lifeguard import finalizers

        return getattr(finalizers, name)
    if name == "PreemptionHandle":
        from lifeguard import preemption

        return preemption.PreemptionHandle
    if name in ("InstallOptions", "Ranks", "SignalSpec"):
        from lifeguard import typed

        return getattr(typed, name)
    raise AttributeError(f"module 'lifeguard' has no attribute {name!r}")
