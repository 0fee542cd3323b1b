"""The implementation behind lifeguard's public functions (``lifeguard/__init__.py`` re-exports
them lazily so that ``import lifeguard`` costs next to nothing)."""

from __future__ import annotations

import _thread
import os
import sys

from lifeguard import journaldir, sentry
from lifeguard.names import GUARDIAN_ENV, MODULES
from lifeguard.settings import Options

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

    from lifeguard.backends.mlflow.finalizer import MlflowFinalizer
    from lifeguard.channel import Channel
    from lifeguard.finalizers import Handle, Registry, Report
    from lifeguard.hooks import ProcessHooks
    from lifeguard.lifecycle import Lifecycle
    from lifeguard.outcome import Outcome
    from lifeguard.sentry import Posts

__all__ = ["current", "finish", "install", "is_installed", "register", "track", "uninstall"]

_lock = _thread.RLock()
# The finalizers registered in this process (made on first use: see registry()).
_registry: Registry | None = None
# The built-in backend finalizers install() registered, so that uninstall() can remove them.
_builtin_handles: list[Handle] = []
_fork_hook_registered = False
_faulthandler_ours = False
# The channel to the watchdog sidecar install() started in this process, if any: uninstall()
# stands it down (never an inherited guardian's: PID 1's, a supervisor's).
_sidecar: Channel | None = None
# The lifecycle install_at_start() set up, while the program has not called install() itself.
_installed_at_start: Lifecycle | None = None
# In a forked child: the runs that were on MLflow's active-run stacks when it was forked. They
# are the parent's, though this process's stacks still hold them.
_inherited_runs: frozenset[str] = frozenset()
# Every run MLFLOW_RUN_ID named at an install() in this process. MLflow takes the variable out of
# the environment when start_run() attaches to it; an install() after that (the program's own
# under `lifeguard run`, finish()'s re-arm, uninstall() then install()) must still know the run
# for the attached one, which it leaves alone unless end_attached.
_attached_runs: frozenset[str] = frozenset()


def current() -> Lifecycle | None:
    """The lifecycle installed in *this* process, if any (never a forked parent's): made now if
    no event has needed it yet (lifeguard.sentry)."""
    from lifeguard import lifecycle

    return lifecycle.current()


def registry() -> Registry:
    global _registry
    if _registry is None:
        from lifeguard.finalizers import Registry

        _registry = Registry()
    return _registry


def is_installed() -> bool:
    """Whether lifeguard guards this process: from install() until uninstall() or the end of
    the process. ``finish()`` leaves it installed: it re-arms for the runs started after it."""
    posts = sentry.current()
    if posts is None:
        return False
    if posts.receiver is None:
        return True  # no event yet: nothing has begun to end
    from lifeguard.lifecycle import Phase

    lifecycle = current()
    return lifecycle is not None and lifecycle.phase in (Phase.INSTALLED, Phase.FINALIZING)


def install(**options: object) -> None:
    global _installed_at_start
    configured = _configured(options)
    parsed = _options(options) if configured else Options()
    with _lock:
        if sentry.current() is not None:
            from lifeguard.lifecycle import Phase

            existing = current()
            if existing is None or existing.phase == Phase.UNINSTALLED:
                return  # made in another thread meanwhile, and not yet: theirs is the install
            if existing is _installed_at_start:
                # The program's own call, after `lifeguard run` installed on its behalf.
                _installed_at_start = None
                if existing.options != parsed and existing.phase == Phase.INSTALLED:
                    _install_again(options)
                return
            if existing.options != parsed:
                from lifeguard._log import logger

                kept, ignored = existing.options.differences(parsed)
                logger().warning(
                    "lifeguard.install() was already called with %s; keeping that and "
                    "ignoring %s (call lifeguard.uninstall() first to change options)",
                    kept,
                    ignored,
                )
            return
        if configured:
            from lifeguard.options import warn_unknown_variables

            warn_unknown_variables()
        _ensure_fork_hook()
        # PID 1 forks first, while no thread of lifeguard's runs yet and before anything
        # records this process's pid (guardian/init.py): the child is the program.
        pid1_guardian = _guard_pid1(parsed)
        # Raises (wrong thread) before any state changes.
        posts = sentry.arm(parsed.signals, _maker(parsed, pid1_guardian), work(parsed))
        # The same steps as lifeguard/__init__.py's install() with nothing to check.
        sentry.see_the_program()
        if (
            pid1_guardian is not None
            or GUARDIAN_ENV in os.environ
            or parsed.watchdog
            or posts.has_work()
        ):
            made_at_install(parsed)
        # Else nothing to connect to and no tracker in use: the lifecycle is made when the first
        # event needs it (lifeguard.sentry).
        journaldir.replay_if_due()


