"""A verl-style Ray actor that owns the MLflow run, under lifeguard.

verl's TaskRunner logs from inside a Ray actor, not the driver. Ray kills actors in ways that
run no Python code (``ray.kill``, the driver's ``ray.shutdown()``), and installs its own SIGTERM
handler in workers (it raises SystemExit). So the actor installs lifeguard with the watchdog in
``__init__``, which Ray runs in the worker's main thread, and starts its run there.

    python examples/ray_actor.py     # a short demo: train, then exit the actor cleanly
"""

from __future__ import annotations

import os

import ray


class Trainer:
    def __init__(self, tracking_uri: str) -> None:
        import lifeguard

        lifeguard.install(watchdog=True)  # chains Ray's own SIGTERM handler
        import mlflow

        mlflow.set_tracking_uri(tracking_uri)
        self.run = mlflow.start_run()
        self.step = 0

    def info(self) -> dict[str, object]:
        import lifeguard

        return {
            "run_id": self.run.info.run_id,
            "pid": os.getpid(),
            "watchdog": lifeguard.watchdog_pid(),
        }

    def train(self, steps: int = 3) -> int:
        import mlflow

        for _ in range(steps):
            self.step += 1
            mlflow.log_metric("loss", 1.0 / self.step, step=self.step)
        return self.step

    def fail(self) -> None:
        raise ValueError("a bad batch: the actor survives, the run goes on")

    def stop(self) -> None:
        ray.actor.exit_actor()


# No restarts: a restarted actor would start a new run; the killed one must end, not resume.
RemoteTrainer = ray.remote(max_restarts=0)(Trainer)


if __name__ == "__main__":
    import tempfile

    ray.init(num_cpus=2, include_dashboard=False)
    uri = f"sqlite:///{tempfile.mkdtemp()}/mlflow.db"
    trainer = RemoteTrainer.remote(uri)  # type: ignore[attr-defined]
    print(ray.get(trainer.info.remote()), ray.get(trainer.train.remote()))
    trainer.stop.remote()
    ray.shutdown()
