"""Multi-node DDP + torch.distributed.checkpoint (DCP) under `slurmagent run` (needs torch).

    #SBATCH -N 2 --ntasks-per-node=1
    export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1) MASTER_PORT=29500
    exec slurmagent run --ckpt-dir /mnt/localssd/ckpt -- srun python examples/ddp_dcp_train.py

argv: [TOTAL_STEPS [OUT_DIR [STEP_SECONDS]]]. Every rank writes its DCP shard into its own node's
SLURMAGENT_CKPT_DIR (a node-local disk); rank 0 writes the folder's `.metadata`. slurmagent
uploads every node's files as ONE checkpoint and, after a requeue, puts the whole of it on
every node before the ranks start, so any rank can read any shard (DDP's replicated tensors
are saved once, by whichever rank DCP picks). The ranks agree on the step to stop at with an
all-reduce of "a checkpoint was asked for", since the signal reaches them at different steps.
The same code works with FSDP: get_state_dict/set_state_dict handle sharded models too.
Without srun it runs with RANK/WORLD_SIZE (and each rank's own SLURMAGENT_CKPT_DIR).
"""

import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

from slurmagent import trainer

TOTAL = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
OUT = Path(sys.argv[2]) if len(sys.argv) > 2 else Path("out")
STEP_S = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
EVERY = 20  # periodic checkpoint
KEEP = 2  # step folders kept on disk

rank = int(os.environ.get("SLURM_PROCID", os.environ.get("RANK", "0")))
world = int(os.environ.get("SLURM_NTASKS", os.environ.get("WORLD_SIZE", "1")))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's data for `step`: the same on a rerun, so a resumed run retraces the original."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(16, 32, generator=g)
    return x, x.sum(dim=1, keepdim=True).tanh()


# recipe: save
def latest(ckpt: Path) -> Path | None:
    """The newest complete step folder: DCP writes `.metadata` last (rank 0, after every shard)."""
    done = sorted(p for p in ckpt.glob("step_*") if (p / ".metadata").is_file())
    return done[-1] if done else None


def save(model, opt, ckpt: Path, step: int) -> None:
    model_sd, opt_sd = get_state_dict(model, opt)
    with trainer.phase("save"):  # a long save (or an evaluation) is a phase, not a hang
        dcp.save({"model": model_sd, "optim": opt_sd}, checkpoint_id=ckpt / f"step_{step:07d}")
        dist.barrier()  # every shard and the .metadata are in place
    trainer.saved(ckpt / f"step_{step:07d}", step=step)  # this node's part of the step, whole
    for old in sorted(ckpt.glob("step_*"))[:-KEEP]:  # each rank cleans its own node
        shutil.rmtree(old, ignore_errors=True)
# recipe: end


def log(line: str) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / f"rank{rank}.log", "a") as fh:
        fh.write(line + "\n")


# recipe: main
def main() -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world)  # MASTER_ADDR/MASTER_PORT
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = trainer.ckpt_dir()
    step = 0
    found = latest(ckpt) if trainer.resumed() else None
    if found is not None:
        model_sd, opt_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": opt_sd}
        dcp.load(state, checkpoint_id=found)  # reads shards written on other nodes too
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        step = int(found.name.split("_")[1])
    log(f"start {step} node={os.environ.get('SLURMD_NODENAME', '-')} resumed={int(trainer.resumed())}")
    while step < TOTAL:
        x, y = batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        step += 1
        trainer.progress(step)  # the hang watch sees the job advance (rate-limited: every step)
        log(f"step {step}")
        time.sleep(STEP_S)
        stop = torch.tensor([int(trainer.checkpoint_requested())])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # all ranks stop at the same step
        if stop.item() or step % EVERY == 0:
            save(model, opt, ckpt, step)
        if stop.item():
            log(f"ckpt {step}")
            dist.destroy_process_group()
            sys.exit(0)
    if rank == 0:
        torch.save(model.module.state_dict(), OUT / "final.pt")
    log("done")
    dist.destroy_process_group()  # without it gloo may abort the exit: FAILED
# recipe: end


if __name__ == "__main__":
    with trainer.checkpoint_handler():
        main()