def made_at_install(options: Options) -> None:
    """The lifecycle, made at install(): a guardian to connect to, or a tracker the program
    imported before lifeguard."""
    lifecycle = current()
    assert lifecycle is not None  # armed, in this thread
    _connect_guardian(lifecycle)
    if options.mlflow and "mlflow.tracking.fluent" in sys.modules:
        # mlflow already loaded (its import did not find lifeguard installed).
        from lifeguard.backends.mlflow.finalizer import preload_the_signal_path

        preload_the_signal_path()
        # A program that only resumes a run (no new run, so no context-provider call) still
        # needs the heartbeat thread that adopts it: heartbeats off, it only adopts.
        from lifeguard.backends.mlflow.heartbeat import start_for

        start_for(options.heartbeat)


def _maker(
    options: Options, pid1_guardian: tuple[Channel, int] | None
) -> Callable[[Posts], ProcessHooks]:
    """What makes the lifecycle for the posts install() arms, when the first event needs it
    (any thread: nothing here may need the main thread, nor ``_lock``, which a thread that
    waits for the making may hold)."""

    def made(posts: Posts) -> ProcessHooks:
        return make(posts, options, pid1_guardian)

    return made


def make(
    posts: Posts, options: Options, pid1_guardian: tuple[Channel, int] | None = None
) -> ProcessHooks:
    """The lifecycle of the posts install() armed, with ``options``: what their events go to."""
    from lifeguard import lifecycle as _lifecycle

    _ensure_fork_hook()
    lifecycle = _lifecycle.Lifecycle(options, registry(), posts)
    if pid1_guardian is not None:
        lifecycle.channel, lifecycle.guardian_pid = pid1_guardian
    _lifecycle.set_current(lifecycle)
    if not _builtin_handles:
        _register_builtins(options, lifecycle)
    return lifecycle.hooks


def work(options: Options) -> tuple[str, ...]:
    """The modules whose presence means a built-in finalizer has something to end."""
    work = ["mlflow.tracking.fluent"] if options.mlflow else []
    for name in options.trackers:
        work += MODULES.get(name, ())
    return tuple(work)


def _configured(options: dict[str, object]) -> bool:
    """Whether the program or its environment gives any option: else the defaults hold, and
    nothing needs checking (lifeguard.options, loaded only then)."""
    return bool(options) or any(name.startswith("LIFEGUARD_") for name in os.environ)


def _options(options: dict[str, object]) -> Options:
    from lifeguard.options import Options as Checked

    return Checked.from_kwargs(options)


def install_at_start() -> None:
    """``install()`` at interpreter start, on behalf of a program run by ``lifeguard run``
    (lifeguard._autoboot), with the options of the environment. The program's own ``install(...)``
    then has the last word: its options replace these, as if it had been first."""
    global _installed_at_start
    with _lock:
        install()
        _installed_at_start = current()


def _install_again(options: dict[str, object]) -> None:
    """The program's own ``install(...)`` over the one made at start on its behalf: the same
    hooks, with its options. A run it attached to through ``MLFLOW_RUN_ID`` stays its to leave
    alone (``_attached_runs``)."""
    uninstall()
    install(**options)


def _register_builtins(options: Options, lifecycle: Lifecycle) -> None:
    """One finalizer per enabled backend, in the documented run order (backends/__init__.py).
    The registry runs newest first, so they are registered last-to-run first, and a program's
    own finalizers, registered after install(), run before all of them. Each is loaded when it
    first has work (finalizers.Deferred): install() loads no backend's code."""
    from lifeguard.finalizers import Deferred
    from lifeguard.names import RUN_ORDER

    for name in reversed(RUN_ORDER):
        if name == "mlflow":
            if not options.mlflow:
                continue
            finalizer = lifecycle.mlflow_finalizer = Deferred(
                name, ("mlflow.tracking.fluent",), _mlflow_finalizer(options)
            )
        elif name in options.trackers:
            finalizer = Deferred(name, MODULES[name], _backend_finalizer(name))
        else:
            continue
        _builtin_handles.append(registry().add(finalizer, name=name))


