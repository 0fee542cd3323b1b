"""The TensorBoard finalizer: close every open SummaryWriter, after noting how the run ended.

A SummaryWriter queues events in memory and writes them from a background thread every
``flush_secs`` (120 s by default). A process killed by SIGTERM loses everything still queued,
and ``__del__`` does not run on that path. TensorBoard has no run status, so the outcome is
written as a text summary (``lifeguard/outcome``: "KILLED (killed by SIGTERM)"), which the
Text tab shows next to the scalars, then the writer is closed: flushed and fsynced.

Writers of both ``torch.utils.tensorboard`` and ``tensorboardX`` are found without the program
registering them: whichever of the two the program imported is searched for live instances.
"""

from __future__ import annotations

import sys

from lifeguard._log import logger

TYPE_CHECKING = False
if TYPE_CHECKING:
    from lifeguard.outcome import Outcome

__all__ = ["TEXT_TAG", "finalize", "open_writers"]

TEXT_TAG = "lifeguard/outcome"


def open_writers() -> list[object]:
    """Every SummaryWriter (or subclass) alive in this process and not yet closed."""
    from lifeguard.names import MODULES

    classes: list[type] = []
    for name in MODULES["tensorboard"]:  # the modules that define a SummaryWriter
        cls = getattr(sys.modules.get(name), "SummaryWriter", None)
        if isinstance(cls, type):
            classes.extend(_with_subclasses(cls))
    if not classes:
        return []
    import gc

    # An instance of a Python class refers to its class, so the class's referrers include
    # every instance. One C-level pass over the heap, paid only when a writer module is loaded.
    kinds = tuple(classes)
    found = [o for o in gc.get_referrers(*classes) if type(o) in kinds]
    # close() sets all_writers to None; a closed writer would reopen a new event file on write.
    return [w for w in found if getattr(w, "all_writers", None) is not None]


def finalize(outcome: Outcome) -> None:
    writers = open_writers()
    for writer in writers:
        try:
            writer.add_text(TEXT_TAG, str(outcome))  # type: ignore[attr-defined]
        except Exception as exc:  # noqa: BLE001 - closing (flushing) matters more
            logger().warning("could not write the outcome to TensorBoard: %s", exc)
        writer.close()  # type: ignore[attr-defined]


def _with_subclasses(cls: type) -> list[type]:
    out, todo = [], [cls]
    while todo:
        current = todo.pop()
        out.append(current)
        todo.extend(current.__subclasses__())
    return out
