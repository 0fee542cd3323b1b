"""Units: the status mapping, option validation, the registry, and the hooks' bookkeeping.

Anything that installs process-wide hooks runs in a fresh interpreter, never in the test runner.
"""

from __future__ import annotations

import ast
import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from pytest_subprocess import FakeProcess

import lifeguard
from lifeguard.backends.generic import Closer
from lifeguard.finalizers import Registry
from lifeguard.options import DEFAULT_DEADLINE, DEFAULT_TRACKERS, Options, parse_signals
from lifeguard.outcome import Outcome, OutcomeKind, Status


def python(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# -- Outcome: the status contract -----------------------------------------------------------


@pytest.mark.parametrize(
    ("outcome", "status", "code"),
    [
        (Outcome.exited(0), Status.FINISHED, 0),
        (Outcome.exited(None), Status.FINISHED, 0),
        (Outcome.exited(3), Status.FAILED, 3),
        (Outcome.exited("msg"), Status.FAILED, 1),
        (Outcome.exited(True), Status.FAILED, 1),
        (Outcome.raised(ValueError("x")), Status.FAILED, 1),
        (Outcome.raised(KeyboardInterrupt()), Status.KILLED, 130),
        (Outcome.raised(SystemExit(4)), Status.FAILED, 4),
        (Outcome.signalled(signal.SIGINT), Status.KILLED, 130),
        (Outcome.signalled(signal.SIGTERM), Status.KILLED, 143),
        (Outcome.signalled(signal.SIGHUP), Status.KILLED, 129),
        (Outcome.signalled(signal.SIGKILL), Status.KILLED, 137),
        (Outcome.signalled(signal.SIGSEGV), Status.FAILED, 139),
        (Outcome.signalled(signal.SIGABRT), Status.FAILED, 134),
        (Outcome.from_wait_status(-9), Status.KILLED, 137),
        (Outcome.from_wait_status(5), Status.FAILED, 5),
        (Outcome(OutcomeKind.EXIT, uncertain=True), Status.KILLED, 1),
        (Outcome.lost(), Status.KILLED, 1),
    ],
)
def test_status_mapping(outcome: Outcome, status: Status, code: int) -> None:
    assert outcome.status is status
    assert outcome.process_exit_code == code


def test_outcome_reason_and_tags() -> None:
    out = Outcome.raised(ValueError("x" * 5000))
    assert out.tags()["lifeguard.exception"] == "ValueError"
    assert len(out.tags()["lifeguard.reason"]) <= 1000
    assert Outcome.signalled(signal.SIGTERM).tags() == {
        "lifeguard.outcome": "signal",
        "lifeguard.reason": "killed by SIGTERM",
        "lifeguard.signal": "SIGTERM",
    }
    assert Outcome.exited(3).reason == "exit code 3"
    assert str(Outcome.exited(0)) == "FINISHED (exit code 0)"


def test_outcome_keeps_its_time() -> None:
    assert Outcome.exited(0, at=123.5).time == 123.5
    assert Outcome.exited(0) == Outcome.exited(0, at=1.0)  # time is not identity


# -- options --------------------------------------------------------------------------------


def test_options_defaults() -> None:
    opts = Options.from_kwargs({}, environ={})
    assert opts.signals == (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    assert opts.deadline == DEFAULT_DEADLINE
    assert opts.mlflow is True and opts.end_attached is False


def test_the_unchecked_defaults_are_the_checked_ones() -> None:
    """install() with no option and no LIFEGUARD_* variable skips the checks and runs with
    lifeguard.settings' defaults: they must be what the checks give for nothing."""
    from lifeguard import settings

    assert Options.from_kwargs({}, environ={}) == settings.Options()
    assert parse_signals(settings.DEFAULT_SIGNALS) == settings.Options().signals
    assert settings.Options() == Options.from_kwargs({}, environ={})
    assert settings.Options() != Options.from_kwargs({"deadline": 3}, environ={})


def test_options_from_environment_and_precedence() -> None:
    env = {
        "LIFEGUARD_DEADLINE": "4.5",
        "LIFEGUARD_SIGNALS": "TERM, SIGUSR1",
        "LIFEGUARD_MLFLOW": "0",
    }
    opts = Options.from_kwargs({}, environ=env)
    assert opts.deadline == 4.5
    assert opts.signals == (signal.SIGTERM, signal.SIGUSR1)
    assert opts.mlflow is False
    assert Options.from_kwargs({"deadline": 2}, environ=env).deadline == 2.0


@pytest.mark.parametrize(
    ("kwargs", "error", "names"),
    [
        ({"deadlin": 3}, TypeError, "'deadlin'"),
        ({"deadline": -1}, ValueError, "option 'deadline'"),
        ({"deadline": float("nan")}, ValueError, "option 'deadline'"),
        ({"deadline": "soon"}, ValueError, "option 'deadline'"),
        ({"deadline": True}, TypeError, "option 'deadline'"),
        ({"signals": ["SIGNOPE"]}, ValueError, "unknown signal 'SIGNOPE'"),
        ({"signals": ["SIGKILL"]}, ValueError, "SIGKILL cannot be hooked"),
        ({"signals": ["SIGCHLD"]}, ValueError, "SIGCHLD does not end a process"),
        ({"signals": 3.5}, TypeError, "option 'signals'"),
        ({"mlflow": "maybe"}, ValueError, "option 'mlflow'"),
        ({"trackers": ["wandb", "neptune"]}, ValueError, "unknown tracker 'neptune'"),
        ({"trackers": 3}, TypeError, "option 'trackers'"),
    ],
)
def test_bad_options_name_the_problem(kwargs: dict[str, object], error: type, names: str) -> None:
    with pytest.raises(error, match=names.replace("(", r"\(")):
        Options.from_kwargs(kwargs, environ={})


def test_bad_environment_variable_is_named() -> None:
    with pytest.raises(ValueError, match="LIFEGUARD_DEADLINE"):
        Options.from_kwargs({}, environ={"LIFEGUARD_DEADLINE": "-3"})


def test_trackers_option_forms() -> None:
    assert Options.from_kwargs({}, environ={}).trackers == DEFAULT_TRACKERS
    assert Options.from_kwargs({"trackers": "none"}, environ={}).trackers == ()
    assert Options.from_kwargs({"trackers": []}, environ={}).trackers == ()
    env = {"LIFEGUARD_TRACKERS": "default, ClearML"}
    assert Options.from_kwargs({}, environ=env).trackers == (*DEFAULT_TRACKERS, "clearml")
    with pytest.raises(ValueError, match="LIFEGUARD_TRACKERS: unknown tracker 'mlflow'"):
        Options.from_kwargs({}, environ={"LIFEGUARD_TRACKERS": "mlflow"})


def test_parse_signals_forms() -> None:
    assert parse_signals((), none=True) == ()  # install(signals=()): no signal, documented
    assert parse_signals(["INT", signal.SIGTERM, 1, "SIGTERM"]) == (2, 15, 1)


# -- the registry ---------------------------------------------------------------------------


def test_registry_lifo_and_once() -> None:
    calls: list[str] = []
    registry = Registry()
    registry.add(lambda o: calls.append("first"), name="first")
    registry.add(lambda o: calls.append("second"), name="second")
    reports = registry.run_all(Outcome.exited(0), deadline=5)
    assert calls == ["second", "first"]
    assert [r.result for r in reports] == ["ok", "ok"]
    assert registry.run_all(Outcome.exited(0), deadline=5) == []
    assert calls == ["second", "first"]


def test_registry_unregister() -> None:
    calls: list[str] = []
    registry = Registry()
    handle = registry.add(lambda o: calls.append("x"))
    assert handle.unregister() is True
    assert handle.unregister() is False
    registry.run_all(Outcome.exited(0), deadline=5)
    assert calls == []


def test_registry_isolates_errors_and_hangs() -> None:
    release = threading.Event()
    calls: list[str] = []
    registry = Registry()
    registry.add(lambda o: calls.append(o.status.value), name="last")
    registry.add(lambda o: release.wait(), name="hangs")
    registry.add(lambda o: 1 / 0, name="raises")
    try:
        reports = registry.run_all(Outcome.exited(3), deadline=3.0)
    finally:
        release.set()
    assert [(r.name, r.result) for r in reports] == [
        ("raises", "raised"),
        ("hangs", "timed out"),
        ("last", "ok"),
    ]
    assert isinstance(reports[0].error, ZeroDivisionError)
    assert calls == ["FAILED"]
    # A hang may use only its fair share (half of what is left: 1.5 s), so the finalizer after
    # it still gets time; a second of slack for a loaded machine, still short of the deadline.
    assert reports[1].seconds < 2.5, reports[1].seconds


def test_register_rejects_non_callables() -> None:
    with pytest.raises(TypeError, match="must be callable"):
        lifeguard.register("not a function")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="name must be a string"):
        lifeguard.register(print, name=3)  # type: ignore[arg-type]


def test_finish_rejects_bad_arguments() -> None:
    with pytest.raises(TypeError, match="exit_code"):
        lifeguard.finish("0")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="outcome"):
        lifeguard.finish(outcome="FAILED")  # type: ignore[arg-type]


