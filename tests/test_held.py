"""What an uncaught exception's traceback holds is released, and nothing still alive is touched
(``lifeguard.backends.mlflow.held``)."""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable

from lifeguard.backends.mlflow import held


class Resource:
    """Stands for a half-read cursor: something whose lifetime is the point."""


def raise_inside_a_comprehension(resource: Resource) -> None:
    rows = [1, 2]

    def fail(row: int) -> int:
        assert resource is not None  # a nested function that raised closes over it too
        raise KeyboardInterrupt

    # The comprehension (a function of its own before 3.12) closes over `resource`.
    [fail(row) for row in rows if resource is not None]


def caught(fn: Callable[[], None]) -> BaseException:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - the test's stand-in for sys.last_value
        return exc
    raise AssertionError("did not raise")


def test_the_frames_and_the_closures_only_they_reach_are_released() -> None:
    resource = Resource()
    gone = weakref.ref(resource)
    exc = caught(functools.partial(raise_inside_a_comprehension, resource))
    del resource
    assert gone() is not None  # held by the traceback's frames (and, 3.11+, a closure)
    held.release(exc)
    assert gone() is None
    assert exc.__traceback__ is not None  # the traceback itself stays printable


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
    held.release(exc)
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
    held.release(exc)
    assert wrapper.__closure__ is not None
    assert wrapper.__closure__[0].cell_contents is resource


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
    held.release(exc)
    assert gone() is None


def test_a_running_frame_is_left_alone() -> None:
    """The frames of code still running (the caller's own) cannot be cleared; no error."""
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt as exc:
        held.release(exc, None)
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
    held.release(exc)
    assert gone() is None


def test_a_module_namespace_in_the_traceback_is_never_emptied() -> None:
    """A module body's (or class body's) ``f_locals`` is the namespace itself."""
    namespace: dict[str, object] = {}
    exc = caught(lambda: exec("kept = 1\nraise KeyboardInterrupt", namespace))
    held.release(exc)
    assert namespace["kept"] == 1
