"""The wandb finalizer: ``wandb.finish(exit_code)`` with the exit code the Outcome maps to.

wandb knows two statuses, read from the exit code: 0 is success, anything else a failure. So a
run MLflow calls FINISHED is 0 in wandb, and FAILED or KILLED is the shell's view of the end
(1, the sys.exit code, or 128 + the signal number), which never is 0.

wandb's own hooks (its ``sys.exit`` and ``sys.excepthook`` wrappers, and an atexit hook) see a
clean exit, ``sys.exit(n)`` and an exception, and report Ctrl-C as 255. They never see SIGTERM or
SIGHUP: without lifeguard such a run has no exit record at all, and its offline file is empty.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from lifeguard.outcome import Outcome

__all__ = ["finalize", "summary"]


def summary(outcome: Outcome) -> dict[str, str]:
    """What is added to the run's summary: the status, in MLflow's words, and why."""
    return {"lifeguard/status": outcome.status.value, **outcome.tags(prefix="lifeguard/")}


def finalize(outcome: Outcome) -> None:
    wandb = sys.modules.get("wandb")
    run = getattr(wandb, "run", None) if wandb is not None else None
    if run is None:  # wandb never imported, never initialised, or already finished
        return
    from lifeguard._log import logger

    try:
        run.summary.update(summary(outcome))
    except Exception as exc:  # noqa: BLE001 - the exit code below is what matters
        logger().warning("could not add the outcome to the wandb summary: %s", exc)
    run.finish(exit_code=outcome.process_exit_code)