# -- import cost and the hooks, each in a fresh interpreter ---------------------------------


def test_import_pulls_in_no_backend() -> None:
    result = python(
        """
        import sys, lifeguard
        lifeguard.install()
        heavy = sorted(m for m in ("mlflow", "psutil", "torch", "typing", "logging", "dataclasses")
                       if m in sys.modules)
        print(heavy)
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_install_with_nothing_to_check_loads_no_checks_and_no_backend() -> None:
    """The common install(): no option, no LIFEGUARD_* variable. It loads neither the option
    checks nor any backend's code (each is loaded when it first has work), nor the lifecycle
    (made when the first event needs it: lifeguard.sentry), and once made the finalizers it
    registers are there all the same. Given a variable, the checks are loaded and run."""
    code = """
        import sys
        before = set(sys.modules)  # a venv's own .pth may have loaded __future__ already
        import lifeguard
        lifeguard.install()
        print(sorted(m for m in sys.modules
                     if m in ("lifeguard.options", "lifeguard.lifecycle", "lifeguard.api")
                     or m.startswith("lifeguard.backends")))
        print(sorted(m for m in set(sys.modules) - before
                     if m.startswith("lifeguard") or m == "__future__"))
        from lifeguard import api
        api.current()
        print(api.registry().names())
        """
    bare = {k: v for k, v in os.environ.items() if not k.startswith("LIFEGUARD_")}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        env=bare,
    )
    assert result.returncode == 0, result.stderr
    loaded, posts, names = result.stdout.splitlines()
    assert loaded == "[]"
    # What install() costs is mostly what it loads (each module ~0.1 ms, install()'s whole budget
    # ~1.5 ms): the posts and what keeps the program in view, no more. `from __future__ import
    # annotations` in any of them would load the __future__ module too.
    allowed = {
        "lifeguard",
        "lifeguard._ears",
        "lifeguard.journaldir",
        "lifeguard.sentry",
    }
    if sys.version_info >= (3, 12):
        allowed.add("lifeguard.toplevel")  # watches the program's top level from install() on
    assert set(ast.literal_eval(posts)) <= allowed
    assert names == "['trackio', 'swanlab', 'wandb', 'mlflow', 'tensorboard']"
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**bare, "LIFEGUARD_DEADLINE": "0"},
    )
    assert result.returncode != 0
    assert "LIFEGUARD_DEADLINE" in result.stderr


@pytest.mark.parametrize("thread", ["the main thread", "another thread"])
def test_a_half_imported_last_gasp_never_turns_a_death_into_an_exit(thread: str) -> None:
    """At the instant of death the last gasp is looked up in sys.modules, where another thread
    may be importing it right then (the ender's first journal entry): half made, it has no
    leave_replayer yet. The AttributeError went past the kill, and the process exited 143
    instead of dying of SIGTERM (mixed SIGTERM/SIGHUP storms, a run open: 11 in 100)."""
    result = python(
        f"""
        import sys, threading, types
        from lifeguard import death
        sys.modules["lifeguard.lastgasp"] = types.ModuleType("lifeguard.lastgasp")  # half made
        if {thread == "the main thread"}:
            death.die_by_signal(15)
        else:
            threading.Thread(target=death.die_from_any_thread, args=(15,)).start()
            threading.Event().wait(60)
        """
    )
    assert result.returncode == -signal.SIGTERM, (result.returncode, result.stderr)


def test_install_uninstall_restores_everything() -> None:
    result = python(
        """
        import atexit, builtins, signal, sys
        def mine(signum, frame): pass
        signal.signal(signal.SIGTERM, mine)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        before = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM),
                  signal.getsignal(signal.SIGHUP), sys.excepthook, sys.exit, builtins.exit)
        import lifeguard
        lifeguard.install()
        lifeguard.install()  # idempotent
        assert lifeguard.is_installed()
        assert signal.getsignal(signal.SIGTERM) is not mine
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN, "ignored must stay ignored"
        assert sys.exit is not before[4] and sys.excepthook is not before[3]
        lifeguard.uninstall()
        after = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM),
                 signal.getsignal(signal.SIGHUP), sys.excepthook, sys.exit, builtins.exit)
        assert after == before, (before, after)
        assert not lifeguard.is_installed()
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_uninstall_leaves_a_later_handler_in_place() -> None:
    result = python(
        """
        import signal, lifeguard
        lifeguard.install()
        def later(signum, frame): pass
        signal.signal(signal.SIGTERM, later)
        lifeguard.uninstall()
        assert signal.getsignal(signal.SIGTERM) is later
        print("ok")
        """
    )
    assert result.stdout.strip() == "ok", result.stderr


