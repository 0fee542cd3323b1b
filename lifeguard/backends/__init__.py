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

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

    from lifeguard.outcome import Outcome

__all__ = ["finalizer_of"]


def finalizer_of(name: str) -> Callable[[Outcome], object]:
    """Backend ``name``'s finalizer (``lifeguard.backends.<name>.finalize``), imported now."""
    import importlib

    module = importlib.import_module(f"lifeguard.backends.{name}")
    finalizer: Callable[[Outcome], object] = module.finalize
    return finalizer
