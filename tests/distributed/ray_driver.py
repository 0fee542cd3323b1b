"""The driver the Ray tests run as a subprocess: starts a local Ray, one Trainer actor (the
example's), prints the ready line, then ends the actor the way ``argv[1]`` says."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import ray
from mlflow.tracking import MlflowClient

EXAMPLES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
sys.path.insert(0, EXAMPLES)
from ray_actor import Trainer  # noqa: E402


class Probe(Trainer):
    def chained_sigterm(self) -> str:
        """What lifeguard chained for SIGTERM at install(): Ray's own handler, we expect."""
        from lifeguard import api

        lifecycle = api.current()
        assert lifecycle is not None
        previous = lifecycle.hooks.posts.saved.get(signal.SIGTERM)
        return (
            f"{getattr(previous, '__module__', '')}.{getattr(previous, '__qualname__', previous)}"
        )


scenario, uri = sys.argv[1], os.environ["MLFLOW_TRACKING_URI"]
# The workers must import the example too.
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
         runtime_env={"env_vars": {"PYTHONPATH": EXAMPLES}})  # fmt: skip
trainer = ray.remote(max_restarts=0)(Probe).remote(uri)
info = {**ray.get(trainer.info.remote()), "chained": ray.get(trainer.chained_sigterm.remote())}
ray.get(trainer.train.remote())
print("LIFEGUARD-READY " + json.dumps({**info, "run_ids": [info["run_id"]]}), flush=True)


def wait_dead() -> str:
    """Until the actor is gone: Ray answers with the reason it died."""
    try:
        while True:
            ray.get(trainer.info.remote(), timeout=60)
            time.sleep(0.05)  # the actor is still up: ask again (Ray gives no death event)
    except ray.exceptions.RayActorError as exc:
        return str(exc)


if scenario == "exit_actor":
    trainer.stop.remote()
    print("DEATH " + json.dumps(wait_dead()), flush=True)
elif scenario == "sigterm":
    os.kill(int(info["pid"]), signal.SIGTERM)
    print("DEATH " + json.dumps(wait_dead()), flush=True)
elif scenario == "kill":
    ray.kill(trainer)
    print("DEATH " + json.dumps(wait_dead()), flush=True)
elif scenario == "shutdown":
    pass  # ray.shutdown() below, with the actor alive
elif scenario == "method_raises":
    try:
        ray.get(trainer.fail.remote())
    except ValueError as exc:
        print("RAISED " + json.dumps(str(exc)), flush=True)
    status = MlflowClient(tracking_uri=uri).get_run(info["run_id"]).info.status
    print("AFTER-RAISE " + json.dumps({"status": status, "step": ray.get(trainer.train.remote())}),
          flush=True)  # fmt: skip
    trainer.stop.remote()
    wait_dead()
ray.shutdown()
