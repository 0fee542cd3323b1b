"""A tiny real training run under a framework's own MLflow integration, ended the way ``--path``
says from inside training (at step 2): Lightning's ``MLFlowLogger`` (which creates its run with
``MlflowClient.create_run``) or HuggingFace's ``Trainer`` with ``report_to=["mlflow"]``.

    frameworks.py --framework lightning --path SIGTERM --out DIR [--no-lifeguard]
"""

from __future__ import annotations

import argparse
import os

from lifeguard import demo

parser = argparse.ArgumentParser()
parser.add_argument("--framework", required=True, choices=["lightning", "hf"])
parser.add_argument("--path", required=True, choices=[*demo.PATHS, *demo.DEATHS])
parser.add_argument("--out", required=True)
parser.add_argument("--no-lifeguard", action="store_true")
args = parser.parse_args()
demo.prepare(args.path)

if not args.no_lifeguard:
    import lifeguard

    lifeguard.install()

import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

STEPS = 6
STOP_AT = 2
data = TensorDataset(torch.randn(STEPS * 4, 8), torch.randn(STEPS * 4, 1))


def at_stop_step(run_id: str) -> None:
    """Tell the parent which run to check, then end as told (a signal arrives meanwhile)."""
    demo.announce(run_ids=[run_id], pid=os.getpid())
    demo.enact(args.path)


if args.framework == "lightning":
    import lightning as L
    from lightning.pytorch.loggers import MLFlowLogger

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.log("loss", loss)
            return loss

        def on_train_batch_end(self, outputs: object, batch: object, index: int) -> None:
            if index == STOP_AT:
                at_stop_step(str(self.logger.run_id))  # type: ignore[union-attr]

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    logger = MLFlowLogger(
        experiment_name="lightning", tracking_uri=os.environ["MLFLOW_TRACKING_URI"]
    )
    trainer = L.Trainer(
        max_epochs=1, logger=logger, accelerator="cpu", devices=1, log_every_n_steps=1,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=args.out,
    )  # fmt: skip
    trainer.fit(Model(), DataLoader(data, batch_size=4))
else:
    import mlflow
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": torch.nn.functional.mse_loss(self.layer(x), y)}

    class StopAt(TrainerCallback):
        def on_step_end(self, targs: object, state: object, control: object, **kw: object) -> None:
            if state.global_step == STOP_AT:  # type: ignore[attr-defined]
                at_stop_step(mlflow.active_run().info.run_id)  # type: ignore[union-attr]

    def collate(rows: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return {"x": torch.stack([r[0] for r in rows]), "y": torch.stack([r[1] for r in rows])}

    training = TrainingArguments(
        output_dir=args.out, report_to=["mlflow"], max_steps=STEPS, logging_steps=1,
        per_device_train_batch_size=4, save_strategy="no", use_cpu=True,
        disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    Trainer(
        model=Model(), args=training, train_dataset=data, data_collator=collate,
        callbacks=[StopAt()],
    ).train()  # fmt: skip
