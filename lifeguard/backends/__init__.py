"""Backend finalizers. Each imports its tracking library lazily, at finalization time, and only
if the program itself imported it: a finalizer for a library the program never used costs one
``sys.modules`` lookup.

The built-in finalizers run in this order, after every finalizer the program registered:

1. ``tensorboard``: closes every open SummaryWriter. Local disk, milliseconds, and nobody can
   do it later: the events live only in this process's memory.
2. ``mlflow``: the status contract's own store. Bounded network writes, journaled on failure.
3. ``wandb``, ``swanlab``, ``trackio``: their ``finish`` may wait on uploads; they get what the
   deadline has left (each its fair share, see ``lifeguard.finalizers``).
4. ``clearml`` (opt-in): last, because ClearML's own exit hooks usually got there first.
"""

from __future__ import annotations

from lifeguard.names import MODULES

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

    from lifeguard.outcome import Outcome

__all__ = ["load"]


def load(name: str) -> Callable[[Outcome], object]:
    """The finalizer for a backend, imported when it first runs: install() stays cheap."""
    return _Lazy(name)


class _Lazy:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        if name not in MODULES:
            raise ValueError(f"unknown backend {name!r}")
        self.name = name

    def applies(self) -> bool:
        """Whether the program loaded this tracker: the registry gives no share of the
        deadline to a finalizer with nothing to do."""
        import sys

        return any(module in sys.modules for module in MODULES[self.name])

    def __call__(self, outcome: Outcome) -> object:
        import importlib

        module = importlib.import_module(f"lifeguard.backends.{self.name}")
        finalizer: Callable[[Outcome], object] = module.finalize
        return finalizer(outcome)

    def __repr__(self) -> str:
        return f"<lifeguard {self.name} finalizer>"
