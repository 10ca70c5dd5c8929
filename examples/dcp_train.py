"""PyTorch + torch.distributed.checkpoint (DCP) under the wrapper, one node or many:

    slurmagent sbatch -t 4:00:00 -- python examples/dcp_train.py --steps 100000
    slurmagent sbatch -N 2 --ntasks-per-node=1 -- --ckpt-dir /mnt/localssd/ckpt -- \
        srun python examples/dcp_train.py --steps 100000      # MASTER_ADDR/MASTER_PORT exported

Each checkpoint is a step folder written by `dcp.save` (its `.metadata` index is written last).
Two layouts:

* `--layout rename` (default): saved as `step-00000200.tmp/`, then renamed to `step-00000200/`
  after a barrier, by the first rank OF EACH NODE: with node-local disks every node holds a
  `.tmp` folder of its own ranks' shards, and one left unrenamed is never synced (a requeued
  rank would miss its shard). A `.tmp` folder is never synced.
* `--layout torchtitan`: saved straight into `step-200/` as torchtitan does; a folder counts
  only once it holds `.metadata` (torchtitan's own rule), so a half-written one is ignored.
  (The wrapper commits a folder only once it was quiet for a whole sync round, so a commit
  never holds one half-written either.)

The newest complete folder is loaded at start; the two newest are kept: old folders are
removed by the first rank of each node (keep-last-k on node-local disks must run on every
node, or the other nodes' shards of old steps stay in the checkpoint forever). Data of step
`s` comes from a generator seeded with (seed, s), so a resumed run computes exactly what an
uninterrupted one does. On the wrapper's signal every rank agrees (`trainer.any_rank`),
saves at the same step and exits 0; the wrapper syncs and requeues.

Several ranks (srun: SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID; torchrun: RANK/WORLD_SIZE/
LOCAL_RANK; plus MASTER_ADDR/MASTER_PORT) initialise a process group; every rank trains the
same replica, and DCP writes one shard per rank into the same folder.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from slurmagent import trainer

STEP_DIR = re.compile(r"step-(\d+)")


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def ranks() -> tuple[int, int, int]:
    """(rank, world size, rank on this node) from srun or torchrun."""
    env = os.environ
    return (int(env.get("SLURM_PROCID", env.get("RANK", "0"))), int(env.get("SLURM_NTASKS", env.get("WORLD_SIZE", "1"))),
            int(env.get("SLURM_LOCALID", env.get("LOCAL_RANK", "0"))))


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# recipe: save
def complete_steps(root: Path) -> list[tuple[int, Path]]:
    """Step folders holding DCP's `.metadata` (written last by dcp.save), oldest first."""
    found = []
    for p in root.iterdir() if root.is_dir() else ():
        m = STEP_DIR.fullmatch(p.name)
        if m and (p / ".metadata").is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def save(model, opt, step: int, root: Path, layout: str, keep: int = 2) -> None:
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "step": step}
    final = root / (f"step-{step:08d}" if layout == "rename" else f"step-{step}")
    node_first = ranks()[2] == 0  # the first rank on this node: its disk is this node's alone
    if layout == "rename":
        tmp = final.with_name(final.name + ".tmp")
        if node_first:
            shutil.rmtree(tmp, ignore_errors=True)
        barrier()  # nobody writes into the folder before it is cleared
        dcp.save(state, checkpoint_id=tmp)
        barrier()  # every shard and the .metadata are written, on every node
        if node_first:  # each node renames its own part: rank 0 alone would leave the others' .tmp
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
            trainer.saved(final, step=step)  # this node's part of the step, whole
    else:
        dcp.save(state, checkpoint_id=final)
        barrier()
        if node_first:
            trainer.saved(final, step=step)
    if node_first:  # keep-last-k on every node, by name (only rank 0's node holds .metadata)
        steps = sorted((int(m.group(1)), p) for p in root.glob("step-*") if (m := STEP_DIR.fullmatch(p.name)))
        for _, old in steps[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def load(model, opt, folder: Path) -> int:
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "step": 0}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["step"])
# recipe: end


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--every", type=int, default=50, help="checkpoint every N steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layout", choices=("rename", "torchtitan"), default="rename")
    ap.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step (stands in for real work)")
    ap.add_argument("--params-out", help="write the final parameters' raw bytes here")
    ap.add_argument("--log", help="append 'start STEP' / 'ckpt STEP' lines here")
    args = ap.parse_args()
    torch.set_num_threads(1)  # same kernels, same bits, in every run
    rank, world, _ = ranks()
    if world > 1:  # MASTER_ADDR/MASTER_PORT from the environment
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=rank, world_size=world)

    def log(line: str) -> None:
        if args.log and rank == 0:
            with open(args.log, "a") as fh:
                fh.write(line + "\n")

    model, opt = build(args.seed)
    root = trainer.ckpt_dir()
    done = complete_steps(root) if trainer.resumed() else []
    step = load(model, opt, done[-1][1]) if done else 0
    log(f"start {step} resumed={int(trainer.resumed())} restart={trainer.restart_count()}")
    with trainer.checkpoint_handler():
        while step < args.steps:
            g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
            x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            time.sleep(args.step_seconds)
            stop = trainer.any_rank(trainer.checkpoint_requested())
            if step % args.every == 0 or stop:
                save(model, opt, step, root, args.layout)
            if stop:
                log(f"ckpt {step}")
                return 0
    if args.params_out and rank == 0:
        with open(args.params_out, "wb") as fh:
            for p in model.parameters():
                fh.write(p.detach().numpy().tobytes())
    log("done")
    return 0


if __name__ == "__main__":
    code = main()
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(code)
