"""``mlflow.start_run()`` against a tracking server that is not there: it raises, uncaught, and
the program exits 1 with MLflow's traceback. With ``on`` as its argument, under lifeguard."""

from __future__ import annotations

import sys

if sys.argv[1:] == ["on"]:
    import lifeguard

    lifeguard.install()

import mlflow

mlflow.start_run()
