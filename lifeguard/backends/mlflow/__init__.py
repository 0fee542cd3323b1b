"""The MLflow backend: everything lifeguard does with MLflow, one concern a module.

- ``finalizer``: ends this process's runs with the outcome (journal first, then the store).
- ``context``: MLflow's ``mlflow.run_context_provider`` plug-in; owner tags at ``start_run``.
- ``heartbeat``: the heartbeat tag, and the adoption of resumed runs.
- ``runs``: ending one run against a store, bounded and journaled; finding runs by owner. Used
  by the finalizer, the guardians and the sweep. Importing it imports mlflow.
- ``sweep``: fetching and ending orphans for ``lifeguard sweep``.

Only ``runs``, ``context`` and ``sweep`` import mlflow at import time; the finalizer and the
heartbeat import it when they first have work, so ``install()`` stays cheap.
"""

from __future__ import annotations

from lifeguard.backends.mlflow.finalizer import MlflowFinalizer

__all__ = ["MlflowFinalizer"]