def test_install_from_a_thread_is_a_clear_error() -> None:
    result = python(
        """
        import threading, lifeguard
        errors = []
        def target():
            try:
                lifeguard.install()
            except RuntimeError as exc:
                errors.append(str(exc))
            lifeguard.install(signals=())  # the documented escape hatch works from a thread
        t = threading.Thread(target=target, name="loader"); t.start(); t.join()
        print(errors[0])
        print(lifeguard.is_installed())
        """
    )
    assert result.returncode == 0, result.stderr
    message, installed = result.stdout.strip().splitlines()
    assert "main thread" in message and "'loader'" in message and "signals=()" in message
    assert installed == "True"


def test_second_install_with_other_options_warns_and_keeps_the_first() -> None:
    result = python(
        """
        import lifeguard
        lifeguard.install(deadline=5)
        lifeguard.install(deadline=7)
        from lifeguard import api
        print(api.current().options.deadline)
        """
    )
    assert result.stdout.strip() == "5.0"
    assert "already called" in result.stderr


def test_finish_without_install_runs_registered_finalizers() -> None:
    result = python(
        """
        import lifeguard
        lifeguard.register(lambda o: print("ran", o.status.value))
        reports = lifeguard.finish(2)
        print([r.result for r in reports])
        """
    )
    assert result.stdout.split("\n")[:2] == ["ran FAILED", "['ok']"], result.stderr