def _mlflow_finalizer(options: Options) -> Callable[[], MlflowFinalizer]:
    """What makes the MLflow finalizer, with what it must know from now: MLflow deletes
    MLFLOW_RUN_ID from the environment when start_run() attaches to it, so the attached run's
    id is read at install(), before that happens; the runs a forked parent left on the
    active-run stacks are the parent's."""
    global _attached_runs
    named = os.environ.get("MLFLOW_RUN_ID")
    if named:
        _attached_runs = _attached_runs | {named}
    attached, end_attached, inherited = _attached_runs, options.end_attached, _inherited_runs

    def make() -> MlflowFinalizer:
        from lifeguard.backends.mlflow.finalizer import MlflowFinalizer

        finalizer = MlflowFinalizer(end_attached=end_attached, attached=attached)
        finalizer.inherited = inherited
        return finalizer

    return make


def _backend_finalizer(name: str) -> Callable[[], Callable[[Outcome], object]]:
    def make() -> Callable[[Outcome], object]:
        from lifeguard.backends import finalizer_of

        return finalizer_of(name)

    return make


def _guard_pid1(options: Options) -> tuple[Channel, int] | None:
    """``watchdog=True`` in PID 1 of a PID namespace (a container's entrypoint): a sidecar
    would die with PID 1, so PID 1 itself stays behind as the watchdog and the program goes on
    as its child (guardian/init.py). Unless a supervisor's channel is already there. Returns
    the channel and the guardian's pid, in the program."""
    import os

    if not options.watchdog or os.getpid() != 1 or GUARDIAN_ENV in os.environ:
        return None
    from lifeguard.guardian import init

    return init.start(options.deadline)


def _connect_guardian(lifecycle: Lifecycle) -> None:
    """A supervisor's channel (inherited through the environment) wins; else start a watchdog
    if asked. Either way the guardian learns about os._exit; a watchdog also about crashes."""
    if GUARDIAN_ENV not in os.environ and not lifecycle.options.watchdog:
        return  # the common case: no guardian, nothing more to import at start-up
    from lifeguard.channel import WATCHDOG, Channel

    channel = lifecycle.channel or Channel.from_env()
    inherited = channel is not None and channel is not lifecycle.channel
    if channel is None and lifecycle.options.watchdog and os.getpid() != 1:
        from lifeguard.guardian import watchdog

        global _sidecar
        channel, lifecycle.guardian_pid = watchdog.start(lifecycle.options.deadline)
        _sidecar = channel
    if channel is None:
        return
    lifecycle.channel = channel
    from lifeguard import lastgasp
    from lifeguard.channel import SUPERVISOR

    # A guardian writes what this process journaled when it dies: a replayer this process
    # leaves behind waits for the guardian to be done, and writes only what it left.
    # The supervisor is the parent; so is PID 1 when it handed its watchdog's channel on
    # across an exec of the program (guardian/init.py).
    if inherited and channel.role == WATCHDOG:
        lifecycle.guardian_pid = os.getppid()
    guardian = os.getppid() if channel.role == SUPERVISOR else lifecycle.guardian_pid
    if guardian:
        lastgasp.note_guardian(guardian)
    lifecycle.hooks.watch_os_exit()
    if channel.role == WATCHDOG:
        import faulthandler

        # A crash (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT) runs no Python code, but
        # faulthandler's C handler writes "Fatal Python error: <signal>" to the pipe and then
        # lets the signal kill the process as before. A faulthandler the user enabled (to
        # stderr, say) is theirs: left alone, and a crash then reads as KILLED.
        if not faulthandler.is_enabled():
            global _faulthandler_ours
            faulthandler.enable(file=channel.fd, all_threads=False)
            _faulthandler_ours = True


def _faulthandler_off() -> None:
    """The watchdog's pipe is closing: faulthandler, if lifeguard enabled it, writes no more to
    it (the fd may be reused by the program's next open)."""
    global _faulthandler_ours
    if _faulthandler_ours:
        import faulthandler

        faulthandler.disable()
        _faulthandler_ours = False


def uninstall() -> None:
    """Restore every hook install() changed. Registered finalizers stay registered."""
    with _lock:
        lifecycle = current()
        if lifecycle is None:
            return
        lifecycle.uninstall()
        for handle in _builtin_handles:
            handle.unregister()
        _builtin_handles.clear()
        _stand_the_sidecar_down(lifecycle)


