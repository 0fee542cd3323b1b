"""A torchrun training script under lifeguard: every rank installs it, rank 0 owns the run.

    torchrun --standalone --nproc-per-node 2 examples/torchrun_train.py [--scenario NAME]

Scenarios (used by the tests): ``clean`` trains and returns; ``wait`` trains, then waits to be
stopped (SIGTERM to torchrun, SIGKILL to rank 0); ``rank1-raises`` makes rank 1 fail after a
step while rank 0 waits in a collective.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import lifeguard

# Before anything else, on every rank. LIFEGUARD_WATCHDOG=1 adds the sidecar.
lifeguard.install()

import mlflow  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenario", default="clean", choices=["clean", "wait", "rank1-raises"])
    parser.add_argument("--record", help="file a rank-0 finalizer appends 'rank pid status' to")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if args.record:
        record = args.record

        def note(outcome: lifeguard.Outcome) -> None:
            with open(record, "a") as f:
                f.write(f"{dist.get_rank() if dist.is_initialized() else rank} "
                        f"{os.getpid()} {outcome.status.value}\n")  # fmt: skip

        # Registered on every rank, runs on rank 0 only: the rank is read at the end.
        lifeguard.register(note, name="record", ranks="zero")

    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = mlflow.start_run() if rank == 0 else None  # rank 0 owns the run
    for step in range(3):
        loss = model(torch.ones(8, 4)).pow(2).mean()
        loss.backward()
        for p in model.parameters():  # a real collective each step: gradient all-reduce
            assert p.grad is not None
            dist.all_reduce(p.grad)
        optimizer.step()
        optimizer.zero_grad()
        if run is not None:
            mlflow.log_metric("loss", loss.item(), step=step)
    dist.barrier()
    if rank == 0:
        ready = {
            "run_ids": [run.info.run_id] if run else [],
            "pid": os.getpid(),
            "watchdog": lifeguard.watchdog_pid(),
        }
        print(f"LIFEGUARD-READY {json.dumps(ready)}", flush=True)

    if args.scenario == "wait":
        while True:
            signal.pause()
    if args.scenario == "rank1-raises":
        if rank == 1:
            raise RuntimeError("rank 1 failed on purpose")
        dist.barrier()  # rank 0 waits in a collective for a peer that is gone
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