def test_exit_builtin_is_seen() -> None:
    """site's exit() raises SystemExit without going through sys.exit."""
    result = python(
        """
        import lifeguard
        lifeguard.install()
        lifeguard.register(lambda o: print(o.status.value, o.exit_code))
        exit(4)
        """
    )
    assert result.returncode == 4
    assert result.stdout.strip() == "FAILED 4"


def test_sys_exit_in_a_thread_does_not_decide_the_outcome() -> None:
    result = python(
        """
        import sys, threading, lifeguard
        lifeguard.install()
        lifeguard.register(lambda o: print(o.status.value))
        t = threading.Thread(target=sys.exit, args=(5,)); t.start(); t.join()
        """
    )
    assert result.returncode == 0
    assert result.stdout.strip() == "FINISHED"


def test_replaced_excepthook_still_reports_the_crash() -> None:
    """rich/IPython replace sys.excepthook without chaining; sys.last_value still tells."""
    result = python(
        """
        import sys, lifeguard
        lifeguard.install()
        lifeguard.register(lambda o: print(o.status.value, o.exception_type))
        sys.excepthook = lambda *a: None
        raise ValueError("hidden")
        """
    )
    assert result.returncode == 1
    assert result.stdout.strip() == "FAILED ValueError"


# -- the child runner, with faked processes -------------------------------------------------


def test_run_child_reports_a_child_that_dies_before_its_ready_line(fp: FakeProcess) -> None:
    from lifeguard.demo import ChildError, run_child

    fp.register(["prog"], stdout="", stderr="ImportError: no mlflow\n", returncode=1)
    with pytest.raises(ChildError, match="without a ready line: ImportError: no mlflow"):
        run_child(["prog"], timeout=10)


def test_run_child_parses_the_ready_line(fp: FakeProcess) -> None:
    from lifeguard.demo import READY, run_child

    fp.register(["prog"], stdout=f'{READY} {{"run_id": "abc", "pid": 7}}\n', returncode=0)
    result = run_child(["prog"], timeout=10)
    assert result.ready == {"run_id": "abc", "pid": 7}
    assert result.returncode == 0


# -- the helper for a main thread stuck in C ------------------------------------------------


