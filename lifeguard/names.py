"""The names several layers share: the tags lifeguard writes on a run, the trackers it knows, and
the environment variables it hands down.

A leaf: it imports nothing, so that any module, from the signal path to the guardians, can use
these names without importing the module that happens to write them.
"""

from __future__ import annotations

__all__ = [
    "GUARDIAN_ENV",
    "MODULES",
    "PACKAGES",
    "RUN_ORDER",
    "TAG_ENDED_BY",
    "TAG_HEARTBEAT",
    "TAG_HEARTBEAT_INTERVAL",
    "TAG_RESUMED_END",
]

# -- run tags (the owner's identity tags are lifeguard.owner's) ------------------------------------

# Epoch ms of this run's owner's last sign of life (backends/mlflow/heartbeat.py writes it; the
# sweep and a journal replay read it).
TAG_HEARTBEAT = "lifeguard.heartbeat"
# Seconds between the owner's heartbeats (0: off), written with the owner: the sweep never judges
# a run lost before several of its own intervals have passed, whatever --stale-after says.
TAG_HEARTBEAT_INTERVAL = "lifeguard.heartbeat.interval"
# The end time (epoch ms) a run had when its current owner resumed it: a RUNNING run with another
# end time was resumed since by a program without lifeguard, whose owner tags these are not.
TAG_RESUMED_END = "lifeguard.owner.resumed_end"
# Who wrote the final status: "process", "watchdog", "supervisor", "replay" or "sweep".
TAG_ENDED_BY = "lifeguard.ended_by"

# -- trackers -------------------------------------------------------------------------------------

# The built-in finalizers' run order, after every finalizer the program registered (see
# lifeguard/backends/__init__.py for why this order).
RUN_ORDER: tuple[str, ...] = ("tensorboard", "mlflow", "wandb", "swanlab", "trackio", "clearml")

# name -> the modules whose presence in sys.modules means the program uses that tracker. Each
# one's finalizer is lifeguard.backends.<name>.finalize; MLflow's needs install()'s options, so
# api.install() builds it itself.
MODULES: dict[str, tuple[str, ...]] = {
    "tensorboard": ("torch.utils.tensorboard.writer", "tensorboardX.writer"),
    "wandb": ("wandb",),
    "swanlab": ("swanlab",),
    "trackio": ("trackio",),
    "clearml": ("clearml",),
}

# The packages whose code the finalizers call into (mlflow's and every backend's tracker). A
# signal that interrupts the main thread inside one of them lets that call finish before the
# finalizers run: it may hold the very lock they need (lifeguard.signals). Every module in
# MODULES lies under one of these (tests/test_units.py checks).
PACKAGES: tuple[str, ...] = (
    "mlflow",
    "torch.utils.tensorboard",
    "tensorboardX",
    "wandb",
    "swanlab",
    "trackio",
    "clearml",
)

# -- environment ----------------------------------------------------------------------------------

# The pipe to a supervisor (lifeguard run), handed to the program and its children: see
# lifeguard/channel.py.
GUARDIAN_ENV = "LIFEGUARD_GUARDIAN"
