"""The generic adapter: end any tracker object that has a ``finish``, ``close`` or ``end``.

``lifeguard.track(obj)`` registers a finalizer that calls the first of those methods the object
has, passing what the method asks for by name: ``exit_code`` (0 for success, as wandb reads
it), ``status`` ("FINISHED", "FAILED" or "KILLED"), ``outcome`` (the :class:`Outcome`) or
``reason`` (one line). A method that takes none of these is called with no argument.
"""

from __future__ import annotations

import inspect

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

    from lifeguard.outcome import Outcome

__all__ = ["METHODS", "Closer"]

METHODS = ("finish", "close", "end")
_ARGUMENTS: dict[str, Callable[[Outcome], object]] = {
    "exit_code": lambda outcome: outcome.process_exit_code,
    "status": lambda outcome: outcome.status.value,
    "outcome": lambda outcome: outcome,
    "reason": lambda outcome: outcome.reason,
}


class Closer:
    """Calls ``obj.<method>(...)`` once with what the method's parameters ask for. The object
    is held until then: tracking it means lifeguard keeps it to the end."""

    __slots__ = ("arguments", "method", "obj")

    def __init__(self, obj: object, method: str | None = None) -> None:
        if method is None:
            method = next((m for m in METHODS if callable(getattr(obj, m, None))), None)
            if method is None:
                raise TypeError(
                    f"lifeguard.track(): {type(obj).__qualname__} has none of the methods "
                    f"{', '.join(METHODS)}; pass method= or register a finalizer instead"
                )
        elif not isinstance(method, str) or not callable(getattr(obj, method, None)):
            raise TypeError(f"lifeguard.track(): {type(obj).__qualname__} has no method {method!r}")
        self.obj = obj
        self.method = method
        try:
            parameters = inspect.signature(getattr(obj, method)).parameters
        except (TypeError, ValueError):  # some builtins have no signature: call with nothing
            parameters = {}  # type: ignore[assignment]
        self.arguments = tuple(name for name in _ARGUMENTS if name in parameters)

    def __call__(self, outcome: Outcome) -> object:
        kwargs = {name: _ARGUMENTS[name](outcome) for name in self.arguments}
        return getattr(self.obj, self.method)(**kwargs)

    def describe(self) -> str:
        return f"{type(self.obj).__qualname__}.{self.method}"