def _stand_the_sidecar_down(lifecycle: Lifecycle) -> None:
    """The watchdog install() started goes with it: told that this process is done, its pipe
    closed, it exits (guardian/watchdog.py). Left running, it took the program's later exit for
    a death and wrote KILLED over its runs ("died without running its exit hooks" after an
    os._exit(4) it was no longer told of), and every install() and uninstall() left one more."""
    global _sidecar
    channel = lifecycle.channel
    if channel is None or channel is not _sidecar:
        return
    _faulthandler_off()
    channel.send("done")
    channel.close()
    lifecycle.channel = None
    lifecycle.guardian_pid = None
    _sidecar = None


def register(
    finalizer: Callable[[Outcome], object], *, name: str | None = None, ranks: object = "all"
) -> Handle:
    # A finalizer to run at the end: the lifecycle that runs it is made first, with the built-in
    # finalizers, which run after the program's own.
    current()
    return registry().add(finalizer, name, ranks)


def track(obj: object, *, method: str | None, name: str | None, ranks: object) -> Handle:
    from lifeguard.backends.generic import Closer

    closer = Closer(obj, method)
    current()
    return registry().add(closer, name or closer.describe(), ranks)


def finish(exit_code: int = 0, *, outcome: Outcome | None = None) -> list[Report]:
    """Run every finalizer now (the exit hooks then have nothing left to do)."""
    from lifeguard.outcome import Outcome

    if outcome is None:
        if isinstance(exit_code, bool) or not isinstance(exit_code, int):
            raise TypeError(f"exit_code must be an int, not {type(exit_code).__name__}")
        outcome = Outcome.exited(exit_code)
    elif not isinstance(outcome, Outcome):
        raise TypeError(f"outcome must be a lifeguard.Outcome, not {type(outcome).__name__}")
    from lifeguard.lifecycle import Phase

    lifecycle = current()
    if lifecycle is not None and lifecycle.phase == Phase.INSTALLED:
        reports = lifecycle.finalize(outcome)
        _rearm(lifecycle)
        return reports
    from lifeguard.settings import DEFAULT_DEADLINE

    deadline = lifecycle.options.deadline if lifecycle is not None else DEFAULT_DEADLINE
    return registry().run_all(outcome, deadline)


def _rearm(lifecycle: Lifecycle) -> None:
    """Runs started after finish() get owner tags, a heartbeat and an ending like any other:
    the built-in finalizers are registered anew and the lifecycle is installed again."""
    from lifeguard.lifecycle import Phase

    with _lock:
        lifecycle.rearm()
        if lifecycle.phase != Phase.INSTALLED:
            return
        for handle in _builtin_handles:
            handle.unregister()
        _builtin_handles.clear()
        _register_builtins(lifecycle.options, lifecycle)
        heartbeat = sys.modules.get("lifeguard.backends.mlflow.heartbeat")
        if heartbeat is not None:
            heartbeat.heartbeat.rearm()
            heartbeat.start_for(lifecycle.options.heartbeat)


def _ensure_fork_hook() -> None:
    global _fork_hook_registered
    if not _fork_hook_registered:
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _fork_hook_registered = True


def _after_fork_in_child() -> None:
    """A forked child (DataLoader worker, multiprocessing) inherits our hooks and registry but
    owns none of the parent's finalizers. Replace, never lock: another parent thread may have
    held the locks at the moment of fork."""
    global _registry, _builtin_handles, _lock, _inherited_runs, _sidecar
    init = sys.modules.get("lifeguard.guardian.init")
    if init is not None and init.forking:
        return  # PID 1's fork: the child is the program itself, not a forked worker
    made = sys.modules.get("lifeguard.lifecycle")
    lifecycle = made._current if made is not None else None
    fluent = sys.modules.get("mlflow.tracking.fluent")
    if fluent is not None:
        try:
            stacks = fluent._active_run_stack.get_all_thread_values()
            _inherited_runs = _inherited_runs | frozenset(
                run.info.run_id for stack in stacks.values() for run in stack
            )
        except Exception:  # noqa: BLE001 - MLflow's internals moved: end nothing inherited
            pass
    if lifecycle is not None and lifecycle.channel is not None:
        from lifeguard.channel import WATCHDOG

        if lifecycle.channel.role == WATCHDOG:
            # The parent's watchdog is the parent's: the child must not speak for it, nor
            # hold its pipe open (EOF is how the watchdog learns of the parent's death).
            if _faulthandler_ours:
                import faulthandler

                faulthandler.disable()
            lifecycle.channel.close()
        lifecycle.channel = None
    _lock = _thread.RLock()
    _registry = None
    if made is not None:
        made.set_current(None)
    _builtin_handles = []
    _sidecar = None
