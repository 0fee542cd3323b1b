"""What an uncaught exception's traceback holds is released when, and as far as, the final
write needs it; nothing the program can still reach is touched
(``lifeguard.backends.mlflow.held``).

``release(..., blocked=...)`` asks ``blocked()`` before it starts and after each frame. The
tests pass "blocked while this object lives" (what a half-read cursor's lock is), or "always
blocked", the worst case, for the do-no-harm checks. Several of these came from an attack on
the first version (session 20), which emptied a kept ``locals()`` dict, closed a suspended
generator, and emptied closures reached through a weak reference or a copied function.
"""

from __future__ import annotations

import functools
import re
import sys
import textwrap
import traceback
import types
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest

from lifeguard.backends.mlflow import held
from tests.conftest import REPO, Store, child_env, without_and_with


class Resource:
    """Stands for a half-read cursor: something whose lifetime is the point."""


def caught(fn: Callable[[], object]) -> BaseException:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - the test's stand-in for sys.last_value
        return exc
    raise AssertionError("did not raise")


def while_alive(ref: weakref.ref[Resource]) -> Callable[[], bool]:
    return lambda: ref() is not None


def always() -> bool:
    return True


def raise_inside_a_comprehension(resource: Resource) -> None:
    rows = [1, 2]

    def fail(row: int) -> int:
        assert resource is not None  # a nested function that raised closes over it too
        raise KeyboardInterrupt

    # The comprehension (a function of its own before 3.12) closes over `resource`.
    [fail(row) for row in rows if resource is not None]


def test_the_frames_and_the_closures_only_they_reach_are_released() -> None:
    resource = Resource()
    gone = weakref.ref(resource)
    exc = caught(functools.partial(raise_inside_a_comprehension, resource))
    del resource
    assert gone() is not None  # held by the traceback's frames (and, 3.11+, closures)
    assert held.release(exc, blocked=while_alive(gone)) is False
    assert gone() is None
    assert exc.__traceback__ is not None  # the traceback itself stays printable


def test_nothing_is_touched_when_nothing_is_blocked() -> None:
    def crash(secret: str = "value-42") -> None:
        batch = [1, 2, 3]
        assert batch
        raise ValueError("crash")

    exc = caught(crash)
    before = traceback.TracebackException.from_exception(exc, capture_locals=True)
    assert held.release(exc, blocked=lambda: False) is False
    after = traceback.TracebackException.from_exception(exc, capture_locals=True)
    assert [f.locals for f in after.stack] == [f.locals for f in before.stack]


def test_only_the_frames_up_to_the_holder_are_released() -> None:
    """Innermost first, and no further than needed: the program's own outer frame keeps its
    locals for an exit hook that formats the traceback (a crash reporter)."""

    def query(cursor: Resource) -> None:
        raise KeyboardInterrupt

    def train(secret: str = "value-42") -> None:
        query(Resource())

    exc = caught(train)
    inner = exc.__traceback__.tb_next.tb_next  # type: ignore[union-attr]
    assert inner is not None and inner.tb_frame.f_code.co_name == "query"
    gone = weakref.ref(inner.tb_frame.f_locals["cursor"])
    del inner
    assert held.release(exc, blocked=while_alive(gone)) is False
    assert gone() is None
    stack = traceback.TracebackException.from_exception(exc, capture_locals=True).stack
    assert stack[1].name == "train"
    assert stack[1].locals is not None and stack[1].locals["secret"] == "'value-42'"


def test_still_blocked_is_said() -> None:
    """A lock nothing in the traceback holds (another process's): everything was tried."""
    exc = caught(functools.partial(raise_inside_a_comprehension, Resource()))
    assert held.release(exc, blocked=always) is True


def test_a_closure_a_live_function_shares_is_left_alone() -> None:
    """A cell the program can still reach (a callback it kept) keeps its contents."""
    kept: list[Callable[[], Resource]] = []

    def outer() -> None:
        resource = Resource()

        def callback() -> Resource:
            return resource

        kept.append(callback)  # lives on after the exception

        def fail() -> None:
            raise KeyboardInterrupt(resource)  # `fail` closes over the same cell

        fail()

    exc = caught(outer)
    held.release(exc, blocked=always)
    assert isinstance(kept[0](), Resource)


def test_a_function_still_reachable_keeps_its_closure() -> None:
    """A nested function the program kept (a decorator's wrapper, say) raised: its frame is
    finished, but the function is live, and so is its closure."""
    resource = Resource()

    def make() -> Callable[[], None]:
        def wrapper() -> None:
            assert resource is not None
            raise KeyboardInterrupt

        return wrapper

    wrapper = make()
    exc = caught(wrapper)
    held.release(exc, blocked=always)
    assert wrapper.__closure__ is not None
    assert wrapper.__closure__[0].cell_contents is resource


def test_a_function_reachable_through_a_weakref_keeps_its_closure() -> None:
    """A weak reference is not a reference count: a nested callback kept only weakly (blinker's
    and psygnal's default connections) must stay callable as it was."""
    callbacks: list[weakref.ref[Callable[[], None]]] = []

    def outer() -> None:
        name = "state"

        def callback() -> None:
            raise KeyError(name)

        callbacks.append(weakref.ref(callback))
        callback()

    exc = caught(outer)
    held.release(exc, blocked=always)
    callback = callbacks[0]()
    if callback is not None:  # 3.10: frames do not keep their function, so it is gone
        with pytest.raises(KeyError):
            callback()


