"""A training program that logs to several trackers at once (verl's ``Tracking`` does), then ends
the way ``--path`` says. The trackers write under ``--out``; each runs offline.

    trackers.py --out DIR --path SIGTERM --tracker wandb --tracker tensorboardX [--no-lifeguard]
"""

from __future__ import annotations

import argparse
import os
import threading

from lifeguard import demo

TRACKERS = ("mlflow", "wandb", "tensorboardX", "torch-tensorboard", "swanlab", "trackio")

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--path", required=True, choices=[*demo.PATHS, *demo.DEATHS])
parser.add_argument("--tracker", action="append", choices=TRACKERS, default=[])
parser.add_argument("--no-lifeguard", action="store_true", help="the same program, unguarded")
parser.add_argument("--deadline", type=float)
parser.add_argument("--watchdog", action="store_true")
parser.add_argument("--hanging", action="store_true", help="also track an object whose end hangs")
parser.add_argument("--raising", action="store_true", help="and one whose finish raises")
args = parser.parse_args()
demo.prepare(args.path)

if not args.no_lifeguard:
    import lifeguard

    options: dict[str, object] = {"watchdog": args.watchdog}
    if args.deadline is not None:
        options["deadline"] = args.deadline
    lifeguard.install(**options)

STEPS = 3
info: dict[str, object] = {"pid": os.getpid()}

if "mlflow" in args.tracker:
    import mlflow

    run = mlflow.start_run()
    info["run_ids"] = [run.info.run_id]
if "wandb" in args.tracker:
    import wandb

    info["wandb_id"] = wandb.init(mode="offline", project="lifeguard", dir=args.out).id
if "tensorboardX" in args.tracker:
    from tensorboardX import SummaryWriter

    # flush_secs far beyond the test: only a close() (or a flush) puts the scalars on disk.
    tbx_writer = SummaryWriter(os.path.join(args.out, "tensorboardX"), flush_secs=3600)
if "torch-tensorboard" in args.tracker:
    from torch.utils.tensorboard import SummaryWriter as TorchSummaryWriter

    torch_writer = TorchSummaryWriter(os.path.join(args.out, "torch-tensorboard"), flush_secs=3600)
if "swanlab" in args.tracker:
    import swanlab

    swanlab.init(project="lifeguard", mode="offline", log_dir=os.path.join(args.out, "swanlog"))
if "trackio" in args.tracker:
    import trackio

    trackio.init(project="lifeguard", name="trackers")

for step in range(STEPS):
    metrics = {"loss": 1.0 / (step + 1)}
    if "mlflow" in args.tracker:
        mlflow.log_metrics(metrics, step=step)
    if "wandb" in args.tracker:
        wandb.log(metrics, step=step)
    if "tensorboardX" in args.tracker:
        tbx_writer.add_scalar("loss", metrics["loss"], step)
    if "torch-tensorboard" in args.tracker:
        torch_writer.add_scalar("loss", metrics["loss"], step)
    if "swanlab" in args.tracker:
        swanlab.log(metrics, step=step)
    if "trackio" in args.tracker:
        trackio.log(metrics, step=step)


class Stuck:
    """A tracker whose end never returns (a dead server without a timeout)."""

    def close(self) -> None:
        os.write(1, b"STUCK-CLOSE\n")
        threading.Event().wait()


class Broken:
    def finish(self, exit_code: int) -> None:
        raise ConnectionError(f"tracker unreachable (exit code {exit_code})")


if args.hanging:
    lifeguard.track(Stuck(), name="stuck")
if args.raising:
    lifeguard.track(Broken(), name="broken")

demo.announce(**info)
demo.enact(args.path)  # "return": main returns, no hook of ours sees it before atexit
