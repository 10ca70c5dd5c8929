"""The Hugging Face Trainer under the wrapper (needs torch, transformers, accelerate).

    slurmagent sbatch -- python examples/hf_train.py
    slurmagent sbatch -N 2 --ntasks-per-node=1 -- --ckpt-dir /mnt/localssd/ckpt -- \\
        srun python examples/hf_train.py    # MASTER_ADDR/MASTER_PORT exported

By default SIGUSR1 kills the Trainer (it installs no handler). `CheckpointOnSignal` (the
recipe's 7 lines) records the wrapper's signal with the trainer helper and, at the end of the
step every rank agrees on, asks the Trainer to save `checkpoint-<global step>/` and stop; the
wrapper then syncs and requeues. The next attempt finds the restored folder and resumes
there (`resume_from_checkpoint`): global step, optimizer, scheduler and RNG state continue.

`output_dir` is SLURMAGENT_CKPT_DIR. On node-local disks HF's defaults work: rank 0 rotates
(`save_total_limit`) on its node only, and a `checkpoint-N/` it removed leaves the checkpoint
with the other ranks' `rng_state_<rank>.pth` in it. `--save-on-each-node` writes and rotates
every checkpoint on each node's first rank too (the other nodes' local disks stay small).

The model is a 2-layer GPT-2 built from a config (nothing downloaded) trained on random
token ids (no tokenizer). Under srun, RANK/WORLD_SIZE/LOCAL_RANK come from SLURM_PROCID/
SLURM_NTASKS/SLURM_LOCALID (the Trainer reads the torchrun names); the ranks use gloo on CPU.
"""

from __future__ import annotations

import argparse
import os
import sys

from slurmagent import trainer


def torchrun_env() -> None:
    """srun's rank variables under the names accelerate reads (torchrun's)."""
    env = os.environ
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        env.setdefault("RANK", env["SLURM_PROCID"])
        env.setdefault("WORLD_SIZE", env["SLURM_NTASKS"])
        env.setdefault("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-steps", type=int, default=200)
    ap.add_argument("--save-steps", type=int, default=20)
    ap.add_argument("--save-total-limit", type=int, default=2)
    ap.add_argument("--save-on-each-node", action="store_true", help="node-local disks: save and rotate on every node")
    ap.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step (stands in for real work)")
    ap.add_argument("--n-embd", type=int, default=32, help="model width (checkpoint size grows as its square)")
    ap.add_argument("--log", help="append 'start/save/step N' lines here (rank 0)")
    args = ap.parse_args()
    torchrun_env()

    import time

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_utils import get_last_checkpoint

    # recipe: callback
    class CheckpointOnSignal(TrainerCallback):
        """On the wrapper's signal, save at the end of this step and stop; say each save is whole;
        tell the hang watch each step and each evaluation batch (an evaluation is not a hang)."""

        def on_prediction_step(self, targs, state, control, **kwargs):
            trainer.progress(state.global_step)  # evaluating: still advancing

        def on_step_end(self, targs, state, control, **kwargs):
            trainer.progress(state.global_step)
            if trainer.any_rank(trainer.checkpoint_requested()):  # every rank stops at the same step
                control.should_save = True
                control.should_training_stop = True
            return control

        def on_save(self, targs, state, control, **kwargs):  # this rank's files of checkpoint-N are written
            folder = os.path.join(targs.output_dir, f"checkpoint-{state.global_step}")
            trainer.saved(folder, step=state.global_step)  # every rank's part of the step: committed together
    # recipe: end

    class Ledger(TrainerCallback):
        """What the test checks: where each attempt started, each save, progress."""

        def note(self, state, line: str) -> None:
            if args.log and state.is_world_process_zero:
                with open(args.log, "a") as fh:
                    fh.write(line + "\n")

        def on_train_begin(self, targs, state, control, **kwargs):
            self.note(state, f"start {state.global_step} resumed={int(trainer.resumed())}")

        def on_step_end(self, targs, state, control, **kwargs):
            time.sleep(args.step_seconds)
            if state.global_step % 5 == 0:
                self.note(state, f"step {state.global_step}")

        def on_save(self, targs, state, control, **kwargs):
            self.note(state, f"save {state.global_step}")

    class RandomTokens(torch.utils.data.Dataset):
        def __init__(self, n: int = 256, length: int = 16, vocab: int = 64):
            self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=args.n_embd, n_layer=2, n_head=2))
    # recipe: train
    out = str(trainer.ckpt_dir())
    targs = TrainingArguments(
        output_dir=out, max_steps=args.max_steps, per_device_train_batch_size=4, learning_rate=1e-3,
        save_strategy="steps", save_steps=args.save_steps, save_total_limit=args.save_total_limit,
        save_on_each_node=args.save_on_each_node, logging_strategy="no", report_to=[], use_cpu=True,
        disable_tqdm=True, dataloader_num_workers=0, seed=0,
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None)
    hf = Trainer(model=model, args=targs, train_dataset=RandomTokens(), callbacks=[CheckpointOnSignal(), Ledger()])
    with trainer.checkpoint_handler():  # SIGUSR1/SIGTERM only set a flag
        hf.train(resume_from_checkpoint=get_last_checkpoint(out) if trainer.resumed() else None)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # a clean exit: gloo's threads never torn down under a live group
    # recipe: end
    return 0


if __name__ == "__main__":
    sys.exit(main())
