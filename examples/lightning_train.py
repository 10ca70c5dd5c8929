"""PyTorch Lightning under the wrapper, with Lightning's own SLURM auto-requeue on or off.

On (Lightning saves `hpc_ckpt_N.ckpt` on SIGUSR1 and runs `scontrol requeue` itself; it
needs SLURM_NTASKS, so submit with `-n`/`--ntasks-per-node`):

    slurmagent sbatch -n 1 -- python examples/lightning_train.py --auto-requeue on

The wrapper holds Lightning's requeue until its final sync is done, stops the trainer (which
would train on), and requeues the job once. On restart Lightning finds the restored
`hpc_ckpt_N.ckpt` in `default_root_dir` (= SLURMAGENT_CKPT_DIR) and resumes from it.

Off (no handler from Lightning; plain `slurmagent sbatch`, or `SLURMEnvironment(auto_requeue=False)`
under srun): the trainer helper records the signal, a callback saves `last.ckpt` at the next
batch end and stops; the next attempt passes it as `ckpt_path`:

    slurmagent sbatch -- python examples/lightning_train.py --auto-requeue off
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.environments import SLURMEnvironment

from slurmagent import trainer


class Model(pl.LightningModule):
    """A model whose checkpoint is `mib` MiB (one big parameter) plus a small real layer."""

    def __init__(self, mib: int, log: str | None):
        super().__init__()
        self.big = torch.nn.Parameter(torch.randn(mib * 1024 * 1024 // 4) * 0.01)
        self.layer = torch.nn.Linear(8, 1)
        self.log_path = log

    def note(self, line: str) -> None:
        if self.log_path:
            with open(self.log_path, "a") as fh:
                fh.write(line + "\n")

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.trainer.global_step % 10 == 0:
            self.note(f"step {self.trainer.global_step}")
        return torch.nn.functional.mse_loss(self.layer(x), y) + self.big[:8].pow(2).sum() * 1e-6

    def on_train_start(self) -> None:
        self.note(f"start {self.trainer.global_step} resumed={int(trainer.resumed())}")

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        self.note(f"save {checkpoint['global_step']}")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)  # no optimizer state: size is the model's

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=4)


# recipe: callback
class CheckpointOnSignal(pl.Callback):
    """Auto-requeue off: on the wrapper's signal, save `path` (temp name, rename) at the next
    batch end and stop training; every rank stops at the same step."""

    def __init__(self, path: Path):
        self.path = path

    def on_validation_batch_end(self, pl_trainer, *_args) -> None:
        trainer.progress(pl_trainer.global_step)  # validating: still advancing, not a hang

    def on_train_batch_end(self, pl_trainer, *_args) -> None:
        trainer.progress(pl_trainer.global_step)  # the hang watch sees the job advance
        if trainer.any_rank(trainer.checkpoint_requested()):
            tmp = self.path.with_name(self.path.name + ".tmp")
            pl_trainer.save_checkpoint(tmp)
            if pl_trainer.is_global_zero:
                os.replace(tmp, self.path)
                trainer.saved(self.path)  # whole: the next sync round commits it
            pl_trainer.should_stop = True
# recipe: end


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--auto-requeue", choices=("on", "off"), default="on")
    ap.add_argument("--max-steps", type=int, default=1000)
    ap.add_argument("--mib", type=int, default=1, help="checkpoint size (MiB)")
    ap.add_argument("--log", help="append 'start/save/step N' lines here")
    args = ap.parse_args()
    root = trainer.ckpt_dir()
    model = Model(args.mib, args.log)
    common = dict(default_root_dir=str(root), max_steps=args.max_steps, max_epochs=-1, logger=False,
                  enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1)
    # recipe: fit
    if args.auto_requeue == "on":
        pl.Trainer(plugins=[SLURMEnvironment(auto_requeue=True)], enable_checkpointing=False, **common).fit(model)
        return 0
    last = root / "last.ckpt"
    plugins = [SLURMEnvironment(auto_requeue=False)] if "SLURM_NTASKS" in os.environ else []
    with trainer.checkpoint_handler():  # before fit: Lightning keeps an existing SIGTERM handler
        pl_trainer = pl.Trainer(plugins=plugins, callbacks=[CheckpointOnSignal(last)], enable_checkpointing=False,
                                **common)
        pl_trainer.fit(model, ckpt_path=str(last) if last.exists() else None)
    # recipe: end
    return 0


if __name__ == "__main__":
    sys.exit(main())