def test_a_closure_a_copied_function_shares_is_left_alone() -> None:
    """A copy made with ``types.FunctionType(..., f.__closure__)`` shares ``f``'s closure tuple:
    one reference holds each cell for both functions."""
    copies: list[Callable[[], None]] = []

    def outer() -> None:
        state = {"n": 1}

        def step() -> None:
            state["n"] += 1
            raise KeyError("step")

        copies.append(
            types.FunctionType(
                step.__code__, step.__globals__, "step_copy", step.__defaults__, step.__closure__
            )
        )
        step()

    exc = caught(outer)
    held.release(exc, blocked=always)
    with pytest.raises(KeyError):
        copies[0]()


def test_the_causes_and_contexts_are_released_too() -> None:
    resource = Resource()
    gone = weakref.ref(resource)

    def first(r: Resource) -> None:
        raise ValueError(type(r).__name__)

    def second(r: Resource) -> None:
        try:
            first(r)
        except ValueError as e:
            raise KeyboardInterrupt from e

    exc = caught(functools.partial(second, resource))
    del resource
    held.release(exc, blocked=while_alive(gone))
    assert gone() is None


def test_a_running_frame_is_left_alone() -> None:
    """The frames of code still running (the caller's own) cannot be cleared; no error."""
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt as exc:
        held.release(exc, None, blocked=always)
        assert sys._getframe().f_locals  # this frame kept its locals


def test_a_copy_of_the_locals_is_released_too() -> None:
    """Before 3.13, a frame whose ``f_locals`` was asked for (by a trace function, a debugger,
    a traceback formatter) keeps a dict copy of its locals that ``clear()`` leaves."""
    resource = Resource()
    gone = weakref.ref(resource)

    def fail(r: Resource) -> None:
        assert sys._getframe().f_locals["r"] is r  # makes the copy, before 3.13
        raise KeyboardInterrupt

    exc = caught(functools.partial(fail, resource))
    del resource
    held.release(exc, blocked=while_alive(gone))
    assert gone() is None


KEPT: dict[str, dict[str, object]] = {}


def train_keeping_its_locals(lr: float = 0.1, epochs: int = 3) -> None:
    KEPT["params"] = locals()  # before 3.13: the frame's own copy of its locals
    raise RuntimeError("diverged")


def test_a_locals_dict_the_program_kept_is_left_alone() -> None:
    """``config = locals()`` at the top of ``train`` is a common idiom; the dict lives on."""
    exc = caught(train_keeping_its_locals)
    held.release(exc, blocked=always)
    assert KEPT["params"] == {"lr": 0.1, "epochs": 3}


def test_a_suspended_generator_is_not_closed() -> None:
    """A generator that caught an error and yielded it is suspended with its frame in the
    error's traceback: clearing that frame would close it (its ``finally`` run by us), and the
    program's next ``next()`` would get StopIteration."""
    closed: list[str] = []

    def records() -> object:
        try:
            for i in range(5):
                try:
                    if i == 1:
                        raise ValueError(f"bad record {i}")
                    yield i
                except ValueError as err:
                    yield err
        finally:
            closed.append("closed")

    gen = records()
    assert next(gen) == 0  # type: ignore[call-overload]
    err = next(gen)  # type: ignore[call-overload]

    def main() -> None:
        raise RuntimeError("bad input") from err

    exc = caught(main)
    held.release(exc, blocked=always)
    assert closed == []
    assert next(gen) == 2  # type: ignore[call-overload]


def test_a_module_namespace_in_the_traceback_is_never_emptied() -> None:
    """A module body's (or class body's) ``f_locals`` is the namespace itself."""
    namespace: dict[str, object] = {}
    exc = caught(lambda: exec("kept = 1\nraise KeyboardInterrupt", namespace))
    held.release(exc, blocked=always)
    assert namespace["kept"] == 1


# The same program without and with lifeguard: its own atexit hook, registered before
# install() (so it runs after lifeguard's), must see the same thing. The store is not locked,
# so nothing is released.
AT_EXIT_PROGRAM = """
import atexit, sys, traceback

SAVED = {}

def report():
    print("params:", SAVED.get("params"))
    stack = traceback.TracebackException(
        sys.last_type, sys.last_value, sys.last_traceback, capture_locals=True
    ).stack
    print("locals:", stack[-1].locals)
    try:
        print("next record:", next(SAVED["records"]))
    except StopIteration:
        print("next record: StopIteration")

atexit.register(report)

import mlflow

if sys.argv[1] == "on":
    import lifeguard

    lifeguard.install()

def records():
    for i in range(5):
        try:
            if i == 1:
                raise ValueError(f"bad record {i}")
            yield i
        except ValueError as err:
            yield err

def train(lr=0.1, epochs=3):
    SAVED["params"] = locals()
    gen = SAVED["records"] = records()
    next(gen)
    err = next(gen)
    raise RuntimeError("training diverged") from err

run = mlflow.start_run()
print("run", run.info.run_id, flush=True)
train()
"""


def test_an_atexit_hook_sees_the_program_as_it_left_it(store: Store, tmp_path: Path) -> None:
    program = tmp_path / "at_exit_program.py"
    program.write_text(textwrap.dedent(AT_EXIT_PROGRAM))
    env = child_env(store, PYTHONPATH=str(REPO))
    runs = without_and_with(program, env)
    assert runs["off"].returncode == runs["on"].returncode == 1, runs["on"].stderr
    run_id = runs["on"].stdout.split()[1]
    assert store.status(run_id) == "FAILED"  # lifeguard did run
    printed = {mode: re.sub(r"0x[0-9a-f]+", "0x", done.stdout) for mode, done in runs.items()}
    assert printed["off"].splitlines()[1:] == printed["on"].splitlines()[1:]