def test_existing_wakeup_fd_still_gets_every_signal() -> None:
    """asyncio's self-pipe (or any wakeup fd set before install) is chained, not lost."""
    result = python(
        """
        import os, select, signal, lifeguard
        r, w = os.pipe(); os.set_blocking(w, False)
        signal.set_wakeup_fd(w)
        signal.signal(signal.SIGUSR1, lambda *a: None)
        lifeguard.install()
        os.kill(os.getpid(), signal.SIGUSR1)
        ready, _, _ = select.select([r], [], [], 30)
        print(list(os.read(r, 16)) if ready else "nothing")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"[{int(signal.SIGUSR1)}]"


def test_a_forked_childs_signal_is_not_the_parents() -> None:
    """A DataLoader worker inherits lifeguard's hooks and the listener's pipes: a SIGTERM to it
    must not be written there, where the parent's listener would take it for its own."""
    result = python(
        """
        import os, signal, lifeguard
        import lifeguard._ears as ears
        lifeguard.install()
        pid = os.fork()
        if pid == 0:
            # The C handler in front of CPython's is the parent's, gone in the child.
            print("child", ears.is_registered(signal.SIGTERM), flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print("died of", os.WTERMSIG(status) if os.WIFSIGNALED(status) else None)
        from lifeguard import lifecycle
        watch = lifecycle.current().hooks.signals
        print("parent", watch.first, ears.is_registered(signal.SIGTERM), flush=True)
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:3] == [
        "child False",
        f"died of {int(signal.SIGTERM)}",
        "parent None True",
    ]


# -- ranks ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "rank", "world", "source"),
    [
        ({}, 0, 1, "single process"),
        ({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8"}, 3, 8, "torchrun"),
        ({"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "16"}, 5, 16, "slurm"),
        ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4"}, 2, 4, "openmpi"),
        ({"PMI_RANK": "1", "PMI_SIZE": "2"}, 1, 2, "pmi"),
        ({"RANK": "x"}, 0, 1, "single process"),
    ],
)
def test_rank_detection(env: dict[str, str], rank: int, world: int, source: str) -> None:
    from lifeguard.distributed import detect

    info = detect(env)
    assert (info.rank, info.world_size, info.source) == (rank, world, source)


def test_rank_zero_finalizers_run_only_on_rank_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    for rank, expected in (("0", ["zero", "all"]), ("1", ["all"])):
        monkeypatch.setenv("RANK", rank)
        calls.clear()
        registry = Registry()
        registry.add(lambda o: calls.append("all"), name="all")
        registry.add(lambda o: calls.append("zero"), name="zero", ranks="zero")
        reports = registry.run_all(Outcome.exited(0), deadline=5)
        assert calls == expected
        assert len(reports) == 2
    assert [r.result for r in reports] == ["skipped", "ok"]


@pytest.mark.parametrize("bad", ["first", -1, [0, "1"], True, 2.0])
def test_bad_ranks_are_named(bad: object) -> None:
    with pytest.raises(ValueError, match="ranks must be"):
        Registry().add(print, ranks=bad)


# -- the generic tracker adapter and the built-in order -----------------------------------------


class _Calls:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, object]]] = []


class WandbLike(_Calls):
    def finish(self, exit_code: int = 0, quiet: bool = False) -> None:
        self.calls.append(("finish", {"exit_code": exit_code}))

    def close(self) -> None:  # finish wins: it is first in the documented order
        self.calls.append(("close", {}))


class StatusAware(_Calls):
    def end(self, status: str, reason: str, outcome: Outcome) -> None:
        self.calls.append(("end", {"status": status, "reason": reason, "outcome": outcome}))


@pytest.mark.parametrize(
    ("outcome", "exit_code"),
    [(Outcome.exited(0), 0), (Outcome.exited(3), 3), (Outcome.signalled(signal.SIGTERM), 143)],
)
def test_closer_passes_the_exit_code(outcome: Outcome, exit_code: int) -> None:
    tracker = WandbLike()
    Closer(tracker)(outcome)
    assert tracker.calls == [("finish", {"exit_code": exit_code})]


def test_closer_passes_status_reason_and_outcome_by_name() -> None:
    tracker = StatusAware()
    outcome = Outcome.raised(ValueError("bad batch"))
    Closer(tracker)(outcome)
    assert tracker.calls == [
        ("end", {"status": "FAILED", "reason": "ValueError: bad batch", "outcome": outcome})
    ]


def test_closer_calls_a_plain_close_and_a_named_method() -> None:
    import io

    buffer = io.StringIO()
    Closer(buffer)(Outcome.exited(0))
    assert buffer.closed
    tracker = WandbLike()
    Closer(tracker, method="close")(Outcome.exited(1))
    assert tracker.calls == [("close", {})]


def test_track_rejects_objects_it_cannot_end() -> None:
    with pytest.raises(TypeError, match="object has none of the methods finish, close, end"):
        lifeguard.track(object())
    with pytest.raises(TypeError, match="WandbLike has no method 'stop'"):
        lifeguard.track(WandbLike(), method="stop")


def test_install_with_nothing_to_check_arms_the_default_options() -> None:
    """install() with nothing to check knows the default signals and which modules mean a
    tracker is in use without loading lifeguard.settings or lifeguard.names for them (written
    out in lifeguard/__init__.py): the same as the options' defaults."""
    from lifeguard import api, sentry
    from lifeguard.settings import DEFAULT_SIGNUMS

    assert api.work(Options()) == lifeguard._DEFAULT_WORK
    result = python(
        """
        import lifeguard
        from lifeguard import sentry
        lifeguard.install()
        print(sorted(sentry.current().saved))
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(sorted(DEFAULT_SIGNUMS))
    assert sentry.current() is None  # nothing armed in the test process itself


def test_builtin_finalizers_run_in_the_documented_order() -> None:
    result = python(
        """
        import lifeguard
        lifeguard.install(trackers="default,clearml")
        lifeguard.register(lambda outcome: None, name="user")
        print(" ".join(report.name for report in lifeguard.finish()))
        """
    )
    assert result.returncode == 0, result.stderr
    from lifeguard.names import RUN_ORDER

    assert result.stdout.split() == ["user", *RUN_ORDER]
    assert RUN_ORDER == ("tensorboard", "mlflow", "wandb", "swanlab", "trackio", "clearml")


def test_unused_trackers_are_not_imported() -> None:
    result = python(
        """
        import sys, lifeguard
        lifeguard.install()
        lifeguard.finish()
        print([m for m in ("wandb", "tensorboardX", "torch", "swanlab", "trackio", "clearml",
                           "mlflow") if m in sys.modules])
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_a_deferred_finalizer_loads_once_and_only_for_a_loaded_tracker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lifeguard.finalizers import Deferred

    calls: list[str] = []

    class Real:
        def applies(self) -> bool:
            return False

        def prepare(self, outcome: Outcome) -> None:
            calls.append("prepare")

        def __call__(self, outcome: Outcome) -> str:
            calls.append("call")
            return "ok"

    def load() -> Real:
        calls.append("load")
        return Real()

    deferred = Deferred("fake", ("lifeguard_test_fake_tracker",), load)
    outcome = Outcome.exited(0)
    registry = Registry()
    registry.add(deferred, name="fake")
    assert not deferred.applies() and not registry.has_work()
    deferred.prepare(outcome)
    assert deferred(outcome) is None
    assert calls == []  # its tracker was never loaded: nothing of it was either
    monkeypatch.setitem(sys.modules, "lifeguard_test_fake_tracker", object())  # type: ignore[arg-type]
    assert not deferred.applies()  # the real one's own answer
    deferred.prepare(outcome)
    assert deferred(outcome) == "ok"
    assert calls == ["load", "prepare", "call"]
    assert repr(deferred) == "<lifeguard fake finalizer>"


def test_a_deferred_finalizer_is_made_once_whichever_threads_ask(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The heartbeat thread and the ender may ask for the MLflow finalizer at once; it keeps
    state (its plan), so there must be one."""
    from lifeguard.finalizers import Deferred

    entered = threading.Semaphore(0)
    release = threading.Event()
    made: list[object] = []

    def load() -> object:
        entered.release()
        release.wait(30)
        made.append(object())
        return lambda outcome: None

    monkeypatch.setitem(sys.modules, "lifeguard_test_fake_tracker", object())  # type: ignore[arg-type]
    deferred = Deferred("fake", ("lifeguard_test_fake_tracker",), load)  # type: ignore[arg-type]
    threads = [threading.Thread(target=deferred.loaded) for _ in range(2)]
    threads[0].start()
    assert entered.acquire(timeout=30)
    threads[1].start()
    # A second load would start at once; with one, the second thread waits for the first.
    assert not entered.acquire(timeout=0.5)
    release.set()
    for thread in threads:
        thread.join(30)
    assert len(made) == 1


def test_unused_builtin_finalizers_take_no_share_of_the_deadline() -> None:
    from lifeguard.finalizers import time_left

    class Unused:
        def applies(self) -> bool:
            return False

        def __call__(self, outcome: Outcome) -> None:
            raise AssertionError("an unused finalizer ran")

    seen: list[float | None] = []
    registry = Registry()
    for name in ("a", "b", "c"):
        registry.add(Unused(), name=name)  # run after the one below (newest first)
    registry.add(lambda outcome: seen.append(time_left()), name="busy")
    reports = registry.run_all(Outcome.exited(0), deadline=6.0)
    assert [(r.name, r.result) for r in reports] == [
        ("busy", "ok"),
        ("c", "unused"),
        ("b", "unused"),
        ("a", "unused"),
    ]
    [left] = seen
    assert left is not None and left > 5.0  # the whole deadline, not a quarter of it


def test_every_backend_module_lies_in_a_package_the_signal_path_waits_for() -> None:
    """signals._is_tracker decides, from names.PACKAGES, whether the main thread is inside a
    tracker; a backend missing there would be interrupted holding its locks."""
    from lifeguard.names import MODULES, PACKAGES
    from lifeguard.signals import _is_tracker

    for modules in MODULES.values():
        for module in modules:
            assert _is_tracker(module), module
    assert _is_tracker("mlflow.tracking.fluent")
    assert not _is_tracker("torch.nn") and not _is_tracker("mlflowx")
    assert len(set(PACKAGES)) == len(PACKAGES)


# -- guardian turns ---------------------------------------------------------------------------


def _hold_turns(directory: Path, numbers: range) -> list[int]:
    import fcntl

    fds = []
    for number in numbers:
        fd = os.open(directory / f".turn-{number}", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fds.append(fd)
    return fds


def test_a_free_turn_is_taken_and_given_back(tmp_path: Path) -> None:
    from lifeguard.guardian.turns import TURNS, turn

    directory = tmp_path / "journal"
    directory.mkdir(mode=0o700)
    held = _hold_turns(directory, range(TURNS - 1))
    try:
        with turn(str(directory), wait=5.0) as number:
            assert number == TURNS - 1
            with turn(str(directory), wait=0.05) as none_left:
                assert none_left is None
        with turn(str(directory), wait=0.05) as again:
            assert again == TURNS - 1  # given back at the end of the block
    finally:
        for fd in held:
            os.close(fd)
    assert stat.S_IMODE((directory / ".turn-0").stat().st_mode) == 0o600


def test_no_turn_free_in_time_goes_ahead_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from lifeguard.guardian.turns import TURNS, turn

    directory = tmp_path / "journal"
    directory.mkdir(mode=0o700)
    held = _hold_turns(directory, range(TURNS))
    try:
        with caplog.at_level("WARNING", logger="lifeguard"), turn(str(directory), 0.1) as got:
            assert got is None
    finally:
        for fd in held:
            os.close(fd)
    assert "guardian turns of this host are still taken" in caplog.text


def test_a_dead_guardians_turn_is_free(tmp_path: Path) -> None:
    """A guardian SIGKILLed in its turn gives it back with its last file descriptor."""
    from lifeguard.guardian.turns import TURNS, turn

    directory = tmp_path / "journal"
    directory.mkdir(mode=0o700)
    held = _hold_turns(directory, range(1, TURNS))
    code = (
        "import sys; from lifeguard.guardian.turns import turn\n"
        "with turn(sys.argv[1]) as n:\n"
        "    print(n, flush=True); sys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(directory)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "0"  # in its turn
        with turn(str(directory), wait=0.05) as none_left:
            assert none_left is None
        proc.kill()
        proc.wait(30)
        with turn(str(directory), wait=5.0) as number:
            assert number == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        for fd in held:
            os.close(fd)


def test_turns_are_not_taken_in_a_directory_that_is_not_private(tmp_path: Path) -> None:
    from lifeguard.guardian.turns import turn

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with turn(str(shared), wait=5.0) as number:
        assert number is None
    assert list(shared.iterdir()) == []  # nothing created there


def test_a_planted_symlink_is_not_a_turn(tmp_path: Path) -> None:
    from lifeguard.guardian.turns import turn

    directory = tmp_path / "journal"
    directory.mkdir(mode=0o700)
    target = tmp_path / "victim"
    (directory / ".turn-0").symlink_to(target)
    with turn(str(directory), wait=5.0) as number:
        assert number == 1
    assert not target.exists()


# -- the demo's relay: a server's port that goes dark and comes back --------------------------


def test_a_relay_down_is_a_dead_server_to_its_clients() -> None:
    import http.server
    import socket

    from lifeguard.localserver import Relay

    class Hello(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: a connection stays open, as requests' do

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "5")
            self.end_headers()
            self.wfile.write(b"hello")

        def log_message(self, format: str, *args: object) -> None:
            pass

    def answer(sock: socket.socket) -> bytes:
        """The whole response: its head and body may come in separate segments."""
        data = b""
        while not data.endswith(b"hello"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
        return data

    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hello)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    relay = Relay(upstream.server_address[1]).up()
    try:
        kept = socket.create_connection(("127.0.0.1", relay.port), timeout=10)
        kept.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert answer(kept).endswith(b"hello")
        relay.down()
        # The open connection is reset or closed, and a new one is refused.
        try:
            assert kept.recv(4096) == b""
        except ConnectionResetError:
            pass
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", relay.port), timeout=10)
        relay.up()  # the same port, answering again
        with socket.create_connection(("127.0.0.1", relay.port), timeout=10) as again:
            again.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert answer(again).endswith(b"hello")
        kept.close()
    finally:
        relay.down()
        upstream.shutdown()
        upstream.server_close()


def test_turns_live_on_this_host_in_a_private_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not in the journal's directory, which is often an NFS home shared by every node."""
    import tempfile

    from lifeguard.guardian.turns import default_dir

    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.setenv("LIFEGUARD_JOURNAL_DIR", str(tmp_path / "journal"))
    assert default_dir() == str(runtime / "lifeguard")
    runtime.chmod(0o777)  # not the user's own: not trusted with the turns
    fallback = os.path.join(tempfile.gettempdir(), f"lifeguard-turns-{os.getuid()}")
    assert default_dir() == fallback
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert default_dir() == fallback


def test_no_import_lock_is_released_while_an_import_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An excepthook called by hand in the middle of an import (a plugin loader reporting a
    plugin's failure) must not take the module lock of the import in progress: the import's own
    release would then fail, and another thread could see the half-run module."""
    from lifeguard import importlocks

    (tmp_path / "lifeguard_test_releases_mid_import.py").write_text(
        "from lifeguard import importlocks\nRELEASED = importlocks.release_stranded()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import lifeguard_test_releases_mid_import as mod  # type: ignore[import-not-found]

    assert mod.RELEASED == 0
    assert importlocks.release_stranded() == 0  # and nothing is stranded after it


def test_each_delivery_is_read_with_its_signal_and_the_time_it_came() -> None:
    """lifeguard's C handler writes a record per delivery: the signal's number and the
    monotonic time it came, which the listener reads however late (lifeguard.sentry)."""
    import time

    from lifeguard.sentry import Ears
    from lifeguard.signals import deliveries

    previous = signal.signal(signal.SIGUSR2, lambda *_: None)
    ears = Ears()
    ears.open()
    read_fd = ears.listen()
    try:
        ears.hear(signal.SIGUSR2)
        before = time.monotonic()
        signal.raise_signal(signal.SIGUSR2)  # delivered to this thread before it returns
        between = time.monotonic()
        signal.raise_signal(signal.SIGUSR2)
        after = time.monotonic()
        heard = deliveries(os.read(read_fd, 4096))
        assert [signum for signum, _ in heard] == [signal.SIGUSR2, signal.SIGUSR2]
        (_, first), (_, last) = heard
        assert before <= first <= between <= last <= after
    finally:
        ears.close()
        os.close(read_fd)
        signal.signal(signal.SIGUSR2, previous)


@pytest.mark.parametrize("pending_before", [False, True])
def test_a_line_to_a_dead_guardian_leaves_no_sigpipe_and_the_mask_as_it_was(
    pending_before: bool,
) -> None:
    """The write's own SIGPIPE is taken; one pending before it is the program's, and stays.
    A handler of the program's stands for its default action, which would kill pytest."""
    from lifeguard.channel import Channel

    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    delivered: list[int] = []
    previous = signal.signal(signal.SIGPIPE, lambda signum, frame: delivered.append(signum))
    try:
        if pending_before:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGPIPE})
            signal.pthread_kill(threading.get_ident(), signal.SIGPIPE)
        assert Channel(write_fd, "watchdog").send("done") is False
        assert delivered == []
        assert (signal.SIGPIPE in signal.sigpending()) is pending_before
        assert signal.pthread_sigmask(signal.SIG_BLOCK, ()) == (
            mask | {signal.SIGPIPE} if pending_before else mask
        )
    finally:
        if pending_before:
            signal.sigtimedwait({signal.SIGPIPE}, 0)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(signal.SIGPIPE, previous)
        os.close(write_fd)
